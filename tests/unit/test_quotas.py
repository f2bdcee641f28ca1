"""The events-per-second token bucket (pure: time is passed in)."""

from __future__ import annotations

import pytest

from hookline.ingest.quotas import Bucket, take


@pytest.mark.parametrize(
    ("bucket", "now_s", "tokens_after", "wait_s"),
    [
        (None, 0.0, 2.0, 0.0),  # a new tenant starts with a full bucket (burst 3)
        (Bucket(1.0, 0.0), 0.0, 0.0, 0.0),  # the last token
        (Bucket(0.0, 0.0), 0.0, 0.0, 0.5),  # empty: a token comes back in 1/rate s
        (Bucket(0.0, 0.0), 0.5, 0.0, 0.0),  # ... and is there then
        (Bucket(0.0, 0.0), 0.25, 0.5, 0.25),  # refused: the bucket keeps what refilled
        (Bucket(1.0, 0.0), 100.0, 2.0, 0.0),  # refills to the burst, never beyond
    ],
)
def test_take(bucket: Bucket | None, now_s: float, tokens_after: float, wait_s: float) -> None:
    after, waited = take(bucket, rate_per_s=2.0, burst=3, now_s=now_s)
    assert after == Bucket(tokens_after, now_s)
    assert waited == wait_s
