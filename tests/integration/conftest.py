"""The in-process ingest (tests/support/inprocess.py): the API's behaviour against the real broker,
without the subprocess system of tests/e2e."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.broker import Broker
from support.inprocess import IngestSystem, ingest_running


@pytest.fixture(scope="module")
def system(
    rabbitmq: Broker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[IngestSystem]:
    """The module's ingest, in this process, in a vhost of its own, shared by its tests. A test module
    sets what the ingest reads as a process would: SYSTEM_ENV = {"HOOKLINE_...": "..."}."""
    settings = getattr(request.module, "SYSTEM_ENV", {})
    with (
        rabbitmq.vhost() as amqp_url,
        ingest_running(amqp_url, tmp_path_factory.mktemp("ingest"), settings) as running,
    ):
        yield running
