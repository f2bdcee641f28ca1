"""The event-type catalog: the types upstreams publish, with a description, example data, a deprecation
flag and a JSON Schema (2020-12) of ``data`` per ``schema_version``.

Kept in the endpoint change log beside the endpoints (records ``event_type.upserted`` and
``event_type.deleted``), so every service knows the same catalog the same way. Validation is per type:
``off``, ``warn`` (accepted; the answer and the log say what is wrong) or ``enforce`` (the ingest answers
422 naming the JSON pointer; an event published straight to AMQP becomes an ``invalid_event`` dead letter
naming it). Schemas are compiled once per type version, and may not refer to anything outside
themselves: fetching a ``$ref`` from a URL would let a schema make hookline call any address.

The catalog also exports and imports an OpenAPI 3.1 document whose ``webhooks`` describe the types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema_rs

from hookline.shared.broker import topology
from hookline.shared.contracts.models import (
    EventTypeDeleted,
    EventTypeInfo,
    EventTypeUpserted,
    Validation,
)

#: At most this many problems are named in an answer or a dead letter.
MAX_PROBLEMS = 3


@dataclass(frozen=True, slots=True)
class Violation:
    """Why an event does not fit its type: ``problems`` are (JSON pointer into the event, message)."""

    validation: Validation
    problems: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        return "; ".join(f"{pointer or '/'}: {message}" for pointer, message in self.problems)

    def pointers(self) -> str:
        """The places only (for logs: a message may quote the payload)."""
        return ", ".join(pointer or "/" for pointer, _ in self.problems)


class SchemaError(ValueError):
    """A schema that is not a valid JSON Schema, or that refers outside itself."""


def compile_schema(schema: Mapping[str, Any]) -> jsonschema_rs.Validator:
    if not jsonschema_rs.meta.is_valid(dict(schema)):
        try:
            jsonschema_rs.meta.validate(dict(schema))
        except jsonschema_rs.ValidationError as exc:
            raise SchemaError(f"not a valid JSON Schema at {_pointer(exc.instance_path)}") from None
    try:
        return jsonschema_rs.Draft202012Validator(dict(schema), retriever=_no_retrieval)
    except (jsonschema_rs.ReferencingError, jsonschema_rs.ValidationError, ValueError) as exc:
        raise SchemaError(f"the schema cannot be used: {str(exc).splitlines()[0][:200]}") from None


def _no_retrieval(uri: str) -> Any:
    raise ValueError(f"$ref to {uri!r}: schemas may refer only to their own parts")


def _pointer(path: list[str | int]) -> str:
    """RFC 6901: ``~`` and ``/`` in a key escaped."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


class Catalog:
    """The event types as of the last change-log record applied."""

    def __init__(self) -> None:
        self._types: dict[str, EventTypeInfo] = {}
        self._validators: dict[tuple[str, int, str], jsonschema_rs.Validator] = {}

    def get(self, name: str) -> EventTypeInfo | None:
        return self._types.get(name)

    def all(self) -> list[EventTypeInfo]:
        return sorted(self._types.values(), key=lambda t: t.name)

    def __len__(self) -> int:
        return len(self._types)

    def restore(self, types: Iterable[EventTypeInfo]) -> None:
        """What a registry's store kept (the state of the change log up to its offset)."""
        for event_type in types:
            self._types[event_type.name] = event_type

    def apply(self, record: EventTypeUpserted | EventTypeDeleted) -> EventTypeInfo | Stale | None:
        name = record.event_type.name if isinstance(record, EventTypeUpserted) else record.name
        before = self._types.get(name)
        if record.base_version is not None and record.base_version != (before.version if before else 0):
            return Stale(before)
        for key in [key for key in self._validators if key[0] == name]:
            del self._validators[key]
        if isinstance(record, EventTypeUpserted):
            after = record.event_type.model_copy(update={"version": (before.version if before else 0) + 1})
            self._types[name] = after
            return after
        self._types.pop(name, None)
        return None

    def check(self, event_type: str, schema_version: int, data: Mapping[str, Any]) -> Violation | None:
        """What is wrong with an event's data by its type's schema (None: nothing, or not checked)."""
        described = self._types.get(event_type)
        if described is None or described.validation == "off" or not described.schemas:
            return None
        schema = described.schemas.get(str(schema_version))
        if schema is None:
            known = ", ".join(sorted(described.schemas, key=int))
            return Violation(
                described.validation,
                (
                    (
                        "/schema_version",
                        f"{event_type} has no schema_version {schema_version} (known: {known})",
                    ),
                ),
            )
        key = (event_type, schema_version, described.updated_at.isoformat())
        validator = self._validators.get(key)
        if validator is None:
            try:
                validator = self._validators[key] = compile_schema(schema)
            except SchemaError:
                return None  # refused when written; a record from elsewhere is not checked against
        problems = tuple(
            ("/data" + _pointer(error.instance_path), error.message[:300])
            for _, error in zip(range(MAX_PROBLEMS), validator.iter_errors(dict(data)), strict=False)
        )
        return Violation(described.validation, problems) if problems else None

    def unknown_patterns(self, patterns: list[str]) -> list[str]:
        """The patterns that match no type in the catalog (none when the catalog is empty: not in use)."""
        if not self._types:
            return []
        return [p for p in patterns if not any(topology.topic_matches(p, name) for name in self._types)]


