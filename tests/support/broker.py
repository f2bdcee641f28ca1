"""The RabbitMQ the tests use, and a fresh vhost per test so that runs never see each other's state.

``HOOKLINE_TEST_AMQP_URL`` names a broker (the one on this machine in CI); without it, a testcontainers
RabbitMQ is started where a Docker engine answers, else the local default broker is used. A broker
that cannot be reached is a test failure, never a skip.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from hookline.cli.localservices import docker_available
from support.waiting import eventually

LOCAL_DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
_CONNECTION = re.compile(r'^(<[^>]+>)\t.*\{"connection_name","([^"]+)"\}', re.MULTILINE)

Run = Callable[[list[str]], str]


class Broker:
    def __init__(self, base_url: str, run_ctl: Run) -> None:
        self.base_url = base_url
        self._run_ctl = run_ctl

    def ctl(self, arguments: list[str]) -> str:
        """Run ``rabbitmqctl`` against this broker (locally, or inside its container); its output."""
        return self._run_ctl(arguments)

    async def ctl_async(self, arguments: list[str]) -> str:
        return await asyncio.to_thread(self._run_ctl, arguments)

    async def restart_app(self, *, down_s: float = 0.0) -> None:
        """Stop and start the RabbitMQ application (the node stays), as an operator's restart would.

        RabbitMQ 3.10 can lose its at-least-once dead-letter supervisor when quorum queues are deleted
        while their dead-letter workers start after a restart (every later declare of such a queue is
        then an INTERNAL_ERROR); tests delete whole vhosts, so the supervisor is checked and restarted.
        """
        await self.ctl_async(["stop_app"])
        if down_s:
            await asyncio.sleep(down_s)  # the operator's pause while the broker is away
        await self.ctl_async(["start_app"])
        await self.ctl_async(["await_startup"])
        await self.ensure_dead_letter_supervisor()

    @asynccontextmanager
    async def alarm(self, resource: Literal["memory", "disk"]) -> AsyncIterator[None]:
        """A resource alarm raised on the broker for the block's duration, as a broker running out of
        memory or disk would raise it, and cleared afterwards whatever happened. It blocks the publishers
        of every vhost: keep the block short."""
        if resource == "memory":
            setting = await self.ctl_async(["eval", "application:get_env(rabbit, vm_memory_high_watermark)."])
            before = re.fullmatch(r"\{ok,([0-9.]+)\}", setting.strip())
            assert before is not None, f"a watermark this helper cannot restore: {setting}"
            raise_it, clear_it = (
                ["set_vm_memory_high_watermark", "0.0001"],
                ["set_vm_memory_high_watermark", before[1]],
            )
        else:
            limit = (await self.ctl_async(["eval", "rabbit_disk_monitor:get_disk_free_limit()."])).strip()
            assert limit.isdigit(), f"a disk limit this helper cannot restore: {limit}"
            raise_it, clear_it = ["set_disk_free_limit", str(10**15)], ["set_disk_free_limit", limit]
        try:
            await self.ctl_async(raise_it)
            await eventually(lambda: self._alarm_raised(resource, True), timeout_s=30)
            yield
        finally:
            await self.ctl_async(clear_it)
            await eventually(lambda: self._alarm_raised(resource, False), timeout_s=30)

    async def _alarm_raised(self, resource: str, raised: bool) -> bool:
        alarms = await self.ctl_async(["eval", "rabbit_alarm:get_alarms()."])  # "[]" when none
        return (resource in alarms) is raised

    async def connections(self, vhost: str) -> dict[str, str]:
        """The vhost's connections: connection name (``hookline-<service>:<pid>``) -> connection pid, as
        ``rabbitmqctl close_connection`` takes it."""
        listed = await self.ctl_async(["list_connections", "-p", vhost, "pid", "client_properties"])
        return {name: pid for pid, name in _CONNECTION.findall(listed)}

    async def ensure_dead_letter_supervisor(self) -> None:
        alive = await self.ctl_async(["eval", "is_pid(whereis(rabbit_fifo_dlx_sup))."])
        if alive.strip() != "true":
            await self.ctl_async(["eval", "supervisor:restart_child(rabbit_sup, rabbit_fifo_dlx_sup)."])

    def url_for(self, vhost: str) -> str:
        parts = urlsplit(self.base_url)
        return urlunsplit((parts.scheme, parts.netloc, "/" + quote(vhost, safe=""), parts.query, ""))

    @contextmanager
    def vhost(self, label: str) -> Iterator[str]:
        """A new vhost (its URL yielded), deleted afterwards with everything in it."""
        name = f"hookline-test-{label[:40]}-{uuid.uuid4().hex[:8]}"
        self._add_vhost(name)
        try:
            yield self.url_for(name)
        finally:
            self._run_ctl(["delete_vhost", name])

    def recreate_vhost(self, url: str) -> None:
        """Delete the vhost of ``url`` with everything in it, and create it again, empty (a broker that
        lost its data)."""
        name = unquote(urlsplit(url).path[1:])
        self._run_ctl(["delete_vhost", name])
        self._add_vhost(name)

    def _add_vhost(self, name: str) -> None:
        user = urlsplit(self.base_url).username or "guest"
        self._run_ctl(["add_vhost", name])
        self._run_ctl(["set_permissions", "-p", name, user, ".*", ".*", ".*"])


def _local_ctl(arguments: list[str]) -> str:
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise RuntimeError("rabbitmqctl is needed to create test vhosts on the local broker")
    done = subprocess.run([ctl, "-q", *arguments], check=True, capture_output=True, text=True, timeout=60)
    return done.stdout


@contextmanager
def broker() -> Iterator[Broker]:
    url = os.environ.get("HOOKLINE_TEST_AMQP_URL")
    if url or not docker_available():
        yield Broker(url or LOCAL_DEFAULT_URL, _local_ctl)
        return
    from testcontainers.rabbitmq import RabbitMqContainer

    with RabbitMqContainer("rabbitmq:3.13") as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(5672)

        def container_ctl(arguments: list[str]) -> str:
            code, output = container.exec(["rabbitmqctl", "-q", *arguments])
            if code != 0:
                raise RuntimeError(output.decode(errors="replace"))
            return str(output.decode(errors="replace"))

        yield Broker(f"amqp://guest:guest@{host}:{port}/", container_ctl)
