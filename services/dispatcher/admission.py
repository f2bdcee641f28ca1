"""Which delivery attempts may start now: a dispatcher's connections shared so that slow endpoints,
however many, cannot take them from the endpoints that answer.

Every attempt holds a slot from the moment its request starts until its answer (or error) arrives. A
dispatcher has ``HOOKLINE_HTTP_MAX_CONNECTIONS`` slots (512), in two shares:

- the **slow share** (``HOOKLINE_SLOW_SHARE``, a quarter: 128): the only slots a slow endpoint's
  attempts may start in;
- the **answering share** (the rest: 384): kept for endpoints that answer within
  ``HOOKLINE_SLOW_ATTEMPT_S`` (2 s, the monitor's ``slow_endpoint`` line).

An endpoint is *slow* on a dispatcher when its last answer took ``slow_attempt_s`` or longer, when one of
its attempts has been waiting that long (an endpoint that starts to hang is moved at once, not after its
timeout), or when an attempt timed out (whatever its timeout); it answers again once an attempt of it
ends in time with none of its attempts still waiting that long. An endpoint the dispatcher has not heard
from yet is on *probation*: one attempt at a time until its first answer, so a crowd of new endpoints
that hang holds one answering slot each, and only for ``slow_attempt_s``. A slow endpoint's prefetch is
its part of the slow share (:meth:`Ledger.slow_prefetch`).

While the dispatcher's event loop runs late (it is short of CPU: ``crowded``, told by lag.py), an
answering endpoint has at most ``CROWDED_IN_FLIGHT`` (8) attempts under way here. More would not deliver
it faster — the loop is the limit — but each step of every other delivery would wait behind them. A
burst of 10,000 to one fast endpoint on this 2-core machine, 16 of its deliveries held by each of two
dispatchers: another lane's trickle p99 202-299 ms with all 16 under way, 101-163 ms with 8, the burst
delivered as fast. Its other deliveries wait in a line of its own, woken as its attempts end (those from
lanes wait for their endpoint's turn before they come here, fewer turns while the loop runs late: turns.py).

An attempt that has waited ``slow_attempt_s`` counts against the slow share from then on, and frees its
answering slot: the answering share is never held longer than that by anything slow, and the slow share
bounds what slow endpoints *start*. (Attempts already under way when their endpoint turned slow can put
the slow share over its size until they end; each ends by its timeout.) One endpoint holds at most its
prefetch (``HOOKLINE_PREFETCH_PER_ENDPOINT``, 16) of either share.

Waiting for a slot is hookline's own time: the attempt's timeout starts when it has one. A delivery that
would wait longer than its ``max_wait_s`` is put off through the delay queues instead (no attempt spent),
so a message is never held long enough for the broker's ``consumer_timeout`` to take the channel.

:class:`Ledger` is the policy, pure (time passed in); :class:`Admission` queues the waiters.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

#: An endpoint the ledger has not seen an attempt of for this long is forgotten (it is on probation again).
FORGET_AFTER_S = 600.0
#: What one answering endpoint may have under way while the event loop runs late (the module's docstring).
CROWDED_IN_FLIGHT = 8
#: A tick of the loop this late (lag.py, every 50 ms) says it is crowded; the next one on time, that it
#: is not. Unloaded, ticks are a fraction of a millisecond late.
CROWDED_LATE_S = 0.01


class Share(Enum):
    ANSWERING = "answering"
    SLOW = "slow"


class Ended(Enum):
    """How an attempt that held a slot ended."""

    ANSWERED = "answered"  # a response, or an error that came back (refused, reset): its time tells
    TIMED_OUT = "timed_out"  # no answer within the endpoint's timeout: slow, however short that is
    NOT_SENT = "not_sent"  # let go before the request (its breaker opened meanwhile): tells nothing


class Standing(Enum):
    NEW = "new"  # nothing heard from it yet: probation
    ANSWERING = "answering"
    SLOW = "slow"


@dataclass(slots=True)
class Ticket:
    """One attempt's slot."""

    number: int
    endpoint_id: str
    started_s: float
    share: Share
    aged: bool = False  # it has waited slow_attempt_s for its answer


@dataclass(slots=True)
class _Endpoint:
    in_flight: int = 0
    aged: int = 0  # its attempts in flight that have waited slow_attempt_s
    heard: bool = False  # an attempt of it has ended since it was last forgotten
    slow: bool = False
    last_s: float = 0.0

    @property
    def standing(self) -> Standing:
        if self.slow or self.aged:
            return Standing.SLOW
        return Standing.ANSWERING if self.heard else Standing.NEW


