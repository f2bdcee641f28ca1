"""Settings come from HOOKLINE_* variables; a bad one stops the service with one line naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from hookline.cli.admin import ClientSettings
from hookline.dispatcher.settings import DispatcherSettings
from hookline.health_monitor.settings import MonitorSettings
from hookline.ingest.settings import IngestSettings
from hookline.outbox_relay.settings import OutboxRelaySettings
from hookline.shared.broker.amqp import broker_urls
from hookline.shared.runtime.settings import load, metrics_tokens


def test_defaults_match_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = DispatcherSettings()
    assert settings.retry_schedule_s == (30, 120, 600, 1800, 7200, 21600)
    assert settings.retention_s == 259200
    assert settings.dispatcher_metrics_port == 8002
    assert settings.amqp_url == "amqp://guest:guest@localhost:5672/"
    assert settings.allow_http is False
    assert settings.allow_private_targets is False


def test_retry_schedule_is_comma_separated_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKLINE_RETRY_SCHEDULE_S", "1, 2,3.5")
    assert DispatcherSettings().retry_schedule_s == (1.0, 2.0, 3.5)


@pytest.mark.parametrize(
    ("variable", "value", "cls"),
    [
        ("HOOKLINE_RETRY_SCHEDULE_S", "1,x", DispatcherSettings),
        ("HOOKLINE_RETRY_SCHEDULE_S", "0,5", DispatcherSettings),
        ("HOOKLINE_DISPATCHER_METRICS_PORT", "70000", DispatcherSettings),
        ("HOOKLINE_AMQP_URL", "http://localhost", DispatcherSettings),
        ("HOOKLINE_AMQP_URL", "amqp://a:5672/x, http://b:5672/x", DispatcherSettings),
        ("HOOKLINE_AMQP_URL", "amqp://a:5672/one,amqp://b:5672/two", DispatcherSettings),
        ("HOOKLINE_AMQP_URL", " , ", DispatcherSettings),
        ("HOOKLINE_API_TOKEN", "short", IngestSettings),
        ("HOOKLINE_METRICS_TOKEN", "short", IngestSettings),
        ("HOOKLINE_METRICS_TOKEN", "short", MonitorSettings),
        ("HOOKLINE_METRICS_TOKEN", "short", DispatcherSettings),
        ("HOOKLINE_INGEST_PORT", "eighty", IngestSettings),
        ("HOOKLINE_DEDUPE_WINDOW_S", "1000000", IngestSettings),  # longer than the delivery log keeps
        ("HOOKLINE_OUTBOX_DSN", "mysql://db/x", OutboxRelaySettings),
        ("HOOKLINE_OUTBOX_BATCH_SIZE", "0", OutboxRelaySettings),
        ("HOOKLINE_OUTBOX_RETENTION_S", "-1", OutboxRelaySettings),
        ("HOOKLINE_PORTAL_FRAME_ANCESTORS", "https://app.example.com/settings", MonitorSettings),  # a page
        ("HOOKLINE_PORTAL_FRAME_ANCESTORS", "app.example.com", MonitorSettings),  # no scheme
        ("HOOKLINE_PORTAL_FRAME_ANCESTORS", "https://a.example 'unsafe-inline'", MonitorSettings),
        ("HOOKLINE_PORTAL_LOGO_URL", "javascript:alert(1)", MonitorSettings),
        ("HOOKLINE_PORTAL_ACCENT", "red;}body{display:none", MonitorSettings),  # into the page's style
    ],
)
def test_a_bad_setting_exits_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str, cls: type
) -> None:
    monkeypatch.setenv("HOOKLINE_API_TOKEN", "x" * 20)
    monkeypatch.setenv("HOOKLINE_OUTBOX_DSN", "postgresql://db/x")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        load(cls)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"hookline: invalid setting {variable}: ")


def test_the_outbox_relay_needs_its_database_and_the_flag_wins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HOOKLINE_OUTBOX_DSN", raising=False)
    with pytest.raises(SystemExit):
        load(OutboxRelaySettings)
    assert "HOOKLINE_OUTBOX_DSN: Value error, name the outbox's database: --dsn" in capsys.readouterr().err
    monkeypatch.setenv("HOOKLINE_OUTBOX_DSN", "postgresql://from-env/db")
    settings = load(OutboxRelaySettings, outbox_dsn="postgresql://from-flag/db")
    assert settings.outbox_dsn is not None
    assert settings.outbox_dsn.get_secret_value() == "postgresql://from-flag/db"
    assert "from-flag" not in repr(settings)  # the password a DSN carries stays out of logs


def test_a_cluster_is_its_nodes_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = "amqp://u:p@n1:5672/prod, amqp://u:p@n2:5673/prod,amqp://u:p@n3:5674/prod"
    monkeypatch.setenv("HOOKLINE_AMQP_URL", nodes)
    assert broker_urls(DispatcherSettings().amqp_url) == [
        "amqp://u:p@n1:5672/prod", "amqp://u:p@n2:5673/prod", "amqp://u:p@n3:5674/prod",
    ]  # fmt: skip


def test_the_ingest_needs_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HOOKLINE_API_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        load(IngestSettings)
    assert "HOOKLINE_API_TOKEN: Field required" in capsys.readouterr().err


@pytest.mark.parametrize("settings_class", [IngestSettings, MonitorSettings])
def test_the_token_published_in_compose_is_refused_outside_development(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], settings_class: type[BaseSettings]
) -> None:
    monkeypatch.setenv("HOOKLINE_API_TOKEN", "local-dev-token-change-me")
    monkeypatch.delenv("HOOKLINE_DEVELOPMENT", raising=False)
    with pytest.raises(SystemExit):
        load(settings_class)
    assert "HOOKLINE_API_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("HOOKLINE_DEVELOPMENT", "true")
    assert load(settings_class).api_token.get_secret_value() == "local-dev-token-change-me"  # type: ignore[attr-defined]


def test_metrics_take_the_api_token_and_the_metrics_token_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOKLINE_API_TOKEN", "a" * 20)
    monkeypatch.delenv("HOOKLINE_METRICS_TOKEN", raising=False)
    assert metrics_tokens(IngestSettings()) == ("a" * 20,)
    # Empty is unset: compose may pass ${HOOKLINE_METRICS_TOKEN:-} through.
    monkeypatch.setenv("HOOKLINE_METRICS_TOKEN", "")
    assert MonitorSettings().metrics_token is None
    assert DispatcherSettings().metrics_token is None
    monkeypatch.setenv("HOOKLINE_METRICS_TOKEN", "m" * 16)
    assert metrics_tokens(MonitorSettings()) == ("a" * 20, "m" * 16)


def _documented_settings() -> set[str]:
    """The names the README's configuration table gives, with its shorthand expanded:
    "`HOOKLINE_INGEST_HOST` / `_PORT`" documents HOOKLINE_INGEST_PORT too."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    names: set[str] = set()
    for row in readme.splitlines():
        if not row.startswith("| `HOOKLINE_"):
            continue
        first_cell = row.split("|")[1]
        full = re.findall(r"`(HOOKLINE_[A-Z0-9_]+)`", first_cell)
        names.update(full)
        parts = full[0].split("_")
        for short in re.findall(r"`(_[A-Z0-9_]+)`", first_cell):
            names.update("_".join(parts[:cut]) + short for cut in range(2, len(parts)))
    return names


@pytest.mark.parametrize(
    "settings_class",
    [IngestSettings, DispatcherSettings, MonitorSettings, OutboxRelaySettings, ClientSettings],
    ids=lambda c: c.__name__,
)
def test_every_setting_is_in_the_readme_configuration_table(settings_class: type[BaseSettings]) -> None:
    wanted = {"HOOKLINE_" + field.upper() for field in settings_class.model_fields}
    assert wanted - _documented_settings() == set()
