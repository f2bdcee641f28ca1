"""The dispatcher process: follows the endpoint log and the breakers, consumes the lanes and the queues
of endpoints that have one of their own, and stops cleanly.

Any number of replicas run side by side; each consumes every lane and every such queue (competing
consumers), with per-endpoint limits so that one slow endpoint can hold at most that many of a
replica's deliveries. Every long-running part is a supervised loop (:mod:`hookline.shared.runtime.supervision`): a broker
restart or a closed connection makes them start over, and ``/readyz`` answers 503 until they are back.
"""

from __future__ import annotations

import asyncio
import resource

import structlog

from hookline.dispatcher.attempt import USER_AGENT
from hookline.dispatcher.dispatching import dispatching
from hookline.dispatcher.lag import LagProbe
from hookline.dispatcher.settings import DispatcherSettings
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.outbound.delivery import DeliveryClient
from hookline.shared.runtime import lifecycle
from hookline.shared.runtime import logging as hookline_logging
from hookline.shared.runtime.probes import probe_server
from hookline.shared.runtime.settings import load
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry

log = structlog.get_logger(__name__)


def _raise_open_files_limit(settings: DispatcherSettings) -> None:
    """Every attempt under way holds a socket, and attempts under way when their endpoint turned slow can
    put the slow share over its size (admission.py): the soft limit on open files (often 1,024) is
    raised to the hard one, and a hard limit too low for the attempts allowed is said at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard != resource.RLIM_INFINITY and hard < 2 * settings.http_max_connections:
        log.warning(
            "open_files_limit_low",
            limit=hard,
            detail=f"HOOKLINE_HTTP_MAX_CONNECTIONS={settings.http_max_connections} wants twice as many",
        )


def main() -> None:
    settings = load(DispatcherSettings)
    hookline_logging.configure(service="dispatcher", level=settings.log_level)
    _raise_open_files_limit(settings)

    async def run() -> None:
        await serve(settings, lifecycle.stop_event())

    lifecycle.run(run, nice=settings.nice)


async def serve(settings: DispatcherSettings, stopping: asyncio.Event) -> None:
    """Run one dispatcher until ``stopping`` is set, then shut down in order (see :func:`dispatching`)."""
    supervisor = Supervisor()
    port = settings.dispatcher_metrics_port  # a replica's own file: one per port (0: in memory)
    registry_path = settings.state_file("dispatcher", port).with_suffix(".registry.sqlite") if port else None

    def problems() -> list[str]:
        # Not blocked: a dispatcher goes on delivering (and acking) while the broker refuses publishes.
        return ([] if broker.connected else ["broker: not connected"]) + supervisor.problems()

    async with (
        Broker(
            settings.amqp_url, name="hookline-dispatcher", connect_timeout_s=settings.connect_timeout_s
        ) as broker,
        # Closed after the change log's follower (stopped below), the last to write it.
        registry.kept_at(registry_path, vhost=broker.vhost) as endpoint_registry,
        # No limit of the client's own: the handler's admission is the limit (HOOKLINE_HTTP_MAX_CONNECTIONS),
        # and an attempt's timeout must never include a wait for one of hookline's connections.
        DeliveryClient.for_endpoints(settings, max_connections=0, user_agent=USER_AGENT) as client,
        LagProbe() as lag,
    ):
        await topology.declare(broker, settings.retention)
        publisher = Publisher(broker)
        try:
            change_log = await registry.follow(
                broker, publisher, supervisor, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
            )
            async with (
                dispatching(settings, broker, supervisor, change_log, publisher, client, lag) as consumers,
                probe_server(
                    settings.dispatcher_metrics_host,
                    settings.dispatcher_metrics_port,
                    problems=problems,
                    metrics_token=settings.metrics_token,
                ),
            ):
                log.info("dispatcher_ready", endpoints=len(endpoint_registry))
                await stopping.wait()
                log.info("dispatcher_stopping", consuming=consumers.own_queues.consuming)
        finally:
            await supervisor.stop()
            await publisher.close()
    log.info("dispatcher_stopped")
