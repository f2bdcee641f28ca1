"""The health monitor's decisions, as tables: which dispatcher probes a half-open endpoint, when a slow
endpoint's breaker opens sooner, and which alerts fire for a picture of the system."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from support.factories import attempt_record, stored_endpoint

from hookline.health_monitor.alerts import Alert, AlertPolicy, evaluate
from hookline.health_monitor.health import Health, HealthPolicy
from hookline.health_monitor.probing import PROBE_ACK_S, PROBE_TIMEOUT_S, prober_for
from hookline.shared.contracts.models import EndpointStatus
from hookline.shared.contracts.telemetry import Heartbeat

NOW_S = 1_800_000_000.0
EP = "ep_" + "1" * 26
LIVE = ["d1", "d2", "d3"]

# --- the prober -------------------------------------------------------------------------------------


def test_the_prober_is_one_of_the_live_dispatchers_spread_by_endpoint() -> None:
    chosen = Counter(prober_for(f"ep_{n:026d}", LIVE, now_s=NOW_S) for n in range(300))
    assert set(chosen) == set(LIVE)
    assert min(chosen.values()) > 50  # spread, not all on one replica


def test_a_probe_that_does_not_report_in_time_moves_to_the_next_dispatcher() -> None:
    start_s = NOW_S // PROBE_TIMEOUT_S * PROBE_TIMEOUT_S
    first = prober_for(EP, LIVE, now_s=start_s)
    assert prober_for(EP, LIVE, now_s=start_s + PROBE_TIMEOUT_S - 1) == first
    later = prober_for(EP, LIVE, now_s=start_s + PROBE_TIMEOUT_S)
    assert LIVE.index(later) == (LIVE.index(first) + 1) % len(LIVE)


def test_the_prober_is_the_same_in_every_process() -> None:
    """A monitor that takes over the lead picks the same prober (Python's hash() differs per process)."""
    script = (
        "from hookline.health_monitor.probing import prober_for; "
        f"print(prober_for({EP!r}, {LIVE!r}, now_s={NOW_S!r}))"
    )
    picks = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert picks == {prober_for(EP, LIVE, now_s=NOW_S)}


def _half_open(*, unacked: dict[str, dict[str, int]] | None = None) -> tuple[Health, float]:
    """A health whose breaker for EP has just gone half-open, three dispatchers beating; when."""
    health = Health(HealthPolicy())
    held = unacked or {}
    for n in range(HealthPolicy().breaker.failure_threshold):
        record = attempt_record(NOW_S, endpoint_id=EP, event_id=f"e{n}", outcome="retry", status=503)
        health.observe(record, now_s=NOW_S, live=True)
    half_open_s = NOW_S + HealthPolicy().breaker.cooldown_s
    for d in LIVE:  # beating when the cooldown ends
        health.observe(heartbeat(d, half_open_s - 1, unacked=held.get(d, {})), now_s=half_open_s, live=True)
    [command] = health.tick(now_s=half_open_s)
    assert command.probe_by in LIVE
    return health, half_open_s


def heartbeat(dispatcher_id: str, at_s: float, **fields: object) -> Heartbeat:
    return Heartbeat(at_s=at_s, dispatcher_id=dispatcher_id, in_flight=0, consumers=1, **fields)


@pytest.mark.parametrize(
    ("took_it_on", "heard_after_s", "asked_again"),
    [
        pytest.param(True, PROBE_ACK_S + 1, False, id="took-it-on"),
        pytest.param(False, PROBE_ACK_S - 1, False, id="not-yet-heard-long-enough"),
        pytest.param(False, PROBE_ACK_S + 1, True, id="did-not-take-it-on"),
    ],
)
def test_a_prober_that_does_not_take_the_probe_on_is_passed_over(
    took_it_on: bool, heard_after_s: float, asked_again: bool
) -> None:
    health, asked_s = _half_open()
    command = health.endpoint(EP).command
    assert command is not None
    prober = command.probe_by
    assert prober is not None
    probing = {EP: command.version} if took_it_on else {}
    now_s = asked_s + heard_after_s
    for d in LIVE:
        health.observe(heartbeat(d, now_s, probing=probing if d == prober else {}), now_s=now_s, live=True)
    commands = health.tick(now_s=now_s)
    if not asked_again:
        assert commands == []
        return
    [again] = commands
    assert again.probe_by in LIVE
    assert again.probe_by != prober, "another dispatcher, long before PROBE_TIMEOUT_S"
    assert now_s - asked_s < PROBE_TIMEOUT_S


def test_a_dispatcher_holding_the_endpoints_messages_is_asked_first() -> None:
    for holder in LIVE:
        health, _ = _half_open(unacked={holder: {EP: 3}})
        command = health.endpoint(EP).command
        assert command is not None
        assert command.probe_by == holder


# --- the breaker's threshold --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("durations_ms", "threshold"),
    [
        pytest.param([], 10, id="no-samples"),
        pytest.param([6_000.0] * 4, 10, id="too-few-samples"),
        pytest.param([100.0] * 20, 10, id="fast"),
        pytest.param([4_900.0] * 20, 10, id="slow-but-under"),
        pytest.param([6_000.0] * 20, 3, id="very-slow"),
        pytest.param([100.0] * 39 + [9_000.0], 10, id="one-slow-in-forty"),
        pytest.param([100.0] * 18 + [9_000.0] * 2, 3, id="a-tenth-very-slow"),
    ],
)
def test_a_very_slow_endpoint_opens_its_breaker_sooner(durations_ms: list[float], threshold: int) -> None:
    health = Health(HealthPolicy())
    for n, duration_ms in enumerate(durations_ms):
        record = attempt_record(NOW_S - 60 + n, endpoint_id=EP, event_id=f"e{n}", duration_ms=duration_ms)
        health.observe(record, now_s=NOW_S, live=True)
    assert health.threshold(health.endpoint(EP), NOW_S) == threshold


