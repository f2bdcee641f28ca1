"""make run's and make test's start of local services, run as make runs it, against addresses on this
machine: the broker that answers is left alone, a port where nothing listens is started for (the local
broker answers on its own port, so nothing changes) and then named, a server that is not installed gets
the command that installs it. The shared broker is never stopped or restarted here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.broker import Broker
from support.services import free_port

pytestmark = pytest.mark.integration


def run(setting: str, value: str, *, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: item for key, item in os.environ.items() if not key.startswith("HOOKLINE_")}
    env[setting] = value
    if path is not None:
        env["PATH"] = path
    command = [sys.executable, "-m", "hookline.cli.localservices", setting]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)


def test_a_broker_that_answers_is_left_alone(rabbitmq: Broker) -> None:
    done = run("HOOKLINE_AMQP_URL", rabbitmq.base_url)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_local_address_where_nothing_listens_is_started_for_then_named(rabbitmq: Broker) -> None:
    port = free_port()
    done = run("HOOKLINE_AMQP_URL", f"amqp://guest:guest@127.0.0.1:{port}/")
    assert done.returncode == 1
    assert f"RabbitMQ does not answer at 127.0.0.1:{port} (HOOKLINE_AMQP_URL): starting it" in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"hookline: RabbitMQ is running but does not answer at 127.0.0.1:{port} (HOOKLINE_AMQP_URL): "
        "point HOOKLINE_AMQP_URL at its port"
    )


def test_a_server_that_is_not_installed_gets_the_command_that_installs_it() -> None:
    port = free_port()
    done = run(
        "HOOKLINE_TEST_POSTGRES_URL", f"postgresql://postgres@127.0.0.1:{port}/postgres", path="/nonexistent"
    )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("hookline: PostgreSQL is not installed; install it with")
    assert "apt-get install -y postgresql" in line
