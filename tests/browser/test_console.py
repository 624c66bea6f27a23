"""The operator console (/admin) in headless Chromium: live sessions, operator stop, figures, sign-in."""

from __future__ import annotations

import re

from playwright.async_api import Browser, expect

from tests.browser.harness import open_chat, say, session_key
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider


async def test_the_console_lists_two_sessions_and_stops_one_while_the_other_streams_on(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 80
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    alice_ctx, bob_ctx = await browser.new_context(), await browser.new_context()  # two cookies: two sessions
    alice, bob = await open_chat(alice_ctx, base), await open_chat(bob_ctx, base)
    await say(alice, "alice asks")
    await say(bob, "bob asks")
    await expect(alice.locator(".msg.bot .body")).to_contain_text("w1")
    await expect(bob.locator(".msg.bot .body")).to_contain_text("w1")

    console = await browser.new_page()
    await console.goto(f"http://127.0.0.1:{daemon.config.admin.port}/admin")
    running = console.locator("#sessions tbody tr[data-state=running]")
    await expect(running).to_have_count(2)
    await expect(console.locator("#n-running")).to_have_text("2")
    alice_row = console.locator(f'#sessions tbody tr[data-key="{await session_key(alice_ctx, daemon)}"]')
    bob_row = console.locator(f'#sessions tbody tr[data-key="{await session_key(bob_ctx, daemon)}"]')
    await expect(alice_row.locator("td.platform")).to_have_text("webchat")
    await expect(alice_row.locator(".pill")).to_have_text("running")
    await expect(alice_row.locator("td.age")).to_have_text(re.compile(r"^\d+\.\d s$"))
    await expect(console.locator("#health li[data-name=webchat]")).to_have_class(re.compile(r"\bok\b"))
    await expect(console.locator("#cache")).to_contain_text("2 / ")

    await alice_row.locator("button.stop-btn").click()
    await expect(console.locator("#toast")).to_contain_text("Stopped webchat")
    await expect(alice.locator(".msg.bot .interruption")).to_have_text("Stopped by the operator")
    await expect(alice.locator("#stop")).to_be_disabled()
    await expect(alice_row).to_have_attribute("data-state", "idle")
    await expect(alice_row.locator("td.why")).to_contain_text("system")
    await expect(alice_row.locator("td.why")).to_contain_text("stopped by operator")
    await expect(alice_row.locator("button.stop-btn")).to_be_disabled()
    alice_conn = provider.requests_for("alice asks")[0]
    await provider.wait_closed(alice_conn)
    assert not alice_conn.completed

    await expect(bob_row).to_have_attribute("data-state", "running")  # untouched, still streaming
    await expect(bob.locator(".msg.bot .body")).to_have_text(re.compile(r"w79\s*$"), timeout=15_000)
    await expect(bob.locator(".interruption")).to_have_count(0)
    assert provider.requests_for("bob asks")[0].completed
    await expect(bob_row).to_have_attribute("data-state", "idle")
    await expect(console.locator("#stop-count")).to_contain_text("1 stop ")
    assert await console.locator("#histogram svg rect.bar-rect[height]:not([height='0'])").count() == 1


async def test_with_a_token_the_console_asks_to_sign_in_and_keeps_an_httponly_cookie(
        browser: Browser, make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(admin={"token": "admin-secret-1234"})
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    context = await browser.new_context()
    page = await context.new_page()
    await page.goto(admin + "/admin")
    await expect(page.locator("#login")).to_be_visible()
    await expect(page.locator("#console")).to_be_hidden()
    await page.locator("#token").fill("not the token")
    await page.locator("#token").press("Enter")
    await expect(page.locator("#login-error")).to_be_visible()
    await page.locator("#token").fill("admin-secret-1234")
    await page.locator("#token").press("Enter")
    await expect(page.locator("#console")).to_be_visible()
    await expect(page.locator("#live")).to_have_attribute("data-state", "live")
    cookie = next(c for c in await context.cookies() if c.get("name") == "switchboard_admin")
    assert cookie.get("httpOnly") and cookie.get("sameSite") == "Strict"

    # A link with the token signs in once and leaves no token in the address bar.
    other = await browser.new_page()
    await other.goto(admin + "/admin?token=admin-secret-1234")
    assert other.url == admin + "/admin"
    await expect(other.locator("#live")).to_have_attribute("data-state", "live")
    await expect(other.locator("#no-sessions")).to_be_visible()


async def test_an_unreachable_provider_shows_in_the_console_as_a_warning_and_the_root_leads_there(
        browser: Browser, make_daemon: DaemonFactory) -> None:
    from tests.support.ports import free_port

    port = free_port()  # nothing listens there
    daemon = await make_daemon(agent={"base_url": f"http://127.0.0.1:{port}/v1", "probe_interval_s": 0.2})
    console = await browser.new_page()
    errors: list[str] = []
    console.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    await console.goto(f"http://127.0.0.1:{daemon.config.admin.port}/")  # the listener's root
    assert console.url.endswith("/admin")
    provider = console.locator("#health li[data-name=provider]")
    await expect(provider).to_have_class(re.compile(r"\bwarn\b"))  # advisory: not "down"
    await expect(provider.locator(".detail")).to_have_text(re.compile(rf"^cannot reach http://127\.0\.0\.1:{port}/v1"))
    await expect(console.locator("#health li[data-name=webchat]")).to_have_class(re.compile(r"\bok\b"))
    assert not [e for e in errors if "favicon" in e or "404" in e], errors  # the favicon is served
