"""``/v1/event-types``: the event-type catalog (catalog.py), and ``/v1/openapi/webhooks``, its OpenAPI 3.1
export and import. Every token reads it; only the admin token changes it (types are shared by tenants).
Changes are conditional like the endpoints' (``If-Match``, 409 when another write got there first)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Body, Header, Response
from pydantic import ValidationError

from hookline.ingest.audit import AuditTrail, Trail
from hookline.ingest.auth import Caller
from hookline.ingest.schemas import EventTypeList, EventTypeUpdate
from hookline.ingest.settings import IngestSettings
from hookline.ingest.state import Changes, Settings
from hookline.shared import __version__
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    ErrorDetail,
    EventTypeCreate,
    EventTypeDeleted,
    EventTypeInfo,
    EventTypeUpserted,
    Model,
)
from hookline.shared.runtime.api import ApiError, invalid_input
from hookline.shared.state import catalog
from hookline.shared.state.registry import ChangeLog, StaleEventTypeError

log = structlog.get_logger(__name__)
router = APIRouter(tags=["event types"])
IfMatch = Annotated[str | None, Header(description="the version (ETag) this change is based on")]


class Imported(Model):
    imported: list[str]


def _checked(spec: EventTypeCreate | EventTypeInfo) -> None:
    for version, schema in spec.schemas.items():
        try:
            catalog.compile_schema(schema)
        except catalog.SchemaError as exc:
            raise ApiError(
                422,
                "invalid_fields",
                "invalid value for: schemas",
                [ErrorDetail(field=f"schemas.{version}", message=str(exc))],
            ) from None


def _found(change_log: ChangeLog, name: str) -> EventTypeInfo:
    found = change_log.catalog.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"no event type {name!r}")
    return found


def _base_version(current: EventTypeInfo, if_match: str | None) -> int:
    if if_match is not None and if_match.strip().removeprefix("W/").strip('"') != str(current.version):
        raise ApiError(409, "event_type_changed", f"{current.name} is at version {current.version}")
    return current.version


async def _write(
    change_log: ChangeLog,
    settings: IngestSettings,
    trail: AuditTrail,
    caller: Caller,
    described: EventTypeInfo,
    *,
    base_version: int,
    response: Response,
) -> EventTypeInfo:
    record = EventTypeUpserted(
        change_id=new_id("chg"), at=datetime.now(UTC), event_type=described, base_version=base_version
    )
    try:
        written = await change_log.write_event_type(record, timeout_s=settings.registry_wait_s)
    except StaleEventTypeError as exc:
        raise ApiError(
            409, "event_type_changed", f"{described.name} changed meanwhile; read it again"
        ) from exc
    assert written is not None
    response.headers["ETag"] = f'"{written.version}"'
    log.info("event_type_written", event_type=written.name, version=written.version)
    await trail.record(
        caller, "event_type.created" if base_version == 0 else "event_type.updated", tenant=None,
        target=written.name, changes={"version": written.version, "validation": written.validation},
    )  # fmt: skip
    return written


@router.post("/v1/event-types", status_code=201, response_model=EventTypeInfo)
async def create_event_type(
    spec: EventTypeCreate,
    change_log: Changes,
    settings: Settings,
    trail: Trail,
    caller: Caller,
    response: Response,
) -> EventTypeInfo:
    caller.require_admin("change the event-type catalog")
    _checked(spec)
    if change_log.catalog.get(spec.name) is not None:
        raise ApiError(409, "event_type_exists", f"{spec.name} is in the catalog already; PATCH it")
    now = datetime.now(UTC)
    described = EventTypeInfo(**spec.model_dump(), created_at=now, updated_at=now)
    return await _write(change_log, settings, trail, caller, described, base_version=0, response=response)


@router.get("/v1/event-types", response_model=EventTypeList)
async def list_event_types(change_log: Changes, _: Caller) -> EventTypeList:
    return EventTypeList(data=change_log.catalog.all())


@router.get("/v1/event-types/{name}", response_model=EventTypeInfo)
async def get_event_type(name: str, change_log: Changes, _: Caller, response: Response) -> EventTypeInfo:
    found = _found(change_log, name)
    response.headers["ETag"] = f'"{found.version}"'
    return found


@router.patch("/v1/event-types/{name}", response_model=EventTypeInfo)
async def update_event_type(
    name: str,
    change: EventTypeUpdate,
    change_log: Changes,
    settings: Settings,
    trail: Trail,
    caller: Caller,
    response: Response,
    if_match: IfMatch = None,
) -> EventTypeInfo:
    caller.require_admin("change the event-type catalog")
    current = _found(change_log, name)
    base_version = _base_version(current, if_match)
    changes = {
        key: value for key, value in change.model_dump(exclude_unset=True).items() if value is not None
    }
    after = EventTypeInfo.model_validate({**current.model_dump(), **changes, "updated_at": datetime.now(UTC)})
    _checked(after)
    return await _write(
        change_log, settings, trail, caller, after, base_version=base_version, response=response
    )


@router.delete("/v1/event-types/{name}", status_code=204)
async def delete_event_type(
    name: str, change_log: Changes, settings: Settings, trail: Trail, caller: Caller, if_match: IfMatch = None
) -> Response:
    caller.require_admin("change the event-type catalog")
    current = _found(change_log, name)
    record = EventTypeDeleted(
        change_id=new_id("chg"),
        at=datetime.now(UTC),
        name=name,
        base_version=_base_version(current, if_match),
    )
    try:
        await change_log.write_event_type(record, timeout_s=settings.registry_wait_s)
    except StaleEventTypeError as exc:
        raise ApiError(409, "event_type_changed", f"{name} changed meanwhile; read it again") from exc
    log.info("event_type_deleted", event_type=name)
    await trail.record(caller, "event_type.deleted", tenant=None, target=name)
    return Response(status_code=204)


@router.get("/v1/openapi/webhooks")
async def export_openapi(change_log: Changes, _: Caller) -> dict[str, Any]:
    """An OpenAPI 3.1 document whose ``webhooks`` describe every type: give it to receivers' developers."""
    return catalog.to_openapi(change_log.catalog.all(), title="hookline webhooks", version=__version__)


@router.post("/v1/openapi/webhooks", response_model=Imported)
async def import_openapi(
    change_log: Changes,
    settings: Settings,
    trail: Trail,
    caller: Caller,
    response: Response,
    document: Annotated[dict[str, Any], Body()],
) -> Imported:
    """Create or replace the types an OpenAPI 3.1 document's ``webhooks`` describe (all checked first:
    one bad type and nothing is imported)."""
    caller.require_admin("change the event-type catalog")
    try:
        bodies = catalog.from_openapi(document)
    except (ValueError, AttributeError) as exc:
        raise ApiError(
            422,
            "invalid_fields",
            "invalid value for: webhooks",
            [ErrorDetail(field="webhooks", message=f"not an OpenAPI 3.1 webhooks document: {exc}")],
        ) from None
    specs = []
    for body in bodies:
        try:
            spec = EventTypeCreate.model_validate(body)
        except ValidationError as exc:
            raise invalid_input(exc.errors()) from None
        _checked(spec)
        specs.append(spec)
    now = datetime.now(UTC)
    for spec in specs:
        current = change_log.catalog.get(spec.name)
        described = EventTypeInfo(
            **spec.model_dump(), created_at=current.created_at if current else now, updated_at=now
        )
        await _write(
            change_log,
            settings,
            trail,
            caller,
            described,
            base_version=current.version if current else 0,
            response=response,
        )
    return Imported(imported=[spec.name for spec in specs])
