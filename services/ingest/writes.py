"""Conditional writes of an endpoint and the checks before them: a target hookline may call, the
endpoint's credentials, the version a change is based on (``If-Match``), and the 409 when another
write got there first."""

from __future__ import annotations

from typing import Any

import structlog

from hookline.ingest.schemas import (
    EndpointCreate,
    EndpointUpdate,
)
from hookline.ingest.settings import IngestSettings
from hookline.ingest.state import IngestState
from hookline.shared.contracts.models import (
    ErrorDetail,
    MtlsAuth,
    OAuth2ClientCredentials,
    StoredEndpoint,
)
from hookline.shared.outbound import credentials
from hookline.shared.outbound.targets import registration_refusal
from hookline.shared.runtime.api import ApiError
from hookline.shared.state.registry import StaleWriteError

log = structlog.get_logger(__name__)


def invalid(field: str, message: str) -> ApiError:
    return ApiError(
        422, "invalid_fields", f"invalid value for: {field}", [ErrorDetail(field=field, message=message)]
    )


async def check_target(url: str, settings: IngestSettings, field: str = "url") -> None:
    """Refuse, naming the reason, a URL hookline would not call (scheme, private or reserved addresses)."""
    refusal = await registration_refusal(
        url, allow_http=settings.allow_http, allow_private=settings.allow_private_targets
    )
    if refusal is not None:
        raise invalid(field, refusal)


async def endpoint_credentials(
    state: IngestState, fields: dict[str, Any], given: EndpointCreate | EndpointUpdate
) -> dict[str, Any]:
    """The stored form of the headers and auth in ``fields`` (those present), checked and sealed."""
    stored: dict[str, Any] = {}
    if "headers" in fields:
        stored |= credentials.stored_headers(state.sealer, given.headers)
    if "auth" in fields:
        auth = given.auth
        if isinstance(auth, OAuth2ClientCredentials):
            await check_target(auth.token_url, state.settings, "auth.token_url")
        if isinstance(auth, MtlsAuth) and (problem := credentials.certificate_problem(auth)) is not None:
            raise invalid("auth", problem)
        stored |= credentials.stored_auth(state.sealer, auth)
    return stored


def base_version(endpoint: StoredEndpoint, if_match: str | None) -> int:
    """The version a change is based on: the caller's ``If-Match`` (``"3"``, ``3`` or ``W/"3"``), or the
    version this request read."""
    if if_match is None:
        return endpoint.version
    text = if_match.strip().removeprefix("W/").strip('"')
    if not text.isascii() or not text.isdigit():
        raise ApiError(400, "invalid_if_match", "If-Match must be an endpoint version, as in its ETag")
    if int(text) != endpoint.version:
        raise changed(endpoint)
    return endpoint.version


def changed(current: StoredEndpoint | None) -> ApiError:
    if current is None:
        return ApiError(404, "not_found", "the endpoint was deleted meanwhile")
    return ApiError(
        409,
        "endpoint_changed",
        f"the endpoint changed meanwhile (now at version {current.version}); read it again and retry",
    )


async def write(state: IngestState, endpoint: StoredEndpoint, base_version: int) -> StoredEndpoint:
    try:
        return await state.change_log.upsert(
            endpoint, base_version=base_version, timeout_s=state.settings.registry_wait_s
        )
    except StaleWriteError as exc:
        raise changed(exc.current) from None
