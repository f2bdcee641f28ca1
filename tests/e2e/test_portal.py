"""The customer portal (/portal/ on the health monitor): links made by the operator's backend, opened once
inside an iframe of a page on another site, scoped by the ingest to a tenant, some endpoints, or reading
only; a customer manages its endpoints and fixes its deliveries there without asking support. How the
ingest scopes links and sessions (no browser, no monitor) is tests/integration/test_portal_sessions.py."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web
from playwright.async_api import FrameLocator, expect
from support import services
from support.browser import chromium
from support.portal import api, link, session_of
from support.receiver import Received, Receiver, Reply
from support.system import System
from support.waiting import eventually

pytestmark = pytest.mark.e2e

ACME_TOKEN = "acme-tenant-token-0123456789"
GLOBEX_TOKEN = "globex-tenant-token-0123456789"
HOST_PORT = services.free_port()  # the operator's page: another site (localhost) than the portal (127.0.0.1)
HOST = f"http://localhost:{HOST_PORT}"
SYSTEM_ENV = {
    "HOOKLINE_TENANT_TOKENS": f"acme:{ACME_TOKEN},globex:{GLOBEX_TOKEN}",
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
    "HOOKLINE_PORTAL_FRAME_ANCESTORS": HOST,
    "HOOKLINE_PORTAL_BRAND_NAME": "Acme Cloud webhooks",
    "HOOKLINE_PORTAL_ACCENT": "#0a7d52",
}
DOCS_SCREENSHOT = Path(__file__).parents[2] / "docs" / "portal.png"


def opening(system: System, made: dict[str, Any]) -> str:
    """The link as the browser opens it, on the test's monitor rather than the default address."""
    return system.monitor.base_url + urlsplit(made["url"]).path


@asynccontextmanager
async def operators_page(portal_url: str) -> AsyncIterator[str]:
    """The operator's own page on another site, showing the portal in an iframe."""

    async def page(_: web.Request) -> web.Response:
        html = f'<!doctype html><title>Acme Cloud</title><h1>Acme Cloud settings</h1><iframe title="webhooks" src="{portal_url}" style="width:100%;height:1400px;border:0"></iframe>'
        return web.Response(text=html, content_type="text/html")

    app = web.Application()
    app.router.add_get("/settings", page)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "localhost", HOST_PORT).start()
    try:
        yield f"{HOST}/settings"
    finally:
        await runner.cleanup()


