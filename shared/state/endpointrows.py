"""The endpoints themselves, as the change log left them: rows of a
:class:`~hookline.shared.state.registrystore.RegistryStore` (a file, or memory), with the parsed ones a
process uses kept in two bounded caches: by id, and by tenant (what the fan-out reads: a lane message
is matched against its tenant's endpoints)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state import notifications
from hookline.shared.state.registrystore import RegistryStore

#: Parsed endpoints kept by id, and by tenant (their sum): a few KiB each.
CACHED_ENDPOINTS = 10_000
CACHED_TENANT_ENDPOINTS = 20_000


class EndpointRows:
    def __init__(self, store: RegistryStore, *, on_evicted: Callable[[str], None]) -> None:
        """``on_evicted``: called with a tenant whose endpoints left the cache (what was derived from
        them goes too)."""
        self.store = store
        self._on_evicted = on_evicted
        self.count = 0
        self._by_id: OrderedDict[str, StoredEndpoint] = OrderedDict()  # parsed, least recently used first
        self._by_tenant: OrderedDict[str, dict[str, StoredEndpoint]] = OrderedDict()
        self._by_tenant_size = 0

    def get(self, endpoint_id: str) -> StoredEndpoint | None:
        found = self._by_id.get(endpoint_id)
        if found is not None:
            self._by_id.move_to_end(endpoint_id)
            return found
        body = self.store.endpoints.endpoint(endpoint_id)
        if body is None:
            return None
        found = StoredEndpoint.model_validate_json(body)
        self._cache(found)
        return found

    def _cache(self, endpoint: StoredEndpoint) -> None:
        self._by_id[endpoint.id] = endpoint
        self._by_id.move_to_end(endpoint.id)
        while len(self._by_id) > CACHED_ENDPOINTS:
            self._by_id.popitem(last=False)

    def deleted(self, endpoint_id: str) -> tuple[StoredEndpoint, datetime] | None:
        """A deleted endpoint's last definition and when it was deleted."""
        found = self.store.endpoints.deleted(endpoint_id)
        if found is None:
            return None
        return StoredEndpoint.model_validate_json(found[0]), datetime.fromtimestamp(found[1], UTC)

    def every(self, *, unlaned_only: bool = False) -> Iterator[StoredEndpoint]:
        """Every endpoint in id order (or those not moved onto their lane yet), read a batch at a time."""
        for body in self.store.endpoints.every(unlaned_only=unlaned_only):
            yield StoredEndpoint.model_validate_json(body)

    def page(self, *, tenant: str | None, after: str | None, limit: int) -> list[StoredEndpoint]:
        """Endpoints in id order (creation order: ids are ULIDs) after ``after``."""
        return [
            StoredEndpoint.model_validate_json(body)
            for body in self.store.endpoints.page(tenant=tenant, after=after, limit=limit)
        ]

    def all(self) -> list[StoredEndpoint]:
        """Every endpoint, parsed at once: for what needs them all (a backup, a test); a service walks
        :meth:`every` or asks for what it needs."""
        return list(self.every())

    def of_tenant(self, tenant: str) -> list[StoredEndpoint]:
        return list(self.tenant_map(tenant).values())

    def tenants(self) -> list[str]:
        return self.store.endpoints.tenants()

    def notifier_named(self, notifier_id: str) -> bool:
        """Whether an endpoint names this notifier (:func:`hookline.shared.state.notifications.notifier_of`)."""
        return self.store.endpoints.named(notifier_id)

    def count_of_tenant(self, tenant: str) -> int:
        cached = self._by_tenant.get(tenant)
        return len(cached) if cached is not None else self.store.endpoints.count(tenant)

    def tenant_map(self, tenant: str) -> dict[str, StoredEndpoint]:
        """The tenant's endpoints by id (the cache itself: read, never change it)."""
        cached = self._by_tenant.get(tenant)
        if cached is not None:
            self._by_tenant.move_to_end(tenant)
            return cached
        cached = {}
        for body in self.store.endpoints.of_tenant(tenant):
            endpoint = StoredEndpoint.model_validate_json(body)
            cached[endpoint.id] = self._by_id.get(endpoint.id, endpoint)
        self._by_tenant[tenant] = cached
        self._by_tenant_size += len(cached)
        while self._by_tenant_size > CACHED_TENANT_ENDPOINTS and len(self._by_tenant) > 1:
            evicted, endpoints = self._by_tenant.popitem(last=False)
            self._by_tenant_size -= len(endpoints)
            self._on_evicted(evicted)
        return cached

    def put(self, before: StoredEndpoint | None, after: StoredEndpoint) -> None:
        self.store.endpoints.put(
            after.id,
            after.tenant,
            notifications.notifier_of(after),
            after.laned,
            after.model_dump_json().encode(),
        )
        self.count += before is None
        self._cache(after)
        if before is not None and before.tenant != after.tenant:
            self._leave_tenant(before)
        cached = self._by_tenant.get(after.tenant)
        if cached is not None:
            self._by_tenant_size += after.id not in cached
            cached[after.id] = after

    def remove(self, before: StoredEndpoint, at: datetime) -> None:
        self.store.endpoints.delete(before.id, before.tenant, seconds(at), before.model_dump_json().encode())
        self.count -= 1
        self._by_id.pop(before.id, None)
        self._leave_tenant(before)

    def _leave_tenant(self, endpoint: StoredEndpoint) -> None:
        cached = self._by_tenant.get(endpoint.tenant)
        if cached is not None and cached.pop(endpoint.id, None) is not None:
            self._by_tenant_size -= 1


def seconds(at: datetime) -> float:
    return at.timestamp() if at.year > 1 else 0.0
