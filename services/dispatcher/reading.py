"""The event in a consumed message, read and checked: decoded (decoding.py), and on an event's first
hop checked against its type's schema in the catalog, with the change log read up to now before a
refusal (this replica's view of the catalog may be behind).
"""

from __future__ import annotations

import structlog

from hookline.dispatcher import decoding
from hookline.dispatcher.catchup import CaughtUp
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.settings import DispatcherSettings
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)


class EventReader:
    def __init__(self, settings: DispatcherSettings, change_log: ChangeLog) -> None:
        self._settings = settings
        self._change_log = change_log
        self._caught_up = CaughtUp(change_log)

    async def parse_event(self, message: Incoming, *, tenant: str) -> decoding.Inbound | decoding.Invalid:
        """The event in a message for one of ``tenant``'s endpoints, checked (the catalog's schema too,
        on an event's first hop)."""
        parsed = decoding.parse(
            message.body,
            message_id=message.message_id,
            content_type=message.content_type,
            exchange=message.exchange,
            routing_key=message.routing_key,
            headers=message.headers,
            endpoint_tenant=tenant,
            max_bytes=self._settings.max_payload_bytes,
        )
        if not isinstance(parsed, decoding.Inbound) or message.exchange != topology.EVENTS_EXCHANGE:
            return parsed
        checked = self._catalog_check(parsed)
        if isinstance(checked, decoding.Inbound):
            return checked
        # Refused by this replica's view of the catalog, which may be behind: an operator relaxed the
        # schema, an ingest answered, and the upstream published at once. Read the log up to now first.
        try:
            await self._caught_up.wait(timeout_s=CALL_TIMEOUT_S)
        except BROKER_ERRORS as exc:  # refused by the view as it is: a dead letter, redrivable
            log.warning("catalog_sync_failed", event_id=parsed.event.id, error=type(exc).__name__)
            return checked
        return self._catalog_check(parsed)

    def _catalog_check(self, parsed: decoding.Inbound) -> decoding.Inbound | decoding.Invalid:
        """An event published straight to AMQP, on its first hop, by its type's schema in the catalog (the
        ingest checked those it took over HTTP, and retries were checked on their first hop)."""
        event = parsed.event
        violation = self._change_log.catalog.check(event.type, event.schema_version, event.data)
        if violation is None:
            return parsed
        if violation.validation == "enforce":
            return decoding.Invalid(
                f"does not match the schema of {event.type}: {violation.describe()}", event.id
            )
        log.warning("event_schema_mismatch", event_id=event.id, type=event.type, at=violation.pointers())
        return parsed
