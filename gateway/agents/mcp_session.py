"""Connections to MCP servers with the official SDK (1.x or 2.x, see `mcp_sdk`): its `ClientSession`
over its streamable HTTP transport, or over the pipes of a server process the daemon started itself.

Two things are done here beyond what the SDK does:

- **Stopping a call tells the server why.** SDK 1.x's `ClientSession.send_request` forgets a
  request whose awaiting task is cancelled without telling the server
  (modelcontextprotocol/python-sdk#2507), which would go on working for nobody: `CancellingSession`
  sends `notifications/cancelled` for it at once, from a task of its own, so the run's repeated
  cancels cannot interrupt the send. SDK 2.x's dispatcher sends that notice itself, saying only
  "caller cancelled": the session's dispatcher puts the run's reason in it instead. Either way a
  result that arrives after that finds no waiter, is dropped by the SDK, and is counted.
- **A stdio server is one of our tool process groups.** The SDK's `stdio_client` starts the
  process itself, out of reach of the daemon's process ledger. Here the `ProcessReaper` starts it
  (its own process group, PDEATHSIG, recorded for the sentinel, TERM then KILL at the end) and the
  SDK's message types frame the newline-delimited JSON-RPC on its pipes, as `stdio_client` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import ClientSession
from mcp.shared.message import SessionMessage

from gateway.agents.mcp_sdk import V2, http, parse_message, sdk_types
from gateway.agents.processes import ProcessReaper, Spawn
from gateway.core.cancellation import get_run
from gateway.core.logs import redactor

log = logging.getLogger(__name__)

MAX_LINE = 32 << 20  # one JSON-RPC message from a server; beyond this the connection is dropped
STDERR_TAIL = 5  # last lines of a server's stderr kept for the report when it dies

# Set by a caller that gives up on a call after a deadline: the reason the server is told.
call_deadline: ContextVar[tuple[float, str] | None] = ContextVar("mcp_call_deadline", default=None)


class ServerGone(Exception):
    """The connection to the server ended (its process exited, its stream closed)."""


def _cancel_reason() -> str:
    """Why a call is being abandoned, in the words the run or the caller's deadline gives."""
    run = get_run()
    if run is not None and run.reason is not None:
        return run.reason.marker
    deadline = call_deadline.get()
    if deadline is not None and time.monotonic() >= deadline[0]:
        return deadline[1]
    return "the client stopped waiting"


MessageHandler = Callable[[Any], Awaitable[None]]


class CancellingSession(ClientSession):
    """`ClientSession` that tells the server about every request it stops waiting for, with the
    reason, and counts the answers that come after that (`on_late_result`)."""

    def __init__(self, read: Any, write: Any, *, message_handler: MessageHandler,
                 on_late_result: Callable[[], None]) -> None:
        self._notices: set[asyncio.Task[None]] = set()
        self._on_late_result = on_late_result
        self._handler = message_handler
        self.cancels_sent = 0
        # Keyword arguments of one SDK version or the other: checked by the SDK, not here.
        options: dict[str, Any] = (
            {"message_handler": message_handler, "dispatcher": _ReasonGivingDispatcher(read, write, session=self)}
            if V2 else {"read_stream": read, "write_stream": write, "message_handler": self._on_message})
        super().__init__(**options)

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, RuntimeError) and "unknown request ID" in str(message):
            self._on_late_result()  # 1.x: the answer to a call that was stopped or timed out
            return
        await self._handler(message)

    async def send_request(self, request: Any, result_type: Any, request_read_timeout_seconds: Any = None,
                           metadata: Any = None, progress_callback: Any = None) -> Any:
        if V2:  # its dispatcher tells the server (`_ReasonGivingDispatcher`)
            return await super().send_request(request, result_type, request_read_timeout_seconds, metadata,
                                              progress_callback)
        request_id = vars(self)["_request_id"]  # 1.x: the id `super().send_request` takes before its first await
        try:
            return await super().send_request(request, result_type, request_read_timeout_seconds, metadata,
                                              progress_callback)
        except asyncio.CancelledError:
            if not isinstance(request.root, sdk_types.InitializeRequest):  # the spec forbids cancelling initialize
                self._notify_cancelled(request_id, _cancel_reason())
            raise

    def _notify_cancelled(self, request_id: int, reason: str) -> None:
        notice = sdk_types.ClientNotification(sdk_types.CancelledNotification(
            params=sdk_types.CancelledNotificationParams(requestId=request_id, reason=reason)))

        async def send() -> None:
            try:
                await self.send_notification(notice)
                self.cancels_sent += 1
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # the connection is gone: so is the request
            except Exception as exc:  # best effort: the call is over for us either way
                log.debug("could not send notifications/cancelled: %r", exc)

        task = asyncio.get_running_loop().create_task(send())
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def settle(self) -> None:
        """Wait for cancel notices still being sent (before the connection closes)."""
        if self._notices:
            await asyncio.wait(list(self._notices), timeout=1.0)


