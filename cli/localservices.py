"""``make run`` and ``make test`` start what they need on this machine: RabbitMQ (and, for the tests,
PostgreSQL) when the configured address is this machine's, nothing answers there, and it is installed;
when it is not installed, one line says the exact command that installs it.

    python -m hookline.cli.localservices HOOKLINE_AMQP_URL [HOOKLINE_TEST_POSTGRES_URL ...]

Each argument names a setting (its value from the environment, else its default). What to do is
:func:`decide`, a pure function of three facts (the address is this machine's, something answers
there, the server is installed); the starting itself is the scripts a newcomer would run by hand
(``scripts/start-rabbitmq.sh``, ``scripts/start-postgres.sh``). Only the standard library: it runs
before anything else is known to work.
"""

from __future__ import annotations

import enum
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})
#: How long a TCP connect may take before the address counts as not answering.
CONNECT_TIMEOUT_S = 2.0
#: After a start script returns (the server answers on its own port), how long to wait for ours.
ANSWER_WAIT_S = 10.0
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@dataclass(frozen=True)
class Server:
    name: str
    default_port: int
    start_script: str
    #: Any of these on PATH (or at these paths) means it is installed.
    programs: tuple[str, ...]
    debian_package: str
    brew_formula: str


RABBITMQ = Server(
    name="RabbitMQ",
    default_port=5672,
    start_script="start-rabbitmq.sh",
    programs=("rabbitmq-server", "/usr/sbin/rabbitmq-server", "/usr/lib/rabbitmq/bin/rabbitmq-server"),
    debian_package="rabbitmq-server",
    brew_formula="rabbitmq",
)
POSTGRES = Server(
    name="PostgreSQL",
    default_port=5432,
    start_script="start-postgres.sh",
    programs=("pg_ctlcluster", "pg_ctl", "postgres"),
    debian_package="postgresql",
    brew_formula="postgresql@16",
)


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    server: Server
    #: Unset, the tests use a RabbitMQ container when a Docker engine answers (tests/support/broker.py).
    container_when_unset: bool = False


SETTINGS = {
    setting.name: setting
    for setting in (
        Setting("HOOKLINE_AMQP_URL", "amqp://guest:guest@localhost:5672/", RABBITMQ),
        Setting("HOOKLINE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", RABBITMQ, True),
        Setting("HOOKLINE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres", POSTGRES),
    )
}


class Action(enum.Enum):
    NOTHING = "answering"
    START = "start"
    INSTALL = "not installed"
    ELSEWHERE = "not answering on another machine"


def decide(*, local: bool, answering: bool, installed: bool) -> Action:
    """What to do about one server: nothing when it answers; start it when it is this machine's and
    installed; say how to install it when it is this machine's and not; otherwise it is for whoever runs
    that machine."""
    if answering:
        return Action.NOTHING
    if not local:
        return Action.ELSEWHERE
    return Action.START if installed else Action.INSTALL


def install_hint(server: Server, *, apt: bool, brew: bool, root: bool) -> str:
    """How to install ``server`` here: the exact command where the package manager is known."""
    if apt:
        return f"install it with: {'' if root else 'sudo '}apt-get install -y {server.debian_package}"
    if brew:
        return f"install it with: brew install {server.brew_formula}"
    return f"install it with your package manager (on Debian: apt-get install -y {server.debian_package})"


def address(url: str, default_port: int) -> tuple[str, int]:
    """host and port of a server URL (a cluster's list: its first node)."""
    parts = urlsplit(url.split(",")[0].strip())
    port = parts.port or (5671 if parts.scheme == "amqps" else default_port)
    return parts.hostname or "localhost", port


def answering(host: str, port: int, *, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def installed(server: Server, which: Callable[[str], str | None] = shutil.which) -> bool:
    return any(which(program) is not None for program in server.programs)


def docker_available() -> bool:
    """Whether a Docker engine answers ``GET /_ping``. Asked over a socket of our own: the docker
    library leaks its socket when no engine listens."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    parts = urlsplit(host)
    try:
        if parts.scheme == "unix":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(2)
                sock.connect(parts.path)
                return _pings(sock)
        if parts.scheme == "tcp" and parts.hostname:
            with socket.create_connection((parts.hostname, parts.port or 2375), timeout=2) as sock:
                return _pings(sock)
    except OSError:
        return False
    return False


def _pings(sock: socket.socket) -> bool:
    sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
    return sock.recv(64).split(b" ")[1:2] == [b"200"]


def ensure(setting: Setting, environ: dict[str, str]) -> str | None:
    """Make the setting's server answer if this machine can; None when it does, else why not (one line)."""
    given = environ.get(setting.name)
    if given is None and setting.container_when_unset and docker_available():
        return None  # the tests start a container of their own
    url = given or setting.default
    server = setting.server
    host, port = address(url, server.default_port)
    action = decide(local=host in LOCAL_HOSTS, answering=answering(host, port), installed=installed(server))
    if action is Action.NOTHING:
        return None
    where = f"{host}:{port} ({setting.name})"
    if action is Action.ELSEWHERE:
        return f"{server.name} does not answer at {where}, which is not this machine: start it there"
    if action is Action.INSTALL:
        hint = install_hint(
            server, apt=shutil.which("apt-get") is not None, brew=shutil.which("brew") is not None,
            root=os.geteuid() == 0,
        )  # fmt: skip
        return f"{server.name} is not installed; {hint}"
    print(f"hookline: {server.name} does not answer at {where}: starting it", file=sys.stderr)
    started = subprocess.run([str(SCRIPTS / server.start_script)], check=False)  # noqa: S603 (our own script)
    if started.returncode != 0:
        return f"{server.name} did not start (scripts/{server.start_script} exited {started.returncode})"
    deadline = time.monotonic() + ANSWER_WAIT_S
    while not answering(host, port):
        if time.monotonic() > deadline:
            return (
                f"{server.name} is running but does not answer at {where}: point {setting.name} at its port"
            )
        time.sleep(0.5)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv)
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or not names:
        print(f"usage: python -m hookline.cli.localservices {' | '.join(SETTINGS)} ...", file=sys.stderr)
        return 2
    for name in names:
        problem = ensure(SETTINGS[name], dict(os.environ))
        if problem is not None:
            print(f"hookline: {problem}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
