"""REST half of the fake Discord: routes, recording, validation and fault injection."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from tests.fakes.discord_models import (
    FakeChannel,
    FakeInteraction,
    Json,
    RestCall,
    Waiters,
    application_payload,
    component_error,
    error_body,
    form_error,
    iso_time,
    user_payload,
)
from tests.fakes.discord_state import FakeState

API_PREFIX = "/api/v10"
_CHANNEL_RE = re.compile(r"^/channels/(\d+)")
_TOKEN_RE = re.compile(r"^/(?:interactions/\d+|webhooks/\d+)/([^/]+)")
_CALLBACK_TYPES = (1, 4, 5, 6, 7, 8, 9, 10, 12)
_NAME_RE = re.compile(r"^[-_\w]{1,32}$")
_TRUE = ("1", "true", "True")
Files = tuple[tuple[str, bytes], ...]


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """JSON response with ``Content-Type: application/json`` exactly (no charset)."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return web.Response(body=json.dumps(data).encode(), status=status, headers=hdrs)


def _error(status: int, code: int, message: str) -> web.Response:
    return _json(error_body(code, message), status)


def _ratelimit_headers(method: str, path: str, remaining: int, reset_after: float) -> dict[str, str]:
    bucket = hashlib.sha1(f"{method} {re.sub(r'[0-9]+', '*', path)}".encode()).hexdigest()[:16]
    return {
        "X-RateLimit-Limit": "50",
        "X-RateLimit-Remaining": str(remaining),
        "X-RateLimit-Reset": f"{time.time() + reset_after:.3f}",
        "X-RateLimit-Reset-After": f"{reset_after:.3f}",
        "X-RateLimit-Bucket": bucket,
    }


@dataclass
class _RequestContext:
    json: Any
    files: Files
    channel_id: int | None = None


_CTX: ContextVar[_RequestContext] = ContextVar("fake_discord_request")


def _ctx() -> _RequestContext:
    """Parsed body of the request being handled (set by the middleware)."""
    return _CTX.get()


@dataclass
class _Fault:
    method: str
    glob: str
    status: int
    retry_after: float
    remaining: int
    is_global: bool


