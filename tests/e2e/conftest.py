"""The whole system as a user runs it: ingest, two dispatchers and the health monitor as processes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.broker import Broker
from support.system import System, services_running


@contextmanager
def running_system(rabbitmq: Broker, log_dir: Path, settings: Mapping[str, str]) -> Iterator[System]:
    """Ingest, two dispatchers and the monitor in a vhost of their own, stopped (SIGTERM) afterwards."""
    with rabbitmq.vhost() as amqp_url, services_running(amqp_url, log_dir, settings) as running:
        yield running


@pytest.fixture(scope="module")
def system(
    rabbitmq: Broker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[System]:
    """The module's system, shared by its tests. A test module may shrink times through settings:
    SYSTEM_ENV = {"HOOKLINE_...": "..."}."""
    settings = getattr(request.module, "SYSTEM_ENV", {})
    with running_system(rabbitmq, tmp_path_factory.mktemp("logs"), settings) as running:
        yield running


@pytest.fixture
def own_system(
    rabbitmq: Broker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[System]:
    """A system for one test: one that kills, stops or restarts a service leaves the module's system
    whole for the tests after it. Its settings are the module's SYSTEM_ENV, or those of the test's
    ``system_env`` mark (a test that needs settings of its own, in a module that covers its area)."""
    own = request.node.get_closest_marker("system_env")
    settings = own.args[0] if own is not None else getattr(request.module, "SYSTEM_ENV", {})
    with running_system(rabbitmq, tmp_path_factory.mktemp("logs"), settings) as running:
        yield running
