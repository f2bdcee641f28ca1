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
from hookline.shared.api import ApiError
from hookline.shared.bearer import UNAUTHORIZED_MESSAGE
from hookline.shared.models import Model


@dataclass(frozen=True)
class Principal:
    tenant: str | None  # None: the admin
    # Who, in the audit trail: "admin", "token:<id>" (a token of /v1/tokens) or "env:<tenant>"
    # (HOOKLINE_TENANT_TOKENS).
    actor: str = "admin"

    def may_see(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant

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
    if stored is not None:
        return Principal(tenant=stored.tenant, actor=f"token:{stored.id}")
    return Principal(tenant=tenant, actor=f"env:{tenant}")


Caller = Annotated[Principal, Depends(principal)]


router = APIRouter(tags=["auth"])


class Identity(Model):
    admin: bool
    tenant: str | None  # the tenant a tenant token is limited to; None for the admin


@router.get("/v1/whoami", response_model=Identity)
async def whoami(caller: Caller) -> Identity:
    """Who this token is: the dashboard asks at login, so that tokens are checked in one place."""
    return Identity(admin=caller.tenant is None, tenant=caller.tenant)
