"""The RabbitMQ the tests use, and a fresh vhost per test so that runs never see each other's state.

``HOOKLINE_TEST_AMQP_URL`` names a broker (the one on this machine in CI); without it, a testcontainers
RabbitMQ is started where a Docker engine answers, else the local default broker is used. A broker
that cannot be reached is a test failure, never a skip.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from hookline.cli.localservices import docker_available
from support.waiting import eventually

LOCAL_DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
_FILE_HANDLE_ACCOUNT = 10_000
_CONNECTION = re.compile(r'^(<[^>]+>)\t.*\{"connection_name","([^"]+)"\}', re.MULTILINE)

Run = Callable[[list[str]], str]


def vhost_of(amqp_url: str) -> str:
    """The vhost a test's URL names (as ``rabbitmqctl -p`` takes it)."""
    return unquote(urlsplit(amqp_url).path.lstrip("/"))


class Broker:
    def __init__(self, base_url: str, run_ctl: Run) -> None:
        self.base_url = base_url
        self._run_ctl = run_ctl
        self._vhosts = _Vhosts(run_ctl, urlsplit(base_url).username or "guest")

    def close(self) -> None:
        """Delete the vhosts still waiting to be; a deletion that failed fails the session here."""
        self._vhosts.close()

    def ctl(self, arguments: list[str]) -> str:
        """Run ``rabbitmqctl`` against this broker (locally, or inside its container); its output."""
        return self._run_ctl(arguments)

    async def ctl_async(self, arguments: list[str]) -> str:
        return await asyncio.to_thread(self._run_ctl, arguments)

    async def restart_app(self, *, down_s: float = 0.0) -> None:
        """Stop and start the RabbitMQ application (the node stays), as an operator's restart would."""
        await self.stop_app()
        if down_s:
            await asyncio.sleep(down_s)  # the operator's pause while the broker is away
        await self.start_app()

    async def stop_app(self) -> None:
        await asyncio.to_thread(self._vhosts.wait_deleted)  # not deleting queues while the node stops
        await self.ctl_async(["stop_app"])

    async def start_app(self) -> None:
        """Start the application again and wait for it, with what a start undoes put back.

        RabbitMQ 3.10 can lose its at-least-once dead-letter supervisor when quorum queues are deleted
        while their dead-letter workers start after a restart (every later declare of such a queue is
        then an INTERNAL_ERROR); tests delete whole vhosts, so the supervisor is checked and restarted.
        Its dead-letter workers start with their queues, with the shorter resend timer of
        :meth:`shorten_dead_letter_resend`."""
        await self.ctl_async(["start_app"])
        await self.ctl_async(["await_startup"])
        await self.ensure_dead_letter_supervisor()
        await asyncio.to_thread(self.widen_file_handle_account)  # a start reads it from the config again

    @asynccontextmanager
    async def alarm(self, resource: Literal["memory", "disk"]) -> AsyncIterator[None]:
        """A resource alarm raised on the broker for the block's duration, as a broker running out of
        memory or disk would raise it, and cleared afterwards whatever happened. It blocks the publishers
        of every vhost: keep the block short."""
        if resource == "memory":
            raise_it = ["set_vm_memory_high_watermark", "0.0001"]
        else:
            raise_it = ["set_disk_free_limit", str(10**15)]
        try:
            await self.ctl_async(raise_it)
            await eventually(lambda: self._alarm_raised(resource, True), timeout_s=30)
            yield
        finally:
            await asyncio.to_thread(self.restore_resource_limits)
            await eventually(lambda: self._alarm_raised(resource, False), timeout_s=30)

    def restore_resource_limits(self) -> None:
        """The memory watermark and disk limit back to the broker's configured ones.

        A limit set at run time stays until the node restarts: a test killed inside :meth:`alarm` (a
        session ended under it) would leave every publish of the next run refused, and each of its tests
        waiting out its timeout. The configured values are the application's environment, which a
        run-time setting leaves alone."""
        self._run_ctl(
            [
                "eval",
                # Each only where configured (a broker's defaults may live elsewhere in other versions).
                "case application:get_env(rabbit, vm_memory_high_watermark) of"
                " {ok, Memory} -> vm_memory_monitor:set_vm_memory_high_watermark(Memory); undefined -> ok end,"
                " case application:get_env(rabbit, disk_free_limit) of"
                " {ok, Disk} -> rabbit_disk_monitor:set_disk_free_limit(Disk); undefined -> ok end.",
            ]
        )

    def widen_file_handle_account(self) -> None:
        """RabbitMQ 3.x counts three file handles per quorum queue, though an idle one holds none open,
        and once its count reaches the limit it derives from the open-file limit (927 of a usual 1,024)
        every caller waits: new connections, a vhost's message store stopping. Three test systems at a
        time (lanes, holding queues, queues of their own) and the vhosts being deleted behind them
        counted 842 here while 251 descriptors were open, and the broker stopped accepting connections
        for 22 s at a time. The count's limit is raised; what is open stays far below the real one.
        (4.x keeps no such count.)"""
        self._run_ctl(
            ["eval", f"try file_handle_cache:set_limit({_FILE_HANDLE_ACCOUNT}) catch error:undef -> ok end."]
        )

    def shorten_dead_letter_resend(self) -> None:
        """RabbitMQ 3.10 starts a quorum queue's dead-letter worker with the queue, and after a restart
        one that dead-letters before the node has recovered its bindings finds no queue ("Cannot forward
        any dead-letter messages") and tries again only after ``dead_letter_worker_publisher_confirm_timeout``
        (180 s): a retry due during the restart arrives three minutes late, nothing lost (README,
        "Operations"). The fault suite, which restarts the broker itself, lost one such retry to its end
        (CI, once). Workers read the timeout when they start, and an application's environment outlives
        ``stop_app``: set once, it holds for every restart of the run, so that tests wait for hookline."""
        self._run_ctl(
            ["eval", "application:set_env(rabbit, dead_letter_worker_publisher_confirm_timeout, 5000)."]
        )

    def alarms(self) -> str:
        """The broker's raised resource alarms, as it prints them ("[]" when none)."""
        return self._run_ctl(["eval", "rabbit_alarm:get_alarms()."]).strip()

    async def _alarm_raised(self, resource: str, raised: bool) -> bool:
        return (resource in await asyncio.to_thread(self.alarms)) is raised

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
    def vhost(self) -> Iterator[str]:
        """A new vhost (its URL yielded), deleted afterwards with everything in it."""
        name = self._vhosts.take()
        try:
            yield self.url_for(name)
        finally:
            self._vhosts.give_back(name)

    def recreate_vhost(self, url: str) -> None:
        """Delete the vhost of ``url`` with everything in it, and create it again, empty (a broker that
        lost its data)."""
        name = vhost_of(url)
        self._run_ctl(["delete_vhost", name])
        self._vhosts.add_one(name)


