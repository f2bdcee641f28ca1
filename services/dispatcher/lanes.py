"""Deliveries from a lane or a holding lane, and each endpoint's turns for them.

What comes from a lane is never held long, since other endpoints' events wait behind it: at most
``HOOKLINE_PREFETCH_PER_ENDPOINT`` of an endpoint's go at once here, and a copy that waits too long for
its turn, for an endpoint whose waiting copies hold its lane, gets the endpoint isolated (its copy
handed on to its queue of its own). A held endpoint's copy (in a holding lane) waits out its open breaker
in the delay queues, and goes out otherwise with the endpoint's whole timeout.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Protocol

from hookline.dispatcher import decoding
from hookline.dispatcher.admission import CROWDED_IN_FLIGHT, Admission
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.gate import MAX_SLOT_WAIT_S, SLOW_SHARE_DEFER_S
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settling import Settling
from hookline.dispatcher.turns import Turns
from hookline.shared.broker import topology
from hookline.shared.contracts.control import BreakerCommand, BreakerState, BreakerView
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state.registry import EndpointRegistry

#: A held endpoint's copy (in a holding lane, past the bound on queues of their own) waits out its open
#: breaker in the delay queues until its probe is due, and at least this long (half open, probed by
#: another copy or another replica): one queue write per wait, not one a second.
HELD_RECHECK_S = 5
#: A lane delivery whose turn has not come within this share of the slow line (0.1 s by default) tells of a
#: backlog; its endpoint is isolated if its waiting copies hold its lane (:func:`holds_its_lane`). Soon:
#: until then the burst passes through the lane, at three queue writes an event instead of one (a quarter
#: of the line let the first two seconds of a 10,000-event burst through, and its lane's neighbours p99
#: 2.6-4.5 s; a twentieth, p99 249-262 ms).
BACKLOG_WAIT_SHARE = 1 / 20


def holds_its_lane(waiting: int, lane_waiting: int, *, per_endpoint: int) -> bool:
    """Whether an endpoint whose lane deliveries waited too long for their turn is backlogged: its
    waiting copies are most of what waits here from its lane, so the lane messages they keep unacked
    hold the lane's window, and the other endpoints' events behind them in the broker wait for it (a
    burst). When a load is spread over a tenant's endpoints (or each event goes to all of them), each
    waits its share: nobody is behind anybody, and a queue of its own would only write each of their
    events twice, on a machine already short of time."""
    return waiting >= per_endpoint and 2 * waiting > lane_waiting


def held_wait_s(breaker: BreakerCommand, *, now_s: float) -> int:
    """How long a held endpoint's copy waits out its breaker: until the probe is due (when the monitor
    half-opens it), at least HELD_RECHECK_S (already due, or half open and probed with another copy)."""
    due_s = 0.0
    if breaker.state is BreakerState.OPEN and breaker.opened_at_s is not None:
        due_s = breaker.opened_at_s + breaker.cooldown_s - now_s
    return max(HELD_RECHECK_S, math.ceil(due_s))


class Deliver(Protocol):
    """The handler's delivery of one message once it has its turn (handler.py)."""

    async def __call__(
        self,
        endpoint: StoredEndpoint,
        message: Incoming,
        parsed_before: decoding.Inbound | None,
        *,
        probe: bool,
        lane: bool,
    ) -> bool: ...


