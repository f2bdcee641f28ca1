"""The attempt record the dispatcher builds as a plain dict (AttemptFields) is the model the monitor and
the ingest validate (AttemptRecord): same fields, and such a dict passes their validation."""

from __future__ import annotations

from typing import get_type_hints

import orjson

from hookline.shared.contracts.telemetry import AttemptFields, AttemptRecord, batch, exchange
from hookline.shared.outbound.delivery import AttemptResult, Timings
from hookline.shared.outbound.sealing import Sealer


def test_the_wire_fields_are_the_model_fields() -> None:
    assert set(get_type_hints(AttemptFields)) == set(AttemptRecord.model_fields)


def test_a_record_built_as_fields_validates_as_the_model() -> None:
    result = AttemptResult(
        status=503, error=None, detail="HTTP 503", retry_after="5",
        timings=Timings(total_ms=12.5, connect_ms=3.0, first_byte_ms=12.0),
        response_headers={"retry-after": "5"}, response_body=b"busy",
    )  # fmt: skip
    fields: AttemptFields = {
        "kind": "attempt", "at_s": 1_700_000_000.0, "dispatcher_id": "d1", "event_id": "evt_1",
        "endpoint_id": "ep_1", "tenant": "acme", "type": "order.created", "attempt": 2, "outcome": "retry",
        "first_attempt_at_s": 1_699_999_990.0, "next_attempt_at_s": 1_700_000_005.0,
        "dead_letter_reason": None, "probe": False, "attempt_kind": "retry",
        **exchange(result, Sealer(None)),
    }  # fmt: skip
    [record] = batch.validate_json(orjson.dumps([fields]))
    assert isinstance(record, AttemptRecord)
    assert record.model_dump() == fields
