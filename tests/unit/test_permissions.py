"""The permission matrix derived from topology's names, broker-setup's plan (pure), and the passwords it
takes."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest

from hookline.cli.brokersetup import (
    MIN_PASSWORD_LENGTH,
    CtlAdmin,
    PasswordError,
    SetupError,
    Upstream,
    password_hash,
    password_variable,
    plan,
    setup,
    wanted_users,
)
from hookline.cli.main import build_parser
from hookline.shared.broker import topology
from hookline.shared.broker.permissions import GRANTS, NOTHING, USERS, Role, names, upstream_grant

ENDPOINT_QUEUE = topology.endpoint_queue("ep_01JD0000000000000000000000", 3)
ROUTE = topology.route_exchange("ep_01JD0000000000000000000000")


def allowed(expression: str, name: str) -> bool:
    return re.search(expression, name) is not None


@pytest.mark.parametrize(
    ("role", "permission", "name", "expected"),
    [
        # The ingest owns the topology.
        (Role.INGEST, "configure", topology.ENDPOINT_LOG, True),
        (Role.INGEST, "configure", ENDPOINT_QUEUE, True),
        (Role.INGEST, "write", "amq.default", True),
        (Role.INGEST, "write", topology.EVENTS_EXCHANGE, True),
        (Role.INGEST, "configure", topology.MONITOR_LEADER_LOCK, False),
        # A dispatcher: endpoint queues, retries, dead letters, telemetry; no streams, no events.
        (Role.DISPATCHER, "configure", ENDPOINT_QUEUE, True),
        (Role.DISPATCHER, "configure", ROUTE, True),
        (Role.DISPATCHER, "configure", topology.ENDPOINT_LOG, False),
        (Role.DISPATCHER, "configure", topology.EVENT_LOG, False),
        (Role.DISPATCHER, "write", topology.delay_level(27), True),
        (Role.DISPATCHER, "write", topology.DEAD_LETTER_EXCHANGE, True),
        (Role.DISPATCHER, "write", topology.EVENTS_EXCHANGE, False),
        (Role.DISPATCHER, "write", topology.CONTROL_EXCHANGE, False),
        (Role.DISPATCHER, "read", ENDPOINT_QUEUE, True),
        (Role.DISPATCHER, "read", topology.EVENT_LOG, False),
        (Role.DISPATCHER, "read", topology.TELEMETRY_LOG, False),
        # A monitor: breaker commands, alerts, the lock; no telemetry or retries of its own.
        (Role.MONITOR, "configure", topology.MONITOR_LEADER_LOCK, True),
        (Role.MONITOR, "write", topology.CONTROL_EXCHANGE, True),
        (Role.MONITOR, "write", topology.TELEMETRY_EXCHANGE, False),
        (Role.MONITOR, "write", topology.delay_level(0), False),
        (Role.MONITOR, "configure", topology.DEAD_LETTER_STREAM, False),
        (Role.MONITOR, "read", topology.TELEMETRY_LOG, True),
        # Anchored: a name that merely starts or ends like an allowed one is not allowed.
        (Role.MONITOR, "write", "xhookline.control", False),
        (Role.MONITOR, "write", "hookline.control.x", False),
    ],
)
def test_each_role_may_use_only_its_names(role: Role, permission: str, name: str, expected: bool) -> None:
    assert allowed(getattr(GRANTS[role], permission), name) is expected


def test_an_upstream_may_only_write_events_and_a_tenant_only_its_keys() -> None:
    grant, topic = upstream_grant("acme")
    assert (grant.configure, grant.read) == (NOTHING, NOTHING)
    assert allowed(grant.write, "events")
    assert not allowed(grant.write, "amq.default")
    assert not allowed(grant.write, topology.ENDPOINT_LOG)
    assert topic is not None
    assert topic.exchange == "events"
    assert allowed(topic.write, "acme.order.created")
    assert not allowed(topic.write, "acmex.order.created")
    assert not allowed(topic.write, "beta.order.created")
    assert upstream_grant(None)[1] is None


def test_names_escapes_and_anchors() -> None:
    assert names(("a.b",), ("p.",)) == r"^(?:a\.b|p\..*)$"
    assert names() == NOTHING


def test_rabbitmq_password_hash() -> None:
    salt = b"\x01\x02\x03\x04"
    hashed = base64.b64decode(password_hash("secret", salt))
    assert hashed[:4] == salt
    assert hashed[4:] == hashlib.sha256(salt + b"secret").digest()


def _plan(current: dict[str, object], *, given: dict[str, str] | None = None, rotate: bool = False):  # type: ignore[no-untyped-def]
    counter = iter(range(100))
    return plan(
        current,
        vhost="v",
        wanted=wanted_users([Upstream(user="orders", tenant="acme"), Upstream(user="anything")]),
        given=given or {},
        rotate=rotate,
        new_password=lambda: f"generated-{next(counter)}",
        new_salt=lambda: b"salt",
    )


def test_new_users_get_generated_passwords_and_every_permission() -> None:
    decided = _plan({"users": []})
    users = {u["name"]: u for u in decided.definitions["users"]}
    assert set(users) == {"hookline-ingest", "hookline-dispatcher", "hookline-monitor", "orders", "anything"}
    assert set(decided.passwords) == set(users)
    assert users["hookline-monitor"]["tags"] == ["monitoring"]
    assert users["hookline-dispatcher"]["tags"] == []
    assert {p["user"] for p in decided.definitions["permissions"]} == set(users)
    assert all(p["vhost"] == "v" for p in decided.definitions["permissions"])
    [topic] = decided.definitions["topic_permissions"]
    assert (topic["user"], topic["exchange"], topic["write"]) == ("orders", "events", r"^acme\.")
    assert decided.clear_topics == []


def test_an_existing_users_password_is_kept_unless_given_or_rotated() -> None:
    existing = {"name": "orders", "password_hash": "KEPT", "tags": []}
    kept = _plan({"users": [existing]})
    assert "orders" not in kept.passwords
    assert next(u for u in kept.definitions["users"] if u["name"] == "orders")["password_hash"] == "KEPT"
    given = _plan({"users": [existing]}, given={"orders": "from-the-environment"})
    assert given.passwords["orders"] == "from-the-environment"
    assert _plan({"users": [existing]}, rotate=True).passwords["orders"].startswith("generated-")


def test_a_tenant_limit_removed_is_cleared() -> None:
    current = {
        "users": [{"name": "anything", "password_hash": "X", "tags": []}],
        "topic_permissions": [{"user": "anything", "vhost": "v", "exchange": "events", "write": "^old\\."}],
    }
    assert _plan(current).clear_topics == ["anything"]


class _Broker:
    """An empty broker that records what is loaded into it."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, Any]] = []

    def export(self) -> dict[str, Any]:
        return {"users": []}

    def load(self, definitions: dict[str, Any]) -> None:
        self.loaded.append(definitions)

    def clear_topic_permissions(self, vhost: str, user: str) -> None:
        raise AssertionError("no topic permission to clear")


