"""SSRF protection at registration, by the ingest (in-process, on the real broker): private targets
are refused naming the reason, and a name is refused without saying what it resolves to. The refusal at
delivery time, by a dispatcher, is in tests/e2e/test_security.py."""

from __future__ import annotations

import pytest
from support.inprocess import IngestSystem

pytestmark = pytest.mark.integration

SYSTEM_ENV = {"HOOKLINE_ALLOW_PRIVATE_TARGETS": "false"}


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:9/hook", "loopback"),
        # A name: refused without saying which internal addresses it resolves to.
        ("http://localhost:9/hook", "localhost does not resolve to a public address"),
        ("http://[::1]:9/hook", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.1.2.3/hook", "private"),
        ("http://100.64.0.1/hook", "not a public address"),
        ("http://[::ffff:127.0.0.1]/hook", "loopback"),
    ],
)
def test_private_targets_are_refused_at_registration(system: IngestSystem, url: str, reason: str) -> None:
    with system.api() as api:
        response = api.post(
            "/v1/endpoints", json={"tenant": "acme", "url": url, "event_types": ["#"], "verify": False}
        )
    assert response.status_code == 422, response.text
    [detail] = response.json()["details"]
    assert detail["field"] == "url"
    assert reason in detail["message"]
    if "localhost" in url:
        assert "127.0.0.1" not in response.text
        assert "::1" not in response.text
