"""The admin commands: requests to the ingest and health-monitor APIs, their answers printed.

Admin commands read HOOKLINE_INGEST_URL and HOOKLINE_API_TOKEN, print the API's JSON answer on stdout,
and exit 1 with the API's error message on stderr when a request fails.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from hookline.shared import __version__
from hookline.shared.contracts.status import AlertView, BrokerStatus, EndpointHealthView, Summary


class ClientSettings(BaseSettings):
    """What the ``hookline`` admin commands need to reach the APIs."""

    model_config = SettingsConfigDict(env_prefix="HOOKLINE_", extra="ignore", frozen=True)

    api_token: SecretStr | None = None
    ingest_url: str = "http://127.0.0.1:8000"
    monitor_url: str = "http://127.0.0.1:8001"


class ApiClient:
    def __init__(self, settings: ClientSettings, *, monitor: bool = False) -> None:
        headers = {"user-agent": f"hookline-cli/{__version__}"}
        if settings.api_token is not None:
            headers["authorization"] = f"Bearer {settings.api_token.get_secret_value()}"
        base_url = settings.monitor_url if monitor else settings.ingest_url
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=30.0)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach {self._http.base_url}: {exc}") from None
        if response.status_code >= 400:
            try:
                body = response.json()
                message = body.get("message", response.text)
                details = "; ".join(
                    f"{d.get('field') or 'body'}: {d['message']}" for d in body.get("details", [])
                )
            except ValueError:
                message, details = response.text, ""
            raise CliError(f"{response.status_code} {message}" + (f" ({details})" if details else ""))
        return response.json() if response.content else None


class CliError(Exception):
    pass


def print_json(value: Any) -> None:
    if value is not None:
        print(json.dumps(value, indent=2, ensure_ascii=False))


def _endpoint_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = {
        "url": args.url,
        "event_types": args.event_types,
        "description": args.description,
        "timeout_s": args.timeout_s,
        "rate_limit_per_s": args.rate_limit_per_s,
        "max_in_flight": args.max_in_flight,
        "body_format": args.body_format,
        "notify_url": args.notify_url,
        "notify_format": args.notify_format,
        "gzip_over_bytes": args.gzip_over_bytes,
        "filter": args.filter,
        "transform": args.transform,
    }
    return {name: value for name, value in fields.items() if value is not None}


def _endpoint_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes = _endpoint_fields(args)
    for flag, field in (
        ("no_rate_limit", "rate_limit_per_s"),
        ("no_max_in_flight", "max_in_flight"),
        ("no_gzip", "gzip_over_bytes"),
        ("no_filter", "filter"),
        ("no_transform", "transform"),
    ):
        if getattr(args, flag):
            changes[field] = None  # null removes the limit
    if args.ordered is not None:
        changes["ordered"] = args.ordered
    return changes


def endpoints(args: argparse.Namespace) -> Any:
    api = ApiClient(ClientSettings())
    match args.action:
        case "add":
            body = {
                "tenant": args.tenant,
                "kind": "polling" if args.polling else "push",
                **_endpoint_fields(args),
                "ordered": args.ordered,
                "verify": args.verify,
            }
            return api.call("POST", "/v1/endpoints", json=body)
        case "list":
            params = {"tenant": args.tenant} if args.tenant else {}
            return api.call("GET", "/v1/endpoints", params=params)
        case "show":
            return api.call("GET", f"/v1/endpoints/{args.id}")
        case "secret":
            return api.call("GET", f"/v1/endpoints/{args.id}/secret")
        case "update":
            headers = {"if-match": str(args.if_version)} if args.if_version is not None else {}
            return api.call(
                "PATCH", f"/v1/endpoints/{args.id}", json=_endpoint_changes(args), headers=headers
            )
        case "delete":
            api.call("DELETE", f"/v1/endpoints/{args.id}", params={"force": "true"} if args.force else {})
            return {"deleted": args.id}
        case "pause" | "resume" | "verify" | "rotate-poll-token":
            return api.call("POST", f"/v1/endpoints/{args.id}/{args.action}")
        case "rotate-secret":
            body = {} if args.overlap_s is None else {"overlap_s": args.overlap_s}
            return api.call("POST", f"/v1/endpoints/{args.id}/rotate-secret", json=body)
        case "test":
            return api.call("POST", f"/v1/endpoints/{args.id}/test", json=_test_event(args))
        case "poll":
            page = {
                name: getattr(args, name) for name in ("iterator", "limit") if getattr(args, name) is not None
            }
            headers = {"authorization": f"Bearer {args.poll_token}"}
            return api.call("GET", f"/v1/endpoints/{args.id}/poll", params=page, headers=headers)
        case "attempts":
            filters = {name: getattr(args, name) for name in ("outcome", "since", "limit", "after")}
            return api.call(
                "GET",
                f"/v1/endpoints/{args.id}/attempts",
                params={k: v for k, v in filters.items() if v is not None},
            )
    raise AssertionError(args.action)


def dead_letters(args: argparse.Namespace) -> Any:
    api = ApiClient(ClientSettings())
    filters = {"endpoint_id": args.endpoint_id, "tenant": args.tenant, "reason": args.reason}
    filters = {name: value for name, value in filters.items() if value is not None}
    if args.action == "list":
        if args.event_id:
            filters["event_id"] = args.event_id
        return api.call("GET", "/v1/dead-letters", params={**filters, "limit": args.limit})
    body: dict[str, Any] = {**filters, "all": args.all}
    if args.event_id:
        body["event_id"] = args.event_id
    if args.ids:
        body["ids"] = args.ids
    return api.call("POST", "/v1/dead-letters/redrive", json=body)


def replay(args: argparse.Namespace) -> Any:
    body = {"since": args.since}
    if args.until:
        body["until"] = args.until
    return ApiClient(ClientSettings()).call("POST", f"/v1/endpoints/{args.endpoint_id}/replay", json=body)


def portal_link(args: argparse.Namespace) -> Any:
    body: dict[str, Any] = {
        "tenant": args.tenant,
        "read_only": args.read_only,
        "expires_in_s": args.expires_in_s,
    }
    if args.endpoint_ids:
        body["endpoint_ids"] = args.endpoint_ids
    return ApiClient(ClientSettings()).call("POST", "/v1/portal/sessions", json=body)


def status(args: argparse.Namespace) -> Any:
    api = ApiClient(ClientSettings(), monitor=True)
    summary = api.call("GET", "/v1/status")
    endpoints = api.call("GET", "/v1/endpoints/health", params={"degrading": str(args.degrading).lower()})
    alerts = api.call("GET", "/v1/alerts")
    if args.json:
        return {"summary": summary, "endpoints": endpoints, "alerts": alerts}
    print(
        status_text(
            Summary.model_validate(summary),
            [EndpointHealthView.model_validate(e) for e in endpoints],
            [AlertView.model_validate(a) for a in alerts],
        )
    )
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _age(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.0f}s"
    if value < 7200:
        return f"{value / 60:.0f}m"
    return f"{value / 3600:.1f}h"


def _broker_text(broker: BrokerStatus) -> str:
    capacity = broker.capacity
    words = ["broker: REFUSING PUBLISHES" if broker.blocked else "broker: taking publishes"]
    if capacity is None:
        return words[0] + "  (its numbers are not readable: HOOKLINE_RABBITMQ_MANAGEMENT_URL)"
    words += [alarm.upper() for alarm in capacity.alarms]
    if capacity.disk_free_bytes is not None:
        words.append(f"disk free {capacity.disk_free_bytes / 1e9:.1f} GB")
    if capacity.fd_used is not None and capacity.fd_limit is not None:
        words.append(f"file handles {capacity.fd_used}/{capacity.fd_limit}")
    if capacity.queues is not None:
        words.append(f"queues {capacity.queues}")
    return "  ".join(words)


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}"


def status_text(summary: Summary, endpoints: list[EndpointHealthView], alerts: list[AlertView]) -> str:
    """The summary line, one row per endpoint (slowest first), then the alerts firing."""
    lines = [
        f"pending {summary.pending}  awaiting retry {summary.awaiting_retry}  in flight {summary.in_flight}  "
        f"dead letters {summary.dead_letter}  delivered/1h {summary.delivered_last_hour}  "
        f"failed/1h {summary.failed_last_hour}  oldest pending {_age(summary.oldest_pending_age_s)}  "
        f"mean {_ms(summary.mean_delivery_ms)} ms  dispatchers {summary.dispatchers}  "
        f"monitor {'leader' if summary.leader else 'standby'}",
        _broker_text(summary.broker),
        "",
        f"{'ENDPOINT':<30} {'TENANT':<14} {'BREAKER':<9} {'P50':>7} {'P95':>7} {'P99':>7} {'5m P95':>7} "
        f"{'SAMPLES':>8} {'OK%':>6} {'TIMEOUT%':>8} {'QUEUE':>6} {'OLDEST':>7}",
    ]
    for e in endpoints:
        queue = "-" if e.queue_depth is None else str(e.queue_depth)
        lines.append(
            f"{e.endpoint_id:<30} {(e.tenant or '-')[:14]:<14} {e.breaker_state.value:<9} {_ms(e.p50_ms):>7} "
            f"{_ms(e.p95_ms):>7} {_ms(e.p99_ms):>7} {_ms(e.last_5m.p95_ms):>7} {e.samples:>8} "
            f"{_percent(e.success_rate):>6} {_percent(e.timeout_rate):>8} {queue:>6} "
            f"{_age(e.oldest_pending_age_s):>7}{' slow' if e.slow else ''}"
        )
    lines.append("")
    lines += [f"ALERT {a.alert} {a.endpoint_id or ''}: {a.detail}" for a in alerts] or ["no alerts firing"]
    return "\n".join(lines)


def events(args: argparse.Namespace) -> Any:
    api = ApiClient(ClientSettings())
    match args.action:
        case "show":
            return api.call("GET", f"/v1/events/{args.id}")
        case "list":
            filters = {
                name: getattr(args, name)
                for name in ("tenant", "type", "subject", "since", "until", "state", "limit", "after")
            }
            return api.call("GET", "/v1/events", params={k: v for k, v in filters.items() if v is not None})
        case "resend":
            return api.call("POST", f"/v1/events/{args.id}/resend", json={"endpoint_id": args.endpoint_id})
    body = {"tenant": args.tenant, "type": args.type, "data": _data_option(args.data)}
    if args.id:
        body["id"] = args.id
    if args.subject:
        body["subject"] = args.subject
    headers = {"idempotency-key": args.idempotency_key} if args.idempotency_key else {}
    return api.call("POST", "/v1/events", json=body, headers=headers)


def _test_event(args: argparse.Namespace) -> dict[str, Any]:
    """``endpoints test``'s request: the catalog's example unless ``--data`` is given."""
    test: dict[str, Any] = {"type": args.type}
    if args.data is not None:
        test["data"] = _data_option(args.data)
    if args.subject is not None:
        test["subject"] = args.subject
    return test


def _data_option(text: str) -> Any:
    """``--data``: an event's data, as JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"--data is not JSON: {exc}") from None
