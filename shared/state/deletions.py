"""Endpoints deleted, and what they still owe: a deleted endpoint stays in its tenant's fan-out until its
lane has passed the deletion's fence (its copies become ``endpoint_gone`` dead letters, not lost), and
one that had queues of its own is watched until they are drained."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from hookline.shared.broker import topology
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state.endpointrows import EndpointRows, seconds


class Deletions:
    def __init__(self, rows: EndpointRows) -> None:
        self._rows = rows
        # Deleted endpoints whose lane has not passed the deletion's fence yet, by tenant: the fan-out
        # still counts them, and their copies become endpoint_gone dead letters (not lost).
        self._deleting: dict[str, dict[str, StoredEndpoint]] = {}
        self._with_queues: set[str] = set()
        self.changed = False  # the sets changed since they were last saved

    def load(self, *, deleting: Iterable[str], with_queues: Iterable[str]) -> None:
        self._with_queues = set(with_queues)
        for endpoint_id in deleting:
            gone = self._rows.deleted(endpoint_id)
            if gone is not None:
                self._deleting.setdefault(gone[0].tenant, {})[endpoint_id] = gone[0]

    def sets(self) -> dict[str, list[str]]:
        return {
            "deleted_with_queues": sorted(self._with_queues),
            "deleting": sorted(i for endpoints in self._deleting.values() for i in endpoints),
        }

    def deleted(self, endpoint: StoredEndpoint, *, had_queues: bool) -> None:
        if had_queues:
            self._with_queues.add(endpoint.id)
        if endpoint.laned:
            self._deleting.setdefault(endpoint.tenant, {})[endpoint.id] = endpoint
        self.changed = True

    def created_again(self, endpoint_id: str) -> None:
        """Created again under the id of a deleted one (a notifier's id is derived from its tenant and
        URL): no longer deleted (the store forgot its deletion), so nothing drains or removes the queues
        it uses again."""
        if endpoint_id in self._with_queues:
            self._with_queues.discard(endpoint_id)
            self.changed = True

    def drained(self, tenant: str, endpoint_id: str) -> bool:
        """The deleted endpoint's lane has passed its fence; whether it was still waiting for it."""
        deleting = self._deleting.get(tenant)
        if deleting is None or deleting.pop(endpoint_id, None) is None:
            return False
        if not deleting:
            del self._deleting[tenant]
        self.changed = True
        return True

    def deleting(self, endpoint_id: str) -> bool:
        """Deleted, and its lane has not passed the deletion's fence yet."""
        return any(endpoint_id in endpoints for endpoints in self._deleting.values())

    def deleting_of_tenant(self, tenant: str) -> list[StoredEndpoint]:
        """The tenant's endpoints deleted whose lane has not passed the deletion's fence yet."""
        return list(self._deleting.get(tenant, {}).values())

    def pending(self, tenant: str) -> dict[str, StoredEndpoint]:
        """As :meth:`deleting_of_tenant`, by id, without a copy (read, never change it)."""
        return self._deleting.get(tenant, {})

    def last_known(self, endpoint_id: str) -> StoredEndpoint | None:
        """The endpoint, or its definition when it was deleted."""
        found = self._rows.get(endpoint_id)
        if found is not None:
            return found
        gone = self._rows.deleted(endpoint_id)
        return gone[0] if gone else None

    def deleted_since(self, since: datetime) -> list[StoredEndpoint]:
        """Endpoints deleted at or after ``since``."""
        found = self._rows.store.endpoints.deleted_since(seconds(since))
        return [StoredEndpoint.model_validate_json(body) for body, _ in found]

    def deleted_matching(self, tenant: str, event_type: str, *, since: datetime) -> list[StoredEndpoint]:
        """The tenant's endpoints deleted at or after ``since`` (past their fence) that an event of
        ``event_type`` would have gone to: a lane message given out again (its dispatcher died) may have
        been published before they were deleted, and what it owed them is kept as a dead letter."""
        deleted = (
            StoredEndpoint.model_validate_json(body)
            for body, _ in self._rows.store.endpoints.deleted_since(seconds(since), tenant=tenant)
        )
        return [
            endpoint
            for endpoint in deleted
            if endpoint.on_lane
            and any(topology.topic_matches(pattern, event_type) for pattern in endpoint.event_types)
        ]

    def deleted_with_queues_since(self, since: datetime) -> list[StoredEndpoint]:
        """Endpoints deleted at or after ``since`` that had queues of their own (they may still hold
        messages to drain into dead letters)."""
        found = (self._rows.deleted(endpoint_id) for endpoint_id in sorted(self._with_queues))
        return [gone for gone, at in filter(None, found) if at >= since]
