"""structlog, configured once per process at its entry point: one JSON object per line on stdout.

Other modules only call ``structlog.get_logger()``. Payload data never goes into a log line: the
delivery path logs ids, tenant, type, status and timings only.
"""

from __future__ import annotations

import logging
import sys

import orjson
import structlog
import structlog.tracebacks


def configure(*, service: str, level: str = "info") -> None:
    level_no = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            # Tracebacks as data, without local variables: locals hold events and endpoint secrets.
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.BytesLoggerFactory(sys.stdout.buffer),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries log through the standard library; keep their warnings, in the same JSON shape.
    logging.basicConfig(level=max(level_no, logging.WARNING), handlers=[_StdlibToStructlog()], force=True)


class _StdlibToStructlog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger = structlog.get_logger(record.name)
        logger.log(record.levelno, "library_log", logger=record.name, message=record.getMessage())