class _Vhosts:
    """Test vhosts made ahead and deleted behind, in batches. Each rabbitmqctl call boots an Erlang VM
    (half a second of CPU here) and a run of the suite uses about a hundred vhosts: three calls each were
    a sixth of its CPU and seconds of every module's start and end. One ``rabbitmqctl eval`` makes or
    deletes a batch; a broker that refuses it (its internals changed) gets one command per step."""

    MADE_AHEAD = 6
    GATHER_S = 1.0  # how long a deletion waits for the teardowns right behind it, to share their call
    ACTOR = '<<"hookline-tests">>'

    def __init__(self, run_ctl: Run, user: str) -> None:
        self._run_ctl = run_ctl
        self._user = user
        self._batched = re.fullmatch(r"[A-Za-z0-9_.@-]+", user) is not None
        self._ready: list[str] = []
        self._doomed: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._pending = 0
        self._settled = threading.Condition()
        self._failures: list[str] = []
        self._deleter: threading.Thread | None = None

    def take(self) -> str:
        if not self._ready:
            names = [f"hookline-test-{uuid.uuid4().hex[:12]}" for _ in range(self.MADE_AHEAD)]
            if not self._try_eval(
                f"[ok = begin ok = rabbit_vhost:add(V, {self.ACTOR}), "
                f'rabbit_auth_backend_internal:set_permissions(<<"{self._user}">>, V, '
                f'<<".*">>, <<".*">>, <<".*">>, {self.ACTOR}) end || V <- {_binaries(names)}], ok.'
            ):
                names = [f"hookline-test-{uuid.uuid4().hex[:12]}"]  # fresh: the batch may have half-made
                self.add_one(names[0])
            self._ready.extend(names)
        return self._ready.pop()

    def add_one(self, name: str) -> None:
        self._run_ctl(["add_vhost", name])
        self._run_ctl(["set_permissions", "-p", name, self._user, ".*", ".*", ".*"])

    def give_back(self, name: str) -> None:
        if self._deleter is None:
            self._deleter = threading.Thread(target=self._delete_behind, name="vhost-deleter", daemon=True)
            self._deleter.start()
        with self._settled:
            self._pending += 1
        self._doomed.put(name)

    def wait_deleted(self) -> None:
        with self._settled:
            self._settled.wait_for(lambda: self._pending == 0, timeout=120)

    def close(self) -> None:
        for name in self._ready:
            self.give_back(name)
        self._ready.clear()
        if self._deleter is not None:
            self._doomed.put(None)
            self._deleter.join(timeout=300)
        assert not self._failures, f"test vhosts not deleted: {self._failures}"

    def _delete_behind(self) -> None:
        while True:
            batch = [self._doomed.get()]
            time.sleep(self.GATHER_S)
            while not self._doomed.empty():
                batch.append(self._doomed.get_nowait())
            names = [name for name in batch if name is not None]
            try:
                self._delete(names)
            except Exception as error:  # kept for close(): a thread's exception would only be printed
                self._failures.append(f"{names}: {error}")
            with self._settled:
                self._pending -= len(names)
                self._settled.notify_all()
            if None in batch:
                return

    def _delete(self, names: list[str]) -> None:
        if not names or self._try_eval(
            f"[ok = rabbit_vhost:delete(V, {self.ACTOR}) || V <- {_binaries(names)}], ok."
        ):
            return
        for name in names:
            self._run_ctl(["delete_vhost", name])

    def _try_eval(self, expression: str) -> bool:
        if self._batched:
            try:
                self._run_ctl(["eval", expression])
                return True
            except (subprocess.CalledProcessError, RuntimeError):
                self._batched = False
        return False


