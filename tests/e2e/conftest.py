"""The whole system as a user runs it: ingest, two dispatchers and the health monitor as processes."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import services
from support.broker import Broker
from support.system import System


@contextmanager
def running_system(
    rabbitmq: Broker, log_dir: Path, label: str, settings: Mapping[str, str]
) -> Iterator[System]:
    """Ingest, two dispatchers and the monitor in a vhost of their own, stopped (SIGTERM) afterwards."""
    with rabbitmq.vhost(label) as amqp_url:
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
            every = (*running.extra, *dispatchers, ingest, running.monitor)
            codes = {s.name: s.stop() for s in every if not s.killed}
        # A clean SIGTERM shutdown is part of the contract: every service exits 0.
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{running.logs()}"


@pytest.fixture(scope="module")
def system(
    rabbitmq: Broker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[System]:
    """The module's system, shared by its tests. A test module may shrink times through settings:
    SYSTEM_ENV = {"HOOKLINE_...": "..."}."""
    label = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    settings = getattr(request.module, "SYSTEM_ENV", {})
    with running_system(rabbitmq, tmp_path_factory.mktemp("logs"), label, settings) as running:
        yield running


@pytest.fixture
def own_system(
    rabbitmq: Broker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[System]:
    """A system for one test: one that kills, stops or restarts a service leaves the module's system
    whole for the tests after it."""
    label = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:60]
    settings = getattr(request.module, "SYSTEM_ENV", {})
    with running_system(rabbitmq, tmp_path_factory.mktemp("logs"), label, settings) as running:
        yield running
