"""The risky part of endpoint transformations (issue 26), measured before they are built: a jq program
runs in C and cannot be interrupted from a thread, so a runaway one (``def f: f; f``) must run where it
can be killed. This prototype runs programs in a worker process fed through a pipe, waits for the answer
on the event loop (never blocking it), and kills and replaces the worker past the limit. It measures
what that costs against running jq in the dispatcher's own process, and how long a runaway takes to be
stopped and a worker to be back, while a ticker on the event loop shows the loop was never held.

    python -m bench.transform_isolation [--evaluations 2000] [--limit-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

import jq
import orjson

EVENT = {
    "id": "evt_1", "type": "order.created", "tenant": "acme",
    "data": {"amount": 1500, "currency": "EUR", "items": [{"sku": f"s_{i}", "qty": 1} for i in range(5)]},
}  # fmt: skip
PROGRAM = '{text: "Order \\(.data.amount) \\(.data.currency)", id: .id, items: [.data.items[].sku]}'
RUNAWAY = "def f: f; f"


def _serve(conn: Connection) -> None:
    compiled: dict[str, Any] = {}
    while True:
        program, body = conn.recv_bytes().split(b"\0", 1)
        source = program.decode()
        try:
            if source not in compiled:
                compiled[source] = jq.compile(source)
            conn.send_bytes(b"ok\0" + orjson.dumps(compiled[source].input_text(body.decode()).first()))
        except Exception as exc:
            conn.send_bytes(b"error\0" + str(exc).encode()[:500])


class Worker:
    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        started = time.perf_counter()
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(child,), daemon=True
        )
        self._process.start()
        self.started_s = time.perf_counter() - started

    async def run(self, program: str, body: bytes, *, limit_s: float) -> tuple[bool, bytes]:
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        loop.add_reader(self._conn.fileno(), lambda: answered.done() or answered.set_result(None))
        self._conn.send_bytes(program.encode() + b"\0" + body)
        try:
            await asyncio.wait_for(answered, limit_s)
        except TimeoutError:
            loop.remove_reader(self._conn.fileno())
            self._process.kill()
            self._process.join()
            self._start()
            return False, b"stopped after its time limit"
        loop.remove_reader(self._conn.fileno())
        kind, result = self._conn.recv_bytes().split(b"\0", 1)
        return kind == b"ok", result

    def close(self) -> None:
        self._process.kill()
        self._process.join()


async def measure(evaluations: int, limit_ms: float) -> dict[str, Any]:
    body = orjson.dumps(EVENT)
    program = jq.compile(PROGRAM)
    started = time.perf_counter()
    for _ in range(evaluations):
        program.input_text(body.decode()).first()
    in_process_us = (time.perf_counter() - started) / evaluations * 1e6

    worker = Worker()
    await worker.run(PROGRAM, body, limit_s=5.0)  # the worker's imports
    started = time.perf_counter()
    for _ in range(evaluations):
        ok, _ = await worker.run(PROGRAM, body, limit_s=limit_ms / 1000)
        assert ok
    pooled_us = (time.perf_counter() - started) / evaluations * 1e6

    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    ticking = asyncio.create_task(ticker())
    started = time.perf_counter()
    ok, said = await worker.run(RUNAWAY, body, limit_s=limit_ms / 1000)
    stopped_ms = (time.perf_counter() - started) * 1000
    ok_after, _ = await worker.run(PROGRAM, body, limit_s=5.0)  # the new worker, warming up
    back_ms = (time.perf_counter() - started) * 1000
    ticking.cancel()
    worker.close()
    longest_gap_ms = max(b - a for a, b in itertools.pairwise(ticks)) * 1000
    assert not ok
    assert ok_after
    return {
        "evaluations": evaluations, "limit_ms": limit_ms,
        "in_process_us": round(in_process_us, 1), "worker_us": round(pooled_us, 1),
        "runaway_stopped_ms": round(stopped_ms, 1), "worker_back_ms": round(back_ms, 1),
        "loop_longest_gap_ms": round(longest_gap_ms, 1), "said": said.decode(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--evaluations", type=int, default=2000)
    parser.add_argument("--limit-ms", type=float, default=50.0)
    arguments = parser.parse_args()
    print(json.dumps(asyncio.run(measure(arguments.evaluations, arguments.limit_ms)), indent=2))


if __name__ == "__main__":
    main()
