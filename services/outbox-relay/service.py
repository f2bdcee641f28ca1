"""The outbox relay process: ``hookline outbox-relay --dsn postgresql://…`` (any number of replicas).

Three supervised loops (:mod:`hookline.shared.runtime.supervision`), each with its own PostgreSQL connection,
started over after a lost database or broker: ``relay`` publishes, ``listen`` wakes it on NOTIFY,
``watch`` reads the lag and deletes sent rows past their retention. ``/readyz`` answers 503 while one
is down.
"""

from __future__ import annotations

import asyncio
import time

import psycopg
import structlog

from hookline.outbox_relay import schema
from hookline.outbox_relay.relay import Relay
from hookline.outbox_relay.settings import OutboxRelaySettings
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.runtime import lifecycle
from hookline.shared.runtime import logging as hookline_logging
from hookline.shared.runtime.probes import probe_server
from hookline.shared.runtime.settings import load
from hookline.shared.runtime.supervision import Supervisor

log = structlog.get_logger(__name__)


def main(*, dsn: str | None, migrate_only: bool) -> None:
    settings = load(OutboxRelaySettings, **({"outbox_dsn": dsn} if dsn else {}))
    hookline_logging.configure(service="outbox-relay", level=settings.log_level)

    async def run() -> None:
        if migrate_only:
            await migrate(settings)
        else:
            await serve(settings, lifecycle.stop_event())

    lifecycle.run(run, nice=settings.nice)


def _dsn(settings: OutboxRelaySettings) -> str:
    assert settings.outbox_dsn is not None  # the setting's validator refuses none
    return settings.outbox_dsn.get_secret_value()


async def migrate(settings: OutboxRelaySettings) -> None:
    async with await schema.connect(_dsn(settings)) as conn:
        applied = await schema.migrate(conn)
    print(f"hookline: outbox schema {'applied: ' + ', '.join(applied) if applied else 'already up to date'}")


async def _check_schema(settings: OutboxRelaySettings) -> None:
    """At start, like the broker: a database that does not answer within HOOKLINE_CONNECT_TIMEOUT_S, or
    one without the outbox table, stops the relay with one line saying so."""
    deadline_s = time.monotonic() + settings.connect_timeout_s
    while True:
        try:
            async with await schema.connect(_dsn(settings)) as conn:
                await schema.check(conn)
            return
        except schema.SchemaMissingError as exc:
            log.error("outbox_schema_missing", detail=str(exc))
            raise SystemExit(2) from None
        except psycopg.OperationalError as exc:
            if time.monotonic() >= deadline_s:
                log.error("outbox_database_unreachable", detail=str(exc)[:300])
                raise SystemExit(1) from None
            log.warning("outbox_database_connect_retry", detail=str(exc)[:300])
            await asyncio.sleep(1.0)


async def serve(settings: OutboxRelaySettings, stopping: asyncio.Event) -> None:
    """Run until ``stopping`` is set, then shut down in order."""
    await _check_schema(settings)
    supervisor = Supervisor()

    def problems() -> list[str]:
        return ([] if broker.publishing_connected else ["broker: not connected"]) + supervisor.problems()

    # No pulse: an upstream's broker user (all a relay needs) may publish to events only.
    async with Broker(
        settings.amqp_url,
        name="hookline-outbox-relay",
        connect_timeout_s=settings.connect_timeout_s,
        pulse=False,
    ) as broker:
        publisher = Publisher(broker)
        relay = Relay(settings, _dsn(settings), publisher)
        supervisor.spawn("relay", relay.relay, stall_s=120)
        supervisor.spawn("listen", relay.listen)
        supervisor.spawn("watch", relay.watch, stall_s=120)
        try:
            async with probe_server(
                settings.outbox_metrics_host,
                settings.outbox_metrics_port,
                problems=problems,
                metrics_token=settings.metrics_token,
            ):
                log.info("outbox_relay_ready")
                await stopping.wait()
                log.info("outbox_relay_stopping")
        finally:
            # Shutdown, in order:
            # 1. start no batch, and let the one in flight commit (within the grace period);
            await relay.finish_batch(settings.shutdown_grace_s)
            # 2. stop the loops (a batch cut short here rolls back: its rows go out again later);
            await supervisor.stop()
            # 3. close the publishing channel (the connections close as the broker session ends).
            await publisher.close()
    log.info("outbox_relay_stopped")
