"""The support dashboard (/ui/ on the health monitor) in a real headless Chromium, against the real services.

A support engineer logs in with a tenant's token, finds an event by id and reads its attempts at each
endpoint, redrives the dead letter it left once the receiver is fixed and watches it arrive, and pauses
an endpoint; another tenant's endpoints and events stay out of sight throughout.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect
from support import services
from support.browser import chromium
from support.receiver import Received, Receiver, Reply
from support.system import System
from support.waiting import eventually

pytestmark = pytest.mark.e2e

ACME_TOKEN = "acme-tenant-token-0123456789"
GLOBEX_TOKEN = "globex-tenant-token-0123456789"
SYSTEM_ENV = {
    "HOOKLINE_TENANT_TOKENS": f"acme:{ACME_TOKEN},globex:{GLOBEX_TOKEN}",
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
}
DOCS_SCREENSHOT = Path(__file__).parents[2] / "docs" / "dashboard.png"


async def publish(system: System, tenant: str, event_type: str, subject: str) -> str:
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    ) as api:
        response = await api.post(
            "/v1/events", json={"tenant": tenant, "type": event_type, "subject": subject, "data": {"n": 1}}
        )
    assert response.status_code == 202, response.text
    event_id: str = response.json()["id"]
    return event_id


async def story(system: System, event_id: str) -> dict[str, Any]:
    with system.api() as api:
        response = await asyncio.to_thread(api.get, f"/v1/events/{event_id}")
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def state_at(found: dict[str, Any], endpoint_id: str) -> str:
    [course] = [c for c in found["endpoints"] if c["endpoint_id"] == endpoint_id]
    state: str = course["state"]
    return state


async def log_in(page: Page, system: System, token: str) -> None:
    await page.goto(f"{system.monitor.base_url}/ui/")
    await expect(page).to_have_url(f"{system.monitor.base_url}/ui/login")  # not logged in yet
    await page.fill("input[name=token]", token)
    await page.click("button[type=submit]")


async def test_support_engineer_finds_redrives_and_pauses(
    system: System, receiver: Receiver, tmp_path: Path
) -> None:
    refusing = True

    def respond(request: Received) -> Reply:
        if request.path == "/orders" and refusing:
            return Reply(
                status=400, body=b'{"error":"unknown type"}', headers={"content-type": "application/json"}
            )
        return Reply(status=200, body=b"thanks", headers={"content-type": "text/plain"})

    receiver.responder = respond
    ok = system.add_endpoint("acme", receiver.url("/ok"), ["order.*"])
    orders = system.add_endpoint("acme", receiver.url("/orders"), ["order.*"])
    hidden = system.add_endpoint("globex", receiver.url("/globex"), ["order.*"])
    with system.api() as api:  # an endpoint its customer fetches from
        fetched = api.post(
            "/v1/endpoints", json={"tenant": "acme", "kind": "polling", "event_types": ["order.*"]}
        ).json()
    event_id = await publish(system, "acme", "order.created", "o_1")
    other_event = await publish(system, "globex", "order.created", "g_1")

    async def settled() -> bool:
        found = await story(system, event_id)
        return state_at(found, ok["id"]) == "delivered" and state_at(found, orders["id"]) == "dead"

    await eventually(settled, timeout_s=30)

    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1400, "height": 900})

        # A wrong token is refused, and says so.
        await log_in(page, system, "not-a-token-at-all-0123")
        await expect(page.get_by_role("alert")).to_contain_text("not valid")

        await page.fill("input[name=token]", ACME_TOKEN)
        await page.click("button[type=submit]")
        await expect(page).to_have_url(f"{system.monitor.base_url}/ui/")
        await expect(page.locator("header .who")).to_contain_text("acme")
        endpoints = page.locator("#endpoints")
        await expect(endpoints.locator(f"tr[data-endpoint={ok['id']}]")).to_be_visible()
        await expect(endpoints.locator(f"tr[data-endpoint={orders['id']}]")).to_be_visible()
        assert hidden["id"] not in await page.content()  # another tenant's endpoint
        polled = endpoints.locator(f"tr[data-endpoint={fetched['id']}]")  # nothing to push, no push actions
        await expect(polled).to_contain_text("polling")
        await expect(polled.locator("button")).to_have_count(0)

        # Find the event by id: its attempts at each endpoint, and why one of them is dead.
        await page.fill("header input[name=id]", event_id)
        await page.click("header button:has-text('Find')")
        await expect(page.locator("h1")).to_contain_text(event_id)
        delivered = page.locator(f"section.course[data-endpoint={ok['id']}]")
        await expect(delivered.locator("[data-state]")).to_have_text("delivered")
        await expect(delivered.locator("table.attempts")).to_contain_text("200")
        await expect(delivered.locator("table.attempts")).to_contain_text("thanks")
        dead = page.locator(f"section.course[data-endpoint={orders['id']}]")
        await expect(dead.locator("[data-state]")).to_have_text("dead")
        await expect(dead.locator(".why")).to_contain_text("permanent_status")
        await expect(dead.locator("table.attempts")).to_contain_text("400")

        # Another tenant's event is not found, whatever its id.
        await page.goto(f"{system.monitor.base_url}/ui/events/{other_event}")
        await expect(page.get_by_role("alert")).to_be_visible()
        assert "globex" not in await page.locator("main").inner_text()

        # The receiver is fixed: redrive the dead letter from the dead-letter page and see it arrive.
        refusing = False
        await page.click("header a:has-text('Dead letters')")

        async def analysed() -> bool:  # the monitor's own view of the dead letters follows a stream
            if orders["id"] in await page.locator("#analysis").inner_text():
                return True
            await page.reload()
            return False

        await eventually(analysed, timeout_s=30, every_s=0.5)
        row = page.locator("#dead-letters tr[data-dead-letter]").filter(has_text=event_id)
        await expect(row).to_have_count(1)
        await row.locator("button:has-text('Redrive')").click()
        await expect(page.get_by_role("status")).to_contain_text("Redrove 1")

        async def redriven() -> bool:
            await page.goto(f"{system.monitor.base_url}/ui/events/{event_id}")
            state = await dead.locator("[data-state]").inner_text()
            return state == "delivered"

        await eventually(redriven, timeout_s=30, every_s=0.5)
        await expect(dead.locator("table.attempts")).to_contain_text("redrive")
        assert [r.path for r in receiver.requests if r.headers.get("webhook-id") == event_id].count(
            "/orders"
        ) == 2

        # Send an endpoint a test event from the overview, and read its answer at once.
        await page.click("header a:has-text('Overview')")
        testing = page.locator(f"#endpoints tr[data-endpoint={ok['id']}] form[action$='/test']")
        await testing.locator("input[name=type]").fill("order.created")
        await testing.locator("input[name=data]").fill('{"tried": true}')
        await testing.locator("button:has-text('Send test event')").click()
        await expect(page.get_by_role("status")).to_contain_text(f"to {ok['id']}: HTTP 200 in")
        [tried] = [
            json.loads(r.body) for r in receiver.requests if json.loads(r.body).get("data") == {"tried": True}
        ]
        assert (tried["type"], tried["tenant"], receiver.requests[-1].path) == (
            "order.created",
            "acme",
            "/ok",
        )
        await testing.locator("input[name=type]").fill("order.created")
        await testing.locator("input[name=data]").fill("{not json")
        await testing.locator("button:has-text('Send test event')").click()
        await expect(page.get_by_role("alert")).to_contain_text("must be JSON")

        # Set an endpoint's filter from the overview and try it on the event found above.
        row = page.locator(f"#endpoints tr[data-endpoint={orders['id']}]")
        await row.get_by_label("filter (CEL)").fill('subject == "o_1"')
        await row.locator("button:has-text('Set filter')").click()
        await expect(page.get_by_role("status")).to_contain_text(
            f"""{orders["id"]}'s filter is now 'subject == "o_1"'"""
        )
        row = page.locator(f"#endpoints tr[data-endpoint={orders['id']}]")
        await row.get_by_label("a recent event to try its filter on").fill(event_id)
        await row.locator("button:has-text('Try filter')").click()
        await expect(page.get_by_role("status")).to_have_text(
            "The filter matches that event: it would be sent."
        )

        # Pause an endpoint from the overview; the ingest says it is paused.
        await page.locator(f"#endpoints tr[data-endpoint={ok['id']}] button:has-text('Pause')").click()
        await expect(page.get_by_role("status")).to_contain_text(f"Paused {ok['id']}")

        async def shown_paused() -> bool:  # the monitor learns of the change from the endpoint log
            row = page.locator(f"#endpoints tr[data-endpoint={ok['id']}]")
            if "paused" in await row.inner_text():
                return True
            await page.reload()
            return False

        await eventually(shown_paused, timeout_s=30, every_s=0.5)
        with system.api() as api:
            assert (await asyncio.to_thread(api.get, f"/v1/endpoints/{ok['id']}")).json()[
                "status"
            ] == "paused"

        await page.screenshot(path=tmp_path / "dashboard.png", full_page=True)
        if os.environ.get("HOOKLINE_DASHBOARD_SCREENSHOT"):  # refreshes the README's picture
            await page.screenshot(path=DOCS_SCREENSHOT, full_page=True)

        # Logging out ends the session: the pages ask for a login again.
        await page.click("header button:has-text('Log out')")
        await page.goto(f"{system.monitor.base_url}/ui/")
        await expect(page).to_have_url(f"{system.monitor.base_url}/ui/login")


