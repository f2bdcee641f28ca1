"""The ingest's request body limits, enforced before a body is read (declared or streamed)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hookline.shared.runtime.api import ApiError, error_response


class BodyLimit:
    """Answer 413 before reading more than ``max_bytes`` of a request body (declared or streamed); the
    paths in ``larger`` have limits of their own (path -> (bytes, the setting that sets it))."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, larger: Mapping[str, tuple[int, str]] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = dict(larger or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, setting = self.larger.get(scope["path"], (self.max_bytes, "HOOKLINE_MAX_PAYLOAD_BYTES"))
        message = f"the request body exceeds the limit of {max_bytes} bytes ({setting})"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            response = error_response(413, "payload_too_large", message)
            await response(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            received = await receive()
            seen += len(received.get("body", b""))
            if seen > max_bytes:
                raise ApiError(413, "payload_too_large", message)
            return received

        await self.app(scope, limited_receive, send)
