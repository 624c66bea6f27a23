"""A current MCP server from the registry, as an operator installs it: `mcp-server-time` (built on the
MCP SDK 2.x) over stdio, whichever SDK the daemon itself runs on.

The server runs from the test interpreter when it has the package (the `test` extra installs it),
else from a virtualenv made once per run under the run's temporary directory (`pip install
mcp-server-time`, within a deadline, or the test fails with pip's log)."""

from __future__ import annotations

import importlib.util
import json
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.agents.mcp_config import McpServerConfig
from gateway.agents.mcp_sdk import VERSION
from gateway.agents.mcp_servers import McpHub
from gateway.agents.processes import ProcessReaper
from tests.support.procs import until
from tests.support.spawn import Group

PIP_DEADLINE_S = 90.0  # below the suite's 120 s per test: the install runs in the test's setup


@pytest.fixture(scope="session")
def time_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The command that starts `mcp-server-time` (stdio)."""
    if importlib.util.find_spec("mcp_server_time") is not None:
        yield [sys.executable, "-m", "mcp_server_time"]
        return
    where = tmp_path_factory.mktemp("mcp-server-time")
    # The test interpreter's packages are seen from it (less to download); its own SDK comes first.
    venv.create(where / "venv", system_site_packages=True, with_pip=True)
    python = where / "venv" / "bin" / "python"
    log = where / "pip.log"
    proc = Group([str(python), "-m", "pip", "install", "--disable-pip-version-check", "mcp-server-time"], log=log)
    try:
        proc.wait(PIP_DEADLINE_S)
    except Exception:
        raise AssertionError(f"pip install mcp-server-time did not finish within {PIP_DEADLINE_S:.0f} s (is "
                             f"PyPI reachable?); log tail:\n{proc.log_tail()}") from None
    finally:
        proc.end()
    if proc.returncode != 0:
        raise AssertionError(f"pip install mcp-server-time failed ({proc.returncode}); log tail:\n{proc.log_tail()}")
    yield [str(python), "-m", "mcp_server_time"]


async def test_a_registry_server_on_the_current_sdk_serves_its_tools(time_server: list[str], tmp_path: Path) -> None:
    reaper = ProcessReaper(grace_s=0.5)
    settings = McpServerConfig(name="time", command=time_server[0], args=[*time_server[1:], "--local-timezone", "UTC"],
                               connect_timeout_s=30)
    hub = McpHub.build([settings], reaper, max_output=4000)
    hub.start()
    server = hub.servers[0]
    try:
        await until(lambda: server.up, 60, f"mcp-server-time never came up (client SDK {VERSION}): {server.detail}")
        assert {"time__get_current_time", "time__convert_time"} <= set(server.tools)
        schema = server.tools["time__get_current_time"].parameters
        assert schema["type"] == "object" and "timezone" in schema["properties"]
        now = json.loads(await server.call("get_current_time", {"timezone": "Europe/Oslo"}))
        assert now["timezone"] == "Europe/Oslo" and "datetime" in now
        converted = json.loads(await server.call("convert_time", {"source_timezone": "UTC", "time": "12:00",
                                                                  "target_timezone": "Asia/Tokyo"}))
        assert converted["target"]["datetime"].endswith("21:00:00+09:00")
        assert server.up and server.restarts == 0
    finally:
        await hub.close()
        await reaper.drain()
