"""Waiting for something the system does asynchronously, with a deadline, never a bare sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    *,
    timeout_s: float = 20.0,
    every_s: float = 0.2,
    explain: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` until it returns something other than None or False; fail after ``timeout_s``,
    saying what ``explain`` returns then (what a failure in CI needs to be understood without a rerun)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await probe()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            detail = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"condition not met within {timeout_s}s{detail}")
        await asyncio.sleep(every_s)
