"""schemathesis checks for the ingest API, loaded through SCHEMATHESIS_HOOKS by tests/integration/test_fuzz.py."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.check
def rejections_name_the_problem(ctx: Any, response: Any, case: Any) -> None:
    """Every 4xx answer says what is wrong: an error code, a message, and the fields when it is about them."""
    if not 400 <= response.status_code < 500:
        return
    body = response.json()
    assert isinstance(body, dict), f"{response.status_code} without a JSON error body"
    assert body.get("error"), f"{response.status_code} without an error code: {body}"
    assert body.get("message"), f"{response.status_code} without a message: {body}"
    if response.status_code == 422 and body["error"] == "invalid_fields":
        assert body.get("details"), f"422 without the fields: {body}"
    assert "Traceback" not in response.text
