"""Endpoint filters and transforms end to end: a CEL expression set on an endpoint (refused, naming where, when it is
wrong), tried against an event, and applied where events are fanned out, so that the endpoint receives
exactly the events it matches and no copy of the others is made for it. A polling endpoint's filter
(no dispatcher involved) is tests/integration/test_filter_polling.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from support import services
from support.monitoring import counted
from support.receiver import Receiver
from support.system import System
from support.waiting import eventually

pytestmark = pytest.mark.e2e

EVENTS = int(os.environ.get("HOOKLINE_TEST_FILTER_EVENTS", "1000"))  # the 10,000: by hand
CURRENCIES = ("EUR", "USD")


async def api(system: System, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=60
    ) as client:
        return await client.request(method, path, **kwargs)


async def test_a_filtered_endpoint_receives_exactly_the_events_it_matches(
    system: System, receiver: Receiver
) -> None:
    # Refused when set, naming the problem and where; tried before it is relied on.
    wrong = await api(
        system, "POST", "/v1/endpoints",
        json={"tenant": "acme", "url": receiver.url("/x"), "event_types": ["order.*"], "filter": "data.amount >="},
    )  # fmt: skip
    assert wrong.status_code == 422, wrong.text
    assert wrong.json()["details"][0]["field"] == "filter"
    assert "line 1, column 15" in wrong.json()["details"][0]["message"]
    tried = await api(
        system, "POST", "/v1/filters/test",
        json={"filter": "data.amount >= 1000", "event": {"type": "order.created", "data": {"amount": 1200}}},
    )  # fmt: skip
    assert tried.json() == {"matches": True, "error": None}, tried.text

    big = system.add_endpoint("acme", receiver.url("/big"), ["order.*"], filter="data.amount >= 1000")
    euro = system.add_endpoint("acme", receiver.url("/euro"), ["order.*"], filter='data.currency == "EUR"')
    system.add_endpoint("acme", receiver.url("/all"), ["order.*"])  # unfiltered: every event
    # From the command line.
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    added = await asyncio.to_thread(
        subprocess.run,
        [services.HOOKLINE, "endpoints", "add", "--tenant", "acme", "--url", receiver.url("/cli"),
         "--event-type", "order.*", "--filter", 'data.currency == "USD"', "--no-verify"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["filter"] == 'data.currency == "USD"'
    refunds = system.add_endpoint(
        "acme", receiver.url("/refunds"), ["order.*"], filter="data.refund.amount > 0"
    )
    on_endpoint = await api(
        system, "POST", f"/v1/endpoints/{big['id']}/filter/test",
        json={"event": {"type": "order.created", "data": {"amount": 999}}},
    )  # fmt: skip
    assert on_endpoint.json() == {"matches": False, "error": None}
    missing = await api(
        system, "POST", f"/v1/endpoints/{refunds['id']}/filter/test",
        json={"event": {"type": "order.created", "data": {"amount": 5}}},
    )  # fmt: skip
    assert missing.json() == {"matches": False, "error": "no field 'refund' in the event"}

    # A mixed stream: amounts 0..1999, alternating currencies.
    published_from = datetime.now(UTC)
    filtered_before = await counted(system, "hookline_filtered_copies_total")
    events = [
        {"tenant": "acme", "type": "order.created", "subject": f"o_{n}",
         "data": {"amount": (n * 7) % 2000, "currency": CURRENCIES[n % 2]}}
        for n in range(EVENTS)
    ]  # fmt: skip
    for start in range(0, EVENTS, 500):
        answer = await api(system, "POST", "/v1/events/batch", json={"events": events[start : start + 500]})
        assert {r["status"] for r in answer.json()["results"]} == {202}, answer.text
    sentinel = await api(
        system, "POST", "/v1/events",
        json={"tenant": "acme", "type": "order.created", "subject": "last", "data": {"amount": 5000, "currency": "EUR"}},
    )  # fmt: skip
    assert sentinel.status_code == 202

    def subjects(path: str) -> set[str]:
        return {json.loads(r.body)["subject"] for r in receiver.requests if r.path == path}

    expected_big = {e["subject"] for e in events if e["data"]["amount"] >= 1000} | {"last"}
    expected_euro = {e["subject"] for e in events if e["data"]["currency"] == "EUR"} | {"last"}
    expected_usd = {e["subject"] for e in events if e["data"]["currency"] == "USD"}

    async def all_arrived() -> bool:  # deliveries to an endpoint run side by side: not in order
        return (
            len(subjects("/all")) == EVENTS + 1
            and subjects("/big") >= expected_big
            and subjects("/euro") >= expected_euro
            and subjects("/cli") >= expected_usd
        )

    await eventually(all_arrived, timeout_s=120)
    # Nothing else: each lane message was screened for every endpoint before any of its deliveries.
    assert subjects("/big") == expected_big
    assert subjects("/euro") == expected_euro
    assert subjects("/cli") == expected_usd
    assert subjects("/refunds") == set()

    # The copies not made: every event each filtered endpoint did not match, counted where it was fanned
    # out (at least once: a lane message given out again is screened again).
    not_matched = (EVENTS + 1 - len(expected_big)) + (EVENTS + 1 - len(expected_euro)) + len(expected_euro)
    not_matched += EVENTS + 1  # /refunds: an error each
    assert await counted(system, "hookline_filtered_copies_total") - filtered_before >= not_matched
    errors = f'hookline_filter_errors_total{{endpoint_id="{refunds["id"]}"}}'
    assert await counted(system, errors) >= EVENTS + 1

    # The delivery log says so: filtered at the endpoints it does not match, and why.
    small = next(e for e in events if e["data"]["amount"] < 1000 and e["data"]["currency"] == "EUR")
    page = (await api(system, "GET", "/v1/events", params={"subject": small["subject"]})).json()["data"]
    story = (await api(system, "GET", f"/v1/events/{page[0]['id']}")).json()
    courses = {c["endpoint_id"]: c for c in story["endpoints"]}
    assert courses[big["id"]]["state"] == "filtered"
    assert courses[big["id"]]["waiting_reason"] == "the endpoint's filter does not match it: not sent"
    assert courses[euro["id"]]["state"] == "delivered"
    assert courses[refunds["id"]]["state"] == "filtered"
    assert "no field 'refund' in the event" in courses[refunds["id"]]["waiting_reason"]
    on_recent = await api(
        system, "POST", f"/v1/endpoints/{big['id']}/filter/test", json={"event_id": page[0]["id"]}
    )
    assert on_recent.json() == {"matches": False, "error": None}, on_recent.text
    instead = await api(
        system, "POST", f"/v1/endpoints/{big['id']}/filter/test",
        json={"event_id": page[0]["id"], "filter": 'data.currency == "EUR"'},
    )  # fmt: skip
    assert instead.json() == {"matches": True, "error": None}, instead.text

    # Changed, it applies to the next events; removed (null), every event its patterns match again.
    changed = await api(system, "PATCH", f"/v1/endpoints/{big['id']}", json={"filter": "data.amount < 10"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["filter"] == "data.amount < 10"
    removed = await api(system, "PATCH", f"/v1/endpoints/{euro['id']}", json={"filter": None})
    assert removed.json()["filter"] is None
    for subject, amount, currency in (("small", 3, "USD"), ("after", 50, "USD")):
        await api(
            system,
            "POST",
            "/v1/events",
            json={
                "tenant": "acme",
                "type": "order.created",
                "subject": subject,
                "data": {"amount": amount, "currency": currency},
            },
        )

    async def changes_applied() -> bool:
        return (
            {"small", "after"} <= subjects("/euro")
            and "after" in subjects("/all")
            and "small" in subjects("/big")
        )

    await eventually(changes_applied, timeout_s=30)
    assert "after" not in subjects("/big")  # decided with the copy /all got: one lane message

    # A replay applies the filter as it is now: the events of the window it matches, no others.
    replayed = await api(
        system, "POST", f"/v1/endpoints/{big['id']}/replay", json={"since": published_from.isoformat()}
    )
    small_ones = {e["subject"] for e in events if e["data"]["amount"] < 10} | {"small"}
    assert replayed.json()["replayed"] == len(small_ones), replayed.text


async def test_an_ordered_endpoint_applies_its_filter_on_its_direct_route(
    system: System, receiver: Receiver
) -> None:
    """An ordered endpoint's queue of its own is bound to events: its dispatcher applies the filter."""
    system.add_endpoint(
        "initech", receiver.url("/ordered"), ["order.*"], filter="data.amount >= 1000", ordered=True
    )
    # One subject: delivered in order, so the last event is the sentinel; the filtered-out ones between
    # must not hold the subject's order back.
    amounts = [500 + 1000 * (n % 2) for n in range(20)] + [5000]
    for n, amount in enumerate(amounts):
        published = await api(
            system, "POST", "/v1/events",
            json={"tenant": "initech", "type": "order.created", "subject": "o_1", "data": {"n": n, "amount": amount}},
        )  # fmt: skip
        assert published.status_code == 202, published.text

    def arrived() -> list[int]:
        return [json.loads(r.body)["data"]["n"] for r in receiver.requests if r.path == "/ordered"]

    async def sentinel() -> bool:
        return len(amounts) - 1 in arrived()

    await eventually(sentinel, timeout_s=30)
    assert arrived() == [n for n, amount in enumerate(amounts) if amount >= 1000]


