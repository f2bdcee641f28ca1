"""The services' JSON log lines as tests read them: one canonical line per outcome (``delivery_attempt``,
``delivery_deferred``, ``breaker_expired``, ...), with what the service decided in its fields."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from support import services


def records(*every: services.Service) -> list[dict[str, Any]]:
    """The JSON log lines of these services."""
    found = []
    for service in every:
        for line in service.log().splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return found


def logged(every: Iterable[services.Service], name: str, **fields: Any) -> list[dict[str, Any]]:
    """The lines ``name`` of these services whose fields have these values."""
    return [
        r
        for r in records(*every)
        if r.get("event") == name and all(r.get(key) == value for key, value in fields.items())
    ]
