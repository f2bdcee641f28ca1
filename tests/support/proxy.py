"""A TCP proxy on 127.0.0.1 between a service and the broker, for network faults without root.

Start it in the test's event loop and point a service's ``HOOKLINE_AMQP_URL`` at ``proxy.url_for(url)``:

    async with TcpProxy("127.0.0.1", 5672) as proxy:
        ...  # proxy.cut(), proxy.stall() / proxy.resume(), proxy.refuse(True)

Each accepted connection gets its own socket to the upstream and one pump task per direction. The
sockets are plain non-blocking sockets driven by ``loop.sock_recv``/``sock_sendall``: no transports,
so nothing closes behind the proxy's back and every socket is closed before ``__aexit__`` returns.

- ``cut()`` resets every live connection on both sides (``SO_LINGER`` 0, so a RST, not a FIN and
  certainly not an AMQP ``Connection.Close``); later connections are proxied as usual.
- ``stall()`` holds every byte in both directions, end of stream included, until ``resume()``: a
  partition, not a drop. Connections accepted while stalled are connected upstream but stalled too.
  A client that gives up during a stall (a heartbeat timeout) is only seen to go once resumed.
- ``refuse(True)`` resets every new connection as soon as it is accepted (broker unreachable);
  live connections are left alone.
- ``drop_consumer_cancels(True)`` drops every ``basic.cancel`` the broker sends (it parses the AMQP
  frames from the broker): a client then believes in consumers the broker has cancelled, as if the
  notification had been lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

CHUNK = 64 * 1024
_FRAME_HEADER = struct.Struct(">BHI")  # type, channel, payload size; then the payload and 0xCE
_METHOD_FRAME = 1
_BASIC_CANCEL = struct.pack(">HH", 60, 30)  # class basic, method cancel
_LINGER_RESET = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends a RST


def _close(sock: socket.socket, *, reset: bool) -> None:
    if reset:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


@dataclass(eq=False)
class _Link:
    client: socket.socket
    upstream: socket.socket


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self._refusing = False
        self._dropping_cancels = False
        self.cancels_dropped = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()  # one per accepted connection, until it is over
        self._links: set[_Link] = set()

    @property
    def connections(self) -> int:
        """Live proxied connections: accepted, connected upstream, not yet over."""
        return len(self._links)

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    def url_for(self, amqp_url: str) -> str:
        """``amqp_url`` through this proxy: user, password, vhost and query kept, host:port replaced."""
        parts = urlsplit(amqp_url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        return urlunsplit(
            (parts.scheme, f"{userinfo}{at}127.0.0.1:{self.port}", parts.path, parts.query, parts.fragment)
        )

    async def __aenter__(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = asyncio.create_task(self._accept(listener), name=f"proxy-accept-{self.port}")
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            await asyncio.gather(self._acceptor, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        await self.cut()

    async def cut(self) -> None:
        """Reset every current connection, both sides, as a network failure would; wait until they are gone."""
        serving = list(self._serving)
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)

    def stall(self) -> None:
        """Stop forwarding in both directions; bytes are held, not dropped, until ``resume()``."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def refuse(self, on: bool) -> None:
        """While on, every new connection is reset as soon as it is accepted."""
        self._refusing = on

    def drop_consumer_cancels(self, on: bool) -> None:
        """While on, the broker's ``basic.cancel`` frames never reach the client."""
        self._dropping_cancels = on

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            client, _ = await loop.sock_accept(listener)
            if self._refusing:
                _close(client, reset=True)
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(self._serve(client), name=f"proxy-connection-{self.port}")
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _connect_upstream(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.upstream_host, self.upstream_port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        upstream = socket.socket(family, kind, proto)
        try:
            upstream.setblocking(False)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(upstream, address)
        except BaseException:
            upstream.close()
            raise
        return upstream

    async def _serve(self, client: socket.socket) -> None:
        """Proxy one connection until either side ends it (then both are closed) or it is cancelled (reset)."""
        reset = True
        try:
            try:
                upstream = await self._connect_upstream()
            except OSError:
                return  # the upstream is unreachable: so is the proxy, for this client
            link = _Link(client, upstream)
            try:
                self._links.add(link)
                pumps = {
                    asyncio.create_task(self._pump(client, upstream)),
                    asyncio.create_task(self._pump(upstream, client, frames=True)),
                }
                try:
                    done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                    # A clean end of stream closes both sides gracefully; a reset or a write error resets both.
                    reset = any(task.exception() is not None for task in done)
                finally:
                    for task in pumps:
                        task.cancel()
                    await asyncio.gather(*pumps, return_exceptions=True)
            finally:
                self._links.discard(link)
                _close(upstream, reset=reset)
        finally:
            _close(client, reset=reset)

    async def _pump(self, source: socket.socket, target: socket.socket, *, frames: bool = False) -> None:
        """Copy ``source`` to ``target`` until end of stream; nothing moves while stalled. ``frames``: the
        broker's side, whose whole frames are passed on (or dropped) one by one."""
        loop = asyncio.get_running_loop()
        pending = b""
        while True:
            await self._flowing.wait()
            data = await loop.sock_recv(source, CHUNK)
            await self._flowing.wait()  # a stall that began while this read was pending holds its bytes
            if not data:
                return
            if frames:
                pending, data = self._filter(pending + data)
            await loop.sock_sendall(target, data)

    def _filter(self, data: bytes) -> tuple[bytes, bytes]:
        """The whole frames of ``data`` to pass on, without the broker's cancels when they are dropped;
        and the start of a frame still to come."""
        out = bytearray()
        at = 0
        while len(data) - at >= _FRAME_HEADER.size:
            kind, _, size = _FRAME_HEADER.unpack_from(data, at)
            end = at + _FRAME_HEADER.size + size + 1
            if end > len(data):
                break
            payload = data[at + _FRAME_HEADER.size : at + _FRAME_HEADER.size + 4]
            if self._dropping_cancels and kind == _METHOD_FRAME and payload == _BASIC_CANCEL:
                self.cancels_dropped += 1
            else:
                out += data[at:end]
            at = end
        return data[at:], bytes(out)
