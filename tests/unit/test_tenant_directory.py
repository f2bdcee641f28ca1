"""Tokens and quotas as the change log applies them (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hookline.shared.contracts.models import PortalGrant, QuotaSet, StoredToken, TenantQuota, TokenUpserted
from hookline.shared.state.tenants import (
    NO_QUOTA,
    PORTAL_LINK_PREFIX,
    PORTAL_SESSION_PREFIX,
    Tenants,
    digest,
    new_token,
)

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def stored(token: str, **fields: object) -> StoredToken:
    return StoredToken.model_validate(
        {"id": "tok_01JD0000000000000000000000", "tenant": "acme", "prefix": token[:12], "digest": digest(token),
         "created_at": NOW, **fields}
    )  # fmt: skip


def upserted(token: StoredToken) -> TokenUpserted:
    return TokenUpserted(change_id="chg_1", at=NOW, token=token)


def test_a_token_authenticates_until_it_expires_or_is_revoked() -> None:
    secret, prefix, _ = new_token()
    assert secret.startswith(prefix)
    tenants = Tenants()
    tenants.apply(upserted(stored(secret, expires_at=NOW + timedelta(hours=1))))
    assert tenants.authenticate(secret, NOW) is not None
    assert tenants.authenticate(secret + "x", NOW) is None
    assert tenants.authenticate(secret, NOW + timedelta(hours=1)) is None, "expired"
    tenants.apply(upserted(stored(secret, revoked_at=NOW)))
    assert tenants.authenticate(secret, NOW) is None, "revoked"


def test_a_revocation_is_not_undone_by_a_write_from_an_older_copy() -> None:
    secret, _, _ = new_token()
    tenants = Tenants()
    tenants.apply(upserted(stored(secret)))
    tenants.apply(upserted(stored(secret, revoked_at=NOW)))
    # Another replica, which had not applied the revocation yet, sets an expiry on its old copy.
    after = tenants.apply(upserted(stored(secret, expires_at=NOW + timedelta(days=30))))
    assert isinstance(after, StoredToken)
    assert after.revoked_at == NOW
    assert after.expires_at == NOW + timedelta(days=30)
    assert tenants.authenticate(secret, NOW + timedelta(seconds=1)) is None


def test_quotas_default_to_none() -> None:
    tenants = Tenants()
    assert tenants.quota("acme") == NO_QUOTA
    tenants.apply(QuotaSet(change_id="chg_2", at=NOW, tenant="acme", quota=TenantQuota(max_endpoints=3)))
    assert tenants.quota("acme").max_endpoints == 3
    assert tenants.quota("beta") == NO_QUOTA


def test_a_portal_link_opens_one_session_the_first_recorded() -> None:
    link, _, _ = new_token(PORTAL_LINK_PREFIX)
    first, second = new_token(PORTAL_SESSION_PREFIX)[0], new_token(PORTAL_SESSION_PREFIX)[0]
    grant = PortalGrant(role="session", endpoint_ids=["ep_1"], read_only=True)
    session_id = "pls_01JD0000000000000000000000"
    tenants = Tenants()
    tenants.apply(upserted(stored(link, id="pll_01JD0000000000000000000000", portal={"role": "link"})))
    assert tenants.authenticate(link, NOW) is not None  # found; the ingest refuses it as a bearer
    kept = tenants.apply(upserted(stored(first, id=session_id, portal=grant)))
    # A second opening, recorded later by another replica, writes a session of the same id: void.
    raced = tenants.apply(upserted(stored(second, id=session_id, portal=grant)))
    assert raced == kept
    assert tenants.authenticate(second, NOW) is None
    found = tenants.authenticate(first, NOW)
    assert found is not None
    assert found.portal == grant
    # Revoking it (the same digest) still applies.
    tenants.apply(upserted(stored(first, id=session_id, portal=grant, revoked_at=NOW)))
    assert tenants.authenticate(first, NOW) is None
