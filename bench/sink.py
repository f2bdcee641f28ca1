"""A minimal keep-alive HTTP receiver for benchmarks: answers 204 and notes when each webhook-id arrived.
``GET /__count`` answers how many requests it has received so far.

Usage: python -m bench.sink PORT OUT_JSON [STATUS [DELAY_MS]]. On SIGTERM it writes
{"count", "arrivals": {id: t}}; a request to a path other than ``/`` or ``/hook`` is noted as
``"<path> <id>"`` (several endpoints behind one sink). With DELAY_MS it answers that much later.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import cast

import uvloop


class _Sink(asyncio.Protocol):
    def __init__(
        self, arrivals: dict[str, float], counter: list[int], response: bytes, delay_s: float
    ) -> None:
        self.arrivals = arrivals
        self.counter = counter
        self.response = response
        self.delay_s = delay_s
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = 0
            webhook_id = None
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
                elif line.startswith(b"webhook-id:"):
                    webhook_id = line[11:].strip().decode()
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            assert self.transport is not None
            if head.startswith(b"get /__count"):
                count = str(self.counter[0]).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(count), count))
                continue
            self.counter[0] += 1
            if webhook_id is not None:
                path = head.split(b" ", 2)[1].decode()
                key = webhook_id if path in ("/", "/hook") else f"{path} {webhook_id}"
                self.arrivals.setdefault(key, time.time())
            if self.delay_s:
                asyncio.get_running_loop().call_later(self.delay_s, self._answer)
            else:
                self.transport.write(self.response)

    def _answer(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.response)


async def main(port: int, out_path: str, status: int, delay_ms: int) -> None:
    arrivals: dict[str, float] = {}
    counter = [0]
    response = f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\n\r\n".encode()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Sink(arrivals, counter, response, delay_ms / 1000), "127.0.0.1", port, backlog=4096
    )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    server.close()
    Path(out_path).write_text(json.dumps({"count": counter[0], "arrivals": arrivals}))  # noqa: ASYNC240


if __name__ == "__main__":
    status = int(sys.argv[3]) if len(sys.argv) > 3 else 204
    uvloop.run(main(int(sys.argv[1]), sys.argv[2], status, int(sys.argv[4]) if len(sys.argv) > 4 else 0))
