"""The web chat page in headless Chromium: an image pasted into the composer goes to the model."""

from __future__ import annotations

import base64

from playwright.async_api import Browser, expect

from tests.browser.harness import open_chat
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


async def test_a_pasted_image_waits_as_a_chip_then_goes_with_the_message(
        browser: Browser, make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    daemon = await make_daemon(agent={"vision": True})
    page = await open_chat(browser, f"http://127.0.0.1:{daemon.config.http.port}")
    # What a browser does on Ctrl+V of a screenshot: a paste event whose clipboard holds a file.
    await page.evaluate("""(b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "shot.png", { type: "image/png" }));
        const ev = new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true });
        document.getElementById("text").dispatchEvent(ev);
    }""", base64.b64encode(PNG).decode())
    chip = page.locator("#attachments .chip")
    await expect(chip).to_have_count(1)
    await expect(chip).to_contain_text("shot.png · 70 B")
    await page.locator("#text").fill("what is this?")
    await page.locator("#send").click()
    await expect(page.locator("#attachments")).to_be_hidden()
    await expect(page.locator(".msg.user").last).to_have_text("what is this?\n[image: shot.png, 70 B]")
    await expect(page.locator(".msg.bot").last).to_contain_text("reply to: what is this?")
    (asked,) = provider.connections
    assert asked.last_user_parts[1] == {
        "type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}
    # After a reload the history shows the same placeholder the page showed while sending.
    await page.reload()
    await expect(page.locator(".msg.user").last).to_have_text("what is this?\n[image: shot.png, 70 B]")
