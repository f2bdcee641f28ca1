"""compose.yaml describes the same system as `make run`, with commands the real CLI accepts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from hookline.cli.brokersetup import password_variable
from hookline.cli.main import build_parser
from hookline.dispatcher.settings import DispatcherSettings
from hookline.health_monitor.settings import MonitorSettings
from hookline.ingest.settings import IngestSettings
from hookline.outbox_relay.settings import OutboxRelaySettings
from hookline.shared.broker.permissions import USERS, Role

ROOT = Path(__file__).resolve().parents[2]
HOOKLINE = str(Path(sys.executable).with_name("hookline"))


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_runs_ingest_two_dispatchers_and_the_monitor_against_rabbitmq() -> None:
    services = {name: s for name, s in _compose()["services"].items() if "profiles" not in s}
    assert set(services) == {"rabbitmq", "broker-setup", "ingest", "dispatcher", "health-monitor"}
    assert services["dispatcher"]["deploy"]["replicas"] == 2
    assert services["rabbitmq"]["image"].startswith("rabbitmq:")
    # The broker is reached from this host only; the services connect as their own users.
    assert all(port.startswith("127.0.0.1:") for port in services["rabbitmq"]["ports"])
    assert services["broker-setup"]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    passwords = services["broker-setup"]["environment"]
    for name, role in (
        ("ingest", Role.INGEST),
        ("dispatcher", Role.DISPATCHER),
        ("health-monitor", Role.MONITOR),
    ):
        service = services[name]
        assert service["command"] == ["hookline", name]
        url = service["environment"]["HOOKLINE_AMQP_URL"]
        assert f"amqp://{USERS[role]}:" in url
        assert "guest" not in url
        # The password the service connects with is the one broker-setup set.
        password = passwords[password_variable(USERS[role])]
        assert password in url
        assert service["depends_on"]["broker-setup"]["condition"] == "service_completed_successfully"
        assert service["environment"]["HOOKLINE_DEVELOPMENT"] == "${HOOKLINE_DEVELOPMENT:-false}"


def test_the_cluster_profile_adds_two_nodes_that_join_the_first_with_one_cookie() -> None:
    compose = _compose()
    services = compose["services"]
    nodes = ["rabbitmq", "rabbitmq-2", "rabbitmq-3"]
    assert [services[n].get("profiles") for n in nodes] == [None, ["cluster"], ["cluster"]]
    assert len({services[n]["image"] for n in nodes}) == 1
    assert [services[n]["hostname"] for n in nodes] == nodes  # node names rabbit@<hostname>
    assert len({services[n]["environment"]["RABBITMQ_COOKIE"] for n in nodes}) == 1
    join = compose["configs"]["rabbitmq-join"]["content"]
    assert "classic_config.nodes.1 = rabbit@rabbitmq\n" in join
    for node in nodes[1:]:
        assert services[node]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
        assert {c["source"] for c in services[node]["configs"]} == {"rabbitmq-conf", "rabbitmq-join"}
        assert f"{node}-data" in compose["volumes"]
    assert "queue_leader_locator = balanced" in compose["configs"]["rabbitmq-conf"]["content"]
    # The services reach every node when told to (README): each one's URL is overridable as a whole.
    assert services["ingest"]["environment"]["HOOKLINE_AMQP_URL"].startswith("${HOOKLINE_INGEST_AMQP_URL:-")


def test_every_compose_command_is_a_real_cli_command() -> None:
    for name, service in _compose()["services"].items():
        if "command" not in service or not str(service.get("image", "")).startswith("hookline:"):
            continue  # the broker, or Prometheus and Grafana (the observability profile)
        program, *arguments = service["command"]
        assert program == "hookline", name
        done = subprocess.run([HOOKLINE, *arguments, "--help"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert build_parser().parse_args(arguments).command == name


def test_every_compose_setting_is_a_real_setting() -> None:
    known = {
        f"HOOKLINE_{field.upper()}"
        for cls in (IngestSettings, DispatcherSettings, MonitorSettings, OutboxRelaySettings)
        for field in cls.model_fields
    }
    for name, service in _compose()["services"].items():
        for variable in service.get("environment", {}):
            if name == "broker-setup" and variable.startswith("HOOKLINE_BROKER_PASSWORD_"):
                continue  # broker-setup's own (cli/brokersetup.py)
            if variable.startswith("HOOKLINE_"):
                assert variable in known, (name, variable)


def test_the_image_installs_from_the_repo_files() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for copied in ("pyproject.toml", "constraints.txt", "shared", "services", "receiver", "cli"):
        assert copied in dockerfile
