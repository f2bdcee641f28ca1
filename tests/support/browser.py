"""A real headless Chromium for the dashboard's tests: Debian's (or HOOKLINE_TEST_CHROMIUM), driven by
Playwright, which never downloads a browser of its own here."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from playwright.async_api import Browser, async_playwright

# Without the background-networking flags Chromium keeps trying Google's hosts on a closed network.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    for candidate in (
        os.environ.get("HOOKLINE_TEST_CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        if candidate and (found := shutil.which(candidate)):
            return found
    raise AssertionError(
        "no Chromium found: `make test` installs Debian's (scripts/install-browser.sh), "
        "or point HOOKLINE_TEST_CHROMIUM at one"
    )


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium_path(), args=FLAGS)
        try:
            yield browser
        finally:
            await browser.close()
