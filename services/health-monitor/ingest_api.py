"""The dashboard's and the portal's way to the ingest API: every call carries the logged-in user's own
token, or the portal session's (opening a portal link carries none: the link is its credential)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

import httpx

from hookline.shared import __version__

TIMEOUT_S = 10.0


class IngestApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class IngestApi:
    def __init__(self, base_url: str, *, timeout_s: float = TIMEOUT_S) -> None:
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=timeout_s,
            headers={"user-agent": f"hookline-dashboard/{__version__}"},
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client.aclose()

    async def call(
        self,
        token: str | None,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json: dict[str, Any] | None = None,
    ) -> Any:
        """The answer's JSON; IngestApiError naming what the ingest said (or that it did not answer)."""
        try:
            response = await self._client.request(
                method,
                path,
                params={k: v for k, v in (params or {}).items() if v},
                json=json,
                headers={"authorization": f"Bearer {token}"} if token else None,
            )
        except httpx.HTTPError as exc:
            raise IngestApiError(503, f"the ingest API did not answer ({type(exc).__name__})") from None
        if response.status_code >= 400:
            try:
                message = str(response.json()["message"])
            except (ValueError, KeyError, TypeError):
                message = response.reason_phrase
            raise IngestApiError(response.status_code, message)
        return response.json() if response.content else None
