"""The customer portal's credentials. ``POST /v1/portal/sessions`` (the admin, or a tenant's token for
its tenant) makes a link for one tenant, optionally limited to some endpoints or read-only, that the
operator's page shows in an iframe; ``POST /v1/portal/open`` exchanges the link, once, for a session
token that the portal's pages (the health monitor's ``/portal/``) present to this API as a bearer.

Both are records of the change log, kept as their SHA-256 as tenant tokens are: every ingest replica
accepts a session as soon as it is written, and whichever monitor serves a page, it only forwards the
session. A link's session has the link's id (``pll_X`` opens ``pls_X``), so when two openings race, the
change log's order decides: the session recorded first holds and the other is refused. A session ends
when the link would have expired (the operator's page asks for a new link at each visit), or when the
admin revokes it (``DELETE /v1/tokens/pls_…``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import structlog
from fastapi import APIRouter
from pydantic import AwareDatetime, Field

from hookline.ingest.audit import Trail
from hookline.ingest.auth import Caller, Principal
from hookline.ingest.state import Changes, Registry, Settings
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import ErrorDetail, Model, PortalGrant, StoredToken, Tenant
from hookline.shared.runtime.api import ApiError
from hookline.shared.state import tenants

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/portal", tags=["portal"])  # behind the API's tokens
open_router = APIRouter(prefix="/v1/portal", tags=["portal"])  # the link is its own credential

LINK_REFUSED = "this portal link is not valid: it has expired, or it was never issued"


class PortalLinkRequest(Model):
    tenant: Tenant
    endpoint_ids: list[str] | None = Field(
        None, min_length=1, max_length=100, description="only these endpoints; omitted: all the tenant's"
    )
    read_only: bool = False
    expires_in_s: int = Field(
        3600, ge=60, le=7 * 86_400, description="the link opens until then, and its session ends then"
    )


class PortalLink(Model):
    id: str = Field(description="the link's; the session it opens is pls_ with the same suffix")
    url: str = Field(description="works once: show it in an iframe, or open it")
    expires_at: AwareDatetime


class PortalOpen(Model):
    link: str = Field(max_length=200, description="the link's token (the last part of its url)")


class PortalSession(Model):
    session: str = Field(description="the bearer token of the session's requests")
    tenant: str
    expires_at: AwareDatetime
    grant: PortalGrant


@router.post("/sessions", status_code=201, response_model=PortalLink)
async def create_link(
    spec: PortalLinkRequest,
    change_log: Changes,
    registry: Registry,
    settings: Settings,
    trail: Trail,
    caller: Caller,
) -> PortalLink:
    caller.require(spec.tenant)
    for endpoint_id in spec.endpoint_ids or ():
        endpoint = registry.get(endpoint_id)
        if endpoint is None or endpoint.tenant != spec.tenant:
            problem = f"no endpoint {endpoint_id!r} of tenant {spec.tenant}"
            raise ApiError(
                422,
                "invalid_fields",
                f"endpoint_ids: {problem}",
                [ErrorDetail(field="endpoint_ids", message=problem)],
            )
    now = datetime.now(UTC)
    secret, prefix, digest = tenants.new_token(tenants.PORTAL_LINK_PREFIX)
    link = await change_log.write_token(
        StoredToken(
            id=new_id("pll"),
            tenant=spec.tenant,
            prefix=prefix,
            digest=digest,
            description="customer portal link",
            created_at=now,
            expires_at=now + timedelta(seconds=spec.expires_in_s),
            portal=PortalGrant(role="link", endpoint_ids=spec.endpoint_ids, read_only=spec.read_only),
        ),
        timeout_s=settings.registry_wait_s,
    )
    await trail.record(
        caller, "portal.link_created", tenant=spec.tenant, target=link.id,
        changes={"endpoint_ids": spec.endpoint_ids, "read_only": spec.read_only, "expires_at": link.expires_at},
    )  # fmt: skip
    assert link.expires_at is not None
    return PortalLink(
        id=link.id, url=f"{settings.portal_url.rstrip('/')}/portal/open/{secret}", expires_at=link.expires_at
    )


@open_router.post("/open", response_model=PortalSession)
async def open_link(spec: PortalOpen, change_log: Changes, settings: Settings, trail: Trail) -> PortalSession:
    now = datetime.now(UTC)
    link = change_log.tenants.authenticate(spec.link, now)
    if link is None or link.portal is None or link.portal.role != "link" or link.expires_at is None:
        raise ApiError(401, "unauthorized", LINK_REFUSED)
    session_id = "pls_" + link.id.removeprefix("pll_")
    if change_log.tenants.token(session_id) is not None:
        raise ApiError(410, "link_used", "this portal link was opened already: ask for a new one")
    secret, prefix, digest = tenants.new_token(tenants.PORTAL_SESSION_PREFIX)
    grant = link.portal.model_copy(update={"role": "session"})
    session = await change_log.write_token(
        StoredToken(
            id=session_id, tenant=link.tenant, prefix=prefix, digest=digest,
            description="customer portal session", created_at=now, expires_at=link.expires_at, portal=grant,
        ),
        timeout_s=settings.registry_wait_s,
    )  # fmt: skip
    if session.digest != digest:  # another opening of the link was recorded first
        raise ApiError(410, "link_used", "this portal link was opened already: ask for a new one")
    await trail.record(
        Principal(link.tenant, f"portal:{session_id}", grant), "portal.link_used", tenant=link.tenant,
        target=link.id,
    )  # fmt: skip
    log.info("portal_session_opened", tenant=link.tenant, session_id=session_id)
    return PortalSession(session=secret, tenant=link.tenant, expires_at=link.expires_at, grant=grant)
