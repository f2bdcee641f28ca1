"""Operator alert sinks: every alert that fires or resolves, POSTed straight to the URLs an operator set.

Straight, not through hookline's own queues: the alerts that matter most (the broker's alarms, its
disk) are those during which hookline cannot publish. ``HOOKLINE_ALERT_WEBHOOK_URLS`` lists sinks,
separated by spaces or commas; each is a URL, optionally preceded by the alerts it takes and ``=``
(``|``-separated names, ``*`` wildcards), and by ``slack+`` for a Slack-compatible incoming webhook:

    HOOKLINE_ALERT_WEBHOOK_URLS="https://ops.example/hooks broker_*|breaker_open=slack+https://hooks.slack.com/services/T/B/X"

A plain sink gets the alert's JSON (as on the ``alerts`` exchange), signed like every hookline
delivery when ``HOOKLINE_ALERT_WEBHOOK_SECRET`` (a ``whsec_`` secret) is set; a Slack sink gets
``{"text": ...}``. Each POST is tried three times (after 1 s and 10 s) in the background; a sink
that still fails is logged (``alert_sink_failed``) and counted, never a reason to stop alerting.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import orjson
import prometheus_client
import structlog

from hookline.shared.outbound import signing
from hookline.shared.outbound.delivery import DeliveryClient

log = structlog.get_logger(__name__)

RETRY_DELAYS_S = (1.0, 10.0)
SINK_TIMEOUT_S = 10.0
QUEUE_MAX = 1_000

SINK_FAILURES = prometheus_client.Counter(
    "hookline_alert_sink_failures", "Alerts a sink did not take after every try.", ["sink"]
)


@dataclass(frozen=True)
class Sink:
    url: str
    alerts: tuple[str, ...] = ("*",)  # fnmatch patterns of alert names
    slack: bool = False

    def wants(self, alert: str) -> bool:
        return any(fnmatch.fnmatchcase(alert, pattern) for pattern in self.alerts)

    @property
    def name(self) -> str:
        """The sink as logs and metrics show it: scheme and host only (a path may hold a token)."""
        scheme, _, rest = self.url.partition("://")
        return f"{scheme}://{rest.split('/', 1)[0].rpartition('@')[2]}"


def parse_sinks(setting: str | None) -> list[Sink]:
    """``HOOKLINE_ALERT_WEBHOOK_URLS`` → sinks; raises ValueError naming the entry it cannot read."""
    sinks = []
    for entry in (setting or "").replace(",", " ").split():
        patterns, equals, target = entry.partition("=")
        if not equals or "://" in patterns:  # no routing part: the "=" (if any) is the URL's own
            patterns, target = "*", entry
        slack = target.startswith("slack+")
        url = target.removeprefix("slack+")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{entry!r}: a sink is [alerts=][slack+]http(s)://…")
        sinks.append(Sink(url=url, alerts=tuple(p for p in patterns.split("|") if p), slack=slack))
    return sinks


def slack_text(body: Mapping[str, Any]) -> str:
    mark = ":red_circle:" if body["state"] == "firing" else ":large_green_circle:"
    where = f" (endpoint {body['endpoint_id']}, tenant {body['tenant']})" if body.get("endpoint_id") else ""
    return f"{mark} *{body['alert']}* {body['state']}{where}: {body['detail']}"


class AlertSinks:
    """Sends alerts to the sinks from a background task; ``async with AlertSinks(...) as sinks``."""

    def __init__(self, sinks: Iterable[Sink], *, secret: str | None, client: DeliveryClient) -> None:
        self._sinks = list(sinks)
        self._keys = [signing.secret_key(secret)] if secret else []
        self._client = client
        self._queue: asyncio.Queue[tuple[Sink, str, bytes, bool]] = asyncio.Queue(QUEUE_MAX)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        if self._sinks:
            self._task = asyncio.create_task(self._send_all(), name="alert-sinks")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def send(self, message_id: str, body: Mapping[str, Any]) -> None:
        """Queue the alert for every sink that takes it (dropped, and counted, if the queue is full)."""
        for sink in self._sinks:
            if not sink.wants(str(body["alert"])):
                continue
            payload = {"text": slack_text(body)} if sink.slack else dict(body)
            try:
                self._queue.put_nowait((sink, message_id, orjson.dumps(payload), sink.slack))
            except asyncio.QueueFull:
                SINK_FAILURES.labels(sink.name).inc()

    async def _send_all(self) -> None:
        while True:
            sink, message_id, payload, slack = await self._queue.get()
            # One at a time: a sink that is down delays the others by its tries, which is rare and short.
            await self._send(sink, message_id, payload, slack)

    async def _send(self, sink: Sink, message_id: str, payload: bytes, slack: bool) -> None:
        for delay_s in (0.0, *RETRY_DELAYS_S):
            await asyncio.sleep(delay_s)
            if slack or not self._keys:
                headers = {"content-type": "application/json"}
            else:
                headers = signing.webhook_headers(
                    self._keys, message_id, payload, timestamp_s=int(time.time())
                )
            result = await self._client.post(sink.url, payload, headers, timeout_s=SINK_TIMEOUT_S)
            if result.status is not None and 200 <= result.status < 300:
                return
            error = result.detail
        SINK_FAILURES.labels(sink.name).inc()
        log.warning("alert_sink_failed", sink=sink.name, error=error[:200])