class LaneDeliveries:
    def __init__(
        self,
        settings: DispatcherSettings,
        registry: EndpointRegistry,
        admission: Admission,
        breakers: BreakerView,
        settling: Settling,
        deliver: Deliver,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._admission = admission
        self._breakers = breakers
        self._settling = settling
        self._deliver = deliver
        # Deliveries from lanes under way per endpoint, and their turns (see from_lane).
        self._lane_turns: dict[str, Turns] = {}
        self._lanes_waiting: Counter[str] = Counter()

    def from_lanes(self) -> dict[str, int]:
        """Deliveries from lanes under way, per endpoint (for heartbeats: what a delete waits for)."""
        return {endpoint_id: turns.users for endpoint_id, turns in self._lane_turns.items()}

    async def from_lane(
        self, endpoint: StoredEndpoint, message: Incoming, parsed: decoding.Inbound | None
    ) -> bool:
        """A lane message's delivery: at most ``HOOKLINE_PREFETCH_PER_ENDPOINT`` of an endpoint's go at
        once here. One that waits for its turn longer than a twentieth of the slow line, for an endpoint
        whose waiting copies hold its lane (:func:`holds_its_lane`), means the endpoint is backlogged:
        it is isolated, so that a burst to it is moved off the lane at the rate of queue writes rather
        than of its answers."""
        turns = self._turns_of(endpoint.id, topology.lane_of(endpoint.tenant))
        try:
            if not await turns.enter(
                self._lane_limit(), timeout_s=self._settings.slow_attempt_s * BACKLOG_WAIT_SHARE
            ):
                if self._holds_its_lane(turns) and await self._settling.isolate(endpoint, "backlogged"):
                    await self._settling.hand_on(message, endpoint, reason="backlogged")
                    return False
                # Its lane's fair share, or no queue to be had: it waits for its turn.
                await turns.enter(self._lane_limit(), timeout_s=None)
            try:
                return await self._deliver(endpoint, message, parsed, probe=False, lane=True)
            finally:
                turns.leave(self._lane_limit())
        finally:
            self._done_with(endpoint.id, turns)

    def _lane_limit(self) -> int:
        """An endpoint's deliveries from its lane under way at once: fewer while the event loop runs late,
        as the admission would start no more of them (admission.py)."""
        per_endpoint = self._settings.prefetch_per_endpoint
        return min(per_endpoint, CROWDED_IN_FLIGHT) if self._admission.ledger.crowded else per_endpoint

    def _turns_of(self, endpoint_id: str, lane: str) -> Turns:
        """The endpoint's turns for deliveries from ``lane`` (its lane, or its holding lane), shared by
        its deliveries under way here (each gives them back with :meth:`_done_with`)."""
        turns = self._lane_turns.get(endpoint_id)
        if turns is None:
            turns = self._lane_turns[endpoint_id] = Turns(lane, self._lanes_waiting)
        turns.users += 1
        return turns

    def _done_with(self, endpoint_id: str, turns: Turns) -> None:
        turns.users -= 1
        if not turns.users:  # dropped with the last of them
            turns.close()
            del self._lane_turns[endpoint_id]

    def _holds_its_lane(self, turns: Turns) -> bool:
        # This copy waits no more, yet it is one of the endpoint's: counted on both sides.
        return holds_its_lane(
            turns.waiting + 1,
            self._lanes_waiting[turns.lane] + 1,
            per_endpoint=self._settings.prefetch_per_endpoint,
        )

    async def from_holding(self, endpoint: StoredEndpoint, message: Incoming, *, probe: bool) -> bool:
        """A copy in a holding lane: its endpoint is isolated past the bound on queues of their own, and
        shares the lane only with others like it. Its breaker open, the copy waits in the delay queues
        until the probe is due (no hand-back cycle); otherwise it goes out with the endpoint's whole
        timeout, at most ``HOOKLINE_PREFETCH_PER_ENDPOINT`` of an endpoint's at once here."""
        if not self._registry.placements.held(endpoint):
            await self._settling.hand_on(
                message, endpoint, reason="moved"
            )  # back in its lane, or a queue of its own
            return False
        breaker = self._breakers.state(endpoint.id)
        if breaker is not None and not probe:
            wait_s = held_wait_s(breaker, now_s=time.time())
            await self._settling.hand_on(message, endpoint, delay_s=wait_s, reason="breaker_open")
            return False
        turns = self._turns_of(endpoint.id, topology.holding_of(endpoint.id))
        limit = self._settings.prefetch_per_endpoint
        try:
            if not await turns.enter(limit, timeout_s=MAX_SLOT_WAIT_S):
                # Far from the broker's consumer_timeout: put off, its turn not had within a minute.
                await self._settling.hand_on(
                    message, endpoint, delay_s=int(SLOW_SHARE_DEFER_S), reason="held_busy"
                )
                return False
            try:
                return await self._deliver(endpoint, message, None, probe=probe, lane=False)
            finally:
                turns.leave(limit)
        finally:
            self._done_with(endpoint.id, turns)