@dataclass(frozen=True, slots=True)
class Stale:
    current: EventTypeInfo | None


# --- OpenAPI 3.1 ``webhooks`` ------------------------------------------------------------------------


def to_openapi(types: list[EventTypeInfo], *, title: str, version: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document whose ``webhooks`` are the types: what a receiver is sent for each."""
    webhooks: dict[str, Any] = {}
    for described in types:
        versions = sorted(described.schemas, key=int)
        data_schema: dict[str, Any] = described.schemas[versions[-1]] if versions else {"type": "object"}
        envelope = {
            "type": "object",
            "required": ["id", "type", "tenant", "occurred_at", "data"],
            "properties": {
                "id": {"type": "string"},
                "type": {"const": described.name},
                "tenant": {"type": "string"},
                "occurred_at": {"type": "string", "format": "date-time"},
                "subject": {"type": "string"},
                "sequence": {"type": "integer", "minimum": 0},
                "schema_version": {"type": "integer", "const": int(versions[-1]) if versions else 1},
                "data": data_schema,
            },
        }
        content: dict[str, Any] = {"schema": envelope}
        if described.examples:
            content["examples"] = {
                f"example{n + 1}": {"value": {"type": described.name, "data": example}}
                for n, example in enumerate(described.examples)
            }
        webhooks[described.name] = {
            "post": {
                "operationId": described.name,
                "summary": described.description.split("\n")[0][:200] or described.name,
                "description": described.description,
                "deprecated": described.deprecated,
                "x-hookline-validation": described.validation,
                "x-hookline-schemas": described.schemas,
                "requestBody": {"required": True, "content": {"application/json": content}},
                "responses": {"2XX": {"description": "received"}},
            }
        }
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "webhooks": webhooks}


def from_openapi(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The event types an OpenAPI 3.1 document's ``webhooks`` describe, as creation bodies. The data
    schema is the request body's ``properties.data`` when it is an event envelope, else the whole body;
    hookline's own export round-trips exactly (``x-hookline-schemas``, ``x-hookline-validation``)."""
    webhooks = document.get("webhooks")
    if not isinstance(webhooks, Mapping):
        raise ValueError("the document has no webhooks section")
    found = []
    for name, item in webhooks.items():
        operation = item.get("post") if isinstance(item, Mapping) else None
        if not isinstance(operation, Mapping):
            raise ValueError(f"webhook {name!r} has no post operation")
        content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
        schema = content.get("schema") if isinstance(content, Mapping) else None
        schemas = operation.get("x-hookline-schemas")
        if not isinstance(schemas, Mapping):
            data = schema.get("properties", {}).get("data") if isinstance(schema, Mapping) else None
            schemas = (
                {"1": data if isinstance(data, Mapping) else schema} if isinstance(schema, Mapping) else {}
            )
        examples = [
            example["value"].get("data", example["value"])
            for example in (content.get("examples") or {}).values()
            if isinstance(example, Mapping) and isinstance(example.get("value"), Mapping)
        ]
        body: dict[str, Any] = {
            "name": name,
            "description": str(operation.get("description", operation.get("summary", ""))),
            "schemas": dict(schemas),
            "examples": examples,
            "deprecated": bool(operation.get("deprecated", False)),
        }
        if operation.get("x-hookline-validation") in ("off", "warn", "enforce"):
            body["validation"] = operation["x-hookline-validation"]
        found.append(body)
    return found