async def test_a_customer_manages_its_endpoints_in_the_operators_iframe(
    system: System, receiver: Receiver, tmp_path: Path
) -> None:
    refusing = True
    accepted: set[str] = set()  # event ids /orders answered 200

    def respond(request: Received) -> Reply:
        event = json.loads(request.body)
        if request.path == "/orders" and event["type"] == "order.created":
            if refusing:
                return Reply(status=400, body=b"unknown type")
            accepted.add(event["id"])
        return Reply(status=200, body=b"thanks")

    receiver.responder = respond
    catalogued = await api(
        system, "POST", "/v1/event-types",
        json={"name": "order.created", "description": "An order was placed.", "examples": [{"order": "o_1", "total": 12}],
              "schemas": {"1": {"type": "object", "properties": {"total": {"type": "number"}}}}},
    )  # fmt: skip
    assert catalogued.status_code in (201, 409), catalogued.text
    orders = system.add_endpoint("initech", receiver.url("/orders"), ["order.*"])
    hidden = system.add_endpoint("globex", receiver.url("/globex"), ["order.*"])
    published = await api(
        system, "POST", "/v1/events", json={"tenant": "initech", "type": "order.created", "data": {"n": 1}}
    )
    event_id = published.json()["id"]

    async def dead() -> bool:
        listed = (await api(system, "GET", "/v1/dead-letters", params={"endpoint_id": orders["id"]})).json()[
            "data"
        ]
        return any(d["event_id"] == event_id for d in listed)

    await eventually(dead, timeout_s=30)
    made = await link(system, tenant="initech")

    async with chromium() as browser, operators_page(opening(system, made)) as settings_page:
        page = await browser.new_page(viewport={"width": 1200, "height": 1000})
        await page.goto(settings_page)
        portal: FrameLocator = page.frame_locator("iframe")
        await expect(portal.locator("header .brand")).to_have_text("Acme Cloud webhooks")
        rows = portal.locator("#endpoints")
        await expect(rows.locator(f"tr[data-endpoint={orders['id']}]")).to_be_visible()
        await expect(rows.locator(f"tr[data-endpoint={hidden['id']}]")).to_have_count(0)

        # Add an endpoint, its types picked from the catalog (with their descriptions and examples).
        await portal.locator("input[name=url]").fill(receiver.url("/new"))
        await portal.get_by_label("Description").fill("orders to the warehouse")
        await expect(portal.locator("fieldset")).to_contain_text("An order was placed.")
        await portal.locator("input[name=event_types][value='order.created']").check()
        await portal.get_by_role("button", name="Add endpoint").click()
        await expect(portal.locator("#verification")).to_contain_text("verified")
        secret = await portal.locator("#secret").text_content()
        assert secret is not None
        assert secret.startswith("whsec_")
        await portal.get_by_role("link", name="Continue to the endpoint").click()
        await expect(portal.locator("h1")).to_have_text(receiver.url("/new"))

        # A test event: the catalog's example, and the 200 shown at once.
        await portal.get_by_role("button", name="Send test event").click()
        await expect(portal.get_by_role("status")).to_contain_text("HTTP 200")
        tested = [
            r for r in receiver.requests if r.path == "/new" and json.loads(r.body)["type"] == "order.created"
        ]
        assert json.loads(tested[-1].body)["data"] == {"order": "o_1", "total": 12}

        # Rotate the secret (the old one keeps signing for the overlap), pause and resume.
        await portal.get_by_role("button", name="Rotate signing secret").click()
        await expect(portal.locator("main")).to_contain_text("previous secret keeps signing")
        assert await portal.locator("#secret").text_content() not in (None, secret)
        await portal.get_by_role("link", name="Continue to the endpoint").click()
        await portal.get_by_label("Description").fill("orders and refunds")
        await portal.get_by_role("button", name="Save").click()
        await expect(portal.get_by_role("status")).to_have_text("Saved.")
        await expect(portal.locator("main > p").nth(1)).to_contain_text("orders and refunds")
        # A filter, set and tried on a recent event before relying on it.
        await portal.locator("form[action$='/edit'] textarea[name=filter]").fill("data.total > 100")
        await portal.get_by_role("button", name="Save").click()
        await expect(portal.locator("#filter")).to_have_text("data.total > 100")
        await portal.get_by_label("Recent event").fill(event_id)
        await portal.get_by_role("button", name="Try it").click()
        await expect(portal.get_by_role("status")).to_have_text(
            "The filter does not match that event (no field 'total' in the event): it would not be sent."
        )
        await portal.get_by_role("button", name="Reveal signing secret").click()
        await expect(portal.locator("#secret")).not_to_have_text(secret)
        await portal.get_by_role("link", name="Continue to the endpoint").click()
        await portal.get_by_role("button", name="Pause").focus()  # keyboard only
        await page.keyboard.press("Enter")
        await expect(portal.locator("#status")).to_have_text("paused")
        await portal.get_by_role("button", name="Resume").click()
        await expect(portal.locator("#status")).to_have_text("active")

        # The event that failed: its attempts and why.
        await portal.get_by_role("link", name="Events").click()
        await portal.get_by_role("link", name=event_id).click()
        course = portal.locator(f"section.course[data-endpoint={orders['id']}]")
        await expect(course.locator("[data-state]")).to_have_text("dead")
        await expect(course.locator("table.attempts")).to_contain_text("unknown type")
        await course.get_by_role("button", name="Resend now").click()
        await expect(portal.get_by_role("status")).to_contain_text(f"Sent again to {orders['id']}")

        # Redrive the dead letter once the receiver is fixed; it arrives.
        refusing = False
        await portal.get_by_role("link", name="Failed deliveries").first.click()
        row = portal.locator("#dead-letters tr", has_text=event_id)
        await row.get_by_role("button", name="Redrive").click()
        await expect(portal.get_by_role("status")).to_contain_text("Redrove 1")

        async def redriven() -> bool:
            return event_id in accepted

        await eventually(redriven, timeout_s=30)
        await portal.get_by_role("link", name="Endpoints").click()
        await expect(rows.locator("tr")).to_have_count(3)  # the header, orders and the new one
        await page.screenshot(path=tmp_path / "portal.png", full_page=False)
        if os.environ.get("HOOKLINE_PORTAL_SCREENSHOT"):  # refreshes the README's picture
            await page.screenshot(path=DOCS_SCREENSHOT, full_page=False)

        # Another monitor serves the same session: the session is the path, checked by the ingest.
        session_path = urlsplit(page.frames[1].url).path
        assert session_path.startswith("/portal/s/hlps_")
        other = services.start("health-monitor", system.env, system.log_dir, name="health-monitor-portal")
        system.extra.append(other)
        await asyncio.to_thread(other.wait_ready, 60)
        async with httpx.AsyncClient(base_url=other.base_url, timeout=30) as client:
            served = await client.get(session_path)
        assert served.status_code == 200, served.text
        assert orders["id"] in served.text
        assert hidden["id"] not in served.text

        # Deleted from its page, an endpoint is gone from the list.
        created = portal.locator("#endpoints tr", has_text=receiver.url("/new"))
        await created.get_by_role("link").click()
        await portal.get_by_role("button", name="Delete this endpoint").click()
        await expect(portal.get_by_role("status")).to_contain_text("Deleted")
        await expect(rows.locator("tr")).to_have_count(2)

        # Limited to one endpoint, a session lists that one and offers no way to add another.
        limited = await session_of(system, await link(system, tenant="initech", endpoint_ids=[orders["id"]]))
        other_endpoint = system.add_endpoint("initech", receiver.url("/elsewhere"), ["order.*"])
        view = await browser.new_page()
        await view.goto(f"{system.monitor.base_url}/portal/s/{limited}/")
        await expect(view.locator("#endpoints tr[data-endpoint]")).to_have_count(1)
        await expect(view.locator(f"tr[data-endpoint={orders['id']}]")).to_be_visible()
        assert other_endpoint["id"] not in await view.content()
        await expect(view.locator("#add")).to_have_count(0)

        # At 360 px wide the portal fits its frame.
        narrow = await browser.new_page(viewport={"width": 360, "height": 800})
        narrow_session = await session_of(system, await link(system, tenant="initech"))
        await narrow.goto(f"{system.monitor.base_url}/portal/s/{narrow_session}/")
        assert await narrow.evaluate("document.documentElement.scrollWidth") <= 360

        # The link works once.
        second = await browser.new_page()
        answer = await second.goto(opening(system, made))
        assert answer is not None
        assert answer.status == 410
        await expect(second.get_by_role("alert")).to_contain_text("opened already")

        # A read-only session is shown no form that changes anything.
        reader = await session_of(system, await link(system, tenant="initech", read_only=True))
        await second.goto(f"{system.monitor.base_url}/portal/s/{reader}/endpoints/{orders['id']}")
        await expect(second.locator("#status")).to_be_visible()
        await expect(second.locator("form[method=post]")).to_have_count(0)

        # Neither a link nor a session is ever written to a log.
        logs = system.logs()  # the second monitor's too
        assert "portal_opened" in logs
        assert "hlpl_" not in logs
        assert "hlps_" not in logs

        # Nothing else frames it: the CSP names the operator's origin only.
        assert answer.headers["content-security-policy"].count(f"frame-ancestors {HOST};") == 1
