"""Dashboard sessions: a login exchanges a token for a random session id kept in an HttpOnly cookie.

The token itself stays here, on the server, because the dashboard forwards it to the ingest: the ingest
decides what that token may see and do, so tenant scoping has one owner. Sessions live in this process
only; after a monitor restart the dashboard asks to log in again.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass

COOKIE = "hookline_session"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 10_000


@dataclass(frozen=True)
class Session:
    id: str
    token: str  # the bearer token the dashboard presents to the ingest on this user's behalf
    tenant: str | None  # None: the admin
    csrf: str  # every form carries it; a cross-site post cannot know it
    expires_at_s: float

    def may_see(self, tenant: str | None) -> bool:
        return self.tenant is None or self.tenant == tenant

    def accepts(self, csrf: str) -> bool:
        return hmac.compare_digest(csrf.encode(), self.csrf.encode())


class Sessions:
    def __init__(self, *, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def open(self, *, token: str, tenant: str | None, now_s: float) -> Session:
        session = Session(
            id=secrets.token_urlsafe(32),
            token=token,
            tenant=tenant,
            csrf=secrets.token_urlsafe(24),
            expires_at_s=now_s + self.ttl_s,
        )
        self._sessions[session.id] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)  # the oldest login goes first
        return session

    def get(self, session_id: str | None, *, now_s: float) -> Session | None:
        session = self._sessions.get(session_id or "")
        if session is not None and session.expires_at_s <= now_s:
            del self._sessions[session.id]
            return None
        return session

    def close(self, session_id: str | None) -> None:
        self._sessions.pop(session_id or "", None)

    def __len__(self) -> int:
        return len(self._sessions)
