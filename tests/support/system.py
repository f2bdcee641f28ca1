"""The whole system as the end-to-end tests run it (the ``system`` fixture of tests/e2e/conftest.py
starts one per module), and what tests do with it."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from support import services


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
        with self.api() as api:
            return add_endpoint(api, tenant, url, patterns, **fields)

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

    def start_again(self, stopped: services.Service) -> services.Service:
        """``stopped`` started again on its port, as a restarted replica is: it finds its local state
        (one file per service and port). Stopped with the others at the end."""
        again = services.start(
            stopped.command, self.env, self.log_dir, name=f"{stopped.name}-again", port=stopped.port
        )
        self.extra.append(again)
        again.wait_ready(timeout_s=60)
        return again

    def start_dispatcher(self, name: str) -> services.Service:
        dispatcher = services.start("dispatcher", self.env, self.log_dir, name=name)
        dispatcher.wait_ready()
        self.extra.append(dispatcher)
        return dispatcher


@contextmanager
def services_running(amqp_url: str, log_dir: Path, settings: Mapping[str, str]) -> Iterator[System]:
    """Ingest, two dispatchers and the monitor on ``amqp_url``, stopped (SIGTERM) afterwards."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # Each replica's local views (SQLite) live with the logs, never in the checkout.
    env = services.base_env(amqp_url, HOOKLINE_STATE_DIR=str(log_dir / "state"), **settings)
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
        every = [s for s in (*running.extra, *dispatchers, ingest, running.monitor) if not s.killed]
        for service in every:  # all at once: each one's shutdown waits on nothing of the others'
            service.terminate()
        codes = {s.name: s.stop() for s in every}
    # A clean SIGTERM shutdown is part of the contract: every service exits 0.
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{running.logs()}"


def add_endpoint(
    api: httpx.Client, tenant: str, url: str, patterns: list[str], **fields: Any
) -> dict[str, Any]:
    """Register an endpoint; without ``verify=True`` it skips the handshake (most tests' receivers
    answer what the test scripts, not a 2xx to a verification)."""
    fields.setdefault("verify", False)
    response = api.post(
        "/v1/endpoints", json={"tenant": tenant, "url": url, "event_types": patterns, **fields}
    )
    assert response.status_code == 201, response.text
    endpoint: dict[str, Any] = response.json()
    return endpoint


def tenant() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def cli(system: System, *arguments: str) -> Any:
    """Run ``hookline ARGUMENTS`` against the system as an operator would; its JSON output."""
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    done = subprocess.run(
        [services.HOOKLINE, *arguments], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