@pytest.mark.parametrize("password", ["REPLACE_ME", "", "x" * (MIN_PASSWORD_LENGTH - 1)])
def test_a_given_password_too_short_is_refused_before_the_broker_is_touched(password: str) -> None:
    broker = _Broker()
    environ = {password_variable(USERS[Role.DISPATCHER]): password}
    with pytest.raises(PasswordError, match="HOOKLINE_BROKER_PASSWORD_HOOKLINE_DISPATCHER is shorter"):
        setup(broker, vhost="/", amqp_url="amqp://broker:5672/", environ=environ)
    assert broker.loaded == []


def test_a_given_password_long_enough_is_set_and_not_shown() -> None:
    broker = _Broker()
    environ = {password_variable(USERS[Role.DISPATCHER]): "x" * MIN_PASSWORD_LENGTH}
    users = {u.user: u for u in setup(broker, vhost="/", amqp_url="amqp://broker:5672/", environ=environ)}
    assert users[USERS[Role.DISPATCHER]].password is None
    assert users[USERS[Role.INGEST]].password is not None  # not given: generated, shown once
    assert len(broker.loaded) == 1


def test_the_cli_exits_2_on_a_refused_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(password_variable(USERS[Role.INGEST]), "REPLACE_ME")
    # Nothing listens there: reaching for it would exit 1 instead.
    args = build_parser().parse_args(["broker-setup", "--management-url", "http://admin:pw@127.0.0.1:9"])
    assert args.run(args) == 2
    assert "HOOKLINE_BROKER_PASSWORD_HOOKLINE_INGEST is shorter than 16" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "problem"),
    [("orders:", "empty"), ("hookline-ingest", "hookline's own"), ("bad name!", "pattern")],
)
def test_an_upstream_that_would_fail_open_or_take_a_role_is_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Upstream.parse(text)


def test_an_operators_user_is_not_turned_into_an_upstream() -> None:
    with pytest.raises(SetupError, match="tags"):
        _plan({"users": [{"name": "anything", "password_hash": "X", "tags": ["administrator"]}]})


def test_a_kept_password_keeps_its_hashing_algorithm() -> None:
    existing = {
        "name": "orders",
        "password_hash": "H",
        "hashing_algorithm": "rabbit_password_hashing_sha512",
        "tags": [],
    }
    [kept] = [u for u in _plan({"users": [existing]}).definitions["users"] if u["name"] == "orders"]
    assert kept["hashing_algorithm"] == "rabbit_password_hashing_sha512"


def _rabbitmqctl_printing(tmp_path: Path, *outputs: str) -> Path:
    """A stand-in for rabbitmqctl (real output cannot be made bad on demand): its n-th call prints
    ``outputs[n]`` (the last one from then on), and each call is counted in ``calls``."""
    for n, output in enumerate(outputs):
        (tmp_path / f"output-{n}").write_text(output)
    script = tmp_path / "rabbitmqctl"
    script.write_text(
        "#!/bin/sh\n"
        f'cd "{tmp_path}"\n'
        "echo call >> calls\n"
        f'n=$(wc -l < calls); n=$((n - 1)); [ "$n" -lt {len(outputs)} ] || n={len(outputs) - 1}\n'
        'cat "output-$n"\n'
    )
    script.chmod(0o755)
    return script


def test_an_export_printed_cut_short_is_asked_for_again(tmp_path: Path) -> None:
    script = _rabbitmqctl_printing(tmp_path, "{", '{"users": [], "vhosts": []}\n')
    assert CtlAdmin(str(script)).export() == {"users": [], "vhosts": []}
    assert (tmp_path / "calls").read_text().count("call") == 2


def test_an_export_never_printed_whole_fails_the_setup_for_a_retry_not_as_a_bad_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _rabbitmqctl_printing(tmp_path, '{"users": [{"name": "orders", "password_hash": "SECRET')
    monkeypatch.setenv("HOOKLINE_AMQP_URL", "amqp://broker:5672/")
    args = build_parser().parse_args(["broker-setup", "--rabbitmqctl", str(script), "--upstream", "orders"])
    assert args.run(args) == 1  # a Kubernetes Job's retry may help
    error = capsys.readouterr().err
    assert "rabbitmqctl export_definitions printed no JSON 3 times" in error
    assert "--upstream" not in error
    assert "SECRET" not in error  # the definitions hold password hashes
    assert (tmp_path / "calls").read_text().count("call") == 3
