"""Browser fixtures: Debian's Chromium (installed if missing, never skipped), one browser per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, async_playwright, expect

from tests.browser.harness import CHROMIUM_ARGS, ChromiumUnavailable, ensure_chromium

expect.set_options(timeout=10_000)


@pytest.fixture(scope="session")
def chromium() -> str:
    try:
        return ensure_chromium()
    except ChromiumUnavailable as exc:
        pytest.fail(f"the browser tests need Chromium: {exc}", pytrace=False)


@pytest.fixture
async def browser(chromium: str) -> AsyncIterator[Browser]:
    # Function-scoped: Playwright's async objects belong to one event loop, and each test has its own.
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()
