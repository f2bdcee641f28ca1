"""Process entry: the event loop, and signals turned into an event the service's shutdown sequence awaits.

Signal handlers only coordinate (set an event); each service owns its ordered shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (Ctrl-C)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    return stopping


def run(main: Callable[[], Coroutine[Any, Any, None]], *, nice: int = 0) -> None:
    """Run a service's main coroutine on uvloop when available, ``nice`` added to the process's niceness
    first (what it yields to the other processes of its machine when they want the CPU too)."""
    if nice:
        os.nice(nice)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        asyncio.run(main())
    else:
        uvloop.run(main())
