"""The dispatcher's Prometheus metrics (served by :mod:`hookline.shared.runtime.probes`)."""

from __future__ import annotations

import functools

import prometheus_client

ATTEMPTS = prometheus_client.Counter(
    "hookline_delivery_attempts", "Delivery attempts by outcome.", ["outcome"]
)
ATTEMPT_SECONDS = prometheus_client.Histogram(
    "hookline_delivery_attempt_seconds",
    "Duration of delivery attempts (request start to response headers, or the error).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30),
)


@functools.cache
def attempts(outcome: str) -> prometheus_client.Counter:
    """The attempt counter of one outcome (``labels()`` looks it up under a lock every time)."""
    return ATTEMPTS.labels(outcome)


DEAD_LETTERS = prometheus_client.Counter(
    "hookline_dead_letters", "Messages dead-lettered, by reason.", ["reason"]
)
# Read when scraped (service.py sets the function): counting on the delivery path costs a lock twice.
IN_FLIGHT = prometheus_client.Gauge("hookline_dispatcher_in_flight", "Deliveries being handled now.")
# Read when scraped too (service.py): the admission of attempts (admission.py).
SLOTS_IN_USE = prometheus_client.Gauge(
    "hookline_dispatcher_attempt_slots_in_use",
    "Attempts under way, by the share of HOOKLINE_HTTP_MAX_CONNECTIONS they count against.",
    ["share"],
)
LOOP_LATE_SECONDS = prometheus_client.Histogram(
    "hookline_dispatcher_loop_late_seconds",
    "How late a timer fired on the dispatcher's event loop, every 50 ms (the wait for CPU; lag.py).",
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
)
LOOP_CPU_WAIT_SECONDS = prometheus_client.Counter(
    "hookline_dispatcher_loop_cpu_wait_seconds",
    "Time the event loop's thread was ready to run but waited for a CPU (Linux schedstat; lag.py): "
    "growing about as fast as the loop runs late, the machine is short of CPU, not the replica busy.",
)
SLOW_ENDPOINTS = prometheus_client.Gauge(
    "hookline_dispatcher_slow_endpoints",
    "Endpoints this dispatcher finds slow (an answer or a wait of HOOKLINE_SLOW_ATTEMPT_S or more).",
)
DEFERRED = prometheus_client.Counter(
    "hookline_deliveries_deferred",
    "Deliveries put back through the delay queues without an attempt, by reason (ordering, pacing, slow_share, slow).",
    ["reason"],
)
TELEMETRY_DROPPED = prometheus_client.Counter(
    "hookline_telemetry_dropped_records",
    "Telemetry records dropped: the broker was unreachable or refusing publishes (an alarm).",
)
CONSUMERS = prometheus_client.Gauge(
    "hookline_dispatcher_consumers",
    "Queues this dispatcher consumes (the lanes, and queues of endpoints of their own).",
)
REDELIVERIES_SETTLED = prometheus_client.Counter(
    "hookline_redeliveries_already_settled",
    "Messages the broker handed out again that this replica had settled (its ack was lost): acked, not re-sent.",
)
UNACKED = prometheus_client.Gauge(
    "hookline_dispatcher_unacked",
    "Messages this replica holds that the broker has no ack for yet (being handled, or settled with the "
    "ack still to go): what a fault now could deliver twice.",
)
CONSUMERS_REATTACHED = prometheus_client.Counter(
    "hookline_dispatcher_consumers_reattached",
    "Consumers the broker no longer had (found by the periodic check, not told by a cancel), attached again.",
)
ISOLATIONS = prometheus_client.Counter(
    "hookline_dispatcher_isolations",
    "Endpoints this dispatcher gave a queue of their own, by reason (slow, backlogged; refused: the bound).",
    ["reason"],
)
LANE_MESSAGES = prometheus_client.Counter(
    "hookline_lane_messages",
    "Lane messages handled: fanned out (fan_out), addressed to one endpoint (addressed), from a holding "
    "lane (held).",
    ["kind"],
)
# One per lane message: looked up once here rather than by label each time.
LANE_FANNED_OUT = LANE_MESSAGES.labels("fan_out")
LANE_ADDRESSED = LANE_MESSAGES.labels("addressed")
LANE_HELD = LANE_MESSAGES.labels("held")
UNSUBSCRIBED = prometheus_client.Counter(
    "hookline_unsubscribed_copies",
    "Events routed straight to an endpoint's queue of its own (a direct route) for a pattern it has dropped "
    "since: acked unsent, as its lane would not have fanned them out to it.",
)
HANDED_ON = prometheus_client.Counter(
    "hookline_handed_on",
    "Copies handed on, unattempted, to their endpoint's address, by reason (isolated: an endpoint with a "
    "queue of its own; breaker_open, slow, backlogged, no_slot, forwarded, crashed, fence_early; moved: "
    "found in a holding lane after its endpoint left it; held_busy: its turn not had there within a minute; "
    "unsettled: a broker error in the middle of its settlement).",
    ["reason"],
)
QUEUES_REDECLARED = prometheus_client.Counter(
    "hookline_endpoint_queues_redeclared", "Endpoint queues found missing and declared again."
)
BREAKERS_EXPIRED = prometheus_client.Counter(
    "hookline_breakers_expired", "Open breakers closed here because no health monitor renewed them."
)
FILTERED = prometheus_client.Counter(
    "hookline_filtered_copies",
    "Copies of events an endpoint's filter did not match (not queued, not delivered; evaluation errors "
    "included).",
)
FILTER_ERRORS = prometheus_client.Counter(
    "hookline_filter_errors",
    "Events an endpoint's filter could not be evaluated on (a missing field, a type mismatch): no match.",
    ["endpoint_id"],
)
