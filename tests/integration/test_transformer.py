"""Transforms applied in worker processes (``Transformer``): real jq in real processes. A runaway program
is stopped at its limit while other transforms go on, and its worker is replaced."""

from __future__ import annotations

import asyncio
import os
import signal

import orjson
import pytest

from hookline.shared.outbound.transforms import Transformer, TransformFailedError

pytestmark = pytest.mark.integration

EVENT = orjson.dumps({"id": "evt_1", "type": "order.created", "data": {"amount": 1500, "currency": "EUR"}})


async def test_a_program_makes_the_body_and_failures_say_why() -> None:
    async with Transformer(workers=1, max_bytes=1024) as transformer:
        body = await transformer.apply('{text: "Order \\(.data.amount) \\(.data.currency)", id}', EVENT)
        assert orjson.loads(body) == {"text": "Order 1500 EUR", "id": "evt_1"}
        for source, said in [
            ('error("no such order")', "no such order"),
            ("empty", "the transform gave no output"),
            ("[range(200)] | map(tostring * 10)", "the transform's output is"),  # over max_bytes
            (".data.amount | ascii_downcase", "explode input must be a string"),
        ]:
            with pytest.raises(TransformFailedError) as failed:
                await transformer.apply(source, EVENT)
            assert said in str(failed.value), (source, str(failed.value))


async def test_a_runaway_is_stopped_at_its_limit_while_others_go_on() -> None:
    async with Transformer(workers=2, limit_s=0.05, max_bytes=1024) as transformer:
        finished: list[str] = []

        async def steady() -> None:
            for _ in range(20):
                finished.append((await transformer.apply(".type", EVENT)).decode())

        runaway = asyncio.create_task(transformer.apply("def f: f; f", EVENT))
        await steady()
        with pytest.raises(TransformFailedError, match="ran past its limit of 50 ms"):
            await runaway
        assert finished == ['"order.created"'] * 20  # the other worker served them
        # Its worker was replaced: two programs at once are served again.
        both = await asyncio.wait_for(
            asyncio.gather(transformer.apply(".id", EVENT), transformer.apply(".type", EVENT)), timeout=30
        )
        assert [orjson.loads(b) for b in both] == ["evt_1", "order.created"]


async def test_a_program_kept_off_the_cpu_is_not_cut_off_by_the_clock() -> None:
    """The limit is the worker's CPU time: a machine short of CPU delays a program without failing it
    (measured by the clock, a few-millisecond program was dead-lettered on a loaded machine). Here the
    worker is stopped for six times the limit while it has the program."""
    async with Transformer(workers=1, limit_s=0.05, max_bytes=1024) as transformer:
        assert await transformer.apply(".type", EVENT) == b'"order.created"'  # the worker is up
        [worker] = transformer._all
        os.kill(worker.process.pid, signal.SIGSTOP)
        try:
            pending = asyncio.create_task(transformer.apply(".id", EVENT))
            await asyncio.sleep(0.3)  # the length of the fault, not a wait for its outcome
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
        assert await pending == b'"evt_1"'
