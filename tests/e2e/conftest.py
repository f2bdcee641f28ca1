"""The whole system as a user runs it: ingest, two dispatchers and the health monitor as processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import services
from support.broker import Broker


@dataclass
class System:
    amqp_url: str
    env: dict[str, str]
    log_dir: Path
    ingest: services.Service
    dispatchers: list[services.Service]
    monitor: services.Service
    extra: list[services.Service] = field(default_factory=list)

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
        )

    def add_endpoint(self, tenant: str, url: str, patterns: list[str], **fields: Any) -> dict[str, Any]:
        """Register an endpoint; without ``verify=True`` it skips the handshake (most tests' receivers
        answer what the test scripts, not a 2xx to a verification)."""
        fields.setdefault("verify", False)
        with self.api() as api:
            response = api.post(
                "/v1/endpoints", json={"tenant": tenant, "url": url, "event_types": patterns, **fields}
            )
        assert response.status_code == 201, response.text
        endpoint: dict[str, Any] = response.json()
        return endpoint

    def logs(self) -> str:
        every = [self.ingest, *self.dispatchers, self.monitor, *self.extra]
        return "\n".join(service.log() for service in every)

    def monitor_api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.monitor.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
        )

    def restart_monitor(self) -> None:
        assert self.monitor.stop() == 0
        self.monitor = services.start("health-monitor", self.env, self.log_dir, name="health-monitor-2")
        self.monitor.wait_ready(timeout_s=60)

    def start_dispatcher(self, name: str) -> services.Service:
        dispatcher = services.start("dispatcher", self.env, self.log_dir, name=name)
        dispatcher.wait_ready()
        self.extra.append(dispatcher)
        return dispatcher


def tenant() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def system(
    rabbitmq: Broker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[System]:
    log_dir = tmp_path_factory.mktemp("logs")
    with rabbitmq.vhost(request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")) as amqp_url:
        # A test module may shrink times through settings: SYSTEM_ENV = {"HOOKLINE_...": "..."}.
        # Each replica's local views (SQLite) live with the logs, never in the checkout.
        env = services.base_env(
            amqp_url, HOOKLINE_STATE_DIR=str(log_dir / "state"), **getattr(request.module, "SYSTEM_ENV", {})
        )
        ingest = services.start("ingest", env, log_dir)
        env["HOOKLINE_INGEST_URL"] = ingest.base_url  # the monitor's dashboard calls it
        dispatchers = [services.start("dispatcher", env, log_dir, name=f"dispatcher-{n}") for n in (1, 2)]
        monitor = services.start("health-monitor", env, log_dir)
        running = System(amqp_url, env, log_dir, ingest, dispatchers, monitor)
        try:
            for service in (ingest, *dispatchers, monitor):
                service.wait_ready()
            yield running
        finally:
            every = (*running.extra, *dispatchers, ingest, running.monitor)
            codes = {s.name: s.stop() for s in every if not s.killed}
        # A clean SIGTERM shutdown is part of the contract: every service exits 0.
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{running.logs()}"