def _reason_giving_dispatcher() -> Any:
    """2.x: the SDK's JSON-RPC dispatcher, its cancel notices carrying the run's reason (it says
    "caller cancelled"), counting them, and counting answers that come for nobody. It hooks two
    methods of the dispatcher's own: should an SDK release rename them, the SDK's notice still goes
    out, with its own words."""
    if not V2:
        return None
    module = importlib.import_module("mcp.shared.jsonrpc_dispatcher")
    coerce = getattr(module, "coerce_request_id", lambda request_id: request_id)

    class ReasonGiving(module.JSONRPCDispatcher):  # type: ignore[misc, name-defined]
        def __init__(self, read: Any, write: Any, *, session: CancellingSession) -> None:
            super().__init__(read, write)
            self._session = session

        async def _cancel_outbound(self, request_id: Any, reason: str, related_request_id: Any) -> None:
            if reason == "caller cancelled":
                reason = _cancel_reason()  # in the caller's task: its run says why
            await super()._cancel_outbound(request_id, reason, related_request_id)
            self._session.cancels_sent += 1

        def _resolve_pending(self, request_id: Any, outcome: Any) -> None:
            if request_id is not None and self._pending.get(coerce(request_id)) is None:
                self._session._on_late_result()
            super()._resolve_pending(request_id, outcome)

    return ReasonGiving


_ReasonGivingDispatcher: Any = _reason_giving_dispatcher()


# --- stdio over a process of our own -------------------------------------------------------------


class ProcessPipes:
    """A server process in its own group, its stdout/stdin as the SDK's message streams."""

    def __init__(self, spawn: Spawn, name: str) -> None:
        self.spawn = spawn
        self.name = name
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.ended = asyncio.Event()
        self.end_reason = ""

    @property
    def pid(self) -> int | None:
        return self.spawn.proc.pid if self.spawn.proc is not None else None

    async def exit_reason(self) -> str:
        """How the process ended, once its output has: its exit status has a moment to arrive."""
        if (proc := self.spawn.proc) is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 1.0)
        return self.end_reason or self.describe_exit()

    def describe_exit(self) -> str:
        proc = self.spawn.proc
        code = proc.returncode if proc is not None else None
        what = "exited" if code is None or code >= 0 else "was killed"
        text = f"{what} (code {code})" if code is None or code >= 0 else f"{what} (signal {-code})"
        if self.stderr_tail:
            text += ": " + redactor(self.stderr_tail[-1])[:200]
        return text


@contextlib.asynccontextmanager
async def stdio_streams(reaper: ProcessReaper, argv: Sequence[str], env: Mapping[str, str], cwd: str | None,
                        name: str) -> AsyncIterator[tuple[MemoryObjectReceiveStream[SessionMessage | Exception],
                                                          MemoryObjectSendStream[SessionMessage], ProcessPipes]]:
    """Start the server and frame its pipes; at the end its stdin closes and its group is terminated
    (TERM, then KILL after the reaper's grace)."""
    spawn = reaper.spawn(argv, pipes=True, env=env, cwd=cwd)
    pipes = ProcessPipes(spawn, name)
    try:
        proc = await asyncio.shield(spawn.task)
    except BaseException:
        spawn.stop()
        raise
    if proc is None:
        raise ServerGone("stopped before it started")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    tasks = [asyncio.ensure_future(_read_messages(stdout, read_writer, pipes)),
             asyncio.ensure_future(_write_messages(stdin, write_reader)),
             asyncio.ensure_future(_read_stderr(stderr, pipes, name))]
    try:
        yield read_stream, write_stream, pipes
    finally:
        stdin.close()
        spawn.stop()  # TERM to the group now; the reaper sends KILL after its grace
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in (read_stream, write_stream):
            await stream.aclose()


def is_transport_error(exc: BaseException) -> bool:
    """Did a call fail because the connection did (rather than the tool)?"""
    return isinstance(exc, (http.TransportError, anyio.ClosedResourceError, anyio.BrokenResourceError,
                            ConnectionError, ServerGone))


async def _read_messages(stdout: asyncio.StreamReader,
                         out: MemoryObjectSendStream[SessionMessage | Exception], pipes: ProcessPipes) -> None:
    """The server's stdout, one JSON-RPC message per line, to the session (a bad line as its error)."""
    buffer = b""
    try:
        async with out:
            while chunk := await stdout.read(65536):
                lines = (buffer + chunk).split(b"\n")
                buffer = lines.pop()
                if len(buffer) > MAX_LINE:
                    pipes.end_reason = f"sent a message over {MAX_LINE >> 20} MiB"
                    return
                for line in lines:
                    if line.strip():
                        await out.send(_message(line))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass
    finally:
        pipes.ended.set()


def _message(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(parse_message(line))
    except ValueError as exc:
        return exc


async def _write_messages(stdin: asyncio.StreamWriter, messages: MemoryObjectReceiveStream[SessionMessage]) -> None:
    """The session's messages to the server's stdin, one line each."""
    try:
        async with messages:
            async for message in messages:
                data = message.message.model_dump_json(by_alias=True, exclude_none=True)
                stdin.write(data.encode() + b"\n")
                await stdin.drain()
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
        pass


async def _read_stderr(stderr: asyncio.StreamReader, pipes: ProcessPipes, name: str) -> None:
    """The server's stderr: its last lines kept (for the log when it dies), each at debug level."""
    while line := await stderr.readline():
        text = line.decode("utf-8", "replace").rstrip()
        if text:
            pipes.stderr_tail.append(text)
            log.debug("mcp server %s: %s", name, redactor(text)[:500])
