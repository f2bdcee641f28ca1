"""Endpoint transformations: a jq program applied to the event JSON, whose output is the body sent
(signed as sent). Checked when set (the ingest) and applied at each attempt (the dispatchers, and the
ingest's own attempts), so one definition here.

jq runs in C and cannot be interrupted from a thread: ``def f: f; f`` never returns. So programs run in
worker processes fed through pipes (:class:`Transformer`); the caller's event loop waits on the pipe. The
limit is the worker's CPU time, not the caller's clock: each evaluation arms a CPU-time timer
(``ITIMER_PROF``) whose signal ends the worker, which is then replaced off the loop
(``bench/transform_isolation.py``: stopped within 54 ms of a 50 ms limit, the loop never held). Measured
by the clock, a program of a few milliseconds "ran past its limit" on a machine short of CPU and its
event was dead-lettered for good. A program may not read the environment,
files, other inputs or the clock: the names that do are refused when it is set, found by scanning its
tokens, string interpolations included (jq's compiler accepts them all).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import signal
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Self

import jq
import orjson
import structlog

log = structlog.get_logger(__name__)

MAX_CHARS = 8000
LIMIT_S = 0.05  # CPU time per evaluation
#: How long the caller waits for an answer however busy the machine: a worker that has had no CPU for
#: this long is given up (a runaway is ended by its CPU-time limit long before).
ANSWER_WAIT_S = 30.0
START_TIMEOUT_S = 30.0  # a worker's imports, on a loaded machine
READY = b"ready"
#: What a transformation may not use: the environment, input beyond the event, files, the clock, stderr.
REFUSED = frozenset(
    {"$ENV", "env", "input", "inputs", "now", "import", "include", "input_filename", "input_line_number",
     "get_search_list", "modulemeta", "$__prog_args", "debug", "stderr", "halt", "halt_error",
     "localtime", "mktime", "gmtime", "strftime", "strptime", "todate", "fromdate", "date", "dateadd",
     "datesub", "$__loc__"}
)  # fmt: skip
_TOKEN = re.compile(r"\$?[A-Za-z_][A-Za-z_0-9]*(?:::[A-Za-z_][A-Za-z_0-9]*)*")
_ERROR_CHARS = 300


class TransformError(ValueError):
    """A program refused when set, saying why."""


class TransformFailedError(Exception):
    """A program that failed on an event (an error, no output, too large, too slow): the copy is dead."""


def check(source: str) -> None:
    """Refuse a program (TransformError) that is too long, uses a refused name, or does not compile."""
    if len(source) > MAX_CHARS:
        raise TransformError(f"a transform is at most {MAX_CHARS} characters, not {len(source)}")
    for token in _TOKEN.findall(_code(source)):
        if token in REFUSED:
            raise TransformError(f"{token} is not allowed in a transform (no environment, files or clock)")
    try:
        jq.compile(source)
    except ValueError as exc:
        raise TransformError(_first_line(str(exc))) from None


def _code(source: str) -> str:
    """``source`` with the text of string literals blanked out, their interpolations ``\\(...)`` kept
    (they are code, parentheses and strings of their own included), and comments dropped."""
    kept: list[str] = []
    # One entry per level: inside a string literal at this level, and the parentheses open in its code.
    levels: list[list[Any]] = [[False, 0]]
    index = 0
    while index < len(source):
        char, level = source[index], levels[-1]
        if level[0]:  # in a string
            if source.startswith("\\(", index):
                levels.append([False, 0])
                kept.append(" (")
                index += 2
                continue
            if char == "\\":
                kept.append(" " * len(source[index : index + 2]))
                index += 2
                continue
            level[0] = char != '"'
            kept.append(char if char == '"' else " ")
        elif char == "#":
            while index < len(source) and source[index] != "\n":
                index += 1
            continue
        else:
            if char == '"':
                level[0] = True
            elif char == "(":
                level[1] += 1
            elif char == ")":
                if level[1] == 0 and len(levels) > 1:  # the interpolation's end: back in its string
                    levels.pop()
                else:
                    level[1] -= 1
            kept.append(char)
        index += 1
    return "".join(kept)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:_ERROR_CHARS] if message.strip() else "jq error"


# --- applying: worker processes ---------------------------------------------------------------------


def _serve(conn: Connection, limit_s: float) -> None:  # pragma: no cover (runs in the worker process)
    compiled: dict[str, Any] = {}
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # its default action ends the process
    conn.send_bytes(READY)  # imported: from now on only evaluations count against the limit
    while True:
        try:
            program, body = conn.recv_bytes().split(b"\0", 1)
        except EOFError:  # the service went (or dropped a worker it was starting): nothing more to do
            return
        source = program.decode()
        signal.setitimer(signal.ITIMER_PROF, limit_s)  # this evaluation's CPU time, compiling included
        try:
            if source not in compiled:
                if len(compiled) > 1000:
                    compiled.clear()
                compiled[source] = jq.compile(source)
            outputs = compiled[source].input_text(body.decode()).all()
            if not outputs:
                conn.send_bytes(b"error\0the transform gave no output")
            else:
                conn.send_bytes(b"ok\0" + orjson.dumps(outputs[0]))
        except Exception as exc:
            conn.send_bytes(b"error\0" + _first_line(str(exc)).encode())
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)


class _Worker:
    """One worker process; made in a thread (it waits for the process to have started)."""

    def __init__(self, limit_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process: BaseProcess = context.Process(target=_serve, args=(child, limit_s), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv_bytes() != READY:
            self.stop()
            raise OSError(f"a transform worker did not start within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class Transformer:
    """A pool of ``workers`` jq worker processes, started at the first transform (a service whose
    endpoints have none never starts one); ``apply`` runs a program on an event without ever holding
    the caller's event loop, and stops one that runs past ``limit_s`` of CPU time."""

    def __init__(self, *, workers: int = 1, limit_s: float = LIMIT_S, max_bytes: int) -> None:
        self._size = workers
        self._limit_s = limit_s
        self._max_bytes = max_bytes
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._replacements: set[asyncio.Task[None]] = set()
        self._started: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        return self

    async def _start(self) -> None:
        for worker in await asyncio.gather(
            *(asyncio.to_thread(_Worker, self._limit_s) for _ in range(self._size))
        ):
            self._all.add(worker)
            self._idle.put_nowait(worker)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in [*self._replacements, *([self._started] if self._started else [])]:
            task.cancel()
        for worker in list(self._all):
            await asyncio.to_thread(worker.stop)
        self._all.clear()

    async def apply(self, source: str, event: bytes) -> bytes:
        """The body ``source`` makes of ``event`` (JSON); TransformFailedError saying why it made none."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._started)
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[None] = loop.create_future()
        fd = worker.conn.fileno()

        def readable() -> None:
            if not answered.done():
                answered.set_result(None)

        loop.add_reader(fd, readable)
        try:
            worker.conn.send_bytes(source.encode() + b"\0" + event)
            await asyncio.wait_for(answered, self._limit_s + ANSWER_WAIT_S)
            answer = worker.conn.recv_bytes()
        except TimeoutError:
            loop.remove_reader(fd)
            self._replacing(worker)
            raise TransformFailedError(f"the transform did not answer within {ANSWER_WAIT_S:.0f} s") from None
        except EOFError:  # the worker ended: its CPU-time limit, as a rule
            loop.remove_reader(fd)
            try:
                reason = await self._ended(worker)
            finally:
                self._replacing(worker)  # after: two threads must not wait for one process
            raise TransformFailedError(reason) from None
        except BaseException:
            loop.remove_reader(fd)
            self._replacing(worker)
            raise
        loop.remove_reader(fd)
        kind, result = answer.split(b"\0", 1)
        self._idle.put_nowait(worker)
        if kind != b"ok":
            raise TransformFailedError(result.decode("utf-8", "replace"))
        if len(result) > self._max_bytes:
            raise TransformFailedError(
                f"the transform's output is {len(result)} bytes, over {self._max_bytes}"
            )
        return result

    async def _ended(self, worker: _Worker) -> str:
        """Why a worker ended mid-evaluation, as its copy's dead letter says."""
        await asyncio.to_thread(worker.process.join, 5.0)
        if worker.process.exitcode == -signal.SIGPROF:
            return f"the transform ran past its limit of {self._limit_s * 1000:.0f} ms"
        return f"the transform's worker ended (exit code {worker.process.exitcode})"

    async def _replace(self, worker: _Worker) -> None:
        """A worker killed (a runaway, or a wait cancelled mid-answer) and another started, off the loop."""
        await asyncio.to_thread(worker.stop)
        while True:
            try:
                fresh = await asyncio.to_thread(_Worker, self._limit_s)
            except OSError as exc:  # out of processes or memory for now: the others serve meanwhile
                log.error("transform_worker_not_started", error=type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            self._all.add(fresh)
            self._idle.put_nowait(fresh)
            log.info("transform_worker_replaced")
            return

    def _replacing(self, worker: _Worker) -> None:
        self._all.discard(worker)
        task = asyncio.get_running_loop().create_task(self._replace(worker))
        self._replacements.add(task)
        task.add_done_callback(self._replacements.discard)
