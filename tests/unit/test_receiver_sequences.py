"""hookline.receiver.Sequences: an event older than the state applied is stale, a gap is not."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from hookline.receiver import Delivery, Sequences


def delivery(sequence: object, subject: object = "order_1", tenant: str = "acme", n: int = 0) -> Delivery:
    event = {"id": f"evt_{n}", "tenant": tenant, "type": "order.updated", "subject": subject, "data": {}}
    if sequence is not None:
        event["sequence"] = sequence
    return Delivery(webhook_id=f"evt_{n}", timestamp_s=0, body=json.dumps(event).encode())


@pytest.mark.parametrize(
    ("applied", "arriving", "stale"),
    [
        ([], 1, False),
        ([3], 2, True),
        ([3], 3, True),  # the same state again (a resend with a new webhook-id is not one: same id)
        ([3], 4, False),
        ([3], 7, False),  # a gap: events of types this endpoint does not get are numbered too
        ([3, 5, 4], 4, True),  # applied out of order: the newest applied wins, it never moves back
        ([3], 0, True),
    ],
)
def test_staleness_by_the_newest_sequence_applied(applied: list[int], arriving: int, stale: bool) -> None:
    with Sequences() as sequences:
        for sequence in applied:
            sequences.applied(delivery(sequence))
        assert sequences.stale(delivery(arriving)) is stale


def test_subjects_and_tenants_are_counted_apart() -> None:
    with Sequences() as sequences:
        sequences.applied(delivery(9))
        assert not sequences.stale(delivery(1, subject="order_2"))
        assert not sequences.stale(delivery(1, tenant="beta"))


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"id": "e", "tenant": "acme", "subject": "s", "data": {}}).encode(),  # no sequence
        json.dumps({"id": "e", "tenant": "acme", "sequence": 4, "data": {}}).encode(),  # no subject
        json.dumps({"id": "e", "subject": "s", "sequence": True}).encode(),
        json.dumps({"id": "e", "subject": "s", "sequence": "4"}).encode(),
        json.dumps({"text": "a slack body"}).encode(),
        json.dumps([1, 2]).encode(),
        b"not json",
    ],
)
def test_an_event_without_a_usable_sequence_is_never_stale_and_records_nothing(body: bytes) -> None:
    with Sequences() as sequences:
        unnumbered = Delivery(webhook_id="e", timestamp_s=0, body=body)
        sequences.applied(unnumbered)
        assert not sequences.stale(unnumbered)
        assert not sequences.stale(delivery(0, subject="s"))


def test_a_file_survives_a_restart_and_serves_threads(tmp_path: Path) -> None:
    path = tmp_path / "sequences.db"
    with Sequences(path) as sequences:
        workers = [threading.Thread(target=sequences.applied, args=(delivery(n, n=n),)) for n in range(1, 51)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    with Sequences(path) as reopened:
        assert reopened.stale(delivery(50))
        assert not reopened.stale(delivery(51))
