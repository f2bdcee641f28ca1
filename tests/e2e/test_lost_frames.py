"""A word lost between a dispatcher and the broker: the broker's cancel of a consumer, or the
dispatcher's ack of a message it settled. One dispatcher reaches the broker through a TCP proxy that
the test controls (the system's own two are stopped); the other services connect directly."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import unquote, urlsplit

import pytest
from support import services
from support.broker import Broker
from support.logs import logged
from support.monitoring import publish
from support.proxy import TcpProxy
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

WEBHOOK_ID = "webhook-id"

pytestmark = pytest.mark.e2e


@asynccontextmanager
async def proxied_dispatcher(
    system: System, **settings: str
) -> AsyncIterator[tuple[TcpProxy, services.Service]]:
    """The system's dispatchers stopped, and one started behind a proxy."""
    for dispatcher in system.dispatchers:
        assert dispatcher.stop() == 0
    upstream = urlsplit(system.amqp_url)
    async with TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5672) as proxy:
        env = {**system.env, "HOOKLINE_AMQP_URL": proxy.url_for(system.amqp_url), **settings}
        dispatcher = services.start("dispatcher", env, system.log_dir, name="dispatcher-behind-proxy")
        system.extra.append(dispatcher)
        await asyncio.to_thread(dispatcher.wait_ready)
        yield proxy, dispatcher
        # Stopped from a thread: the proxy runs on this event loop, and the dispatcher's shutdown needs
        # the broker's answers (a cancel-ok) to pass through it.
        assert await asyncio.to_thread(dispatcher.stop) == 0


async def test_a_consumer_the_broker_dropped_without_a_word_is_attached_again(
    own_system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """The broker's cancel (the queue was deleted by hand) never reaches the dispatcher, which believes
    it still consumes the queue: its check with the broker finds the queue gone or without a consumer,
    says so, and attaches again; events published afterwards are delivered."""
    system = own_system
    async with proxied_dispatcher(system, HOOKLINE_CONSUMER_CHECK_S="1") as (proxy, dispatcher):
        acme = tenant()
        # A cap needs a single consumer: the endpoint has a queue of its own, which the dispatcher consumes.
        # In a thread: the ingest answers once the dispatcher says (through the proxy, on this loop) it
        # knows the endpoint.
        endpoint = await asyncio.to_thread(
            system.add_endpoint, acme, receiver.url("/kept"), ["kept.*"], max_in_flight=10
        )
        await receiver.wait_for_ids(set(await publish(system, acme, "kept.x", ["evt_kept_before"])))
        [attached, *_] = logged([dispatcher], "consumer_attached", endpoint_id=endpoint["id"])

        proxy.drop_consumer_cancels(True)
        vhost = unquote(urlsplit(system.amqp_url).path.lstrip("/"))
        await rabbitmq.ctl_async(["delete_queue", "-p", vhost, f"hookline.endpoint.{endpoint['id']}"])

        async def cancel_dropped() -> bool:
            return proxy.cancels_dropped > 0

        await eventually(cancel_dropped)
        assert not logged([dispatcher], "consumer_cancelled_by_broker"), "the cancel was to be lost"

        async def found() -> bool:
            return bool(logged([dispatcher], "consumer_missing_at_broker", tag=attached["tag"], alert=True))

        await eventually(found, timeout_s=30)

        async def attached_again() -> bool:
            tags = {r["tag"] for r in logged([dispatcher], "consumer_attached", endpoint_id=endpoint["id"])}
            return len(tags) == 2  # the first consumer's, and a new one's

        await eventually(attached_again)
        await receiver.wait_for_ids(set(await publish(system, acme, "kept.x", ["evt_kept_after"])))


async def test_a_delivery_whose_ack_was_lost_is_not_sent_again(
    own_system: System, receiver: Receiver
) -> None:
    """The endpoint answers 2xx, then the dispatcher's ack is lost with its connection (the proxy holds
    it, then resets the connection): the broker hands the message out again, and the dispatcher, which
    recorded the delivery, acks it without a second POST. The receiver sees the event once."""
    system = own_system
    async with proxied_dispatcher(system) as (proxy, dispatcher):
        acme = tenant()

        def answer(request: Received) -> Reply:
            if request.headers[WEBHOOK_ID] == "evt_ack_lost":
                proxy.stall()  # before the 2xx: the ack that follows it cannot get through
            return Reply()

        receiver.responder = answer
        await asyncio.to_thread(system.add_endpoint, acme, receiver.url("/once"), ["once.*"])
        await publish(system, acme, "once.x", ["evt_ack_lost"])

        async def settled() -> bool:
            return bool(logged([dispatcher], "delivery_attempt", event_id="evt_ack_lost", outcome="success"))

        await eventually(settled)
        await proxy.cut()
        proxy.resume()

        async def acked_on_redelivery() -> bool:
            return bool(
                logged(
                    [dispatcher], "redelivery_already_settled", event_id="evt_ack_lost", outcome="delivered"
                )
            )

        await eventually(acked_on_redelivery, timeout_s=60)
        await receiver.wait_for_ids(set(await publish(system, acme, "once.x", ["evt_sentinel"])))
        assert Counter(r.headers[WEBHOOK_ID] for r in receiver.requests) == {
            "evt_ack_lost": 1,
            "evt_sentinel": 1,
        }
