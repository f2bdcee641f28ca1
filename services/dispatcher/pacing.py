"""Pacing one endpoint's deliveries: its rate limit (a token bucket), and slowing down when it says 429.

Limits hold across replicas because a limited endpoint is served by one dispatcher at a time (its queue
has a single active consumer, and the consumer's prefetch is the ``max_in_flight`` cap); the pacing
below is that dispatcher's. The functions are pure, time passed in.

On a 429 the endpoint's rate is halved (down to a tenth of its limit) and nothing is sent to it before
``Retry-After`` (or 1 s); each success gives back 5 % of the rate: additive-increase would be slower to
recover than an endpoint that merely had a bad second deserves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_FACTOR = 0.1
BURST_S = 0.1
RECOVERY = 1.05


@dataclass
class TokenBucket:
    rate_per_s: float
    capacity: float  # the burst allowed after a quiet period
    tokens: float
    updated_s: float

    def reserve(self, now_s: float) -> float:
        """Take one token (possibly in advance); returns how long to wait before using it."""
        self.tokens = min(self.capacity, self.tokens + (now_s - self.updated_s) * self.rate_per_s)
        self.updated_s = now_s
        self.tokens -= 1
        return max(0.0, -self.tokens / self.rate_per_s)


@dataclass
class EndpointPace:
    factor: float = 1.0
    not_before_s: float = 0.0
    bucket: TokenBucket | None = None


@dataclass
class Pacer:
    _paces: dict[str, EndpointPace] = field(default_factory=dict)

    def wait_s(
        self, endpoint_id: str, rate_limit_per_s: float | None, *, now_s: float, max_wait_s: float
    ) -> float:
        """How long the next delivery to this endpoint must wait (0: go now). A wait longer than
        ``max_wait_s`` means the delivery is put off: then no token is taken, so putting deliveries
        off never runs the bucket into debt."""
        pace = self._paces.setdefault(endpoint_id, EndpointPace())
        wait_s = max(0.0, pace.not_before_s - now_s)
        if rate_limit_per_s is None or wait_s > max_wait_s:
            return wait_s
        rate = rate_limit_per_s * pace.factor
        # The burst after a quiet period: a tenth of a second's worth, at least one delivery.
        capacity = max(1.0, rate * BURST_S)
        if pace.bucket is None:
            pace.bucket = TokenBucket(rate_per_s=rate, capacity=capacity, tokens=capacity, updated_s=now_s)
        pace.bucket.rate_per_s = rate
        pace.bucket.capacity = capacity
        total_s = wait_s + pace.bucket.reserve(now_s + wait_s)
        if total_s > max_wait_s:
            pace.bucket.tokens += 1  # put off: give the token back
        return total_s

    def record(
        self, endpoint_id: str, *, status: int | None, retry_after_s: float | None, now_s: float
    ) -> float | None:
        """Learn from an answer; after a 429, returns when the endpoint's pause ends (the attempt record
        says so: what a support engineer, and a test, read instead of guessing from arrival times)."""
        pace = self._paces.setdefault(endpoint_id, EndpointPace())
        if status == 429:
            pace.factor = max(MIN_FACTOR, pace.factor / 2)
            pace.not_before_s = max(
                pace.not_before_s, now_s + (retry_after_s if retry_after_s is not None else 1.0)
            )
            return pace.not_before_s
        if status is not None and 200 <= status < 300:
            pace.factor = min(1.0, pace.factor * RECOVERY)
        return None

    def paused_for_s(self, endpoint_id: str, *, now_s: float) -> float:
        """How long the endpoint's 429 pause still lasts (0: none): a delivery that waited for its turn
        or for a connection while a 429 came back is checked again right before it goes."""
        pace = self._paces.get(endpoint_id)
        return 0.0 if pace is None else max(0.0, pace.not_before_s - now_s)

    def forget(self, endpoint_id: str) -> None:
        self._paces.pop(endpoint_id, None)
