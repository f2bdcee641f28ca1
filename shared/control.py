"""Breaker commands from the health monitor to every dispatcher replica.

The monitor owns the breakers and publishes each change to the fanout exchange ``hookline.control``,
which feeds the stream ``hookline.breakers`` (1 h). It also publishes a snapshot of every breaker that
is not closed every few seconds, so a dispatcher that starts or reconnects reads the last minutes of
the stream and knows the current states, not only future changes. Versions make applying idempotent.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from hookline.shared.models import Model


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerCommand(Model):
    kind: Literal["breaker"] = "breaker"
    endpoint_id: str
    state: BreakerState
    version: int  # increasing; a dispatcher ignores a command older than the one it applied
    probe_by: str | None = None  # half_open: the one dispatcher that delivers the probe
    # The breaker's own state, so that a restarted monitor can take over where it was.
    opened_at_s: float | None = None
    first_opened_at_s: float | None = None
    cooldown_s: float = 0.0
    consecutive_failures: int = 0


class BreakerSnapshot(Model):
    """Every breaker that is not closed; any endpoint missing from it is closed as of ``version``."""

    kind: Literal["snapshot"] = "snapshot"
    version: int
    breakers: list[BreakerCommand]


ControlRecord = Annotated[BreakerCommand | BreakerSnapshot, Field(discriminator="kind")]
control_record: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)


class BreakerView:
    """A dispatcher's knowledge of the breakers, from the commands and snapshots it has read."""

    def __init__(self) -> None:
        self._commands: dict[str, BreakerCommand] = {}
        self._snapshot_version = 0

    def state(self, endpoint_id: str) -> BreakerCommand | None:
        """The command in force, or None when the breaker is closed."""
        command = self._commands.get(endpoint_id)
        return command if command is not None and command.state is not BreakerState.CLOSED else None

    def apply(self, record: ControlRecord) -> set[str]:
        """Apply a record; returns the endpoints whose breaker changed."""
        if isinstance(record, BreakerCommand):
            return {record.endpoint_id} if self._apply(record) else set()
        changed = {command.endpoint_id for command in record.breakers if self._apply(command)}
        listed = {command.endpoint_id for command in record.breakers}
        for endpoint_id, command in list(self._commands.items()):
            if endpoint_id not in listed and command.version < record.version:
                del self._commands[endpoint_id]
                if command.state is not BreakerState.CLOSED:
                    changed.add(endpoint_id)
        return changed

    def commands(self) -> list[BreakerCommand]:
        """Every breaker that is not closed, as last commanded."""
        return [command for command in self._commands.values() if command.state is not BreakerState.CLOSED]

    def _apply(self, command: BreakerCommand) -> bool:
        current = self._commands.get(command.endpoint_id)
        if current is not None and current.version >= command.version:
            return False
        self._commands[command.endpoint_id] = command
        return current is None or (current.state, current.probe_by) != (command.state, command.probe_by)