# --- alerts -----------------------------------------------------------------------------------------


def _fired(health: Health, **kwargs: object) -> set[str]:
    endpoint = kwargs.pop("endpoint", stored_endpoint(EP))
    alerts = evaluate(
        health, {EP: endpoint},  # type: ignore[dict-item]
        recent_dead_letters=kwargs.pop("dead", lambda _: 0),  # type: ignore[arg-type]
        now_s=NOW_S, policy=AlertPolicy(), **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    return {name for name, _ in alerts}


def _observed(*records: dict[str, object]) -> Health:
    health = Health(HealthPolicy())
    for n, fields in enumerate(records):
        record = attempt_record(NOW_S - 100 + n, endpoint_id=EP, event_id=f"e{n}", **fields)
        health.observe(record, now_s=NOW_S, live=True)
    return health


@pytest.mark.parametrize(
    ("health", "kwargs", "fired"),
    [
        pytest.param(_observed({}), {}, set(), id="healthy"),
        pytest.param(_observed(*[{"duration_ms": 2_500.0}] * 6), {}, {"slow_endpoint"}, id="slow"),
        pytest.param(
            _observed(*[{"outcome": "retry", "status": 429}] * 5), {}, {"rate_limited"}, id="rate-limited"
        ),
        pytest.param(
            _observed(*[{"outcome": "permanent", "status": 401}] * 5), {}, {"credentials_rejected"},
            id="credentials",
        ),
        pytest.param(
            _observed(*[{"outcome": "retry", "status": 429}] * 4 + [{}] * 10), {}, set(), id="a-few-429s"
        ),
        pytest.param(_observed({}), {"dead": lambda _: 1}, {"dead_letters_growing"}, id="dead-letters"),
        pytest.param(
            _observed({}), {"endpoint": stored_endpoint(EP, status=EndpointStatus.DISABLED)},
            {"endpoint_disabled"}, id="disabled",
        ),
        pytest.param(
            _observed(*[{"outcome": "retry", "status": 503}] * 20),
            {"endpoint": stored_endpoint(EP, status=EndpointStatus.DISABLED)},
            {"endpoint_disabled"}, id="disabled-with-its-breaker-open-again",
        ),
        pytest.param(_observed({}), {"missing": {"hookline.events.log": None}}, {"topology_missing"}, id="core-missing"),
        pytest.param(_observed({}), {"missing": {"hookline.ep.x": EP}}, {"queue_missing"}, id="queue-missing"),
        pytest.param(
            _observed({}), {"others": [Alert("broker_blocked", None, None, "an alarm")]}, {"broker_blocked"},
            id="others-passed-through",
        ),
    ],
)  # fmt: skip
def test_which_alerts_fire(health: Health, kwargs: dict[str, object], fired: set[str]) -> None:
    assert _fired(health, **kwargs) == fired


def test_an_open_breaker_alerts_and_warns_before_the_endpoint_is_disabled() -> None:
    policy = HealthPolicy()
    health = _observed(*[{"outcome": "retry", "status": 503}] * policy.breaker.failure_threshold)
    assert "breaker_open" in _fired(health)
    opened_at_s = health.endpoint(EP).breaker.opened_at_s
    assert opened_at_s is not None
    late = NOW_S + AlertPolicy().disable_after_s / 2
    alerts = evaluate(
        health, {EP: stored_endpoint(EP)}, recent_dead_letters=lambda _: 0, now_s=late, policy=AlertPolicy()
    )
    assert {"breaker_open", "endpoint_disabling"} <= {name for name, _ in alerts}