async def test_forms_without_the_session_token_are_refused(system: System) -> None:
    """A form posted from another site (no CSRF token) changes nothing, even with the session cookie."""
    endpoint = system.add_endpoint("acme", "http://127.0.0.1:9/never", ["order.*"])
    async with httpx.AsyncClient(base_url=system.monitor.base_url, timeout=30) as ui:
        login = await ui.post("/ui/login", data={"token": ACME_TOKEN})
        assert login.status_code == 303, login.text
        assert login.cookies["hookline_session"]
        assert "httponly" in login.headers["set-cookie"].lower()
        assert "samesite=strict" in login.headers["set-cookie"].lower()
        forged = await ui.post(f"/ui/endpoints/{endpoint['id']}/pause", data={"csrf": "guessed"})
        assert forged.status_code == 403, forged.text
        page = await ui.get("/ui/")
        assert page.status_code == 200
        assert "default-src 'none'" in page.headers["content-security-policy"]  # no script runs
        assert page.headers["cache-control"] == "no-store"
    with system.api() as api:
        assert (await asyncio.to_thread(api.get, f"/v1/endpoints/{endpoint['id']}")).json()[
            "status"
        ] == "active"
    assert json.loads(forged.text)["error"] == "forbidden"


async def test_the_admin_sees_every_tenant_and_filters_by_one(system: System) -> None:
    acme = system.add_endpoint("acme", "http://127.0.0.1:9/acme", ["order.*"])
    globex = system.add_endpoint("globex", "http://127.0.0.1:9/globex", ["order.*"])
    async with httpx.AsyncClient(base_url=system.monitor.base_url, timeout=30) as ui:
        assert (await ui.post("/ui/login", data={"token": services.TOKEN})).status_code == 303

        async def both_known() -> bool:  # the monitor follows the endpoint log: a moment behind the ingest
            everything = (await ui.get("/ui/")).text
            return acme["id"] in everything and globex["id"] in everything

        await eventually(both_known)
        only_globex = (await ui.get("/ui/", params={"tenant": "globex"})).text
        assert globex["id"] in only_globex
        assert acme["id"] not in only_globex
        # A tenant's session ignores the filter: it is its own tenant, whatever the query says.
        ui.cookies.clear()
        assert (await ui.post("/ui/login", data={"token": ACME_TOKEN})).status_code == 303
        asked_for_globex = (await ui.get("/ui/", params={"tenant": "globex"})).text
        assert acme["id"] in asked_for_globex
        assert globex["id"] not in asked_for_globex