def _binaries(names: list[str]) -> str:
    """``names`` (hex and dashes) as an Erlang list of binaries."""
    return "[" + ", ".join(f'<<"{name}">>' for name in names) + "]"


class _LocalCtl:
    """``rabbitmqctl`` against this machine's node (``RABBITMQ_NODENAME`` names another), with each
    ``eval`` sent through ``erl_call`` where the node's Erlang has it.

    Every rabbitmqctl call boots an Erlang VM: half a second of CPU. A run of the suite made about two
    hundred (the vhosts' batches, most of them), about a fifth of all the CPU its tests took.
    erl_call, a small C program shipped with Erlang, asks the running node (5 ms). The node's name,
    cookie and Erlang directory come from one rabbitmqctl call, at the first ``eval``."""

    def __init__(self) -> None:
        ctl = shutil.which("rabbitmqctl")
        if ctl is None:
            raise RuntimeError("rabbitmqctl is needed to create test vhosts on the local broker")
        self._ctl = ctl
        self._erl_call: list[str] | None = None
        self._looked_up = False
        self._lookup = threading.Lock()
        self._home = tempfile.mkdtemp(prefix="hookline-erl-call-")
        atexit.register(shutil.rmtree, self._home, ignore_errors=True)

    def __call__(self, arguments: list[str]) -> str:
        if arguments[0] == "eval" and (erl_call := self._erl_call_command()) is not None:
            return _erl_call_eval(erl_call, arguments[1], home=self._home)
        return self._rabbitmqctl(arguments)

    def _rabbitmqctl(self, arguments: list[str]) -> str:
        done = subprocess.run(
            [self._ctl, "-q", *arguments], check=True, capture_output=True, text=True, timeout=60
        )
        return done.stdout

    def _erl_call_command(self) -> list[str] | None:
        with self._lookup:
            if not self._looked_up:
                self._erl_call = self._find_erl_call()
                self._looked_up = True
            return self._erl_call

    def _find_erl_call(self) -> list[str] | None:
        found = self._rabbitmqctl(
            ["eval", 'io:format("~s ~s ~s~n", [node(), erlang:get_cookie(), code:root_dir()]), ok.']
        )
        node, cookie, erlang_root = found.splitlines()[0].split(" ", 2)
        program = Path(erlang_root) / "bin" / "erl_call"
        if not os.access(program, os.X_OK):
            return None
        # The cookie in a file of this process's own (erl_call reads $HOME/.erlang.cookie), never on a
        # command line that any local user's ps shows.
        (Path(self._home) / ".erlang.cookie").write_text(cookie)
        (Path(self._home) / ".erlang.cookie").chmod(0o400)
        names = "-name" if "." in node.partition("@")[2] else "-sname"
        return [str(program), names, node, "-e"]


def _erl_call_eval(erl_call: list[str], expression: str, *, home: str) -> str:
    """The value of ``expression`` on the node as rabbitmqctl eval prints it (``ok``, ``[]``, ``true``)."""
    # A client name of its own: erl_call's own (even its "random" one) repeats across calls made at once,
    # and the node then refuses the second.
    done = subprocess.run(
        [*erl_call, "-h", f"hookline-tests-{uuid.uuid4().hex}"],
        input=expression + "\n",
        env={**os.environ, "HOME": home},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    answer = done.stdout.strip()
    if done.returncode != 0 or not (answer.startswith("{ok, ") and answer.endswith("}")):
        raise RuntimeError(f"erl_call: {answer or done.stderr.strip()}")
    return answer.removeprefix("{ok, ").removesuffix("}") + "\n"


@contextmanager
def broker() -> Iterator[Broker]:
    url = os.environ.get("HOOKLINE_TEST_AMQP_URL")
    if url or not docker_available():
        running = Broker(url or LOCAL_DEFAULT_URL, _LocalCtl())
        _no_alarm_left(running)
        running.widen_file_handle_account()
        running.shorten_dead_letter_resend()
        yield running
        running.close()
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

        running = Broker(f"amqp://guest:guest@{host}:{port}/", container_ctl)
        running.shorten_dead_letter_resend()
        yield running
        running.close()


def _no_alarm_left(running: Broker) -> None:
    """A broker that refuses publishes fails the session at once, naming why, rather than each test
    after its timeout: one left so by an earlier run is restored first."""
    running.restore_resource_limits()
    deadline = time.monotonic() + 15
    while (alarms := running.alarms()) != "[]" and time.monotonic() < deadline:
        time.sleep(0.5)  # the monitors clear an alarm on their next check
    if alarms != "[]":
        raise RuntimeError(
            f"the broker at {running.base_url} has resource alarms raised ({alarms}): it refuses every"
            " publish until memory or disk is freed"
        )
