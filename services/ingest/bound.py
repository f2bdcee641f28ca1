"""The tenant patterns this ingest has bound on their lanes and that have stayed needed since: binding
one again is skipped (a registration of a tenant's twentieth endpoint on the same events binds nothing).

The leading monitor unbinds a pattern only once none of its tenant's endpoints has named it for a while
(bindings.py in the monitor); a pattern that stops being needed here, in this replica's view of the
change log, is forgotten at once, so the next endpoint naming it binds it again. An endpoint being
created on another replica at that moment binds it itself (each ingest binds what it has not bound).
"""

from __future__ import annotations

from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state.registry import EndpointRegistry


class BoundPatterns:
    def __init__(self, registry: EndpointRegistry) -> None:
        self._registry = registry
        self._bound: set[tuple[str, str]] = set()

    def unbound(self, tenant: str, patterns: list[str]) -> list[str]:
        """Of ``patterns``, those this ingest has not bound for ``tenant`` since they were last needed."""
        return [pattern for pattern in patterns if (tenant, pattern) not in self._bound]

    def bound(self, tenant: str, patterns: list[str]) -> None:
        self._bound.update((tenant, pattern) for pattern in patterns)

    def on_change(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        """A registry listener: a pattern its tenant no longer needs is forgotten."""
        del after  # a pattern named anew is bound by the request that names it
        if before is None:
            return
        still = self._registry.subscriptions.patterns_needed(before.tenant)
        for pattern in before.event_types:
            if pattern not in still:
                self._bound.discard((before.tenant, pattern))
