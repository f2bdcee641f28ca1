"""The whole system as a user runs it: ingest, two dispatchers and the health monitor as processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import services
from support.broker import Broker
from support.system import System


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
