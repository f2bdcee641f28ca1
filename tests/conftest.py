"""Fixtures shared by every test: the broker, a fresh vhost per test, a real HTTP receiver."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from support.broker import Broker, broker
from support.receiver import Receiver


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
