"""structlog, configured once per process at its entry point: one JSON object per line on stdout.

Other modules only call ``structlog.get_logger()``. Payload data never goes into a log line: the
delivery path logs ids, tenant, type, status and timings only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, BinaryIO

import orjson
import structlog
import structlog.tracebacks


def configure(*, service: str, level: str = "info", output: BinaryIO | None = None) -> None:
    """``output``: stdout unless given (a command whose stdout is its result logs to stderr)."""
    level_no = logging.getLevelNamesMapping()[level.upper()]
    stream = output if output is not None else sys.stdout.buffer
    structlog.configure(
        processors=[
            _Stamp(service),
            structlog.processors.add_log_level,
            # Tracebacks as data, without local variables: locals hold events and endpoint secrets.
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=lambda *_: _Output(stream),
        cache_logger_on_first_use=True,
    )
    # Libraries log through the standard library; keep their warnings, in the same JSON shape.
    logging.basicConfig(level=max(level_no, logging.WARNING), handlers=[_StdlibToStructlog()], force=True)


class _Stamp:
    """The service's name and the time (``ts``, ISO 8601 UTC, microseconds) on every line; the date and
    time of day are formatted once a second, as the delivery path logs thousands of lines a second."""

    def __init__(self, service: str) -> None:
        self._service = service
        self._second = -1
        self._prefix = ""

    def __call__(self, _: object, __: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        now_us = time.time_ns() // 1000
        second, micro = divmod(now_us, 1_000_000)
        if second != self._second:
            self._second, self._prefix = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event["service"] = self._service
        event["ts"] = f"{self._prefix}.{micro:06d}Z"
        return event


#: Lines at info and below reach the file within this long (a killed process may lose that much of them);
#: a write and a flush per line cost the delivery path more than the rest of its log line.
FLUSH_AFTER_S = 0.05


class _Output:
    """Writes each line into the file's buffer; warnings and errors are flushed at once, the rest by a
    callback ``FLUSH_AFTER_S`` after the first unflushed line (at once when no event loop runs)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._flush_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on

    def _buffered(self, message: bytes, *_: Any) -> None:
        self._file.write(message + b"\n")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush()
            return
        if self._flush_on is not loop:  # none scheduled, or on a loop that has stopped since
            self._flush_on = loop
            loop.call_later(FLUSH_AFTER_S, self._flush)

    def _at_once(self, message: bytes, *_: Any) -> None:
        self._file.write(message + b"\n")
        self._flush()

    def _flush(self) -> None:
        self._flush_on = None
        self._file.flush()

    debug = info = msg = log = _buffered
    warning = warn = error = err = critical = exception = fatal = failure = _at_once


class _StdlibToStructlog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger = structlog.get_logger(record.name)
        logger.log(record.levelno, "library_log", logger=record.name, message=record.getMessage())