class RestMixin(FakeState):
    """Serves ``/api/v10`` and records every request in ``requests``."""

    def _init_rest(self) -> None:
        self.requests: list[RestCall] = []
        self._faults: list[_Fault] = []
        self._waiters = Waiters()

    # ----- test controls ----------------------------------------------------
    @property
    def sent(self) -> list[RestCall]:
        """Every REST write (non-GET request), including failed ones, in order."""
        return [r for r in self.requests if r.method != "GET"]

    def fail_next(
        self,
        method: str,
        path_glob: str,
        status: int = 429,
        retry_after: float = 0.2,
        *,
        times: int = 1,
        is_global: bool = False,
    ) -> None:
        """Fail the next ``times`` requests matching ``method`` and ``path_glob`` (fnmatch on
        the path relative to the API base, e.g. ``/channels/*/messages``)."""
        self._faults.append(_Fault(method.upper(), path_glob, status, retry_after, times, is_global))

    async def wait_for(self, predicate: Callable[[RestCall], bool], timeout: float = 5.0) -> RestCall:
        """First recorded request (past or future) matching ``predicate``."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    for call in self.requests:
                        if predicate(call):
                            return call
                    await self._waiters.new()
        except TimeoutError:
            seen = ", ".join(f"{c.method} {c.path} -> {c.status}" for c in self.requests[-10:])
            raise TimeoutError(f"no matching REST call within {timeout}s; last calls: [{seen}]") from None

    # ----- plumbing ---------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(API_PREFIX + "/"):
            return await handler(request)
        path = request.path[len(API_PREFIX) :]
        body, files = await self._read_body(request)
        ctx = _RequestContext(body, files)
        _CTX.set(ctx)
        delay = self._latency.get(self._channel_of(path) or 0)
        if delay:
            await asyncio.sleep(delay)  # simulated slow channel (set_latency)
        response: web.StreamResponse | None = self._auth_error(request, path)
        if response is None:
            response = self._take_fault(request.method, path)
        if response is None:
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # unknown route / method
                response = _error(exc.status, 0, f"{exc.status}: {exc.reason}")
            if response.status < 300:
                response.headers.update(_ratelimit_headers(request.method, path, 49, 0.05))
        match = _CHANNEL_RE.match(path)
        channel_id = ctx.channel_id or (int(match.group(1)) if match else None)
        query = dict(request.query)
        self.requests.append(
            RestCall(request.method, path, response.status, channel_id, body, files, query, self.clock())
        )
        self._waiters.wake()
        return response

    def _channel_of(self, path: str) -> int | None:
        """Channel a request is about: /channels/{id}/..., or an interaction's (by token)."""
        if match := _CHANNEL_RE.match(path):
            return int(match.group(1))
        if match := _TOKEN_RE.match(path):
            inter = self._interactions.get(match.group(1))
            return inter.channel_id if inter is not None else None
        return None

    @staticmethod
    async def _read_body(request: web.Request) -> tuple[Any, Files]:
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            files = tuple((v.filename, v.file.read()) for v in form.values() if isinstance(v, web.FileField))
            payload = form.get("payload_json")
            return (json.loads(payload) if isinstance(payload, str) else None), files
        raw = await request.read()
        return (json.loads(raw) if raw else None), ()

    def _auth_error(self, request: web.Request, path: str) -> web.Response | None:
        if path.startswith(("/webhooks/", "/interactions/")) or path == "/gateway":
            return None
        if request.headers.get("Authorization") != f"Bot {self.token}":
            return _error(401, 0, "401: Unauthorized")
        return None

    def _take_fault(self, method: str, path: str) -> web.Response | None:
        for fault in self._faults:
            if fnmatchcase(method, fault.method) and fnmatchcase(path, fault.glob):
                fault.remaining -= 1
                if fault.remaining <= 0:
                    self._faults.remove(fault)
                if fault.status != 429:
                    return _error(fault.status, 0, f"{fault.status}: injected failure")
                body = {"message": "You are being rate limited.", "retry_after": fault.retry_after}
                body["global"] = fault.is_global
                headers = _ratelimit_headers(method, path, 0, fault.retry_after)
                headers.update({"Via": "1.1 google", "Retry-After": str(math.ceil(fault.retry_after))})
                headers["X-RateLimit-Scope"] = "global" if fault.is_global else "user"
                if fault.is_global:
                    headers["X-RateLimit-Global"] = "true"
                return _json(body, 429, headers)
        return None

    def _rest_routes(self) -> list[web.RouteDef]:
        a = API_PREFIX
        msg = a + "/channels/{channel_id}/messages/{message_id}"
        hook = a + "/webhooks/{app_id}/{token}"
        return [
            web.get(a + "/users/@me", self._get_me),
            web.get(a + "/users/{user_id}", self._get_user),
            web.post(a + "/users/@me/channels", self._create_dm),
            web.get(a + "/oauth2/applications/@me", self._get_application),
            web.get(a + "/gateway", self._get_gateway),
            web.get(a + "/gateway/bot", self._get_gateway),
            web.get(a + "/channels/{channel_id}", self._get_channel),
            web.get(a + "/channels/{channel_id}/messages", self._list_messages),
            web.post(a + "/channels/{channel_id}/messages", self._create_message),
            web.post(a + "/channels/{channel_id}/typing", self._typing),
            web.route("*", msg, self._message_route),
            web.route("*", msg + "/reactions/{emoji}/@me", self._reaction),
            web.route("*", a + "/applications/{app_id}/commands", self._commands_route),
            web.route("*", a + "/applications/{app_id}/guilds/{guild_id}/commands", self._commands_route),
            web.post(a + "/interactions/{interaction_id}/{token}/callback", self._interaction_callback),
            web.post(hook, self._followup),
            web.route("*", hook + "/messages/{message_id}", self._webhook_message),
            web.get("/attachments/{channel_id}/{attachment_id}/{filename}", self._get_attachment),
        ]

    # ----- users, application, gateway ---------------------------------------
    async def _get_me(self, request: web.Request) -> web.Response:
        me = {"verified": True, "mfa_enabled": False, "flags": 0, "locale": "en-US"}
        return _json({**user_payload(self.bot), **me})

    async def _get_user(self, request: web.Request) -> web.Response:
        user = self.users.get(int(request.match_info["user_id"]))
        return _json(user_payload(user)) if user else _error(404, 10013, "Unknown User")

    async def _create_dm(self, request: web.Request) -> web.Response:
        user_id = int((_ctx().json or {}).get("recipient_id", 0))
        if user_id not in self.users:
            return _error(404, 10013, "Unknown User")
        channel = self.channels[self.dm_channel_id(user_id)]
        _ctx().channel_id = channel.id
        return _json(self._channel_json(channel))

    async def _get_application(self, request: web.Request) -> web.Response:
        owner = next((u for u in self.users.values() if not u.bot), self.bot)
        return _json(application_payload(self.application_id, self.bot, owner))

    async def _get_gateway(self, request: web.Request) -> web.Response:
        limit = {"total": 1000, "remaining": 999, "reset_after": 14400000, "max_concurrency": 1}
        data: Json = {"url": self.gateway_url}
        if request.path.endswith("/bot"):
            data.update(shards=1, session_start_limit=limit)
        return _json(data)

    # ----- channels and messages --------------------------------------------
    def _channel(self, request: web.Request) -> FakeChannel | None:
        channel = self.channels.get(int(request.match_info["channel_id"]))
        if channel is not None:
            _ctx().channel_id = channel.id
        return channel

    async def _get_channel(self, request: web.Request) -> web.Response:
        channel = self._channel(request)
        return _json(self._channel_json(channel)) if channel else _error(404, 10003, "Unknown Channel")

    async def _list_messages(self, request: web.Request) -> web.Response:
        channel = self._channel(request)
        if channel is None:
            return _error(404, 10003, "Unknown Channel")
        found = self.messages(channel.id)[::-1]
        before, after = int(request.query.get("before", 1 << 63)), int(request.query.get("after", 0))
        found = [m for m in found if after < int(m["id"]) < before]
        return _json(found[: int(request.query.get("limit", 50))])

    def _invalid(self, body: Json, files: Files, *, creating: bool) -> web.Response | None:
        content = body.get("content")
        if content is not None and len(str(content)) > 2000:
            err = form_error("content", "BASE_TYPE_MAX_LENGTH", "Must be 2000 or fewer in length.")
            return _json(err, 400)
        if len(body.get("embeds") or []) > 10:
            return _json(form_error("embeds", "BASE_TYPE_MAX_LENGTH", "Must be 10 or fewer in length."), 400)
        if body.get("components") and not int(body.get("flags") or 0) & 32768:  # not IS_COMPONENTS_V2
            bad = component_error(body["components"])
            if bad is not None:
                return _json(bad, 400)
        keys = ("content", "embeds", "sticker_ids", "components", "poll")
        if creating and not files and not any(body.get(k) for k in keys):
            return _error(400, 50006, "Cannot send an empty message")
        return None

    def _uploads(self, channel_id: int, files: Files) -> list[Json]:
        return [self._attachment(channel_id, name, data, None) for name, data in files]

    async def _echo(self, event: str, msg: Json) -> None:
        if not self.echo_own_messages or int(msg.get("flags") or 0) & 64:
            return
        data = self._event_message(msg)
        if event == "MESSAGE_DELETE":
            data = {k: data[k] for k in ("id", "channel_id", "guild_id") if k in data}
        await self._dispatch(event, data)

    async def _create_message(self, request: web.Request) -> web.Response:
        channel = self._channel(request)
        if channel is None:
            return _error(404, 10003, "Unknown Channel")
        body: Json = _ctx().json or {}
        invalid = self._invalid(body, _ctx().files, creating=True)
        if invalid is not None:
            return invalid
        ref = body.get("message_reference") or {}
        if ref.get("message_id") and int(ref["message_id"]) not in self._messages:
            if ref.get("fail_if_not_exists", True):
                err = form_error("message_reference", "REPLIES_UNKNOWN_MESSAGE", "Unknown message")
                return _json(err, 400)
            body = {k: v for k, v in body.items() if k != "message_reference"}
        if body.get("enforce_nonce") and body.get("nonce") is not None:
            for existing in self.messages(channel.id):
                if existing.get("nonce") == body["nonce"] and existing["author"]["id"] == str(self.bot.id):
                    return _json(existing)  # Discord de-duplicates by nonce
        uploads = self._uploads(channel.id, _ctx().files)
        msg = self._new_message(channel, self.bot, body, attachments=uploads)
        await self._echo("MESSAGE_CREATE", msg)
        return _json(msg)

    def _apply_edit(self, msg: Json, body: Json, files: Files) -> None:
        for key in ("content", "embeds", "components", "flags"):
            if key in body:
                msg[key] = body[key] if body[key] is not None else {"content": "", "flags": 0}.get(key, [])
        if "attachments" in body or files:
            keep = {str(a.get("id")) for a in body.get("attachments") or []}
            old = [a for a in msg["attachments"] if a["id"] in keep or "attachments" not in body]
            msg["attachments"] = old + self._uploads(int(msg["channel_id"]), files)
        msg["flags"] = int(msg.get("flags") or 0) & ~128  # editing ends a deferred "thinking" state
        msg["edited_timestamp"] = iso_time()

    async def _message_route(self, request: web.Request) -> web.StreamResponse:
        channel = self._channel(request)
        msg = self._messages.get(int(request.match_info["message_id"]))
        if channel is None:
            return _error(404, 10003, "Unknown Channel")
        if msg is None or msg["channel_id"] != str(channel.id):
            return _error(404, 10008, "Unknown Message")
        if request.method == "GET":
            return _json(msg)
        if request.method == "DELETE":
            del self._messages[int(msg["id"])]
            await self._echo("MESSAGE_DELETE", msg)
            return web.Response(status=204)
        if request.method != "PATCH":
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "PATCH", "DELETE"])
        body: Json = _ctx().json or {}
        if msg["author"]["id"] != str(self.bot.id) and {"content", "embeds", "attachments"} & set(body):
            return _error(403, 50005, "Cannot edit a message authored by another user")
        invalid = self._invalid(body, _ctx().files, creating=False)
        if invalid is not None:
            return invalid
        self._apply_edit(msg, body, _ctx().files)
        await self._echo("MESSAGE_UPDATE", msg)
        return _json(msg)

    async def _typing(self, request: web.Request) -> web.Response:
        if self._channel(request) is None:
            return _error(404, 10003, "Unknown Channel")
        return web.Response(status=204)

    async def _reaction(self, request: web.Request) -> web.Response:
        if self._channel(request) is None:
            return _error(404, 10003, "Unknown Channel")
        if int(request.match_info["message_id"]) not in self._messages:
            return _error(404, 10008, "Unknown Message")
        return web.Response(status=204)

    async def _get_attachment(self, request: web.Request) -> web.StreamResponse:
        data = self._files.get(int(request.match_info["attachment_id"]))
        if data is None:
            return web.Response(status=404)
        return await self.file_serving.serve(request, data)

    # ----- application commands ---------------------------------------------
    async def _commands_route(self, request: web.Request) -> web.Response:
        if request.match_info["app_id"] != str(self.application_id):
            return _error(403, 50001, "Missing Access")
        guild_id = int(request.match_info["guild_id"]) if "guild_id" in request.match_info else None
        if guild_id is not None and guild_id not in self.guilds:
            return _error(403, 50001, "Missing Access")
        if request.method == "GET":
            return _json(self._commands.get(guild_id, []))
        if request.method != "PUT":
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "PUT"])
        old = {(c["name"], c["type"]): c["id"] for c in self._commands.get(guild_id, [])}
        result: list[Json] = []
        for index, cmd in enumerate(_ctx().json or []):
            ctype, name = int(cmd.get("type", 1)), str(cmd.get("name", ""))
            desc = str(cmd.get("description", ""))
            bad_name = not _NAME_RE.match(name) or (ctype == 1 and name != name.lower())
            if bad_name or (ctype == 1 and not 1 <= len(desc) <= 100):
                key = "name" if bad_name else "description"
                errors = form_error(key, "APPLICATION_COMMAND_INVALID_" + key.upper(), "Invalid")["errors"]
                return _json(error_body(50035, "Invalid Form Body", {str(index): errors}), 400)
            cid = old.get((name, ctype)) or str(self.ids.next())
            full: Json = {"default_member_permissions": None, "dm_permission": True, "nsfw": False}
            full.update({"contexts": None, "integration_types": [0], "options": [], **cmd})
            full.update(id=cid, application_id=str(self.application_id), version=cid, type=ctype)
            if guild_id is not None:
                full["guild_id"] = str(guild_id)
            result.append(full)
        self._commands[guild_id] = result
        return _json(result)

    # ----- interactions and their webhooks -------------------------------------
    def _interaction(self, request: web.Request) -> FakeInteraction | None:
        inter = self._interactions.get(request.match_info["token"])
        app_id = str(self.application_id)
        if inter is None or request.match_info.get("app_id", app_id) != app_id:
            return None
        _ctx().channel_id = inter.channel_id
        return inter

    def _missed_deadline(self, inter: FakeInteraction) -> bool:
        """Not acknowledged within ``interaction_deadline_s``: Discord invalidates the token."""
        deadline = self.interaction_deadline_s
        return not inter.responded and deadline is not None and self.clock() - inter.created_at > deadline

    def _webhook_error(self, inter: FakeInteraction | None) -> web.Response | None:
        """Followup / @original requests with a dead token."""
        if inter is None or self._missed_deadline(inter):
            return _error(404, 10015, "Unknown Webhook")
        if self.clock() - inter.created_at > self.interaction_token_ttl_s:
            return _error(401, 50027, "Invalid Webhook Token")
        return None

    def _interaction_message(self, inter: FakeInteraction, body: Json, files: Files) -> Json:
        user = self.users[inter.user_id]
        owners = {"0": str(inter.guild_id)} if inter.guild_id else {"1": str(user.id)}
        meta: Json = {"id": str(inter.id), "type": inter.type, "user": user_payload(user)}
        if inter.type == 3:
            meta["interacted_message_id"] = str(inter.message_id)
        else:
            meta["name"] = inter.name
        meta["authorizing_integration_owners"] = owners
        extra: Json = {"webhook_id": str(self.application_id), "application_id": str(self.application_id)}
        extra["interaction_metadata"] = meta
        channel = self.channels[inter.channel_id]
        uploads = self._uploads(channel.id, files)
        return self._new_message(channel, self.bot, body, attachments=uploads, msg_type=20, extra=extra)

    async def _interaction_callback(self, request: web.Request) -> web.Response:
        inter = self._interaction(request)
        if inter is None or request.match_info["interaction_id"] != str(inter.id):
            return _error(404, 10062, "Unknown interaction")
        if inter.responded:
            return _error(400, 40060, "Interaction has already been acknowledged.")
        if self._missed_deadline(inter):
            return _error(404, 10062, "Unknown interaction")
        body: Json = _ctx().json or {}
        rtype, data = int(body.get("type", 0)), dict(body.get("data") or {})
        if rtype not in _CALLBACK_TYPES or (rtype in (6, 7) and inter.type != 3):  # 6, 7: components only
            choices = ", ".join(str(t) for t in _CALLBACK_TYPES if inter.type == 3 or t not in (6, 7))
            return _json(form_error("type", "BASE_TYPE_CHOICES", f"Value must be one of {{{choices}}}."), 400)
        msg: Json | None = None
        if rtype in (4, 5):
            if rtype == 4:
                invalid = self._invalid(data, _ctx().files, creating=True)
                if invalid is not None:
                    return invalid
            else:
                data["flags"] = int(data.get("flags") or 0) | 128
            msg = self._interaction_message(inter, data, _ctx().files)
            inter.original_id = int(msg["id"])
            await self._echo("MESSAGE_CREATE", msg)
        elif rtype in (6, 7):  # the component's own message becomes @original
            msg = self._messages.get(inter.message_id or 0)
            if msg is None:
                return _error(404, 10008, "Unknown Message")
            inter.original_id = int(msg["id"])
            if rtype == 7:
                invalid = self._invalid(data, _ctx().files, creating=False)
                if invalid is not None:
                    return invalid
                self._apply_edit(msg, data, _ctx().files)
                await self._echo("MESSAGE_UPDATE", msg)
            else:
                msg = None
        inter.responded, inter.responded_at = True, self.clock()
        inter.response_type, inter.response_flags = rtype, int(data.get("flags") or 0)
        if request.query.get("with_response") not in _TRUE:
            return web.Response(status=204)
        flags = int((msg or {}).get("flags") or 0)
        info: Json = {"id": str(inter.id), "type": inter.type, "response_message_loading": bool(flags & 128)}
        info["response_message_ephemeral"] = bool(flags & 64)
        result: Json = {"interaction": info}
        if msg is not None:
            info["response_message_id"] = msg["id"]
            result["resource"] = {"type": rtype, "message": msg}
        return _json(result)

    async def _followup(self, request: web.Request) -> web.Response:
        inter = self._interaction(request)
        dead = self._webhook_error(inter)
        if dead is not None or inter is None:
            return dead or _error(404, 10015, "Unknown Webhook")
        body: Json = _ctx().json or {}
        invalid = self._invalid(body, _ctx().files, creating=True)
        if invalid is not None:
            return invalid
        loading = self._messages.get(inter.original_id or 0) if inter.response_type == 5 else None
        if loading is not None and int(loading.get("flags") or 0) & 128:
            # Right after a deferred (type 5) response a followup edits the loading message and
            # keeps its ephemeral flag (Discord's documented backwards compatibility).
            self._apply_edit(loading, {k: v for k, v in body.items() if k != "flags"}, _ctx().files)
            await self._echo("MESSAGE_UPDATE", loading)
            return _json(loading) if request.query.get("wait") in _TRUE else web.Response(status=204)
        msg = self._interaction_message(inter, body, _ctx().files)
        await self._echo("MESSAGE_CREATE", msg)
        return _json(msg) if request.query.get("wait") in _TRUE else web.Response(status=204)

    async def _webhook_message(self, request: web.Request) -> web.StreamResponse:
        inter = self._interaction(request)
        dead = self._webhook_error(inter)
        if dead is not None or inter is None:
            return dead or _error(404, 10015, "Unknown Webhook")
        raw_id = request.match_info["message_id"]
        msg_id = inter.original_id if raw_id == "@original" else int(raw_id)
        msg = self._messages.get(msg_id or 0)
        own = msg is not None and (msg.get("webhook_id") == str(self.application_id) or msg_id == inter.original_id)
        if msg is None or not own:
            return _error(404, 10008, "Unknown Message")
        if request.method == "GET":
            return _json(msg)
        if request.method == "DELETE":
            del self._messages[int(msg["id"])]
            await self._echo("MESSAGE_DELETE", msg)
            return web.Response(status=204)
        if request.method != "PATCH":
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "PATCH", "DELETE"])
        body: Json = _ctx().json or {}
        invalid = self._invalid(body, _ctx().files, creating=False)
        if invalid is not None:
            return invalid
        self._apply_edit(msg, body, _ctx().files)
        await self._echo("MESSAGE_UPDATE", msg)
        return _json(msg)


__all__ = ["API_PREFIX", "RestMixin"]
