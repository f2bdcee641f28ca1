"""Pacing (rate limit, 429 back-off) and per-subject ordering, as pure state machines."""

from __future__ import annotations

import pytest

from hookline.dispatcher.decoding import Inbound
from hookline.dispatcher.handler import _order_key
from hookline.dispatcher.ordering import STALE_S, SubjectOrder
from hookline.dispatcher.pacing import Pacer
from hookline.shared.contracts.models import Event


def test_the_rate_limit_spaces_deliveries() -> None:
    pacer = Pacer()
    waits = [pacer.wait_s("ep", 10.0, now_s=100.0, max_wait_s=60) for _ in range(25)]
    # A burst of a tenth of a second's worth (at least one) goes at once, then one every 1/rate s.
    assert waits[0] == 0.0
    assert waits[1] == pytest.approx(0.1)
    assert waits[24] == pytest.approx(2.4)
    burst = [pacer.wait_s("big", 100.0, now_s=0.0, max_wait_s=60) for _ in range(12)]
    assert burst[:10] == [0.0] * 10
    assert burst[10] == pytest.approx(0.01)


def test_without_a_limit_there_is_no_wait() -> None:
    assert Pacer().wait_s("ep", None, now_s=0.0, max_wait_s=60) == 0.0


def test_a_429_halves_the_rate_and_honours_retry_after() -> None:
    pacer = Pacer()
    pacer.wait_s("ep", 10.0, now_s=0.0, max_wait_s=60)
    pacer.record("ep", status=429, retry_after_s=3.0, now_s=0.0)
    assert pacer.wait_s("ep", 10.0, now_s=1.0, max_wait_s=60) >= 2.0  # not before Retry-After
    for _ in range(20):
        pacer.record("ep", status=429, retry_after_s=None, now_s=0.0)
    pace = pacer._paces["ep"]
    assert pace.factor == pytest.approx(0.1), "never below a tenth of the limit"
    for _ in range(100):
        pacer.record("ep", status=204, retry_after_s=None, now_s=10.0)
    assert pace.factor == 1.0, "successes give the rate back"


@pytest.mark.parametrize(
    ("answers", "paused_until_s"),
    [
        ([(429, 3.0, 10.0)], 13.0),  # Retry-After: 3, at 10 s
        ([(429, None, 10.0)], 11.0),  # no Retry-After: a second
        ([(429, 5.0, 10.0), (429, 1.0, 11.0)], 15.0),  # a shorter Retry-After never shortens the pause
        ([(429, 1.0, 10.0), (429, 5.0, 10.5)], 15.5),  # a longer one lengthens it
        ([(204, None, 10.0)], None),  # only a 429 pauses the endpoint
        ([(503, 30.0, 10.0)], None),  # a 503's Retry-After delays its event only
        ([(None, None, 10.0)], None),  # no answer
    ],
)
def test_recording_a_429_says_until_when_the_endpoint_is_paused(
    answers: list[tuple[int | None, float | None, float]], paused_until_s: float | None
) -> None:
    """What the attempt record tells (``paused_until_s``) is the pause the pacer then holds."""
    pacer = Pacer()
    said = [pacer.record("ep", status=s, retry_after_s=r, now_s=at) for s, r, at in answers]
    assert said[-1] == paused_until_s
    if paused_until_s is not None:
        now_s = answers[-1][2]
        assert pacer.wait_s("ep", None, now_s=now_s, max_wait_s=60) == pytest.approx(paused_until_s - now_s)


def test_a_429_without_a_rate_limit_still_pauses_the_endpoint() -> None:
    pacer = Pacer()
    pacer.record("ep", status=429, retry_after_s=None, now_s=5.0)
    assert pacer.wait_s("ep", None, now_s=5.0, max_wait_s=60) == pytest.approx(1.0)


def test_a_subject_goes_in_order_and_blocks_only_itself() -> None:
    order = SubjectOrder()
    assert order.admit("ep", "s1", "e1", 1, now_s=0) is None  # attempted
    assert order.admit("ep", "s1", "e2", 2, now_s=0) == 1  # e1 outstanding: deferred
    assert order.admit("ep", "s2", "x1", 3, now_s=0) is None  # another subject is not held back
    order.retrying("ep", "s1", "e1", due_s=30)  # e1 failed: its retry is due in 30 s
    assert order.admit("ep", "s1", "e2", 2, now_s=5) == 25  # deferred until then
    assert order.admit("ep", "s1", "e1", 1, now_s=30) is None  # the retry comes back first
    order.done("ep", "s1", "e1")
    assert order.admit("ep", "s1", "e2", 2, now_s=31) is None  # now e2
    order.done("ep", "s1", "e2")
    assert order.admit("ep", "s1", "e3", 4, now_s=32) is None


