"""Shared by the browser tests and the screenshot script: Chromium from Debian, and page helpers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from playwright.async_api import Browser, BrowserContext, Page, expect

from platforms.webchat import WebchatAdapter

if TYPE_CHECKING:
    from gateway.ops.daemon import Daemon

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]


class ChromiumUnavailable(RuntimeError):
    """Chromium is missing and could not be installed from Debian's packages."""


def ensure_chromium() -> str:
    """The path of Debian's Chromium, installing the `chromium` package first if it is missing.

    Playwright's own browser download cannot work here (no network but the package registries),
    so the tests drive the distribution's build through `executable_path`.
    """
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ChromiumUnavailable(f"{CHROMIUM} is missing and this is not a root Debian shell: "
                                  "run `apt-get install -y chromium` as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=False)
        if done.returncode != 0:
            raise ChromiumUnavailable(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-2000:]}")
    if not CHROMIUM.exists():
        raise ChromiumUnavailable(f"the chromium package installed, but {CHROMIUM} is still missing")
    return str(CHROMIUM)


async def open_chat(browser: Browser | BrowserContext, base: str) -> Page:
    """A new page on the web chat, connected (its hello frame arrived)."""
    page = await browser.new_page()
    await page.goto(base + "/")
    await expect(page.locator("#conn")).to_have_attribute("data-state", "connected")
    return page


async def say(page: Page, text: str) -> None:
    await page.locator("#text").fill(text)
    await page.locator("#text").press("Enter")


async def session_key(context: BrowserContext, daemon: Daemon) -> str:
    """The router's session key of a browser context's web chat session: a keyed hash of its
    cookie (the cookie itself is a credential, never an identifier)."""
    cookies = {c.get("name"): c.get("value") for c in await context.cookies()}
    webchat = daemon.adapters["webchat"]
    assert isinstance(webchat, WebchatAdapter)
    return f"webchat:dm:{webchat.session_id(str(cookies['switchboard_chat']))}"
