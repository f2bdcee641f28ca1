"""The real services, each a process of its own with its own environment: forked from a server that has
already imported hookline (support.forkserver), or with ``HOOKLINE_TEST_FORK=0`` started as
``hookline <service>``."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from support import forkserver

HOOKLINE = str(Path(sys.executable).with_name("hookline"))
TOKEN = "test-token-0123456789abcdef"


# Ports for the services tests start: below the kernel's ephemeral range (where receivers and client
# sockets get theirs), in a block of their own per pytest-xdist worker, taken in turn. A port picked by
# one worker (or a moment ago by this one, for a service still starting) is then never picked by another
# before it is bound. Two pytest sessions on one machine (two developers' checkouts) keep apart by giving
# one of them HOOKLINE_TEST_PORT_BLOCKS_FROM (a block number, 0-10; each xdist worker takes the next,
# and make test's serial run, beside them, the one after the workers': scripts/run-tests.sh).
_PORT_BLOCK = 1000
_FIRST_PORT = 20000
_next_port = itertools.count()


def free_port() -> int:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    worker += int(os.environ.get("HOOKLINE_TEST_PORT_BLOCKS_FROM", "0"))
    low = _FIRST_PORT + worker * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = low + next(_next_port) % _PORT_BLOCK
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (a service of an earlier test still stopping)
        return port
    raise RuntimeError(f"no free port in {low}-{low + _PORT_BLOCK - 1}")


def base_env(amqp_url: str, **overrides: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HOOKLINE_")}
    env.update(
        HOOKLINE_AMQP_URL=amqp_url,
        HOOKLINE_API_TOKEN=TOKEN,
        HOOKLINE_ALLOW_HTTP="true",
        HOOKLINE_ALLOW_PRIVATE_TARGETS="true",
        HOOKLINE_CONNECT_TIMEOUT_S="15",
        HOOKLINE_SHUTDOWN_GRACE_S="5",
        # Tests shrink the retry schedule through settings; jitter off makes the delays exact.
        HOOKLINE_RETRY_SCHEDULE_S="1,2",
        HOOKLINE_RETRY_JITTER="none",
        # Reading the broker's resources through its CLI costs half a second of CPU a time: only the
        # tests about them (test_broker_resources.py) turn it on.
        HOOKLINE_RABBITMQ_DIAGNOSTICS="",
    )
    env.update(overrides)
    return env


class Service:
    """One service process; its JSON log goes to a file the test can read."""

    def __init__(self, command: str, env: Mapping[str, str], log_dir: Path, *, port: int, name: str) -> None:
        self.command = command
        self.port = port
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.killed = False
        self._terminated = False
        self.process: subprocess.Popen[bytes] | forkserver.ForkedProcess
        # A service started again under its name starts its log afresh.
        with self.log_path.open("wb") as log:
            if forkserver.enabled():
                self.process = forkserver.start([command], env, self.log_path)
            else:
                self.process = subprocess.Popen([HOOKLINE, command], env=dict(env), stdout=log, stderr=log)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        # Four services importing their libraries at once on a loaded two-core machine took 20-30 s to
        # log a first line (issue 23): the deadline is for that machine, a quiet one takes seconds.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM, not waited for (:meth:`stop` waits): services stopped together shut down at once."""
        # Once only: a second SIGTERM that comes after the service restored the default handler kills it.
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit code (SIGKILL after the timeout is a failure for the caller)."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL, as a fault; such a service is left out of the clean-exit check."""
        self.killed = True
        self.process.kill()
        self.process.wait()


def start(
    command: str, env: Mapping[str, str], log_dir: Path, *, name: str | None = None, port: int | None = None
) -> Service:
    """``hookline COMMAND`` on ``port`` (a free one when None: a service on the port of one stopped
    before finds that one's local state, one file per service and port)."""
    port = free_port() if port is None else port
    port_variable = {
        "ingest": "HOOKLINE_INGEST_PORT",
        "dispatcher": "HOOKLINE_DISPATCHER_METRICS_PORT",
        "health-monitor": "HOOKLINE_MONITOR_PORT",
        "outbox-relay": "HOOKLINE_OUTBOX_METRICS_PORT",
    }[command]
    return Service(command, {**env, port_variable: str(port)}, log_dir, port=port, name=name or command)
