"""Tool calls in the web chat, as a person sees them: a row per call as it starts (name, the gist
of its arguments, its elapsed time ticking, its Stop), its result or its interruption when it ends —
and the same rows after a reload, mid-turn or after it."""

from __future__ import annotations

import re

from playwright.async_api import Browser, Page, expect

from tests.browser.harness import open_chat, say
from tests.conftest import DaemonFactory

ECHO = {"kind": "echo"}


async def _rows(page: Page) -> list[tuple[str | None, str, str, str]]:
    """Each tool row: its state, name, arguments and time, as shown."""
    rows = page.locator(".tool")
    return [(await row.get_attribute("data-state"), await row.locator(".tool-name").inner_text(),
             await row.locator(".tool-args").inner_text(), await row.locator(".tool-time").inner_text())
            for row in await rows.all()]


async def test_a_tool_call_shows_as_it_runs_ticks_ends_and_reloads_the_same(
        browser: Browser, make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(agent=ECHO)
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "!sleep 4")
    row = page.locator(".tool")
    await expect(row).to_have_attribute("data-state", "running")
    await expect(row.locator(".tool-name")).to_have_text("sleep")
    await expect(row.locator(".tool-args")).to_have_text("4")
    await expect(row.locator(".tool-stop")).to_be_visible()
    await expect(row.locator(".tool-time")).to_have_text(re.compile(r"^[01] s$"))
    # It ticks while it runs (a busy machine may skip a second, so any later second counts).
    await expect(row.locator(".tool-time")).to_have_text(re.compile(r"^[23] s$"), timeout=5_000)
    await expect(row).to_have_attribute("data-state", "done", timeout=10_000)
    await expect(row.locator(".tool-time")).to_have_text(re.compile(r"^[4-9] s$"))
    await expect(row.locator(".tool-stop")).to_be_hidden()
    await expect(row.locator(".tool-result pre")).to_have_text(re.compile(r"exit 0|^$|."))
    await expect(page.locator(".msg.bot .body")).to_have_text([re.compile(r"^Done: ")])
    await expect(page.locator("body[data-running=false]")).to_have_count(1)
    live = await _rows(page)
    assert live[0][:3] == ("done", "sleep", "4") and len(live) == 1
    await page.reload()
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(page.locator(".msg.bot .body")).to_have_text([re.compile(r"^Done: ")])
    assert await _rows(page) == live  # reload equals live
    assert await page.locator(".notice.tools").count() == 0  # the rows replaced "Used sleep"


async def test_a_stopped_tool_call_is_marked_once_and_a_reload_mid_call_keeps_its_row(
        browser: Browser, make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(agent=ECHO)
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "!sleep 30")
    row = page.locator(".tool")
    await expect(row.locator(".tool-time")).to_have_text(re.compile(r"^[1-9] s$"), timeout=5_000)
    before = int((await row.locator(".tool-time").inner_text()).split()[0])
    await page.reload()  # mid-call: the row is back, still running and ticking from where it was
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(row).to_have_attribute("data-state", "running")
    later = "|".join(str(n) for n in range(before + 1, 30))
    await expect(row.locator(".tool-time")).to_have_text(re.compile(rf"^({later}) s$"), timeout=5_000)
    await row.locator(".tool-stop").click()  # the row's own Stop
    await expect(row).to_have_attribute("data-state", "interrupted")
    await expect(row.locator(".tool-time")).to_have_text(re.compile(rf"^stopped after ({later}) s$"))
    await expect(row.locator(".tool-stop")).to_be_hidden()
    await expect(page.locator("#stop")).to_be_disabled()
    await expect(page.locator(".notice.mark[data-kind=stopped]")).to_have_text(["Stopped"])
    await expect(page.locator("body[data-running=false]")).to_have_count(1)
    assert await page.locator(".notice").count() == 1  # one stop notice per stop: the mark
    live = await _rows(page)
    await page.reload()
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(page.locator(".notice.mark[data-kind=stopped]")).to_have_text(["Stopped"])
    assert await _rows(page) == live


async def test_a_notice_keeps_its_line_breaks(browser: Browser, make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(agent=ECHO)
    page = await browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    await page.goto(f"http://127.0.0.1:{daemon.config.http.port}/")
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    assert errors == []  # no 404 for the favicon
    await say(page, "/help")
    notice = page.locator(".notice.multi")
    await expect(notice).to_contain_text("/stop")
    lines = (await notice.inner_text()).splitlines()
    assert lines[0] == "Commands:" and any(line.startswith("/stop") for line in lines), lines
    box = await notice.bounding_box()
    assert box is not None and box["height"] > 4 * 16  # several lines, not one run-on paragraph
