"""The public port of `serve --replicas N`, in front of the router from the first second.

SGLang's router answers as soon as it listens: /health 200 and requests its own 503 (without
Retry-After) while no replica has loaded, and it cannot be handed a socket or share a port. So the
supervisor listens on --host/--port itself. Until the router counts a healthy replica, every
request there is answered as a loading `vinoserve serve` answers it: 503 with Retry-After and the
API's error body (Anthropic's on /v1/messages). From then on each connection is spliced, bytes
as they are, to the router on loopback: a stream stays a stream, and nothing is parsed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

from vinoserve.server.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATHS, anthropic_error
from vinoserve.server.errors import error_body

log = logging.getLogger("vinoserve.scale")
RETRY_AFTER_S = 5  # as a loading server says (server/app.py)
_MAX_HEAD = 64 * 1024
_MAX_DRAINED = 8 * 2**20  # a body read (and dropped) before answering, so the client hears the 503
_CHUNK = 64 * 1024


class Gate:
    def __init__(self, host: str, port: int, upstream_port: int) -> None:
        self.host, self.port, self.upstream_port = host, port, upstream_port
        self.ready = False  # set once, by the supervisor's thread; read by the gate's
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> None:
        """Listens now (OSError if the port is taken), then serves on a thread of its own."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        self._server = self._loop.run_until_complete(asyncio.start_server(self._connection, sock=sock))
        threading.Thread(target=self._loop.run_forever, name="vinoserve-gate", daemon=True).start()

    def stop_listening(self) -> None:
        """No new connections; those spliced already carry on until the router ends them."""
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.ready:
                await self._splice(reader, writer)
            else:
                await self._loading(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            pass  # the client went away, or sent no HTTP: nothing to answer
        finally:
            writer.close()

    async def _loading(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        if len(head) > _MAX_HEAD:
            return
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else "/"
        length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                       if k.strip().lower() == "content-length" and v.strip().isdigit()), 0)
        if 0 < length <= _MAX_DRAINED:
            await asyncio.wait_for(reader.readexactly(length), 30)
        message = "no replica has loaded the model yet"
        shape = anthropic_error if path.startswith(ANTHROPIC_PATHS) else error_body
        body = json.dumps(shape(503, message, code="model_not_ready")).encode()
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                     b"retry-after: %d\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                     % (RETRY_AFTER_S, len(body), body if not lines[0].startswith("HEAD ") else b""))
        await writer.drain()

    async def _splice(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until `reader` ends, then ends `writer`'s side (the other direction may go on)."""
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
