"""Conventions every hookline HTTP API shares: bearer tokens, error bodies, probes, serving.

Errors always have the shape ``{"error": <code>, "message": <text>, "details": [{"field", "message"}]}``,
so a client can show which field was wrong; no stack trace or secret ever reaches a response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import aio_pika
import structlog
import uvicorn
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

from hookline.shared.broker.amqp import BrokerBlockedError, ChannelLostError
from hookline.shared.contracts.models import ErrorBody, ErrorDetail
from hookline.shared.runtime import lifecycle
from hookline.shared.runtime.bearer import UNAUTHORIZED_MESSAGE, presents_token
from hookline.shared.runtime.probes import ProbeAnswer, exposition, liveness, readiness, unauthorized
from hookline.shared.state.statefiles import StateFileReplacedError

log = structlog.get_logger(__name__)

#: What a 503 for a write the broker did not take tells the client to wait before sending it again.
BROKER_RETRY_AFTER_S = 5
#: What a 503 for a read of a local view being rebuilt (its file was damaged) tells the client.
VIEW_RETRY_AFTER_S = 2


class ApiError(Exception):
    """An error with a status, a stable code and a message safe to show the caller."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Sequence[ErrorDetail] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = list(details)
        self.headers = dict(headers or {})


def broker_unavailable(message: str) -> ApiError:
    """503 for a write the broker did not take (lost, or refusing publishes during an alarm): nothing
    was done, and the same request can be sent again after ``Retry-After``."""
    return ApiError(503, "broker_unavailable", message, headers={"Retry-After": str(BROKER_RETRY_AFTER_S)})


def error_response(
    status: int,
    code: str,
    message: str,
    details: Sequence[ErrorDetail] = (),
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = ErrorBody(error=code, message=message, details=list(details))
    headers = {**({"WWW-Authenticate": "Bearer"} if status == 401 else {}), **(headers or {})}
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def _field_name(location: Sequence[int | str]) -> str | None:
    parts = [str(part) for part in location if part != "body"]
    return ".".join(parts) or None


def invalid_input(errors: Sequence[ErrorDetails] | Sequence[Any]) -> ApiError:
    """Turn pydantic errors into a 400 (body is not JSON) or a 422 naming every bad field."""
    details = [ErrorDetail(field=_field_name(error["loc"]), message=error["msg"]) for error in errors]
    if any(error["type"] == "json_invalid" for error in errors):
        return ApiError(400, "malformed_json", "the request body is not valid JSON", details)
    fields = ", ".join(sorted({detail.field for detail in details if detail.field})) or "body"
    return ApiError(422, "invalid_fields", f"invalid value for: {fields}", details)


def route_path(request: Request) -> str:
    """The path to log: the matched route's template, since a path may carry a credential (a portal
    session's pages, /portal/s/<session>/…)."""
    return str(getattr(request.scope.get("route"), "path", "(no route)"))


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers)

    async def on_broker_lost(request: Request, exc: Exception) -> Response:
        log.warning("broker_write_failed", path=route_path(request), error=type(exc).__name__)
        return await on_api_error(request, broker_unavailable(f"the broker did not take it: {exc}"))

    async def on_state_file_replaced(request: Request, exc: Exception) -> Response:
        # The local view it reads was found damaged and is being rebuilt from its stream (logged there).
        log.warning("view_rebuilding", path=route_path(request))
        return error_response(
            503, "view_rebuilding", "a local view is being rebuilt; try again in a moment",
            headers={"Retry-After": str(VIEW_RETRY_AFTER_S)},
        )  # fmt: skip

    async def on_request_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return await on_api_error(_, invalid_input(exc.errors()))

    async def on_pydantic_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ValidationError)
        return await on_api_error(_, invalid_input(exc.errors()))

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled_error", path=route_path(request), error=type(exc).__name__, exc_info=exc)
        return error_response(500, "internal_error", "internal error; see the service log")

    app.add_exception_handler(ApiError, on_api_error)
    for broker_error in (BrokerBlockedError, ChannelLostError, aio_pika.exceptions.AMQPConnectionError):
        app.add_exception_handler(broker_error, on_broker_lost)
    app.add_exception_handler(StateFileReplacedError, on_state_file_replaced)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(ValidationError, on_pydantic_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def bearer_token_guard(*tokens: str) -> Callable[[Request], None]:
    """A dependency that admits only requests carrying ``Authorization: Bearer <token>``, the token one
    of ``tokens``."""
    if not tokens:
        raise ValueError("a bearer token guard needs at least one token")

    def guard(request: Request) -> None:
        if not presents_token(request.headers.get("authorization", ""), tokens):
            raise ApiError(401, "unauthorized", UNAUTHORIZED_MESSAGE)

    return guard


class _Server(uvicorn.Server):
    # uvicorn re-raises the signal it caught once it has stopped, which makes the process die "by
    # SIGTERM" instead of exiting 0; the service's own stop event drives the shutdown instead.
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve(app: FastAPI, *, host: str, port: int, grace_s: float) -> None:
    """Serve ``app`` until SIGTERM or SIGINT: stop accepting, finish requests within ``grace_s``, then
    run the lifespan's exit (which closes the broker resources in order)."""
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=max(1, int(grace_s)),
        )
    )
    stopping = lifecycle.stop_event()

    async def stop_on_signal() -> None:
        await stopping.wait()
        server.should_exit = True

    watcher = asyncio.create_task(stop_on_signal())
    try:
        await server.serve()
    finally:
        watcher.cancel()
    if not server.started:
        raise SystemExit(1)


def probes_router(problems: Callable[[], list[str]], *, metrics_tokens: Sequence[str]) -> APIRouter:
    """The probes (:mod:`hookline.shared.runtime.probes` decides their answers) on an API's own listener. ``problems`` says what is missing (the broker, a loop
    that is not running); ``/metrics`` answers only a bearer token of ``metrics_tokens``: it shares the
    API's listener, and the monitor's series name endpoints. The probes stay open: orchestrators call
    them without credentials."""
    if not metrics_tokens:
        raise ValueError("an API's /metrics needs at least one token")

    def respond(answer: ProbeAnswer) -> Response:
        return JSONResponse(answer.body, status_code=answer.status, headers=dict(answer.headers))

    router = APIRouter(include_in_schema=False)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not presents_token(request.headers.get("authorization", ""), metrics_tokens):
            return respond(unauthorized())
        body, content_type = exposition()
        return Response(body, media_type=content_type)

    @router.get("/healthz")
    async def healthz() -> Response:
        return respond(liveness())

    @router.get("/readyz")
    async def readyz() -> Response:
        return respond(readiness(problems()))

    return router
