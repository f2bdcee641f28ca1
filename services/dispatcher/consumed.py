"""A message consumed from a queue, read straight off aiormq's delivery.

aio-pika wraps every delivery in an ``IncomingMessage`` (a lockable object whose every attribute goes
through a checked ``__setattr__``) and runs the callback in a second task beside aiormq's; together
about a tenth of a delivery's CPU (profile in docs/decisions.md, "CPU per delivery"). The dispatcher's
consumers use :func:`consume` instead; what the handler needs of a message is :class:`Incoming`, which
aio-pika's own messages (a probe's ``basic.get``) satisfy too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Protocol

import aiormq
from aio_pika.abc import AbstractChannel
from aio_pika.exceptions import MessageProcessError
from aio_pika.message import decode_timestamp
from aiormq.abc import DeliveredMessage


class Incoming(Protocol):
    """What the handler reads of a message and how it settles it."""

    @property
    def body(self) -> bytes: ...
    @property
    def message_id(self) -> str | None: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def headers(self) -> Mapping[str, Any] | None: ...
    @property
    def timestamp(self) -> datetime | None: ...
    @property
    def exchange(self) -> str | None: ...
    @property
    def routing_key(self) -> str | None: ...
    @property
    def delivery_tag(self) -> int | None: ...
    @property
    def redelivered(self) -> bool | None: ...
    @property
    def channel(self) -> aiormq.abc.AbstractChannel: ...

    async def ack(self) -> None: ...
    async def nack(self, *, requeue: bool = True) -> None: ...
    async def reject(self, *, requeue: bool = False) -> None: ...


class Delivery:
    """One delivery of a consumer; settled once (a second ack, nack or reject raises, as aio-pika's)."""

    __slots__ = (
        "body",
        "channel",
        "content_type",
        "delivery_tag",
        "exchange",
        "headers",
        "message_id",
        "processed",
        "redelivered",
        "routing_key",
        "timestamp",
    )

    def __init__(self, message: DeliveredMessage) -> None:
        properties = message.header.properties
        self.body = message.body
        self.channel = message.channel
        self.message_id: str | None = properties.message_id
        self.content_type: str | None = properties.content_type
        self.headers: Mapping[str, Any] | None = properties.headers
        self.timestamp = decode_timestamp(properties.timestamp)
        self.exchange = message.exchange
        self.routing_key = message.routing_key
        self.delivery_tag = message.delivery_tag
        self.redelivered = message.redelivered
        self.processed = False  # settled here, or for a batched ack (acks.py)

    def settle(self) -> int:
        """Mark it settled and return its tag; raises if it was settled already."""
        if self.processed:
            raise MessageProcessError("Message already processed", self)
        self.processed = True
        assert self.delivery_tag is not None  # consumed with acks: every delivery has a tag
        return self.delivery_tag

    async def ack(self) -> None:
        await self.channel.basic_ack(self.settle())

    async def nack(self, *, requeue: bool = True) -> None:
        await self.channel.basic_nack(self.settle(), requeue=requeue)

    async def reject(self, *, requeue: bool = False) -> None:
        await self.channel.basic_reject(self.settle(), requeue=requeue)


async def consume(
    channel: AbstractChannel,
    queue: str,
    callback: Callable[[Delivery], Awaitable[None]],
    *,
    timeout_s: float,
) -> str:
    """Consume ``queue`` on ``channel`` (its prefetch applies); returns the consumer tag."""
    underlay = await channel.get_underlay_channel()

    async def on_delivery(message: DeliveredMessage) -> None:
        await callback(Delivery(message))  # already in a task of its own (aiormq starts one)

    ok = await underlay.basic_consume(queue, on_delivery, timeout=timeout_s)
    assert ok.consumer_tag is not None
    return ok.consumer_tag


async def cancel(channel: AbstractChannel, tag: str, *, timeout_s: float) -> None:
    underlay = await channel.get_underlay_channel()
    await underlay.basic_cancel(tag, timeout=timeout_s)