def test_a_later_event_never_overtakes_a_deferred_earlier_one() -> None:
    order = SubjectOrder()
    assert order.admit("ep", "s", "e1", 1, now_s=0) is None
    assert order.admit("ep", "s", "e2", 2, now_s=0) == 1
    order.done("ep", "s", "e1")
    # e3 arrives before e2 comes back from its deferral: it waits behind e2.
    assert order.admit("ep", "s", "e3", 3, now_s=0.5) is not None
    assert order.admit("ep", "s", "e2", 2, now_s=1) is None


def test_putting_deliveries_off_never_runs_the_bucket_into_debt() -> None:
    pacer = Pacer()
    pacer.record("ep", status=429, retry_after_s=30.0, now_s=0.0)
    for _ in range(1000):  # a backlog, every delivery put off while the endpoint pauses
        assert pacer.wait_s("ep", 2.0, now_s=1.0, max_wait_s=10) > 10
    # Once the pause is over, deliveries go at the (halved) rate again, not 500 s later.
    assert pacer.wait_s("ep", 2.0, now_s=31.0, max_wait_s=10) <= 1.0


def test_an_earlier_event_settled_elsewhere_blocks_its_subject_only_until_it_is_stale() -> None:
    """The earlier event was retried (due at 10 s) and then delivered by another replica (the probe, or
    a failover): it never comes back here. Later events wait while it could still come, then go."""
    order = SubjectOrder()
    assert order.admit("ep", "s1", "e1", 1, now_s=0) is None
    order.retrying("ep", "s1", "e1", due_s=10)
    assert order.admit("ep", "s1", "e2", 2, now_s=5) == 5  # still due: wait for it
    assert order.admit("ep", "s1", "e2", 2, now_s=10 + STALE_S - 1) == 1  # late, but could still come
    assert order.admit("ep", "s1", "e2", 2, now_s=10 + STALE_S + 1) is None  # gone: the subject moves on
    assert order.admit("ep", "s1", "e3", 3, now_s=10 + STALE_S + 2) == 1  # e2 is the one out now


def test_the_event_holding_a_subject_back_is_named() -> None:
    order = SubjectOrder()
    assert order.admit("ep", "s1", "e1", 1, now_s=0) is None
    assert order.admit("ep", "s1", "e0", 0, now_s=0) is None  # published earlier, seen later: goes
    assert order.admit("ep", "s1", "e2", 2, now_s=0) == 1
    assert order.holding("ep", "s1", "e2") == "e0"  # the earliest of those before it
    assert order.holding("ep", "s1", "e0") is None
    assert order.holding("ep", "other", "x") is None


def _inbound(sequence: int | None, seen_ns: int | None = None) -> Inbound:
    event = Event.model_validate({
        "id": f"e{sequence}", "type": "a.b", "tenant": "t", "occurred_at": "2026-12-01T00:00:00Z",
        "subject": "s", "sequence": sequence, "data": {},
    })  # fmt: skip
    return Inbound(event=event, attempt=1, first_attempt_at_s=None, sequence=seen_ns)


def test_the_publishers_sequence_orders_a_subject_in_place_of_arrival() -> None:
    """Published out of order (7 before 6): with the publisher's numbers, 6 does not wait behind 7's
    retry; by arrival it would have."""
    assert _order_key(_inbound(6, seen_ns=10**18).event, _inbound(6, seen_ns=10**18)) == 6
    assert _order_key(_inbound(None, seen_ns=123).event, _inbound(None, seen_ns=123)) == 123  # a retry's
    order = SubjectOrder()
    seventh, sixth = _inbound(7), _inbound(6)
    assert order.admit("ep", "s", "e7", _order_key(seventh.event, seventh), now_s=0) is None
    order.retrying("ep", "s", "e7", due_s=60)  # 7 failed; its retry is a minute away
    assert order.admit("ep", "s", "e6", _order_key(sixth.event, sixth), now_s=1) is None
    # By arrival (the later arrival has the later time) 6 would have waited for 7's retry:
    by_arrival = SubjectOrder()
    assert by_arrival.admit("ep", "s", "e7", 100, now_s=0) is None
    by_arrival.retrying("ep", "s", "e7", due_s=60)
    assert by_arrival.admit("ep", "s", "e6", 200, now_s=1) == 59


@pytest.mark.parametrize(("now_s", "paused_s"), [(0.0, 3.0), (1.0, 2.0), (3.0, 0.0), (9.0, 0.0)])
def test_the_pause_left_after_a_429(now_s: float, paused_s: float) -> None:
    pacer = Pacer()
    pacer.record("ep", status=429, retry_after_s=3.0, now_s=0.0)
    assert pacer.paused_for_s("ep", now_s=now_s) == pytest.approx(paused_s)
    assert pacer.paused_for_s("unknown", now_s=now_s) == 0.0
