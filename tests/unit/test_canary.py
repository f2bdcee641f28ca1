"""The canary book: what was sent, what arrived, which alerts fire (no I/O, the clock passed in)."""

from __future__ import annotations

from typing import Any

from hookline.health_monitor.canary import CANARY_TYPE, CanaryBook
from hookline.shared.contracts.ids import encode_ulid
from hookline.shared.contracts.telemetry import AttemptRecord

T0 = 1_800_000_000.0
EP = "ep_" + "1" * 26


def canary(sent_s: float) -> str:
    return "evt_" + encode_ulid(int(sent_s * 1000), bytes(10))


def attempt(
    event_id: str, at_s: float, *, outcome: str = "success", status: int | None = 200, **more: Any
) -> AttemptRecord:
    return AttemptRecord.model_validate(
        {
            "at_s": at_s, "dispatcher_id": "d", "event_id": event_id, "endpoint_id": EP, "tenant": "canary",
            "type": CANARY_TYPE, "attempt": 1, "outcome": outcome, "status": status, "error": None,
            "duration_ms": 2.0, "first_attempt_at_s": at_s, **more,
        }
    )  # fmt: skip


def names(book: CanaryBook, now_s: float) -> set[str]:
    return {alert.name for alert in book.alerts([EP], tenant="canary", now_s=now_s, late_s=30)}


def test_a_delivered_canary_gives_its_latency_and_no_alert() -> None:
    book = CanaryBook()
    first = canary(T0)
    book.sending(first)
    book.on_attempt(attempt(first, T0 + 0.25))
    assert book.latency_s == {EP: 0.25}
    assert names(book, T0 + 100) == set()


def test_a_canary_not_delivered_in_time_is_late_until_a_later_one_arrives() -> None:
    book = CanaryBook()
    book.sending(canary(T0))
    assert names(book, T0 + 29) == set()
    assert names(book, T0 + 30) == {"canary_late"}
    book.sending(canary(T0 + 40))
    book.on_attempt(attempt(canary(T0 + 40), T0 + 41))  # a later one arrived: the path works again
    assert names(book, T0 + 60) == set()


def test_a_failed_attempt_fires_until_a_success() -> None:
    book = CanaryBook()
    sent = canary(T0)
    book.sending(sent)
    book.on_attempt(attempt(sent, T0 + 1, outcome="retry", status=503))
    [failed] = book.alerts([EP], tenant="canary", now_s=T0 + 2, late_s=30)
    assert (failed.name, failed.endpoint_id, failed.detail) == (
        "canary_failed",
        EP,
        "the last canary attempt failed (HTTP 503)",
    )
    book.on_attempt(attempt(sent, T0 + 3, attempt=2))
    assert names(book, T0 + 4) == set()


def test_other_events_and_foreign_ids_are_ignored_and_memory_is_bounded() -> None:
    book = CanaryBook()
    book.on_attempt(attempt(canary(T0), T0, type="order.created"))
    book.on_attempt(attempt("my-own-id", T0))
    assert book.latency_s == {}
    for n in range(500):
        book.sending(canary(T0 + n))
    assert len(book.sent) == 100
    # A standby monitor never sent anything: no late alert from it.
    assert names(CanaryBook(), T0 + 1000) == set()
