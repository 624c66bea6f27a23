"""Telegram updates in: our own long-polling loop over getUpdates, or a webhook.

Polling is our own loop rather than PTB's Updater: each update is handed on (to the router, which
records the message durably and de-duplicates it) *before* the next getUpdates confirms it through
its offset, so a crash neither loses nor double-processes a message. A webhook answers 200 only
once the message is recorded, so Telegram delivers anything else again.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiohttp import web
from telegram import Bot, BotCommand, Update
from telegram.error import BadRequest, Conflict, InvalidToken, NetworkError, RetryAfter, TelegramError

from gateway.core import commands
from gateway.core.backoff import Backoff
from gateway.core.cancellation import cancel_and_wait
from gateway.core.outage import OutageLog
from gateway.core.ports import Health
from platforms.config import TelegramConfig
from platforms.errors import explain
from platforms.ingress import IngressLeader
from platforms.telegram_intake import PLATFORM, BotIdentity, album_of, albums
from platforms.telegram_outbound import Scrub, retry_after_s

log = logging.getLogger("platforms.telegram_bot")  # the Telegram adapter logs under one name
T = TypeVar("T")

ALLOWED_UPDATES = ("message", "callback_query")  # channel posts, edits, reactions... are not asked for
SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
UNAVAILABLE_RETRY_S = 2.0
ALBUM_WAIT_S = 0.5  # how long the rest of an album may take to arrive after its first part
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 60.0  # the loop's backoff after a failure (±10 % jitter)
STOP_WAIT_S = 5.0  # how long `stop` lets an update being handed on finish
# Hands an update (with the rest of its album) on; False: not stored now, deliver it again later.
Handle = Callable[[Update, Sequence[Update]], Awaitable[bool]]


class TelegramTransport:
    """The intake loop and the webhook route of one bot. It learns the bot's identity on
    connecting, reports health, and in cluster mode polls only while this worker holds the
    ingress lease (the offset passes between workers through it)."""

    def __init__(self, bot: Bot, config: TelegramConfig, identity: BotIdentity, handle: Handle, *,
                 leader: IngressLeader | None, scrub: Scrub) -> None:
        self._bot = bot
        self._config = config
        self._me = identity
        self._handle = handle
        self._leader = leader
        self._scrub = scrub
        self.ready = asyncio.Event()  # set once connected (polling, or the webhook registered)
        self._health = Health(False, "connecting to Telegram")
        self._outage = OutageLog(log, PLATFORM)
        self._offset: int | None = None
        self._confirmed: int | None = None  # the offset Telegram has been sent
        self._task: asyncio.Task[None] | None = None
        self._interruptible = False  # the loop is waiting (long poll, backoff), not handing an update on
        self._closing = False
        self._closed = False
        self._webhook_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()

    def health(self) -> Health:
        return self._health

    def routes(self) -> list[web.RouteDef]:
        return [web.post(self._config.webhook_path, self._webhook)] if self._config.mode == "webhook" else []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="telegram")

    async def stop(self) -> None:
        """Stop intake. An update being handed on is finished first; then what was handed on is
        confirmed, so the next start does not fetch it again."""
        self._closing = True
        task = self._task
        if task is not None and not task.done():
            if self._interruptible:
                task.cancel()
            _done, late = await asyncio.wait({task}, timeout=STOP_WAIT_S)
            await cancel_and_wait(late)
        await self._confirm_offset()

    def close(self) -> None:
        """The client is going away: webhook updates still being handed on are cancelled."""
        self._closed = True
        for task in list(self._background):
            task.cancel()

    # --- polling --------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(RETRY_FIRST_S, RETRY_MAX_S, jitter=0.1)
        connected = False
        while not self._closing:
            try:
                if not connected:
                    await self._waiting(self._connect())
                    connected = True
                    backoff.reset()
                    if self._config.mode == "webhook":
                        return
                await self._lead()
                await self._poll_once()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = retry_after_s(exc) if isinstance(exc, RetryAfter) else backoff.step()
                self._failed(exc, delay)
                await self._waiting(asyncio.sleep(delay))

    async def _waiting(self, aw: Coroutine[Any, Any, T]) -> T:
        """Await something `stop` may simply cancel (nothing half-handed-on can be lost)."""
        self._interruptible = True
        try:
            return await aw
        finally:
            self._interruptible = False

    async def _connect(self) -> None:
        await self._bot.initialize()  # getMe: checks the token, learns our id and username
        self._me.id, self._me.username = self._bot.id, self._bot.username
        webhook = self._config.mode == "webhook"
        if webhook:
            assert self._config.webhook_url and self._config.secret_token  # enforced by the config
            await self._bot.set_webhook(self._config.webhook_url, allowed_updates=list(ALLOWED_UPDATES),
                                        secret_token=self._config.secret_token.reveal(), drop_pending_updates=False)
        else:
            await self._bot.delete_webhook(drop_pending_updates=False)  # keep what arrived while we were down
        try:
            await self._bot.set_my_commands([BotCommand(c, d) for c, d in commands.menu()])
        except TelegramError as exc:  # cosmetic: commands still work when typed
            log.warning("telegram: could not register commands: %s", self._scrub(explain(exc)))
        self._recovered("webhook registered" if webhook else "polling")
        self.ready.set()
        log.info("telegram: connected as @%s (%s)", self._me.username, self._config.mode)

    async def _lead(self) -> None:
        """Cluster mode: stand by until this worker holds the ingress lease; then go on from the
        offset the previous leader handed on."""
        if self._leader is None or self._leader.held():
            return
        self._health = Health(True, "standing by: another worker polls Telegram")
        await self._waiting(self._leader.wait())
        stored = await self._leader.load("offset")
        self._offset = int(stored) if stored else self._offset

    async def _poll_once(self) -> None:
        offset = self._offset
        updates = await self._waiting(self._bot.get_updates(
            offset=offset, timeout=self._config.poll_timeout_s, allowed_updates=list(ALLOWED_UPDATES)))
        self._confirmed = offset
        self._recovered("polling")
        if updates and album_of(updates[-1]) is not None:
            # An album arrives as one message per photo, often split across polls: wait a moment
            # and ask again from the same offset (nothing is confirmed yet) to have all of it.
            await self._waiting(asyncio.sleep(ALBUM_WAIT_S))
            updates = await self._waiting(self._bot.get_updates(
                offset=offset, timeout=0, allowed_updates=list(ALLOWED_UPDATES))) or updates
        for group in albums(updates):
            if self._closing:
                return  # the rest stays unconfirmed and is fetched again by the next process
            if not await self._handle(group[0], group[1:]):
                # Not stored (storage or Redis down): leave it unconfirmed, fetch it again later.
                await self._waiting(asyncio.sleep(UNAVAILABLE_RETRY_S))
                return
            self._offset = group[-1].update_id + 1
            if self._leader is not None:
                await self._leader.save("offset", str(self._offset))

    async def _confirm_offset(self) -> None:
        """On the way out, confirm what was handed on so the next start does not refetch it."""
        if self._offset is None or self._offset == self._confirmed or self._closed:
            return
        try:
            await asyncio.wait_for(self._bot.get_updates(offset=self._offset, timeout=0, limit=1,
                                                         allowed_updates=list(ALLOWED_UPDATES)), 3.0)
            self._confirmed = self._offset
        except (TelegramError, TimeoutError) as exc:  # harmless: refetched updates are duplicates
            log.info("telegram: could not confirm the last updates on stop: %s", self._scrub(explain(exc)))

    def _failed(self, exc: Exception, delay: float) -> None:
        """Degrade health and log the cause — once per outage and kind, not once per retry."""
        kind, level, text = failure(exc, self._scrub)
        self._health = Health(False, text)
        self._outage.failed(kind, f"{text}; retrying in {delay:.1f} s (backing off up to {RETRY_MAX_S:.0f} s)",
                            level=level, exc_info=exc if kind == "bug" else None)

    def _recovered(self, state: str) -> None:
        self._outage.recovered(f"connection restored ({state})")
        self._health = Health(True, state)

    # --- webhook --------------------------------------------------------------------------

    async def _webhook(self, request: web.Request) -> web.Response:
        expected = self._config.secret_token.reveal().encode() if self._config.secret_token else b""
        given = request.headers.get(SECRET_HEADER, "").encode("utf-8", "surrogatepass")  # non-UTF-8: wrong, not 500
        if not expected or not hmac.compare_digest(given, expected):
            return web.Response(status=401, text="wrong secret token")
        if self._closing or not self.ready.is_set():
            return web.Response(status=503, text="not ready")  # Telegram delivers it again later
        try:
            update = Update.de_json(await request.json(), self._bot)
        except Exception:
            return web.Response(status=400, text="not a Telegram update")
        # A task of its own: if Telegram hangs up (the request is cancelled), handing it on
        # still completes, and the update is simply delivered again (a duplicate, dropped).
        task = asyncio.get_running_loop().create_task(self._handle_in_order(update))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if not await asyncio.shield(task):  # Telegram delivers it again later; the redelivery is de-duplicated
            return web.Response(status=503, text="not stored; try again later", headers={"Retry-After": "5"})
        return web.Response(text="ok")  # only now: the message is recorded

    async def _handle_in_order(self, update: Update) -> bool:
        async with self._webhook_lock:  # one at a time, in arrival order
            return await self._handle(update, ())


def _conflict(exc: TelegramError, _scrub: Scrub) -> str:
    if "webhook" in str(exc).lower():
        return ("409 Conflict: a webhook is set for this bot token, so getUpdates is refused "
                "(another instance running in webhook mode?)")
    return "409 Conflict: another process is polling Telegram with this bot token; only one instance may run per token"


# What a failure of the intake loop is, first match wins: (class, kind, log level, what to say).
# BadRequest is a NetworkError in PTB, but about the request: it goes before NetworkError.
_FAILURES: tuple[tuple[type[TelegramError], str, int, Callable[[TelegramError, Scrub], str]], ...] = (
    (Conflict, "conflict", logging.ERROR, _conflict),
    (InvalidToken, "token", logging.ERROR, lambda _e, _s: "Telegram rejected the bot token (check telegram.token)"),
    (RetryAfter, "flood", logging.WARNING, lambda _e, _s: "Telegram asked us to slow down (429)"),
    (BadRequest, "api", logging.WARNING, lambda e, scrub: f"Telegram error: {scrub(str(e))}"),
    (NetworkError, "network", logging.WARNING,
     lambda e, scrub: f"cannot reach Telegram: {scrub(str(e)) or type(e).__name__}"),
    (TelegramError, "api", logging.WARNING, lambda e, scrub: f"Telegram error: {scrub(str(e))}"),
)


def failure(exc: Exception, scrub: Scrub) -> tuple[str, int, str]:
    """(kind, log level, text) of a failure of the intake loop: the same kind logs once per outage."""
    for cls, kind, level, say in _FAILURES:
        if isinstance(exc, cls):
            return kind, level, say(exc, scrub)
    return "bug", logging.ERROR, f"unexpected {type(exc).__name__} in the Telegram loop"
