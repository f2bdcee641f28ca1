"""What make run and make test do about RabbitMQ and PostgreSQL on this machine: the decision from three
facts, the install command, and where a setting points (table-tested)."""

from __future__ import annotations

import pytest

from hookline.cli.localservices import (
    POSTGRES,
    RABBITMQ,
    Action,
    address,
    decide,
    install_hint,
    installed,
)


@pytest.mark.parametrize(
    ("local", "answering", "is_installed", "action"),
    [
        (True, True, True, Action.NOTHING),
        (True, True, False, Action.NOTHING),  # answering is all that counts (a container, say)
        (False, True, False, Action.NOTHING),
        (True, False, True, Action.START),
        (True, False, False, Action.INSTALL),
        (False, False, True, Action.ELSEWHERE),  # installed here does not help a broker elsewhere
        (False, False, False, Action.ELSEWHERE),
    ],
)
def test_what_to_do_about_a_server(local: bool, answering: bool, is_installed: bool, action: Action) -> None:
    assert decide(local=local, answering=answering, installed=is_installed) is action


@pytest.mark.parametrize(
    ("apt", "brew", "root", "hint"),
    [
        (True, False, True, "install it with: apt-get install -y rabbitmq-server"),
        (True, True, False, "install it with: sudo apt-get install -y rabbitmq-server"),
        (False, True, False, "install it with: brew install rabbitmq"),
        (
            False,
            False,
            False,
            "install it with your package manager (on Debian: apt-get install -y rabbitmq-server)",
        ),
    ],
)
def test_the_install_command_is_the_one_for_this_system(apt: bool, brew: bool, root: bool, hint: str) -> None:
    assert install_hint(RABBITMQ, apt=apt, brew=brew, root=root) == hint


@pytest.mark.parametrize(
    ("url", "default_port", "expected"),
    [
        ("amqp://guest:guest@localhost:5672/", 5672, ("localhost", 5672)),
        ("amqp://guest:guest@127.0.0.1/", 5672, ("127.0.0.1", 5672)),
        ("amqps://u:p@rabbit.example/prod", 5672, ("rabbit.example", 5671)),
        ("amqp://u:p@[::1]:5999/", 5672, ("::1", 5999)),
        ("amqp://u:p@a:5681/v,amqp://u:p@b:5682/v", 5672, ("a", 5681)),
        ("postgresql://postgres@127.0.0.1/postgres", 5432, ("127.0.0.1", 5432)),
    ],
)
def test_where_a_setting_points(url: str, default_port: int, expected: tuple[str, int]) -> None:
    assert address(url, default_port) == expected


def test_installed_means_any_of_its_programs_is_found() -> None:
    assert installed(
        POSTGRES, which=lambda name: "/usr/bin/pg_ctlcluster" if name == "pg_ctlcluster" else None
    )
    assert not installed(POSTGRES, which=lambda _: None)
    assert installed(RABBITMQ, which=lambda name: name if name == "/usr/sbin/rabbitmq-server" else None)
