"""Fixtures shared by every test: the broker, a fresh vhost per test, a real HTTP receiver; and the order
modules are handed out in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from support.broker import Broker, broker
from support.receiver import Receiver


# Modules that start the services, and a few others (marked long), take tens of seconds each; unit
# modules take about one. Handed out longest first (make test passes --no-loadscope-reorder, so xdist
# keeps this order rather than putting the modules with most tests first), the quick ones fill in at
# the end and no worker is left alone with a long module while the others idle.
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def tier(item: pytest.Item) -> int:
        if item.get_closest_marker("e2e") or item.get_closest_marker("long"):
            return 0
        return 1 if item.get_closest_marker("integration") else 2

    module_tier: dict[Path, int] = {}
    for item in items:
        module_tier[item.path] = min(tier(item), module_tier.get(item.path, 2))
    items.sort(key=lambda item: module_tier[item.path])  # stable: a module's tests stay together, in order


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[Broker]:
    with broker() as running:
        yield running


@pytest.fixture
def amqp_url(rabbitmq: Broker) -> Iterator[str]:
    """The URL of a vhost of this test's own: no test sees another's endpoints, queues or logs."""
    with rabbitmq.vhost() as url:
        yield url


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with Receiver() as running:
        yield running
