"""One attempt and its request: the body transformed (the endpoint's transform), signed with the keys
that sign now, POSTed in a client span; the attempt cut at the slow line when it came from a lane; its
outcome classified and settled by the pure policy (outcome.py, backoff.py), the endpoint's pace told of
the answer, and the attempt's telemetry record and log line written before the settlement is applied
(settling.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

import structlog
from opentelemetry.trace import SpanKind

from hookline.dispatcher import decoding, metrics
from hookline.dispatcher.admission import Admission, Ended, Ticket
from hookline.dispatcher.backoff import Jitter, RetryPolicy, honoured_retry_after_s
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.gate import Gate
from hookline.dispatcher.outcome import DeadLetter, Retry, Settlement, classify, settle
from hookline.dispatcher.pacing import Pacer
from hookline.dispatcher.reporting import Telemetry
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settling import Settling
from hookline.shared import __version__
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptFields, Outcome, exchange
from hookline.shared.contracts.webhook import webhook_request
from hookline.shared.outbound import signing
from hookline.shared.outbound.credentials import Credentials
from hookline.shared.outbound.delivery import AttemptResult, DeliveryClient, ErrorKind
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.outbound.transforms import Transformer, TransformFailedError
from hookline.shared.runtime.tracing import Tracing

log = structlog.get_logger(__name__)

USER_AGENT = f"hookline/{__version__}"

#: The attempt record's fields that its log line repeats (never the response: it may hold customer data).
_LOGGED_FIELDS = (
    "event_id", "endpoint_id", "tenant", "type", "attempt", "status", "outcome", "error", "duration_ms",
    "dns_ms", "connect_ms", "first_byte_ms", "dead_letter_reason",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Keys:
    version: datetime  # the endpoint's updated_at they were made from
    keys: list[bytes]
    expires: datetime | None  # when the first of them stops signing


class Attempts:
    def __init__(
        self,
        settings: DispatcherSettings,
        client: DeliveryClient,
        sealer: Sealer,
        telemetry: Telemetry,
        admission: Admission,
        pacer: Pacer,
        gate: Gate,
        settling: Settling,
        *,
        tracing: Tracing | None = None,
        transformer: Transformer | None = None,
        random_unit: Callable[[], float] = random.random,
    ) -> None:
        self._settings = settings
        self._credentials = Credentials(sealer, client)
        self._tracing = tracing or Tracing("dispatcher", None)
        # Started at the first transform; the service owns (and stops) the one it passes.
        self._transformer = transformer or Transformer(max_bytes=settings.max_payload_bytes)
        self._random_unit = random_unit
        self._telemetry = telemetry
        self._signing_keys: dict[str, _Keys] = {}
        self._policies: dict[str, tuple[datetime, RetryPolicy]] = {}  # per endpoint, with its version
        self._admission = admission
        self._pacer = pacer
        self._gate = gate
        self._settling = settling
        self._sealer = sealer

    async def attempt_and_settle(
        self,
        message: Incoming,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        sequence: int | None,
        ticket: Ticket,
        *,
        probe: bool,
        lane: bool = False,
    ) -> None:
        started_s = time.time()
        # From a lane, an attempt is cut at the slow line (unless the endpoint's own timeout is shorter):
        # the events behind it in the lane must not wait for a slow endpoint.
        deadline_s = self._settings.slow_attempt_s if lane else None
        cut = asyncio.timeout(deadline_s if deadline_s and deadline_s < endpoint.timeout_s else None)
        try:
            async with cut:
                result = await self._attempt(endpoint, parsed, message.body)
        except TimeoutError:
            if not cut.expired():
                self._admission.release(ticket, Ended.NOT_SENT)
                raise  # not the cut: a crash of the attempt's own
            self._admission.release(ticket, Ended.TIMED_OUT)  # slow here from now on
            await self._gate.cut(message, endpoint, parsed)
            return
        except BaseException:
            self._admission.release(
                ticket, Ended.NOT_SENT
            )  # cancelled (shutdown), or a crash: it says nothing
            raise
        self._admission.release(
            ticket, Ended.TIMED_OUT if result.error is ErrorKind.TIMEOUT else Ended.ANSWERED
        )
        outcome = classify(result.status, result.error)
        first_attempt_at_s = parsed.first_attempt_at_s or started_s
        settlement = settle(
            outcome,
            status=result.status,
            attempt=parsed.attempt,
            first_attempt_at_s=first_attempt_at_s,
            now_s=time.time(),
            policy=self._policy(endpoint),
            random=self._random_unit(),
            retry_after=result.retry_after,
            now=datetime.now(UTC),
            error=result.error,
        )
        ended_s = time.time()
        metrics.attempts(outcome.value).inc()
        metrics.ATTEMPT_SECONDS.observe(result.timings.total_ms / 1000)
        # A 429's Retry-After also pauses the endpoint (a 503's delays this event only).
        pause_s = (
            honoured_retry_after_s(
                result.retry_after,
                status=result.status,
                now=datetime.now(UTC),
                cap_s=self._settings.retry_after_cap_s,
            )
            if result.status == 429
            else None
        )
        paused_until_s = self._pacer.record(
            endpoint.id, status=result.status, retry_after_s=pause_s, now_s=ended_s
        )
        self._report(
            endpoint, parsed, outcome, settlement, result, first_attempt_at_s, ended_s, paused_until_s,
            probe=probe,
        )  # fmt: skip
        await self._settling.settle(
            settlement, message, endpoint, parsed, first_attempt_at_s, result, sequence
        )

    def _report(
        self,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        outcome: Outcome,
        settlement: Settlement,
        result: AttemptResult,
        first_attempt_at_s: float,
        ended_s: float,
        paused_until_s: float | None,
        *,
        probe: bool,
    ) -> None:
        """The attempt's telemetry record and its canonical log line (the record's fields, without the
        receiver's answer: it may hold a customer's data)."""
        event = parsed.event
        next_attempt_in_s = settlement.delay_s if isinstance(settlement, Retry) else None
        # As it goes on the wire (AttemptFields; the monitor and the ingest validate it as an
        # AttemptRecord): a model built here would cost the delivery path as much as the rest.
        record: AttemptFields = {
            "kind": "attempt",
            "at_s": ended_s,
            "dispatcher_id": self._telemetry.dispatcher_id,
            "event_id": event.id,
            "endpoint_id": endpoint.id,
            "tenant": event.tenant,
            "type": event.type,
            "attempt": parsed.attempt,
            "outcome": outcome.value,
            "first_attempt_at_s": first_attempt_at_s,
            "next_attempt_at_s": ended_s + next_attempt_in_s if next_attempt_in_s is not None else None,
            "dead_letter_reason": settlement.reason.value if isinstance(settlement, DeadLetter) else None,
            "probe": probe,
            "attempt_kind": "probe"
            if probe
            else "retry"
            if parsed.attempt > 1
            else parsed.origin or "delivery",
            **exchange(result, self._sealer),
        }
        self._telemetry.attempt(record)
        fields = cast("Mapping[str, object]", record)
        log.info(
            "delivery_attempt",
            **{name: fields[name] for name in _LOGGED_FIELDS},
            next_attempt_in_s=next_attempt_in_s,
            # A 429's pause of the whole endpoint: on the line only, not the telemetry record, which
            # the monitor and ingest of the version before would refuse whole (an unknown field).
            paused_until_s=paused_until_s,
            probe=probe or None,
        )

    def _policy(self, endpoint: StoredEndpoint) -> RetryPolicy:
        cached = self._policies.get(endpoint.id)
        if cached is not None and cached[0] == endpoint.updated_at:
            return cached[1]
        settings = self._settings
        policy = RetryPolicy(
            schedule_s=tuple(endpoint.retry_schedule_s or settings.retry_schedule_s),
            retention_s=endpoint.retention_s or settings.retention_s,
            max_attempts=endpoint.max_attempts or settings.max_attempts,
            jitter=Jitter(settings.retry_jitter),
            retry_after_cap_s=settings.retry_after_cap_s,
        )
        self._policies[endpoint.id] = (endpoint.updated_at, policy)
        return policy

    async def _attempt(
        self, endpoint: StoredEndpoint, parsed: decoding.Inbound, body: bytes
    ) -> AttemptResult:
        event = parsed.event
        transformed = None
        if endpoint.transform is not None:  # the endpoint's version now: a PATCH changes later bodies
            try:
                transformed = await self._transformer.apply(endpoint.transform, body)
            except TransformFailedError as exc:
                return AttemptResult.failed(ErrorKind.TRANSFORM, str(exc))
        request = webhook_request(
            endpoint, self._keys(endpoint), event.id, body,
            timestamp_s=int(time.time()), sequence=event.sequence, transformed=transformed,
        )  # fmt: skip
        headers = request.headers
        attributes: dict[str, str | int | float] = {
            "hookline.event_id": event.id, "hookline.event_type": event.type, "hookline.endpoint_id": endpoint.id,
            "hookline.tenant": event.tenant, "hookline.attempt": parsed.attempt,
        }  # fmt: skip
        with self._tracing.span("hookline.deliver", parsed.trace, attributes, kind=SpanKind.CLIENT) as (
            trace,
            span,
        ):
            if trace is not None:
                headers.update(trace.headers())
            result = await self._credentials.post(endpoint, request.body, headers)
            if span is not None:
                span.set_attribute("http.response.status_code", result.status or 0)
                if result.error is not None:
                    span.set_attribute("error.type", result.error.value)
        return result

    def _keys(self, endpoint: StoredEndpoint) -> list[bytes]:
        """The keys of the secrets that sign now: the newest, and during a rotation the previous ones.

        Opened (and decoded) once per endpoint version, again when a rotated-out secret expires.
        """
        now = datetime.now(UTC)
        cached = self._signing_keys.get(endpoint.id)
        if (
            cached is None
            or cached.version != endpoint.updated_at
            or (cached.expires and now >= cached.expires)
        ):
            live = [s for s in endpoint.secrets if s.expires_at is None or s.expires_at > now]
            cached = _Keys(
                version=endpoint.updated_at,
                keys=[signing.secret_key(self._sealer.open(secret.value)) for secret in live],
                expires=min((s.expires_at for s in live if s.expires_at is not None), default=None),
            )
            self._signing_keys[endpoint.id] = cached
        return cached.keys
