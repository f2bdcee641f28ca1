"""Which dispatcher probes a half-open endpoint: pure, time passed in.

A probe is spread over the live dispatchers by endpoint and moves on when it does not report back in
time; a dispatcher whose heartbeats say it did not take the probe on is passed over for it. The
breaker decisions that ask for a probe are in health.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from hookline.shared.contracts.control import BreakerCommand
from hookline.shared.contracts.telemetry import Heartbeat

#: A probe that has not reported back after this long is asked for again.
PROBE_TIMEOUT_S = 120.0
#: A prober whose heartbeats this long after it was asked do not say it took the probe on is passed over
#: (it is not attached, or its breaker view lags): two heartbeats.
PROBE_ACK_S = 10.0


def prober_for(endpoint_id: str, live: list[str], *, now_s: float) -> str:
    """The dispatcher (of ``live``, sorted) that probes a half-open endpoint: spread over the replicas by
    endpoint, and moved on to the next one every PROBE_TIMEOUT_S, so a probe that keeps failing to report
    is tried elsewhere. Stable (CRC-32, not the process-salted ``hash()``): a monitor that takes over
    the lead picks the same one."""
    return live[(zlib.crc32(endpoint_id.encode()) + int(now_s // PROBE_TIMEOUT_S)) % len(live)]


def declined(beat: Heartbeat | None, command: BreakerCommand | None, *, asked_at_s: float) -> bool:
    """The prober's heartbeats since it was asked (at ``asked_at_s``, by ``command``) do not say it
    took this probe on."""
    return (
        beat is not None
        and command is not None
        and beat.at_s >= asked_at_s + PROBE_ACK_S
        and beat.probing.get(command.endpoint_id) != command.version
    )


def choose_prober(
    endpoint_id: str,
    live: list[str],
    dispatchers: Mapping[str, Heartbeat],
    passed_over: dict[str, set[str]],
    *,
    now_s: float,
) -> str:
    """Of the live dispatchers not passed over for this probe, those holding messages of the endpoint
    first (theirs come back to its queue, where the prober takes one)."""
    candidates = [d for d in live if d not in passed_over.get(endpoint_id, ())]
    if not candidates:
        passed_over.pop(endpoint_id, None)  # every one was: ask them all again
        candidates = live
    holders = [d for d in candidates if dispatchers[d].unacked.get(endpoint_id)]
    return prober_for(endpoint_id, holders or candidates, now_s=now_s)
