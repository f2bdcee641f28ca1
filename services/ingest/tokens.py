"""``/v1/tokens`` (admin): tenants' API tokens as data — created (the token shown once), listed by
prefix, given an expiry, revoked. Kept hashed in the change log: every ingest replica accepts a new
token, and refuses a revoked or expired one, as soon as the record is written."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import AwareDatetime, Field

from hookline.ingest.audit import Trail
from hookline.ingest.auth import Caller
from hookline.ingest.state import Changes, Settings
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import ErrorDetail, Model, PortalGrant, StoredToken, Tenant
from hookline.shared.runtime.api import ApiError
from hookline.shared.state import tenants
from hookline.shared.state.notifications import OPERATOR_TENANT
from hookline.shared.state.registry import ChangeLog

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


class TokenCreate(Model):
    tenant: Tenant
    expires_at: AwareDatetime | None = None
    description: str = Field("", max_length=200)


class TokenUpdate(Model):
    expires_at: AwareDatetime | None = Field(description="when it stops working (now or earlier: at once)")


class TokenInfo(Model):
    id: str
    tenant: str
    prefix: str
    description: str
    created_at: AwareDatetime
    expires_at: AwareDatetime | None
    revoked_at: AwareDatetime | None
    portal: PortalGrant | None = None  # a customer portal's link or session (revoking a session ends it)
    active: bool

    @classmethod
    def of(cls, token: StoredToken, now: datetime) -> TokenInfo:
        return cls(
            **token.model_dump(exclude={"digest"}),
            active=tenants.active(token, now),
        )


class TokenCreated(TokenInfo):
    token: str = Field(description="shown this once: only its SHA-256 is kept")


class TokenList(Model):
    data: list[TokenInfo]


def _stored(change_log: ChangeLog, token_id: str) -> StoredToken:
    token = change_log.tenants.token(token_id)
    if token is None:
        raise ApiError(404, "not_found", f"no token {token_id}")
    return token


@router.post("", status_code=201, response_model=TokenCreated)
async def create_token(
    spec: TokenCreate, change_log: Changes, settings: Settings, trail: Trail, caller: Caller
) -> TokenCreated:
    caller.require_admin("create tokens")
    if spec.tenant == OPERATOR_TENANT:
        # Its endpoints are the notifiers, which hold every tenant's notify_url.
        problem = f"tenant {OPERATOR_TENANT!r} is hookline's own"
        raise ApiError(422, "invalid_fields", problem, [ErrorDetail(field="tenant", message=problem)])
    now = datetime.now(UTC)
    secret, prefix, digest = tenants.new_token()
    stored = await change_log.write_token(
        StoredToken(
            id=new_id("tok"),
            tenant=spec.tenant,
            prefix=prefix,
            digest=digest,
            description=spec.description,
            created_at=now,
            expires_at=spec.expires_at,
        ),
        timeout_s=settings.registry_wait_s,
    )
    await trail.record(
        caller, "token.created", tenant=stored.tenant, target=stored.id,
        changes={"prefix": stored.prefix, "expires_at": stored.expires_at, "description": stored.description},
    )  # fmt: skip
    return TokenCreated(**TokenInfo.of(stored, now).model_dump(), token=secret)


@router.get("", response_model=TokenList)
async def list_tokens(
    change_log: Changes, caller: Caller, tenant: Annotated[str | None, Query()] = None
) -> TokenList:
    caller.require_admin("list tokens")
    now = datetime.now(UTC)
    listed = sorted(change_log.tenants.tokens(tenant), key=lambda t: t.created_at)
    return TokenList(data=[TokenInfo.of(token, now) for token in listed])


@router.patch("/{token_id}", response_model=TokenInfo)
async def expire_token(
    token_id: str, change: TokenUpdate, change_log: Changes, settings: Settings, trail: Trail, caller: Caller
) -> TokenInfo:
    caller.require_admin("change tokens")
    before = _stored(change_log, token_id)
    after = await change_log.write_token(
        before.model_copy(update={"expires_at": change.expires_at}), timeout_s=settings.registry_wait_s
    )
    await trail.record(
        caller, "token.expiry_set", tenant=after.tenant, target=after.id,
        changes={"expires_at": {"from": before.expires_at, "to": after.expires_at}},
    )  # fmt: skip
    return TokenInfo.of(after, datetime.now(UTC))


@router.delete("/{token_id}", status_code=204)
async def revoke_token(
    token_id: str, change_log: Changes, settings: Settings, trail: Trail, caller: Caller
) -> Response:
    caller.require_admin("revoke tokens")
    before = _stored(change_log, token_id)
    if before.revoked_at is None:
        after = await change_log.write_token(
            before.model_copy(update={"revoked_at": datetime.now(UTC)}),
            timeout_s=settings.registry_wait_s,
        )
        await trail.record(caller, "token.revoked", tenant=after.tenant, target=after.id)
    return Response(status_code=204)
