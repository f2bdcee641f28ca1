"""The ingest alone, in this test process: the real FastAPI application with its real lifespan (broker
session, endpoint change log, dead-letter view, local views) on the real broker, in a vhost of its own,
served by uvicorn on 127.0.0.1 from a thread of its own. What the API answers is tested here in seconds;
what needs a dispatcher delivering, the monitor or a process killed is the e2e tests' (tests/e2e).

Sync tests call it with ``httpx.Client`` as they call the subprocess system; its log lines (the JSON the
service would write to stdout) are kept for ``logs()``."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog
import uvicorn

from hookline.ingest.service import create_app
from hookline.ingest.settings import IngestSettings
from hookline.shared.runtime import logging as hookline_logging
from support import services
from support.system import add_endpoint


class _Sink(io.RawIOBase):
    """Where the structlog lines of every in-process service go: the bytes of the one capturing now."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._targets: list[bytearray] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raw = bytes(data)
        with self._lock:
            for target in self._targets:
                target.extend(raw)
        return len(raw)

    def flush(self) -> None:
        pass

    @contextmanager
    def capturing(self) -> Iterator[bytearray]:
        captured = bytearray()
        with self._lock:
            self._targets.append(captured)
        try:
            yield captured
        finally:
            with self._lock:
                self._targets.remove(captured)


_SINK = _Sink()


@contextmanager
def _service_logging(level: str) -> Iterator[None]:
    """The services' logging configuration (JSON lines) into :data:`_SINK` for the block; the test
    process's own (structlog's and the root logger's) back afterwards. Loggers are not cached: a logger
    used here must not keep writing here once the block is over."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    hookline_logging.configure(service="ingest", level=level, output=_SINK)  # type: ignore[arg-type]
    structlog.configure(cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**saved)
        root.handlers[:] = handlers
        root.setLevel(root_level)


@dataclass
class InProcessIngest:
    """One ingest application served from a thread (its own event loop), as ``services.Service`` is
    for a process: ``base_url``, ``port``, ``log()``."""

    name: str
    port: int
    _captured: bytearray

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return bytes(self._captured).decode(errors="replace")


@contextmanager
def ingest_serving(env: Mapping[str, str], *, name: str = "ingest") -> Iterator[InProcessIngest]:
    """The ingest configured from ``env`` (HOOKLINE_* variables, as a process would read them), ready
    (its lifespan has started: the change log and dead letters are read up to now), and stopped at the
    end of the block as SIGTERM stops it: requests finished, then the lifespan's exit."""
    port = services.free_port()
    variables = {key: value for key, value in env.items() if key.startswith("HOOKLINE_")}
    variables["HOOKLINE_INGEST_PORT"] = str(port)
    variables["HOOKLINE_INGEST_HOST"] = "127.0.0.1"
    # The values a process would read from its environment, given as the settings' fields (which win
    # over this test process's own environment), each validated as the variable would be.
    fields = {key.removeprefix("HOOKLINE_").lower(): value for key, value in variables.items()}
    settings = IngestSettings(
        **{name: fields[name] for name in IngestSettings.model_fields if name in fields}
    )
    server = uvicorn.Server(  # from a thread: it leaves the process's signals alone
        uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
        )
    )
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:
            failure.append(exc)

    with _SINK.capturing() as captured:
        ingest = InProcessIngest(name, port, captured)
        thread = threading.Thread(target=serve, name=f"in-process-{name}", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                thread.join(30)
                raise AssertionError(f"{name} did not start: {failure}\n{ingest.log()}")
            time.sleep(0.05)
        try:
            yield ingest
        finally:
            server.should_exit = True
            thread.join(60)
            assert not thread.is_alive(), f"{name} did not stop\n{ingest.log()}"
            assert not failure, f"{name} failed: {failure}\n{ingest.log()}"


@dataclass
class IngestSystem:
    """What the integration tests of the API use, shaped as :class:`support.system.System` is for the
    parts they need: ``api()``, ``add_endpoint``, ``amqp_url``, ``env``, ``ingest.base_url``,
    ``logs()``; ``start_ingest`` for a second replica (or one set otherwise) on the same vhost."""

    amqp_url: str
    env: dict[str, str]
    log_dir: Path
    ingest: InProcessIngest
    extra: list[InProcessIngest] = field(default_factory=list)

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
        )

    def add_endpoint(self, tenant: str, url: str, patterns: list[str], **fields: Any) -> dict[str, Any]:
        with self.api() as api:
            return add_endpoint(api, tenant, url, patterns, **fields)

    def logs(self) -> str:
        return "\n".join(ingest.log() for ingest in (self.ingest, *self.extra))


@contextmanager
def ingest_running(amqp_url: str, log_dir: Path, settings: Mapping[str, str]) -> Iterator[IngestSystem]:
    """The in-process ingest on ``amqp_url`` with the subprocess system's settings and ``settings``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = services.base_env(amqp_url, HOOKLINE_STATE_DIR=str(log_dir / "state"), **settings)
    level = env.get("HOOKLINE_LOG_LEVEL", "info")
    with _service_logging(level), ingest_serving(env) as ingest:
        yield IngestSystem(amqp_url, env, log_dir, ingest)


@contextmanager
def another_ingest(system: IngestSystem, name: str, **overrides: str) -> Iterator[InProcessIngest]:
    """One more ingest on the system's vhost (a replica: a state directory of its own unless given),
    stopped at the end of the block."""
    env = {**system.env, "HOOKLINE_STATE_DIR": str(system.log_dir / f"state-{name}"), **overrides}
    with ingest_serving(env, name=name) as ingest:
        system.extra.append(ingest)  # its lines stay in logs()
        yield ingest
