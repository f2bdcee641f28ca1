"""Waiting for something the system does asynchronously, with a deadline, never a bare sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, timeout_s: float = 20.0, every_s: float = 0.2
) -> T:
    """Call ``probe`` until it returns something other than None or False; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await probe()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(every_s)
