"""Folding the endpoint change log into state: each record applied, in the log's order and by the same
rule in every process, to the endpoint registry, the event-type catalog or the tenants' tokens and
quotas, and noted in the registry's store. :class:`~hookline.shared.state.registry.ChangeLog` follows
the stream and appends to it; this decides what a record does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from pydantic import TypeAdapter, ValidationError

from hookline.shared.broker import permissions
from hookline.shared.broker.streams import Record, offset_of
from hookline.shared.contracts.models import (
    ChangeRecord,
    EndpointDeleted,
    EndpointDrained,
    EndpointsUpserted,
    EndpointUpserted,
    EventTypeDeleted,
    EventTypeInfo,
    EventTypeUpserted,
    PlacementSet,
    QuotaSet,
    StoredEndpoint,
    StoredToken,
    TokenUpserted,
    error_summary,
)
from hookline.shared.state import catalog
from hookline.shared.state.tenants import Tenants

if TYPE_CHECKING:
    from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

records: TypeAdapter[ChangeRecord] = TypeAdapter(ChangeRecord)
_LEGACY_SYNC = b'{"kind":"sync"'


@dataclass(frozen=True, slots=True)
class Stale:
    """A conditional change that lost: the endpoint is at another version (or gone, or exists already)."""

    current: StoredEndpoint | None


class ChangeFold:
    def __init__(self, registry: EndpointRegistry, event_types: catalog.Catalog, tenants: Tenants) -> None:
        self.registry = registry
        self.catalog = event_types
        self.tenants = tenants

    def restore(self) -> int | None:
        """Start from the registry's store: the event types, tokens and quotas it kept. The offset of the
        last record the store holds (None: none, the log is read from its first)."""
        offset = self.registry.open()
        if offset is None:
            return None
        store = self.registry.store
        self.catalog.restore(EventTypeInfo.model_validate_json(body) for body in store.kept("type"))
        self.tenants.restore(
            (StoredToken.model_validate_json(body) for body in store.kept("token")),
            {quota.tenant: quota.quota for quota in map(QuotaSet.model_validate_json, store.kept("quota"))},
        )
        log.info("registry_resumed", path=str(store.path), offset=offset, endpoints=len(self.registry))
        return offset

    def on_record(self, message: Record) -> object:
        """Apply the record (the follower's callback); what it applied, for the writer awaiting it."""
        result = self._apply(message)
        offset = offset_of(message)
        if offset is not None:
            self.registry.store.applied(offset)
        return result

    def _apply_tenant_record(self, record: TokenUpserted | QuotaSet, body: bytes) -> object:
        kept = self.tenants.apply(record)
        if isinstance(record, QuotaSet):
            self.registry.store.keep("quota", record.tenant, body)
        elif isinstance(kept, StoredToken):  # as applied (a revocation stands)
            self.registry.store.keep("token", kept.id, kept.model_dump_json().encode())
        return kept

    def _apply(self, message: Record) -> object:
        if message.body.startswith(_LEGACY_SYNC):
            return None  # read-back markers of versions that wrote them as records
        try:
            record = records.validate_json(message.body)
        except ValidationError as exc:
            # A record this version cannot read is skipped loudly rather than stopping the service.
            log.error("endpoint_log_record_unreadable", offset=offset_of(message), error=error_summary(exc))
            self.registry.store.skipped()  # a later version reads the log again (registrystore.py)
            return None
        if isinstance(record, TokenUpserted | QuotaSet):
            if not permissions.trusted_writer(message.user_id):
                # The dispatchers and monitors may append to this log (to disable an endpoint), never
                # a token or a quota: such a record is forged.
                log.error("tenant_record_refused", offset=offset_of(message), user=message.user_id)
                return None
            return self._apply_tenant_record(record, message.body)
        if isinstance(record, EndpointDrained):
            self.registry.apply_drained(record)
            return None
        if isinstance(record, PlacementSet):
            placed = self.registry.apply_placement(record)
            if isinstance(placed, Stale):
                log.info("placement_change_stale", endpoint_id=record.placement.endpoint_id)
            return placed
        if isinstance(record, EventTypeUpserted | EventTypeDeleted):
            applied = self.catalog.apply(record)
            if isinstance(applied, catalog.Stale):
                log.info("event_type_change_stale", base_version=record.base_version)
            else:
                name = record.event_type.name if isinstance(record, EventTypeUpserted) else record.name
                body = applied.model_dump_json().encode() if applied is not None else None
                self.registry.store.keep("type", name, body)
            return applied
        if isinstance(record, EndpointsUpserted):
            return [self._apply_endpoint(upsert) for upsert in record.upserts]
        return self._apply_endpoint(record)

    def _apply_endpoint(self, record: EndpointUpserted | EndpointDeleted) -> StoredEndpoint | Stale | None:
        result = self.registry.apply(record)
        if isinstance(result, Stale):
            endpoint_id = record.endpoint.id if isinstance(record, EndpointUpserted) else record.endpoint_id
            log.info("endpoint_change_stale", endpoint_id=endpoint_id, base_version=record.base_version)
        return result
