"""Operator alert sinks: the setting read as an operator writes it, and what a Slack sink is sent."""

from __future__ import annotations

import pytest

from hookline.health_monitor.sinks import Sink, parse_sinks, slack_text


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (None, []),
        ("", []),
        ("https://ops.example/hooks", [Sink("https://ops.example/hooks")]),
        (
            "https://a.example/x?token=1&b=2, broker_*|breaker_open=slack+https://hooks.slack.com/services/T/B/X",
            [
                Sink("https://a.example/x?token=1&b=2"),
                Sink(
                    "https://hooks.slack.com/services/T/B/X", alerts=("broker_*", "breaker_open"), slack=True
                ),
            ],
        ),
        ("slack+http://127.0.0.1:9/s", [Sink("http://127.0.0.1:9/s", slack=True)]),
    ],
)
def test_parse_sinks(setting: str | None, expected: list[Sink]) -> None:
    assert parse_sinks(setting) == expected


@pytest.mark.parametrize(
    "setting", ["ops.example/hooks", "breaker_open=ftp://x", "slack+mailto:ops@example.com"]
)
def test_a_sink_that_is_not_a_url_is_refused_by_name(setting: str) -> None:
    with pytest.raises(ValueError, match="a sink is"):
        parse_sinks(setting)


@pytest.mark.parametrize(
    ("alert", "patterns", "wanted"),
    [
        ("broker_disk_alarm", ("broker_*",), True),
        ("breaker_open", ("broker_*",), False),
        ("breaker_open", ("broker_*", "breaker_open"), True),
        ("anything", ("*",), True),
    ],
)
def test_a_sink_takes_the_alerts_its_patterns_name(
    alert: str, patterns: tuple[str, ...], wanted: bool
) -> None:
    assert Sink("https://x.example", alerts=patterns).wants(alert) is wanted


def test_the_sink_name_hides_paths_and_credentials() -> None:
    assert Sink("https://user:pw@hooks.slack.com/services/T/B/SECRET").name == "https://hooks.slack.com"


def test_slack_text() -> None:
    firing = {
        "alert": "breaker_open",
        "state": "firing",
        "endpoint_id": "ep_1",
        "tenant": "acme",
        "detail": "open",
    }
    assert slack_text(firing) == ":red_circle: *breaker_open* firing (endpoint ep_1, tenant acme): open"
    resolved = {
        "alert": "broker_disk_low",
        "state": "resolved",
        "endpoint_id": None,
        "tenant": None,
        "detail": "2 GB",
    }
    assert slack_text(resolved) == ":large_green_circle: *broker_disk_low* resolved: 2 GB"
