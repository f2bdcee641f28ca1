"""The customer portal's pure parts: which routes a session may call, and the pages' headers."""

from __future__ import annotations

import pytest

from hookline.health_monitor.portal import Look
from hookline.health_monitor.settings import MonitorSettings
from hookline.ingest.auth import PORTAL_ROUTES
from hookline.ingest.service import create_app
from hookline.ingest.settings import IngestSettings

TOKEN = "a-token-of-the-tests-0123456789"


def test_every_route_a_portal_session_may_call_exists() -> None:
    """PORTAL_ROUTES names routes by their path templates: a renamed route would silently be refused."""
    app = create_app(IngestSettings(api_token=TOKEN))
    routes = {(method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item}
    assert routes >= PORTAL_ROUTES, PORTAL_ROUTES - routes
    assert ("POST", "/v1/events") in routes - PORTAL_ROUTES  # publishing stays the upstream's


@pytest.mark.parametrize(
    ("ancestors", "logo", "frame_ancestors", "img_src"),
    [
        ("", None, "frame-ancestors 'none';", "img-src 'self' data:;"),
        (
            "https://app.example.com http://localhost:3000",
            "https://cdn.example.com/logo.svg",
            "frame-ancestors https://app.example.com http://localhost:3000;",
            "img-src 'self' data: https://cdn.example.com;",
        ),
    ],
)
def test_the_pages_are_framed_only_by_the_operators_origins(
    ancestors: str, logo: str | None, frame_ancestors: str, img_src: str
) -> None:
    look = Look.of(MonitorSettings(api_token=TOKEN, portal_frame_ancestors=ancestors, portal_logo_url=logo))
    policy = look.headers["content-security-policy"]
    assert frame_ancestors in policy
    assert img_src in policy
    assert "script-src" not in policy  # default-src 'none': no script at all
    assert look.headers["referrer-policy"] == "no-referrer"  # the session is in the path
