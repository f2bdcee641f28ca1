"""Breaker commands from the health monitor to every dispatcher replica.

The monitor owns the breakers and publishes each change to the fanout exchange ``hookline.control``,
which feeds the stream ``hookline.breakers`` (1 h). It also publishes a snapshot of every breaker that
is not closed every few seconds, so a dispatcher that starts or reconnects reads the last minutes of
the stream and knows the current states, not only future changes. Versions make applying idempotent.

Those snapshots are also a lease: a breaker that no command or snapshot has renewed for the lease time
is closed by the dispatchers themselves, so a monitor that went silent (killed, partitioned) never keeps
an endpoint blocked for ever. A monitor that comes back renews or reopens it with its next snapshot.
"""

from __future__ import annotations

import enum
from datetime import timedelta
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from hookline.shared.contracts.models import Model

#: How far back a follower of the breaker log starts: snapshots of every open breaker come every few
#: seconds, so the last two minutes give the states in force.
BREAKER_LOOKBACK = timedelta(minutes=2)


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
    """A dispatcher's knowledge of the breakers, from the commands and snapshots it has read.

    ``lease_s`` None: breakers never expire (the monitor's own view, rebuilt from its log).
    Times are monotonic seconds, passed in.
    """

    def __init__(self, *, lease_s: float | None = None) -> None:
        self._commands: dict[str, BreakerCommand] = {}
        self._renewed_s: dict[str, float] = {}
        self._lease_s = lease_s
        self.saw_snapshot = False  # a snapshot lists every breaker that is not closed

    def state(self, endpoint_id: str) -> BreakerCommand | None:
        """The command in force, or None when the breaker is closed."""
        command = self._commands.get(endpoint_id)
        return command if command is not None and command.state is not BreakerState.CLOSED else None

    def apply(self, record: ControlRecord, *, now_s: float = 0.0) -> set[str]:
        """Apply a record; returns the endpoints whose breaker changed."""
        if isinstance(record, BreakerCommand):
            return {record.endpoint_id} if self._apply(record, now_s) else set()
        self.saw_snapshot = True
        changed = {command.endpoint_id for command in record.breakers if self._apply(command, now_s)}
        listed = {command.endpoint_id for command in record.breakers}
        for endpoint_id, command in list(self._commands.items()):
            if endpoint_id not in listed and command.version < record.version:
                self._forget(endpoint_id)
                if command.state is not BreakerState.CLOSED:
                    changed.add(endpoint_id)
        return changed

    def expire(self, *, now_s: float) -> list[BreakerCommand]:
        """Forget the breakers nobody renewed within the lease; returns them (each once)."""
        if self._lease_s is None:
            return []
        lease_s = self._lease_s
        expired = [
            command
            for endpoint_id, command in self._commands.items()
            if command.state is not BreakerState.CLOSED and now_s - self._renewed_s[endpoint_id] > lease_s
        ]
        for command in expired:
            self._forget(command.endpoint_id)
        return expired

    def commands(self) -> list[BreakerCommand]:
        """Every breaker that is not closed, as last commanded."""
        return [command for command in self._commands.values() if command.state is not BreakerState.CLOSED]

    def _apply(self, command: BreakerCommand, now_s: float) -> bool:
        current = self._commands.get(command.endpoint_id)
        if current is not None and current.version >= command.version:
            if current.version == command.version:
                self._renewed_s[command.endpoint_id] = now_s  # the same state, said again
            return False
        self._commands[command.endpoint_id] = command
        self._renewed_s[command.endpoint_id] = now_s
        return current is None or (current.state, current.probe_by) != (command.state, command.probe_by)

    def _forget(self, endpoint_id: str) -> None:
        self._commands.pop(endpoint_id, None)
        self._renewed_s.pop(endpoint_id, None)
