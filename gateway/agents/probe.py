"""Is the model provider reachable? A cheap request now and then (`GET <base_url>/models`), so an
operator sees an unreachable or misconfigured provider in the health details and the console
before a user meets it as a failed answer.

Advisory only: readiness does not depend on it. Every worker talks to the same provider, so a
provider outage failing readiness would take every worker out of its load balancer at once — and
with them the commands, the history and the stop buttons that still work without a model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gateway.core.cancellation import cancel_and_wait
from gateway.core.ports import Health

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    base_url: str
    api_key: str | None = None


class ProviderProbe:
    """Checks `target()` (None: the agent needs no provider, as the echo agent) every `interval_s`,
    each check within `timeout_s`; `health()` says what the last one found."""

    def __init__(self, target: Callable[[], ProbeTarget | None], *, interval_s: float = 30.0,
                 timeout_s: float = 5.0) -> None:
        self._target = target
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._health: Health | None = None
        self._task: asyncio.Task[None] | None = None
        self._reported: str | None = None  # the last problem logged (logged once, then its recovery)

    def health(self) -> Health | None:
        """The last check's finding (None: no provider to check, or no check yet); advisory."""
        return self._health

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])

    async def _loop(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as http:
            while True:
                await self.check(http)
                await asyncio.sleep(self.interval_s)

    async def check(self, http: aiohttp.ClientSession) -> Health | None:
        target = self._target()
        if target is None:
            self._health = None
            return None
        url = target.base_url.rstrip("/") + "/models"
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        started = time.monotonic()
        try:
            async with http.get(url, headers=headers, allow_redirects=False) as resp:
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            why = f"no answer within {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else (
                str(exc) or type(exc).__name__)
            self._found(Health(False, f"cannot reach {target.base_url}: {why}", required=False))
            return self._health
        took = f"{1000 * (time.monotonic() - started):.0f} ms"
        if status in (401, 403):
            self._found(Health(False, f"{target.base_url} refuses the API key (HTTP {status}): check agent.api_key",
                               required=False))
        elif status >= 500:
            self._found(Health(False, f"{target.base_url} answers HTTP {status}", required=False))
        else:  # 2xx, or a server without a model list (404): it is there and answering
            self._found(Health(True, f"{target.base_url} answers ({took})", required=False))
        return self._health

    def _found(self, health: Health) -> None:
        self._health = health
        if not health.ok and health.detail != self._reported:
            log.warning("model provider: %s (checked every %g s; readiness does not depend on it)",
                        health.detail, self.interval_s)
            self._reported = health.detail
        elif health.ok and self._reported is not None:
            log.info("model provider: %s again", health.detail)
            self._reported = None

