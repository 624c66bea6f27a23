"""The model provider's reachability: a cheap periodic check, shown in `/readyz` and the console,
never counted against readiness."""

from __future__ import annotations

import aiohttp

from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider
from tests.support.ports import free_port
from tests.support.procs import until


async def test_an_unreachable_provider_is_shown_but_the_daemon_stays_ready(make_daemon: DaemonFactory) -> None:
    port = free_port()  # nothing listens there
    daemon = await make_daemon(agent={"base_url": f"http://127.0.0.1:{port}/v1", "probe_interval_s": 0.2})
    await until(lambda: daemon.probe.health() is not None, 10, "the provider was never checked")
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/readyz") as resp:
            body = await resp.json()
        assert resp.status == 200 and body["ready"] is True  # every worker shares the provider: advisory only
        check = body["checks"]["provider"]
        assert check["ok"] is False and check["required"] is False
        assert check["detail"].startswith(f"cannot reach http://127.0.0.1:{port}/v1: ")
        async with http.get(admin + "/admin/api/stats") as resp:
            assert (await resp.json())["health"]["provider"] == check


async def test_a_reachable_provider_is_shown_as_answering(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    daemon = await make_daemon(agent={"probe_interval_s": 0.2})
    await until(lambda: daemon.probe.health() is not None, 10, "the provider was never checked")
    found = (await daemon.readiness())["provider"]
    assert found.ok and found.detail.startswith(f"{provider.base_url} answers (")


async def test_the_echo_agent_has_no_provider_to_check(make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(agent={"kind": "echo", "probe_interval_s": 0.1})
    assert "provider" not in await daemon.readiness()