async def test_a_transformed_body_is_sent_signed_as_sent_and_a_runaway_is_dead_lettered(
    system: System, receiver: Receiver
) -> None:
    program = '{text: "Order \\(.data.amount) \\(.data.currency)", id, items: [.data.items[]?.sku]}'
    # Refused when set: a name that reads the environment, files or the clock; a polling endpoint.
    for wrong in ("$ENV.HOME", '"at \\(now)"', "{a: .data"):
        refused = await api(
            system, "POST", "/v1/endpoints",
            json={"tenant": "umbrella", "url": receiver.url("/x"), "event_types": ["#"], "transform": wrong},
        )  # fmt: skip
        assert (refused.status_code, refused.json()["details"][0]["field"]) == (422, "transform"), (
            refused.text
        )
    polling = await api(
        system, "POST", "/v1/endpoints",
        json={"tenant": "umbrella", "kind": "polling", "event_types": ["#"], "transform": "."},
    )  # fmt: skip
    assert polling.status_code == 422, polling.text
    tried = await api(
        system, "POST", "/v1/transforms/test",
        json={"transform": program, "event": {"id": "evt_1", "data": {"amount": 5, "currency": "EUR"}}},
    )  # fmt: skip
    assert tried.json() == {"output": {"text": "Order 5 EUR", "id": "evt_1", "items": []}, "error": None}
    runaway_tried = await api(
        system, "POST", "/v1/transforms/test", json={"transform": "def f: f; f", "event": {}}
    )
    assert runaway_tried.json()["error"] == "the transform ran past its limit of 50 ms"

    shaped = system.add_endpoint("umbrella", receiver.url("/shaped"), ["order.*"], transform=program)
    runaway = system.add_endpoint("umbrella", receiver.url("/runaway"), ["order.*"], transform="def f: f; f")
    system.add_endpoint("umbrella", receiver.url("/plain"), ["order.*"])
    ids = []
    for n in range(5):
        published = await api(
            system, "POST", "/v1/events",
            json={"tenant": "umbrella", "type": "order.created", "subject": f"u_{n}",
                  "data": {"amount": 100 + n, "currency": "EUR", "items": [{"sku": f"s_{n}"}]}},
        )  # fmt: skip
        ids.append(published.json()["id"])

    def bodies(path: str) -> list[dict[str, Any]]:
        return [json.loads(r.body) for r in receiver.requests if r.path == path]

    async def delivered() -> bool:
        return {b["id"] for b in bodies("/shaped")} >= set(ids) and {
            b["id"] for b in bodies("/plain")
        } >= set(ids)

    await eventually(delivered, timeout_s=60)
    assert {b["text"] for b in bodies("/shaped")} == {f"Order {100 + n} EUR" for n in range(5)}
    first = next(r for r in receiver.requests if r.path == "/shaped" and json.loads(r.body)["id"] == ids[0])
    assert json.loads(first.body) == {"text": "Order 100 EUR", "id": ids[0], "items": ["s_0"]}
    verified = Webhook(shaped["secret"]).verify(first.body, dict(first.headers))  # signed as sent
    assert verified["text"] == "Order 100 EUR"
    assert first.headers["webhook-id"] == ids[0]

    # The runaway: stopped at its limit each time, its copies dead letters saying so, never retried.
    async def dead() -> list[dict[str, Any]] | None:
        listed = (await api(system, "GET", "/v1/dead-letters", params={"endpoint_id": runaway["id"]})).json()
        return listed["data"] if {d["event_id"] for d in listed["data"]} >= set(ids) else None

    letters = await eventually(dead, timeout_s=60)
    assert {(d["reason"], d["attempts"]) for d in letters} == {("transform_failed", 1)}
    assert {d["last_error"] for d in letters} == {"the transform ran past its limit of 50 ms"}
    assert bodies("/runaway") == []

    # Changed, the transform applies to what is sent next (a test event too); the webhook-id stays the event's.
    changed = await api(
        system, "PATCH", f"/v1/endpoints/{shaped['id']}", json={"transform": "{id, n: .data.amount}"}
    )
    assert changed.status_code == 200, changed.text
    tested = await api(
        system,
        "POST",
        f"/v1/endpoints/{shaped['id']}/test",
        json={"type": "order.created", "data": {"amount": 7}},
    )
    assert tested.json()["outcome"] == "success", tested.text
    assert bodies("/shaped")[-1] == {"id": tested.json()["event_id"], "n": 7}
