"""Regenerate the README's screenshots in docs/: `python -m tests.browser.screenshots [outdir]`.

Runs a daemon against the fake provider and drives Debian's Chromium through the main states:
a reply streaming, a stopped reply, a restart mid-turn, tool calls (one done, one running), the
console, and a phone-sized chat.
Not part of the test suite, so the suite never rewrites docs/.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from playwright.async_api import Browser, Page, async_playwright, expect

from gateway.ops.config import load_config
from gateway.ops.daemon import Daemon
from tests.browser.harness import CHROMIUM_ARGS, ensure_chromium, open_chat, say
from tests.conftest import free_port
from tests.fakes.openai_provider import FakeProvider, Script

ANSWER = """Sort the entries by their size with `os.scandir`:

```python
import os

def by_size(path="."):
    files = [e for e in os.scandir(path) if e.is_file()]
    return sorted(files, key=lambda e: e.stat().st_size, reverse=True)

for entry in by_size():
    print(f"{entry.stat().st_size:>10}  {entry.name}")
```

A few notes:

- `scandir` reads each entry's metadata **once**, so it is faster than `listdir` + `stat`.
- Add `follow_symlinks=False` to size the links themselves.
- For a whole tree, walk it with `os.walk` and see the [os docs](https://docs.python.org/3/library/os.html)."""

STORY = ("Once upon a time, a switchboard operator connected every call in a small mountain town. "
         "She knew each voice, every line, and which calls could wait. " * 6).strip()


async def _shoot(page: Page, out: Path, name: str) -> None:
    await page.screenshot(path=str(out / name))
    print(f"wrote {out / name}")


async def _tools(browser: Browser, base: str, provider: FakeProvider, out: Path) -> None:
    """A finished tool call with its result, and a long one running: its time ticking, its Stop."""
    page = await open_chat(await browser.new_context(viewport={"width": 1000, "height": 560}), base)
    provider.then(Script(tool_calls=[("shell", {"command": "du -sh * | sort -rh | head -3"})]))
    provider.then(Script(text="`switchboard.db.reserve` takes the most room (16 MB): the store keeps that much disk "
                                "free for itself. Then come the database and its log."))
    await say(page, "What takes the most room here?")
    await expect(page.locator(".msg.bot .body")).to_contain_text("and its log")
    await expect(page.locator("body[data-running=false]")).to_have_count(1)
    await page.locator(".tool-result summary").click()
    provider.then(Script(tool_calls=[("shell", {"command": "sleep 30; pytest -q tests/"})]))
    await say(page, "Run the test suite, please.")
    await expect(page.locator(".tool[data-state=running] .tool-time")).to_have_text("4 s", timeout=10_000)
    await _shoot(page, out, "webchat-tools.png")
    await page.locator(".tool[data-state=running] .tool-stop").click()
    await expect(page.locator(".tool[data-state=interrupted]")).to_have_count(1)
    await page.close()


async def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    async with FakeProvider(delay_s=0.06) as provider:
        provider.by_text["How do I list the files in a folder by size, in Python?"] = Script(text=ANSWER)
        provider.by_text["Tell me a story about switchboards."] = Script(text=STORY)
        provider.by_text["And a long one about telegraphs?"] = Script(text=STORY, delay_s=0.12)
        provider.by_text["Write me a haiku about queues."] = Script(
            text="Messages in line —\neach one waits its turn to speak,\nthe lane keeps its word.", delay_s=0.6)
        with tempfile.TemporaryDirectory() as data:
            env = {"SWITCHBOARD_HTTP__PORT": str(free_port()), "SWITCHBOARD_ADMIN__PORT": str(free_port()),
                   "SWITCHBOARD_STORE__DATA_DIR": data, "SWITCHBOARD_AGENT__KIND": "openai",
                   "SWITCHBOARD_AGENT__BASE_URL": provider.base_url, "SWITCHBOARD_AGENT__MODEL": "llama3.2",
                   "SWITCHBOARD_AGENT__RETRIES": "0", "SWITCHBOARD_TOOLS__SHELL": "true",
                   "SWITCHBOARD_TOOLS__SHELL_CWD": data}
            daemon = Daemon(load_config(None, env))
            await daemon.start()
            base = f"http://127.0.0.1:{daemon.config.http.port}"
            admin = f"http://127.0.0.1:{daemon.config.admin.port}/admin"
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(executable_path=ensure_chromium(), args=CHROMIUM_ARGS)
                desk = await browser.new_context(viewport={"width": 1000, "height": 720})
                page = await open_chat(desk, base)

                await say(page, "How do I list the files in a folder by size, in Python?")
                await expect(page.locator(".msg.bot .body")).to_contain_text("size the links")
                await _shoot(page, out, "webchat-streaming.png")
                await expect(page.locator("body[data-running=false]")).to_have_count(1)

                await say(page, "Tell me a story about switchboards.")
                await expect(page.locator(".msg.bot .body").last).to_contain_text("every line")
                await page.locator("#stop").click()
                await expect(page.locator(".msg.bot .interruption").last).to_be_visible()
                await _shoot(page, out, "webchat-stopped.png")

                await say(page, "And a long one about telegraphs?")
                await expect(page.locator(".msg.bot")).to_have_count(3)
                await expect(page.locator(".msg.bot .body").last).to_contain_text("operator")
                await daemon.stop()
                await expect(page.locator("#banner")).to_be_visible()
                await _shoot(page, out, "webchat-restart.png")
                daemon = Daemon(daemon.config)
                await daemon.start()
                await expect(page.locator("#conn")).to_have_attribute("data-state", "connected", timeout=15_000)
                await _tools(browser, base, provider, out)

                other = await open_chat(await browser.new_context(), base)
                await say(other, "Write me a haiku about queues.")
                await say(page, "Tell me a story about switchboards.")
                third = await open_chat(await browser.new_context(), base)
                await say(third, "And a long one about telegraphs?")
                console = await desk.new_page()
                await console.set_viewport_size({"width": 1280, "height": 760})
                await console.goto(admin)
                await expect(console.locator("#sessions tbody tr[data-state=running]")).to_have_count(3)
                await console.locator("#sessions tbody tr[data-state=running] button").last.click()
                await expect(console.locator("#sessions tbody tr[data-state=running]")).to_have_count(2)
                await console.wait_for_timeout(1200)
                await _shoot(console, out, "console.png")

                phone = await browser.new_context(viewport={"width": 390, "height": 720}, device_scale_factor=2,
                                                  is_mobile=True, has_touch=True)
                small = await open_chat(phone, base)
                await say(small, "How do I list the files in a folder by size, in Python?")
                await expect(small.locator(".msg.bot .body li")).to_have_count(3, timeout=20_000)
                await expect(small.locator("body[data-running=false]")).to_have_count(1, timeout=20_000)
                await _shoot(small, out, "webchat-phone.png")
                await browser.close()
            await daemon.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs"))
