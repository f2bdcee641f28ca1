"""Who is calling: the admin token sees everything; a tenant token sees and publishes for its tenant only.

Tenant tokens are data (``/v1/tokens``, kept hashed in the change log); ``HOOKLINE_TENANT_TOKENS`` stays
as a bootstrap. Tokens are compared in constant time, each of them, whatever matches first.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from hookline.ingest.state import State
from hookline.shared.contracts.models import Model, PortalGrant, StoredEndpoint
from hookline.shared.runtime.api import ApiError
from hookline.shared.runtime.bearer import UNAUTHORIZED_MESSAGE
from hookline.shared.state.registry import EndpointRegistry

#: What a customer portal session may call (method, route): its tenant's endpoints, their deliveries and
#: dead letters, and the event-type catalog; never publishing, tokens, quotas or the catalog's writes.
PORTAL_ROUTES = frozenset(
    {
        ("GET", "/v1/whoami"),
        ("GET", "/v1/event-types"),
        ("GET", "/v1/event-types/{name}"),
        ("GET", "/v1/endpoints"),
        ("POST", "/v1/endpoints"),
        ("GET", "/v1/endpoints/{endpoint_id}"),
        ("PATCH", "/v1/endpoints/{endpoint_id}"),
        ("DELETE", "/v1/endpoints/{endpoint_id}"),
        ("GET", "/v1/endpoints/{endpoint_id}/secret"),
        ("GET", "/v1/endpoints/{endpoint_id}/attempts"),
        *(
            ("POST", f"/v1/endpoints/{{endpoint_id}}/{action}")
            for action in ("verify", "rotate-secret", "pause", "resume", "replay", "test")
        ),
        ("POST", "/v1/endpoints/{endpoint_id}/filter/test"),
        ("POST", "/v1/filters/test"),
        ("POST", "/v1/transforms/test"),
        ("GET", "/v1/events"),
        ("GET", "/v1/events/{event_id}"),
        ("POST", "/v1/events/{event_id}/resend"),
        ("GET", "/v1/dead-letters"),
        ("POST", "/v1/dead-letters/redrive"),
    }
)
#: A read-only session may not reveal a signing secret either, though it is a GET.
_PORTAL_CHANGES = frozenset(key for key in PORTAL_ROUTES if key[0] != "GET" or key[1].endswith("/secret"))


@dataclass(frozen=True)
class Principal:
    tenant: str | None  # None: the admin
    # Who, in the audit trail: "admin", "token:<id>" (a token of /v1/tokens), "env:<tenant>"
    # (HOOKLINE_TENANT_TOKENS) or "portal:<session id>" (a customer portal session).
    actor: str = "admin"
    portal: PortalGrant | None = None  # a portal session's limits

    def may_see(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant

    def endpoint(self, registry: EndpointRegistry, endpoint_id: str) -> StoredEndpoint:
        """The endpoint, if this caller may see it; another tenant's is "not found" (404): its existence
        is not theirs to know."""
        endpoint = registry.get(endpoint_id)
        if endpoint is None or not self.may_see(endpoint.tenant):
            raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
        return endpoint

    def sees_endpoint(self, endpoint_id: str | None) -> bool:
        """Within a portal session limited to some endpoints, whether this is one of them."""
        grant = self.portal
        return grant is None or grant.endpoint_ids is None or endpoint_id in grant.endpoint_ids

    def require(self, tenant: str) -> None:
        """Refuse a request about another tenant's data (403)."""
        if not self.may_see(tenant):
            raise ApiError(403, "forbidden", f"this token is for tenant {self.tenant!r}, not {tenant!r}")

    def require_admin(self, what: str) -> None:
        """Refuse what only the admin may do (403)."""
        if self.tenant is not None:
            raise ApiError(403, "forbidden", f"only the admin token may {what}")

    def scope(self, tenant: str | None) -> str | None:
        """The tenant a listing is limited to: the token's own, or the filter the admin asked for."""
        if self.tenant is None:
            return tenant
        self.require(tenant or self.tenant)
        return self.tenant


def parse_tenant_tokens(setting: str | None) -> dict[str, str]:
    """``acme:tok1,globex:tok2`` → {token: tenant}."""
    tokens: dict[str, str] = {}
    for pair in (setting or "").split(","):
        if pair.strip():
            tenant, _, token = pair.strip().partition(":")
            if not tenant or len(token) < 16:
                raise ValueError(
                    "HOOKLINE_TENANT_TOKENS takes tenant:token pairs with tokens of 16+ characters"
                )
            tokens[token] = tenant
    return tokens


def principal(request: Request, state: State) -> Principal:
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    presented = presented.strip()
    offered = presented.encode()
    admin = hmac.compare_digest(offered, state.settings.api_token.get_secret_value().encode())
    tenant = None
    for token, owner in state.tenant_tokens.items():
        if hmac.compare_digest(offered, token.encode()):
            tenant = owner
    stored = state.change_log.tenants.authenticate(presented, datetime.now(UTC))
    if scheme.lower() != "bearer" or not (admin or tenant or stored):
        raise ApiError(401, "unauthorized", UNAUTHORIZED_MESSAGE)
    if admin:
        return Principal(tenant=None)
    if stored is not None and stored.portal is not None:
        if stored.portal.role != "session":  # a link opens a session; it is no API credential
            raise ApiError(401, "unauthorized", UNAUTHORIZED_MESSAGE)
        return _admitted(request, Principal(stored.tenant, f"portal:{stored.id}", stored.portal))
    if stored is not None:
        return Principal(tenant=stored.tenant, actor=f"token:{stored.id}")
    return Principal(tenant=tenant, actor=f"env:{tenant}")


def _admitted(request: Request, caller: Principal) -> Principal:
    """A portal session's request, if its grant allows it: the routes of PORTAL_ROUTES, nothing that
    changes anything when read-only, and only its endpoints when limited to some (others: 404, as if
    they did not exist). Listings that span endpoints filter with ``sees_endpoint``."""
    route = request.scope.get("route")
    key = (request.method, str(getattr(route, "path", "")))
    if key not in PORTAL_ROUTES:
        raise ApiError(403, "forbidden", f"a portal session may not call {key[0]} {key[1]}")
    if caller.portal is not None and caller.portal.read_only and key in _PORTAL_CHANGES:
        raise ApiError(403, "forbidden", "this portal session is read-only")
    endpoint_id = request.path_params.get("endpoint_id")
    if endpoint_id is not None and not caller.sees_endpoint(endpoint_id):
        raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
    if key == ("POST", "/v1/endpoints") and not caller.sees_endpoint(None):
        raise ApiError(403, "forbidden", "this portal session is limited to the endpoints it was opened for")
    return caller


Caller = Annotated[Principal, Depends(principal)]


router = APIRouter(tags=["auth"])


class Identity(Model):
    admin: bool
    tenant: str | None  # the tenant a tenant token is limited to; None for the admin
    portal: PortalGrant | None = None  # a portal session's limits


@router.get("/v1/whoami", response_model=Identity)
async def whoami(caller: Caller) -> Identity:
    """Who this token is: the dashboard asks at login and the portal at each page, so that tokens are
    checked in one place."""
    return Identity(admin=caller.tenant is None, tenant=caller.tenant, portal=caller.portal)
