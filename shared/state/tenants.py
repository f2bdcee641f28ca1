"""Tenants' API tokens and quotas, as of the last change-log record applied.

Tokens and quotas are records of the endpoint change log (:mod:`registry`), so every ingest replica
applies a new token, a revocation or a quota as soon as it is written, and knows them all again after a
restart. A token is kept as its SHA-256 only: a token is 256 random bits, so its digest cannot be
reversed, and the log (which every service reads) holds nothing that authenticates.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from datetime import datetime

from hookline.shared.contracts.models import QuotaSet, StoredToken, TenantQuota, TokenUpserted

TOKEN_PREFIX = "hlt_"  # noqa: S105 (what tokens start with, not one)
PORTAL_LINK_PREFIX = "hlpl_"
PORTAL_SESSION_PREFIX = "hlps_"
NO_QUOTA = TenantQuota()
_SHOWN_CHARS = 8  # after the prefix


def new_token(prefix: str = TOKEN_PREFIX) -> tuple[str, str, str]:
    """A fresh token: (the token, shown once; its prefix, listed; its digest, stored)."""
    token = prefix + secrets.token_urlsafe(32)
    return token, token[: len(prefix) + _SHOWN_CHARS], digest(token)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def active(token: StoredToken, now: datetime) -> bool:
    return token.revoked_at is None and (token.expires_at is None or now < token.expires_at)


class Tenants:
    def __init__(self) -> None:
        self._tokens: dict[str, StoredToken] = {}
        self._by_digest: dict[str, str] = {}
        self._quotas: dict[str, TenantQuota] = {}

    def apply(self, record: TokenUpserted | QuotaSet) -> StoredToken | TenantQuota:
        if isinstance(record, QuotaSet):
            self._quotas[record.tenant] = record.quota
            return record.quota
        token = record.token
        earlier = self._tokens.get(token.id)
        if earlier is not None and earlier.digest != token.digest:
            # A portal link opened twice at once: the session recorded first holds, the other is void.
            return earlier
        if earlier is not None and earlier.revoked_at is not None:
            # Revoked for good: a later write based on a copy from before the revocation (another
            # replica's PATCH of the expiry) cannot bring it back.
            token = token.model_copy(
                update={"revoked_at": min(earlier.revoked_at, token.revoked_at or earlier.revoked_at)}
            )
        self._tokens[token.id] = token
        self._by_digest[token.digest] = token.id
        return token

    def restore(self, tokens: Iterable[StoredToken], quotas: Mapping[str, TenantQuota]) -> None:
        """What a registry's store kept (the state of the change log up to its offset)."""
        for token in tokens:
            self._tokens[token.id] = token
            self._by_digest[token.digest] = token.id
        self._quotas.update(quotas)

    def authenticate(self, presented: str, now: datetime) -> StoredToken | None:
        """The active token ``presented`` is, if any."""
        if not presented.startswith((TOKEN_PREFIX, PORTAL_LINK_PREFIX, PORTAL_SESSION_PREFIX)):
            return None
        found = self._tokens.get(self._by_digest.get(digest(presented), ""))
        # Looked up by digest; compared in constant time all the same.
        if found is None or not hmac.compare_digest(found.digest, digest(presented)):
            return None
        return found if active(found, now) else None

    def token(self, token_id: str) -> StoredToken | None:
        return self._tokens.get(token_id)

    def tokens(self, tenant: str | None = None) -> list[StoredToken]:
        return [t for t in self._tokens.values() if tenant is None or t.tenant == tenant]

    def quota(self, tenant: str) -> TenantQuota:
        return self._quotas.get(tenant, NO_QUOTA)

    def quotas(self) -> dict[str, TenantQuota]:
        """Every quota set, by tenant (a backup's)."""
        return dict(self._quotas)
