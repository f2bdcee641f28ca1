"""A dispatcher's view of the breakers: commands and snapshots apply idempotently, and with a lease a
breaker that no monitor renews is closed by the dispatcher itself (a silent monitor never blocks an
endpoint for ever), once, until a monitor says otherwise again."""

from __future__ import annotations

import pytest

from hookline.shared.contracts.control import BreakerCommand, BreakerSnapshot, BreakerState, BreakerView

EP1 = "ep_" + "1" * 26
EP2 = "ep_" + "2" * 26
LEASE_S = 10.0


def opened(
    endpoint_id: str = EP1, version: int = 1, state: BreakerState = BreakerState.OPEN
) -> BreakerCommand:
    return BreakerCommand(endpoint_id=endpoint_id, state=state, version=version, cooldown_s=5)


def snapshot(version: int, *breakers: BreakerCommand) -> BreakerSnapshot:
    return BreakerSnapshot(version=version, breakers=list(breakers))


def test_an_unrenewed_open_breaker_expires_once() -> None:
    view = BreakerView(lease_s=LEASE_S)
    command = opened()
    assert view.apply(command, now_s=0) == {EP1}
    assert view.state(EP1) == command
    assert view.expire(now_s=LEASE_S) == [], "not before the lease is over"
    assert view.state(EP1) == command

    assert view.expire(now_s=LEASE_S + 0.1) == [command]
    assert view.state(EP1) is None
    assert view.commands() == []
    assert view.expire(now_s=LEASE_S + 60) == [], "reported once"


@pytest.mark.parametrize(
    ("renewal", "changed"),
    [
        pytest.param(opened(version=1), set(), id="the-same-command-again"),
        pytest.param(opened(version=2), set(), id="a-newer-command-same-state"),
        pytest.param(opened(version=2, state=BreakerState.HALF_OPEN), {EP1}, id="a-newer-command-new-state"),
        pytest.param(snapshot(1, opened(version=1)), set(), id="a-snapshot-listing-it"),
        pytest.param(snapshot(5, opened(version=1)), set(), id="a-later-snapshot-listing-it"),
    ],
)
def test_commands_and_snapshots_renew_the_lease(
    renewal: BreakerCommand | BreakerSnapshot, changed: set[str]
) -> None:
    view = BreakerView(lease_s=LEASE_S)
    view.apply(opened(), now_s=0)
    assert view.apply(renewal, now_s=8) == changed
    assert view.expire(now_s=15) == [], "renewed at 8 s: good until 18 s"
    assert view.state(EP1) is not None
    [expired] = view.expire(now_s=18.5)
    assert expired.endpoint_id == EP1
    assert view.state(EP1) is None


def test_an_older_command_neither_changes_nor_renews() -> None:
    view = BreakerView(lease_s=LEASE_S)
    view.apply(opened(version=3), now_s=0)
    assert view.apply(opened(version=2, state=BreakerState.CLOSED), now_s=8) == set()
    assert view.state(EP1) == opened(version=3)
    assert [command.version for command in view.expire(now_s=LEASE_S + 1)] == [3]


def test_a_snapshot_that_no_longer_lists_an_endpoint_closes_it() -> None:
    view = BreakerView(lease_s=LEASE_S)
    view.apply(opened(EP1, version=1), now_s=0)
    view.apply(opened(EP2, version=4), now_s=0)
    # A snapshot taken before EP2's command (version 3 < 4) does not know of it: EP2 stays open.
    assert view.apply(snapshot(3), now_s=1) == {EP1}
    assert view.state(EP1) is None
    assert view.state(EP2) is not None
    assert view.apply(snapshot(5), now_s=2) == {EP2}
    assert view.commands() == []
    assert view.expire(now_s=100) == [], "closed breakers have nothing to expire"


def test_a_later_snapshot_reopens_an_expired_breaker() -> None:
    view = BreakerView(lease_s=LEASE_S)
    command = opened(version=1)
    view.apply(command, now_s=0)
    assert view.expire(now_s=11) == [command]
    # The monitor comes back and still holds the breaker open: its next snapshot reopens it.
    assert view.apply(snapshot(2, command), now_s=12) == {EP1}
    assert view.state(EP1) == command
    assert view.expire(now_s=21) == [], "the snapshot started a new lease"
    assert view.expire(now_s=22.5) == [command]


def test_a_closed_command_is_no_breaker() -> None:
    view = BreakerView(lease_s=LEASE_S)
    view.apply(opened(version=1), now_s=0)
    assert view.apply(opened(version=2, state=BreakerState.CLOSED), now_s=1) == {EP1}
    assert view.state(EP1) is None
    assert view.commands() == []
    assert view.expire(now_s=100) == []


def test_without_a_lease_breakers_never_expire() -> None:
    view = BreakerView()
    command = opened()
    view.apply(command, now_s=0)
    assert view.expire(now_s=1e9) == []
    assert view.state(EP1) == command
    assert view.commands() == [command]