async def test_the_audit_page_shows_who_changed_what_and_a_tenant_only_its_own(system: System) -> None:
    with system.api() as api:
        acme = api.post(
            "/v1/endpoints",
            json={
                "tenant": "acme",
                "url": "http://127.0.0.1:9/audit-page",
                "event_types": ["#"],
                "verify": False,
            },
        ).json()
        assert api.post(f"/v1/endpoints/{acme['id']}/pause").status_code == 200
    async with httpx.AsyncClient(base_url=system.monitor.base_url, timeout=30) as ui:
        assert (await ui.post("/ui/login", data={"token": ACME_TOKEN})).status_code == 303
        async with httpx.AsyncClient(
            base_url=system.ingest.base_url, headers={"authorization": f"Bearer {GLOBEX_TOKEN}"}, timeout=30
        ) as globex_api:
            created = await globex_api.post(
                "/v1/endpoints",
                json={"tenant": "globex", "url": "http://127.0.0.1:9/g", "event_types": ["#"]},
            )
            assert created.status_code == 201, created.text
        globex_id = created.json()["id"]

        async def shown() -> str | None:
            page = (await ui.get("/ui/audit")).text
            return page if "endpoint.paused" in page else None

        page = await eventually(shown, timeout_s=10)
        assert acme["id"] in page
        assert "endpoint.created" in page
        assert "<code>admin</code>" in page  # who: the admin's token created and paused it
        assert globex_id not in page, "another tenant's changes stay out of sight"
        # Newest first: the pause above the creation.
        assert page.index("endpoint.paused") < page.index("endpoint.created")
