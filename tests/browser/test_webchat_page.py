"""The web chat page in headless Chromium: streaming, Stop, history, restarts, reconnects, safety."""

from __future__ import annotations

import asyncio
import itertools
import re
import time

from playwright.async_api import Browser, Page, expect

from gateway.ops.daemon import Daemon
from platforms.webchat import WebchatAdapter
from tests.browser.harness import open_chat, say, session_key
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script

MARKDOWN = ("Here is **bold**, *italic* and `inline code`:\n\n```python\nprint('hi')\n```\n\n- one\n- two\n\n"
            "1. first\n2. second\n\nSee [the docs](https://example.com/docs) or https://example.org/x. End")


async def _snapshots_until_idle(page: Page, timeout: float = 10) -> list[str]:
    """Every distinct text the last bot message showed, until the turn is over."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    body = page.locator(".msg.bot .body").last
    while time.monotonic() < deadline:
        if await body.count():
            text = await body.inner_text()
            if not seen or seen[-1] != text:
                seen.append(text)
        if seen and await page.locator("body[data-running=false]").count():
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"the turn did not end; saw {seen[-1:]!r}")


async def test_a_reply_streams_in_as_markdown_and_stop_follows_the_turn(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s = 0.03
    provider.by_text["show me markdown"] = Script(text=MARKDOWN)
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await expect(page.locator("#empty")).to_be_visible()
    await expect(page.locator("#stop")).to_be_disabled()

    await say(page, "show me markdown")
    await expect(page.locator("#stop")).to_be_enabled()
    seen = await _snapshots_until_idle(page)
    assert len(seen) >= 4, seen  # it grew across several edits, not in one piece
    assert all(len(a) < len(b) for a, b in itertools.pairwise(seen)), seen
    await expect(page.locator("#stop")).to_be_disabled()

    bot = page.locator(".msg.bot").last
    await expect(bot.locator("strong")).to_have_text("bold")
    await expect(bot.locator("em")).to_have_text("italic")
    await expect(bot.locator("p code")).to_have_text("inline code")
    await expect(bot.locator(".code pre code")).to_have_text("print('hi')")
    await expect(bot.locator(".code-head span")).to_have_text("python")
    await expect(bot.locator("ul > li")).to_have_text(["one", "two"])
    await expect(bot.locator("ol > li")).to_have_text(["first", "second"])
    links = bot.locator("a")
    await expect(links).to_have_count(2)
    assert await links.nth(0).get_attribute("href") == "https://example.com/docs"
    assert await links.nth(1).get_attribute("href") == "https://example.org/x"
    assert "noopener" in (await links.nth(0).get_attribute("rel") or "")
    await expect(page.locator(".msg.user")).to_have_text(["show me markdown"])
    await expect(page.locator(".msg.user.pending")).to_have_count(0)  # acknowledged


async def test_stop_mid_stream_closes_the_provider_and_reload_restores_history(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.01, 3
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    page = await open_chat(browser, base)
    await say(page, "a short one")
    await expect(page.locator(".msg.bot .body")).to_have_text("reply to: a short one w0 w1 w2")
    await expect(page.locator("#stop")).to_be_disabled()

    provider.delay_s, provider.words = 0.05, 200
    await say(page, "a long one")
    await expect(page.locator(".msg.bot .body").last).to_contain_text("w3")
    conn = provider.requests_for("a long one")[0]
    await page.locator("#stop").click()
    await provider.wait_closed(conn)
    assert not conn.completed
    stopped = page.locator(".msg.bot").last.locator(".interruption")
    await expect(stopped).to_have_text("Stopped")
    await expect(stopped).to_have_attribute("data-kind", "stopped")
    await expect(page.locator(".notice")).to_have_count(0)  # the mark replaces the "Stopped." acknowledgement
    await expect(page.locator("#stop")).to_be_disabled()
    partial = await page.locator(".msg.bot .body").last.inner_text()
    assert "⏹" not in partial and partial.startswith("reply to: a long one")

    await page.reload()
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(page.locator(".msg.user")).to_have_text(["a short one", "a long one"])
    await expect(page.locator(".msg.bot .body")).to_have_text(["reply to: a short one w0 w1 w2", partial])
    await expect(page.locator(".msg.bot").last.locator(".interruption")).to_have_text("Stopped")
    await expect(page.locator("#stop")).to_be_disabled()

    await page.locator("#new").click()
    await expect(page.locator(".notice")).to_have_text(["Started a new conversation. The old one is archived."])
    await expect(page.locator(".msg")).to_have_count(0)
    await page.reload()
    await expect(page.locator("#empty")).to_be_visible()
    await expect(page.locator(".msg")).to_have_count(0)


async def test_a_restart_mid_turn_is_shown_and_the_page_reconnects_by_itself(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 200
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "tell me a long story")
    await expect(page.locator(".msg.bot .body")).to_contain_text("w3")

    await daemon.stop()  # running turns end with the system reason "gateway restart"
    mark = page.locator(".msg.bot").first.locator(".interruption")
    await expect(mark).to_have_attribute("data-kind", "restart")  # shown live, before the socket closed
    await expect(mark).to_have_text("Interrupted by a gateway restart")
    await expect(page.locator("#conn")).to_have_attribute("data-state", "restarting")
    await expect(page.locator("#banner")).to_have_text(re.compile("restarting"))
    await say(page, "are you back?")  # typed while the gateway is down: kept, sent after reconnecting
    await expect(page.locator(".msg.user.pending")).to_have_text(["are you back?"])

    provider.delay_s, provider.words = 0.01, 3
    second = Daemon(daemon.config)  # same port and data directory: the page finds it by itself
    await second.start()
    try:
        await expect(page.locator("#conn")).to_have_attribute("data-state", "connected", timeout=15_000)
        await expect(page.locator("#banner")).to_be_hidden()
        first = page.locator(".msg.bot").first
        await expect(first.locator(".interruption")).to_have_attribute("data-kind", "restart")
        await expect(first.locator(".interruption")).to_have_text("Interrupted by a gateway restart")
        await expect(page.locator(".msg.bot .body").last).to_have_text("reply to: are you back? w0 w1 w2")
        # The new daemon resumed the cut-off answer by itself; its prompt is a notice, not a user message.
        await expect(page.locator(".notice[data-kind=resume]")).to_have_count(1)
        await expect(page.locator(".msg.user")).to_have_text(["tell me a long story", "are you back?"])
        await expect(page.locator(".msg.user.pending")).to_have_count(0)
        assert len(provider.requests_for("are you back?")) == 1

        await page.reload()
        await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
        await expect(page.locator(".msg.user")).to_have_text(["tell me a long story", "are you back?"])
        await expect(page.locator(".msg.bot .body").last).to_have_text("reply to: are you back? w0 w1 w2")
        await expect(page.locator(".msg.bot").first.locator(".interruption")).to_have_attribute("data-kind", "restart")
    finally:
        await second.stop()


async def test_a_dropped_socket_reconnects_without_duplicating_the_conversation(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 40
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "keep talking")
    await expect(page.locator(".msg.bot .body")).to_contain_text("w3")
    adapter = daemon.adapters["webchat"]
    assert isinstance(adapter, WebchatAdapter)
    for sockets in list(adapter._sockets.values()):  # the network drops the socket mid-stream
        for ws in list(sockets):
            await ws.close()
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(page.locator(".msg.bot .body").last).to_have_text(re.compile(r"w39\s*$"))
    await expect(page.locator(".msg.user")).to_have_text(["keep talking"])
    await expect(page.locator(".msg.bot")).to_have_count(1)
    assert len(provider.requests_for("keep talking")) == 1
    await page.reload()
    await expect(page.locator(".msg.user")).to_have_text(["keep talking"])
    await expect(page.locator(".msg.bot .body")).to_have_text([re.compile(r"^reply to: keep talking .*w39\s*$")])


async def test_queued_and_error_notices_are_styled(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.03, 20
    provider.by_text["please fail"] = Script(status=500)
    daemon = await make_daemon(router={"busy": "queue"})
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "first")
    await expect(page.locator(".msg.bot")).to_have_count(1)
    await say(page, "second")
    await expect(page.locator(".notice[data-kind=queued]")).to_contain_text("Queued — 1 ahead")
    await expect(page.locator(".msg.bot .body")).to_have_text([re.compile(r"w19\s*$"), re.compile(r"w19\s*$")])
    await say(page, "please fail")
    failed = page.locator(".msg.bot").last
    await expect(failed).to_have_class(re.compile(r"\berror\b"))
    await expect(failed.locator("p.warn")).to_contain_text("The agent failed")
    await expect(page.locator("#stop")).to_be_disabled()
    await say(page, "/help")  # a typed command is answered with a notice and is not part of the conversation
    await expect(page.locator(".notice").last).to_contain_text("/stop")
    await expect(page.locator(".msg.user.command")).to_have_text(["/help"])


async def test_model_html_and_script_links_are_shown_as_text(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    attack = ('<img src=x onerror="window.__xss=1"> <script>window.__xss=2</script> '
              '[click me](javascript:window.__xss=3) [data](data:text/html,<b>x</b>) '
              '<a href="javascript:window.__xss=4">a</a> [fine](https://example.com/ok)')
    provider.delay_s = 0.01
    provider.by_text["be evil"] = Script(text=attack)
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "be evil")
    bot = page.locator(".msg.bot").last
    await expect(bot.locator(".body")).to_contain_text("fine")
    await expect(page.locator("body[data-running=false]")).to_have_count(1)
    for _ in range(2):  # as streamed, then as restored from history
        await expect(bot.locator(".body")).to_contain_text('<img src=x onerror="window.__xss=1">')
        await expect(bot.locator(".body")).to_contain_text("<script>window.__xss=2</script>")
        await expect(bot.locator(".body")).to_contain_text("[click me](javascript:window.__xss=3)")
        assert await bot.locator("img, script, iframe, b").count() == 0
        links = bot.locator("a")
        await expect(links).to_have_count(1)
        assert await links.get_attribute("href") == "https://example.com/ok"
        assert await page.evaluate("window.__xss") is None
        await page.reload()
        await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
        bot = page.locator(".msg.bot").last


MD_CASES = [
    ("plain *em* and **strong** and ~~gone~~",
     "<p>plain <em>em</em> and <strong>strong</strong> and <del>gone</del></p>"),
    ("snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"),
    ("line one\nline two", "<p>line one<br>line two</p>"),
    (r"\*not em\* and `a <b> c`", "<p>*not em* and <code>a &lt;b&gt; c</code></p>"),
    ("see https://example.com/a_(b). and <https://x.y>", '<p>see <a href="https://example.com/a_(b)" target="_blank" '
     'rel="noopener noreferrer nofollow">https://example.com/a_(b)</a>. and &lt;<a href="https://x.y/" '
     'target="_blank" rel="noopener noreferrer nofollow">https://x.y</a>&gt;</p>'),
    ("[x](ftp://host/f) [y](/relative) [z](JaVaScRiPt:alert(1))",
     "<p>[x](ftp://host/f) [y](/relative) [z](JaVaScRiPt:alert(1))</p>"),
    ("- a\n  - nested\n- b", "<ul><li><p>a</p><ul><li><p>nested</p></li></ul></li><li><p>b</p></li></ul>"),
    ("3. three\n4. four", '<ol start="3"><li><p>three</p></li><li><p>four</p></li></ol>'),
    ("## Title\n> quoted **bold**\n\n---", "<h4>Title</h4><blockquote><p>quoted <strong>bold</strong></p>"
     "</blockquote><hr>"),
    ("```js\nlet a = '<i>';\n", '<div class="code"><div class="code-head"><span>js</span><button type="button">'
     "Copy</button></div><pre><code>let a = '&lt;i&gt;';\n</code></pre></div>"),  # a fence still streaming
]


async def test_the_markdown_renderer_builds_only_safe_elements(
        browser: Browser, make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    for source, html in MD_CASES:
        rendered = await page.evaluate("(src) => { const d = document.createElement('div'); SB_MD.render(src, d);"
                                       " return d.innerHTML; }", source)
        assert rendered == html, source
    assert await page.evaluate("window.__xss") is None


async def test_a_stopped_answer_shows_exactly_what_is_stored_live_and_after_a_reload(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    # Tokens far faster than the edit interval: at every stop some text is in flight, never shown.
    provider.delay_s, provider.words = 0.002, 3000
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    key = await session_key(page.context, daemon)
    live: list[str] = []
    for trial in range(4):
        await say(page, f"long {trial}")
        body = page.locator(".msg.bot").nth(trial).locator(".body")
        await expect(body).to_contain_text(f"w{100 * (trial + 1)}")
        await page.locator("#stop").click()
        await expect(page.locator(".msg.bot").nth(trial).locator(".interruption")).to_have_text("Stopped")
        await expect(page.locator("body[data-running=false]")).to_have_count(1)
        live.append(await body.inner_text())
        _, history = await daemon.store.conversation(key)
        assert history[-1].content.strip() == live[-1], f"trial {trial}: the page and the transcript differ"
    await page.reload()
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(page.locator(".msg.bot .body")).to_have_text(live)
    await expect(page.locator(".msg.bot .interruption")).to_have_text(["Stopped"] * 4)


async def test_a_stopped_tool_turn_keeps_its_mark_after_a_reload(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    daemon = await make_daemon()
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    await say(page, "take your time")
    await expect(page.locator("#stop")).to_be_enabled()
    deadline = time.monotonic() + 5
    while not [c for c in provider.connections if c.completed]:  # the model asked for the tool
        assert time.monotonic() < deadline, "the tool never started"
        await asyncio.sleep(0.01)
    await page.locator("#stop").click()
    # Live as after a reload: the call's row, cut short, and the mark below it (one stop notice).
    await expect(page.locator(".notice[data-kind=stopped]")).to_have_text(["Stopped"])
    await expect(page.locator("#stop")).to_be_disabled()
    await expect(page.locator(".tool")).to_have_attribute("data-state", "interrupted")
    await page.reload()
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    await expect(page.locator(".tool .tool-name")).to_have_text(["sleep"])
    await expect(page.locator(".tool")).to_have_attribute("data-state", "interrupted")
    mark = page.locator(".notice.mark")
    await expect(mark).to_have_text(["Stopped"])
    await expect(mark).to_have_attribute("data-kind", "stopped")


async def test_a_draft_over_the_limit_stays_in_the_composer_with_the_limit_shown(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    daemon = await make_daemon(router={"max_message_chars": 100})
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    count, text = page.locator("#count"), page.locator("#text")
    await expect(count).to_be_hidden()
    draft = "😀" + "x" * 149  # 150 characters as the gateway counts them (the emoji is one)
    await text.fill(draft)  # as a paste does
    await expect(count).to_be_visible()
    await expect(count).to_have_text("150 / 100 — too long to send")
    await expect(count).to_have_attribute("data-over", "true")
    await expect(page.locator("#send")).to_be_disabled()
    await text.press("Enter")
    await expect(text).to_have_value(draft)  # kept, not thrown away
    await expect(page.locator(".msg.user")).to_have_count(0)
    assert provider.connections == []
    await text.fill("😀" + "x" * 94)  # 95: near the limit, fine to send
    await expect(count).to_have_text("95 / 100")
    await expect(count).to_have_attribute("data-over", "false")
    await text.press("Enter")
    await expect(text).to_have_value("")
    await expect(count).to_be_hidden()
    await expect(page.locator(".msg.bot .body")).to_have_text([re.compile(r"^reply to: 😀x+ w0\s*$")])
