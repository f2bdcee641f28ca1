"""Process entry: the event loop, and signals turned into an event the service's shutdown sequence awaits.

Signal handlers only coordinate (set an event); each service owns its ordered shutdown.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

#: Allocations (less deallocations) of tracked objects between two collections of the youngest generation,
#: and collections of each generation between two of the next: CPython's defaults are 700, 10 and 10.
#: A delivery allocates hundreds of short-lived objects (a message, its futures and the HTTP exchange),
#: nearly all freed by their reference counts, so at 700 the collector ran every few deliveries and
#: walked the survivors of each: one dispatcher draining a backlog (`bench.run`, 10,000 events) delivered
#: 16-20 % more per second with these (docs/decisions.md). Cycles wait a little longer to be freed.
GC_THRESHOLDS = (20_000, 20, 100)


def stop_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (Ctrl-C)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    return stopping


def run(main: Callable[[], Coroutine[Any, Any, None]], *, nice: int = 0) -> None:
    """Run a service's main coroutine on uvloop when available, ``nice`` added to the process's niceness
    first (what it yields to the other processes of its machine when they want the CPU too), with the
    garbage collector's thresholds raised (``GC_THRESHOLDS``)."""
    if nice:
        os.nice(nice)
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        asyncio.run(main())
    else:
        uvloop.run(main())