@dataclass
class Ledger:
    """The slots in use and each endpoint's standing. ``start`` says whether an attempt may start now;
    ``end`` returns its slot; ``age`` moves attempts that have waited ``slow_after_s`` to the slow share."""

    slots: int
    slow_slots: int
    slow_after_s: float
    in_use: dict[Share, int] = field(default_factory=lambda: dict.fromkeys(Share, 0))
    slow_count: int = 0  # endpoints standing slow
    busy: int = 0  # endpoints with attempts in flight
    crowded: bool = False  # the event loop runs late: an answering endpoint holds CROWDED_IN_FLIGHT at most
    _endpoints: dict[str, _Endpoint] = field(default_factory=dict)
    _tickets: dict[int, Ticket] = field(default_factory=dict)  # in flight and not aged, oldest first
    _numbers: itertools.count[int] = field(default_factory=itertools.count)
    _swept_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.slow_slots < self.slots:
            raise ValueError("the slow share must leave slots on both sides")

    def standing(self, endpoint_id: str) -> Standing:
        endpoint = self._endpoints.get(endpoint_id)
        return Standing.NEW if endpoint is None else endpoint.standing

    def in_flight(self, endpoint_id: str) -> int:
        """The endpoint's attempts holding slots now."""
        endpoint = self._endpoints.get(endpoint_id)
        return 0 if endpoint is None else endpoint.in_flight

    def holds_more_than_its_share(self, endpoint_id: str) -> bool:
        """Whether the endpoint holds more than twice an even share of the slots in use (between the
        endpoints with attempts in flight): when the slots run out, such an endpoint keeps the others'
        deliveries waiting, while endpoints that each hold their share are only a busy replica."""
        in_flight = self.in_flight(endpoint_id)
        return in_flight > 0 and in_flight * self.busy > 2 * sum(self.in_use.values())

    def limit(self, share: Share) -> int:
        return self.slow_slots if share is Share.SLOW else self.slots - self.slow_slots

    def share_for(self, endpoint_id: str) -> Share:
        return Share.SLOW if self.standing(endpoint_id) is Standing.SLOW else Share.ANSWERING

    def room(self, endpoint_id: str) -> int | None:
        """How many more attempts the endpoint itself may start now, whatever its share has free (None:
        no limit of its own). New: one at a time until it answers (probation); answering, while the loop
        is crowded: up to CROWDED_IN_FLIGHT. At 0 its next delivery waits for one of its own attempts to
        end, not for its share."""
        endpoint = self._endpoints.get(endpoint_id)
        if endpoint is None:
            return 1
        standing = endpoint.standing
        if standing is Standing.NEW:
            return max(0, 1 - endpoint.in_flight)
        if standing is Standing.ANSWERING and self.crowded:
            return max(0, CROWDED_IN_FLIGHT - endpoint.in_flight)
        return None

    def slow_prefetch(self) -> int:
        """What one slow endpoint may hold of this dispatcher's deliveries: its part of the slow share
        (a power of two, so that it changes only when the number of slow endpoints halves or doubles).
        The rest of a slow endpoint's messages wait in its queue, where any replica can take them."""
        fair = max(1, self.slow_slots // max(1, self.slow_count))
        return 1 << (fair.bit_length() - 1)

    def start(self, endpoint_id: str, *, now_s: float) -> Ticket | None:
        """A slot for an attempt now, or None: its share is full, or the endpoint has no room of its own
        (on probation with an attempt out already, or as many under way as a crowded loop allows)."""
        if self.room(endpoint_id) == 0:
            return None
        endpoint = self._endpoints.setdefault(endpoint_id, _Endpoint())
        endpoint.last_s = now_s
        share = Share.SLOW if endpoint.standing is Standing.SLOW else Share.ANSWERING
        if self.in_use[share] >= self.limit(share):
            return None
        self.in_use[share] += 1
        self.busy += not endpoint.in_flight
        endpoint.in_flight += 1
        ticket = Ticket(next(self._numbers), endpoint_id, now_s, share)
        self._tickets[ticket.number] = ticket
        return ticket

    def end(self, ticket: Ticket, ended: Ended, *, now_s: float) -> None:
        """The attempt is over: its slot is free; how it ended, and how long it took, decide the
        endpoint's standing."""
        self._tickets.pop(ticket.number, None)
        self.in_use[ticket.share] -= 1
        endpoint = self._endpoints[ticket.endpoint_id]
        was_slow = endpoint.standing is Standing.SLOW
        endpoint.in_flight -= 1
        self.busy -= not endpoint.in_flight
        endpoint.last_s = now_s
        if ticket.aged:
            endpoint.aged -= 1
        if ended is not Ended.NOT_SENT:
            endpoint.heard = True
            endpoint.slow = ended is Ended.TIMED_OUT or now_s - ticket.started_s >= self.slow_after_s
        self.slow_count += (endpoint.standing is Standing.SLOW) - was_slow

    def age(self, *, now_s: float) -> None:
        """Attempts that have waited ``slow_after_s``: their endpoint is slow, and they count against
        the slow share from now on (their answering slot is free)."""
        while self._tickets:
            ticket = next(iter(self._tickets.values()))
            if now_s - ticket.started_s < self.slow_after_s:
                break
            del self._tickets[ticket.number]
            ticket.aged = True
            endpoint = self._endpoints[ticket.endpoint_id]
            if endpoint.standing is not Standing.SLOW:
                self.slow_count += 1
            endpoint.aged += 1
            if ticket.share is Share.ANSWERING:
                self.in_use[Share.ANSWERING] -= 1
                self.in_use[Share.SLOW] += 1
                ticket.share = Share.SLOW
        if now_s - self._swept_s >= FORGET_AFTER_S:
            self._forget_idle(now_s)

    def next_aging_s(self) -> float | None:
        """When the oldest attempt not yet aged will be (None: there is none)."""
        if not self._tickets:
            return None
        return next(iter(self._tickets.values())).started_s + self.slow_after_s

    def _forget_idle(self, now_s: float) -> None:
        self._swept_s = now_s
        idle = [
            endpoint_id
            for endpoint_id, endpoint in self._endpoints.items()
            if not endpoint.in_flight and now_s - endpoint.last_s >= FORGET_AFTER_S
        ]
        for endpoint_id in idle:
            self.slow_count -= self._endpoints.pop(endpoint_id).standing is Standing.SLOW


class Admission:
    """The ledger, with waiters queued in order for their share (or, when their endpoint has no room of its
    own, for one of its attempts to end)."""

    def __init__(self, ledger: Ledger, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self._clock = clock
        self._waiting: dict[Share, deque[asyncio.Future[None]]] = {share: deque() for share in Share}
        self._own_lines: dict[str, deque[asyncio.Future[None]]] = {}
        self._aging: asyncio.TimerHandle | None = None

    def loop_ran_late(self, late_s: float) -> None:
        """How late the event loop's last tick was (lag.py): past CROWDED_LATE_S it is crowded."""
        crowded = late_s >= CROWDED_LATE_S
        if crowded == self.ledger.crowded:
            return
        self.ledger.crowded = crowded
        if not crowded:  # every endpoint has room again
            for endpoint_id in list(self._own_lines):
                self._wake_own(endpoint_id)

    async def acquire(self, endpoint_id: str, *, max_wait_s: float) -> Ticket | None:
        """A slot for an attempt to ``endpoint_id``, waited for up to ``max_wait_s`` (None: not in time)."""
        ticket = self._start(endpoint_id)
        if ticket is not None:
            return ticket
        try:
            async with asyncio.timeout(max_wait_s):
                while True:
                    await self._wait_turn(endpoint_id)
                    ticket = self._start(endpoint_id)
                    if ticket is not None:
                        return ticket
                    # Woken for a slot it cannot take (it turned slow meanwhile): the slot is someone
                    # else's, and this one waits again in its own line.
                    self._wake_free()
        except TimeoutError:
            return None

    def release(self, ticket: Ticket, ended: Ended) -> None:
        self.ledger.end(ticket, ended, now_s=self._clock())
        self._wake_own(ticket.endpoint_id)
        self._wake_free()

    def _wake_own(self, endpoint_id: str) -> None:
        """As many of the endpoint's own line as it has room for (each goes on to its share's line if
        that is full): one on probation, all once it has answered and the loop is not crowded."""
        line = self._own_lines.get(endpoint_id)
        if not line:
            return
        room = self.ledger.room(endpoint_id)
        for _ in range(len(line) if room is None else min(room, len(line))):
            self._wake(line)

    def _start(self, endpoint_id: str) -> Ticket | None:
        self._age()
        ticket = self.ledger.start(endpoint_id, now_s=self._clock())
        if ticket is not None and self._aging is None:
            self._schedule_aging()
        return ticket

    async def _wait_turn(self, endpoint_id: str) -> None:
        own = self.ledger.room(endpoint_id) == 0
        line = (
            self._own_lines.setdefault(endpoint_id, deque())
            if own
            else self._waiting[self.ledger.share_for(endpoint_id)]
        )
        turn = asyncio.get_running_loop().create_future()
        line.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._wake(line)  # woken, then cancelled: the turn goes to the next in line
            elif turn in line:  # (a wake may have dropped it already)
                line.remove(turn)
            raise
        finally:
            # Only its own line: a waiter woken from it earlier may have left, and a new line been
            # started for the endpoint since, whose waiters nothing would wake if it were dropped.
            if own and not line and self._own_lines.get(endpoint_id) is line:
                del self._own_lines[endpoint_id]

    def _age(self) -> None:
        freed = self.ledger.in_use[Share.ANSWERING]
        self.ledger.age(now_s=self._clock())
        for _ in range(freed - self.ledger.in_use[Share.ANSWERING]):
            self._wake(self._waiting[Share.ANSWERING])

    def _schedule_aging(self) -> None:
        due_s = self.ledger.next_aging_s()
        if due_s is None:
            self._aging = None
            return
        loop = asyncio.get_running_loop()
        self._aging = loop.call_later(max(0.0, due_s - self._clock()), self._on_aging)

    def _on_aging(self) -> None:
        self._age()
        self._schedule_aging()

    def _wake_free(self) -> None:
        for share, line in self._waiting.items():
            for _ in range(min(len(line), self.ledger.limit(share) - self.ledger.in_use[share])):
                self._wake(line)

    @staticmethod
    def _wake(line: deque[asyncio.Future[None]] | None) -> None:
        while line:
            turn = line.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    def close(self) -> None:
        if self._aging is not None:
            self._aging.cancel()
            self._aging = None
