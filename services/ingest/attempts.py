"""Attempts the ingest makes itself (an endpoint's verification, an event sent again by hand): signed
like every delivery, and recorded in the telemetry stream like the dispatchers' attempts, so that the
delivery log has them. Beside the event's course (ASIDE_KINDS): no retry follows them. An attempt made
while the broker refuses publishes (an alarm) is still made, and its record held until the broker takes
it (:mod:`hookline.shared.broker.heldpublishes`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import aio_pika
import structlog

from hookline.shared.broker import topology
from hookline.shared.broker.heldpublishes import HeldPublishes
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.contracts.telemetry import (
    AttemptKind,
    AttemptRecord,
    Deferral,
    Heartbeat,
    Outcome,
    batch,
    exchange,
)
from hookline.shared.contracts.webhook import webhook_request
from hookline.shared.outbound import signing
from hookline.shared.outbound.credentials import Credentials
from hookline.shared.outbound.delivery import AttemptResult, ErrorKind
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.outbound.transforms import Transformer, TransformFailedError

log = structlog.get_logger(__name__)

#: Who made an attempt, in its record (a dispatcher's id, for the dispatchers' own).
ATTEMPTER_ID = f"ingest:{os.getpid()}"


def signing_keys(sealer: Sealer, endpoint: StoredEndpoint, now: datetime) -> list[bytes]:
    return [
        signing.secret_key(sealer.open(secret.value))
        for secret in endpoint.secrets
        if secret.expires_at is None or secret.expires_at > now
    ]


@dataclass(frozen=True)
class Attempts:
    sealer: Sealer  # opens the signing secrets; seals the response bodies kept in the record
    credentials: Credentials  # what a request carries besides the signature (the endpoint's auth)
    records: HeldPublishes  # the attempt records, to the telemetry exchange (held while refused)
    transformer: Transformer  # the endpoint's transform, for what is sent as its deliveries are

    async def make(
        self,
        endpoint: StoredEndpoint,
        *,
        event_id: str,
        event_type: str,
        body: bytes,
        kind: AttemptKind,
        number: int,
        sequence: int | None = None,
    ) -> tuple[AttemptResult, AttemptRecord]:
        """POST ``body`` to the endpoint now and record the attempt (a record the broker refuses now is
        published once it takes it: the attempt itself happened)."""
        keys = signing_keys(self.sealer, endpoint, datetime.now(UTC))
        started_s = time.time()
        try:
            # A verification is hookline's own request: never transformed.
            transformed = (
                await self.transformer.apply(endpoint.transform, body)
                if endpoint.transform is not None and kind != "verification"
                else None
            )
        except TransformFailedError as exc:
            result = AttemptResult.failed(ErrorKind.TRANSFORM, str(exc))
        else:
            request = webhook_request(
                endpoint, keys, event_id, body,
                timestamp_s=int(time.time()), sequence=sequence, transformed=transformed,
            )  # fmt: skip
            result = await self.credentials.post(endpoint, request.body, request.headers)
        ok = result.status is not None and 200 <= result.status < 300
        record = AttemptRecord(
            at_s=time.time(),
            dispatcher_id=ATTEMPTER_ID,
            event_id=event_id,
            endpoint_id=endpoint.id,
            tenant=endpoint.tenant,
            type=event_type,
            attempt=number,
            outcome=Outcome.SUCCESS if ok else Outcome.FAILED,
            first_attempt_at_s=started_s,
            attempt_kind=kind,
            **exchange(result, self.sealer),
        )
        if not await self.record([record]):
            log.warning("attempt_record_held", event_id=event_id, endpoint_id=endpoint.id, kind=kind)
        return result, record

    async def record(self, records: Sequence[AttemptRecord]) -> bool:
        """``records`` to the telemetry stream in one message; False: held until the broker takes it."""
        telemetry: list[AttemptRecord | Heartbeat | Deferral] = [*records]
        message = aio_pika.Message(batch.dump_json(telemetry), content_type="application/json")
        return await self.records.publish(
            message, exchange=topology.TELEMETRY_EXCHANGE, routing_key="", what="attempt"
        )
