"""The dispatcher's index of the consumers it holds: by queue and by endpoint, kept in step."""

from __future__ import annotations

from typing import cast

import pytest
from aio_pika.abc import AbstractChannel

from hookline.dispatcher.ownqueues import Mode, _Active, _Consumer, _Wanted

CHANNEL = cast(AbstractChannel, object())


def consumer(endpoint_id: str, tag: str, mode: Mode = Mode.DELIVER) -> _Consumer:
    return _Consumer(_Wanted(endpoint_id, mode, 32), tag, CHANNEL)


def test_consumers_are_found_by_endpoint_and_by_queue() -> None:
    active = _Active()
    active.add("q.a.0", consumer("ep_a", "t1"))
    active.add("q.a.1", consumer("ep_a", "t2", Mode.FORWARD))
    active.add("q.b.0", consumer("ep_b", "t3"))

    assert sorted(name for name, _ in active.of_endpoint("ep_a")) == ["q.a.0", "q.a.1"]
    assert [c.tag for _, c in active.of_endpoint("ep_b")] == ["t3"]
    assert active.of_endpoint("ep_c") == []
    assert "q.b.0" in active
    assert "q.c.0" not in active
    assert len(active) == 3
    assert sorted(c.tag for c in active.values()) == ["t1", "t2", "t3"]


def test_a_popped_consumer_leaves_both_indexes() -> None:
    active = _Active()
    active.add("q.a.0", consumer("ep_a", "t1"))
    active.add("q.a.1", consumer("ep_a", "t2"))

    assert active.pop("q.a.0").tag == "t1"
    assert [name for name, _ in active.of_endpoint("ep_a")] == ["q.a.1"]
    active.pop("q.a.1")
    assert active.of_endpoint("ep_a") == []
    assert len(active) == 0
    with pytest.raises(KeyError):
        active.pop("q.a.1")


def test_iterating_while_popping_is_safe_and_clear_empties_everything() -> None:
    active = _Active()
    for n in range(5):
        active.add(f"q.{n}", consumer(f"ep_{n % 2}", f"t{n}"))
    for name, _ in active.items():
        active.pop(name)
    assert len(active) == 0

    active.add("q.x", consumer("ep_x", "tx"))
    active.clear()
    assert len(active) == 0
    assert active.of_endpoint("ep_x") == []
