"""A small HTTP listener for ``/metrics`` and ``/healthz`` inside the daemon's event loop.

Why not prometheus-client's own ``start_http_server``: it runs a thread that calls the
collectors while the event loop changes the very dicts they read. Here a scrape runs in
the loop between two of its steps, so a collector sees a consistent state without locks.

What keeps it from hurting the daemon: at most ``max_clients`` connections at once
(more are closed at once), a request head of at most 8 KiB that must arrive within
``timeout_s``, a response that must drain within ``timeout_s``, and every failure of a
connection or a collector ends that connection only (counted in ``errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

log = logging.getLogger("meshopt.metrics")

MAX_HEAD_BYTES = 8192
Health = Callable[[], tuple[bool, dict[str, Any]]]

INDEX = b"""<html><head><title>meshopt</title></head><body>
<p><a href="/metrics">/metrics</a> (Prometheus) and <a href="/healthz">/healthz</a></p>
</body></html>
"""


class MetricsServer:
    """``await start()`` binds (OSError if it cannot); ``await close()`` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Health,
        *,
        max_clients: int = 8,
        timeout_s: float = 5.0,
    ) -> None:
        self.host = host
        self.port = port
        self.registry = registry
        self.health = health
        self.max_clients = max_clients
        self.timeout_s = timeout_s
        self.active = 0
        self.counters: dict[str, int] = {"requests": 0, "refused_busy": 0, "errors": 0}
        self._server: asyncio.Server | None = None
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port): port 0 asks the kernel for a free one."""
        assert self._server is not None and self._server.sockets
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.host, self.port, limit=MAX_HEAD_BYTES, backlog=16
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        # Cut the connections off; their handlers then end on their own.
        for writer in list(self._clients.values()):
            writer.transport.abort()
        if self._clients:
            await asyncio.wait(list(self._clients), timeout=self.timeout_s)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= self.max_clients:
            self.counters["refused_busy"] += 1
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._clients[task] = writer
        self.active += 1
        try:
            await self._serve(reader, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            self.counters["errors"] += 1
        except asyncio.LimitOverrunError:
            self.counters["errors"] += 1
            with contextlib.suppress(Exception):
                await self._respond(writer, 431, "text/plain", b"request head too large\n")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here costs one scrape, never the daemon
            self.counters["errors"] += 1
            log.warning("metrics: request failed: %r", exc)
        finally:
            # close() sends what is still buffered; a client that does not read it
            # within the timeout is cut off.
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), self.timeout_s)
            except (TimeoutError, OSError):
                writer.transport.abort()
            finally:
                self.active -= 1
                if task is not None:
                    self._clients.pop(task, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
        self.counters["requests"] += 1
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            await self._respond(writer, 400, "text/plain", b"bad request\n")
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            await self._respond(writer, 405, "text/plain", b"GET or HEAD only\n")
            return
        head_only = method == b"HEAD"
        if target == b"/metrics":
            try:
                body = generate_latest(self.registry)
            except Exception as exc:
                self.counters["errors"] += 1
                log.warning("metrics: collecting failed: %r", exc)
                await self._respond(writer, 500, "text/plain", b"collecting failed\n", head_only)
                return
            await self._respond(writer, 200, CONTENT_TYPE_PLAIN_0_0_4, body, head_only)
        elif target == b"/healthz":
            ok, detail = self.health()
            body = json.dumps({"status": "ok" if ok else "failing", **detail}).encode() + b"\n"
            await self._respond(writer, 200 if ok else 503, "application/json", body, head_only)
        elif target == b"/":
            await self._respond(writer, 200, "text/html", INDEX, head_only)
        else:
            await self._respond(writer, 404, "text/plain", b"not found\n", head_only)

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        content_type: str,
        body: bytes,
        head_only: bool = False,
    ) -> None:
        reason = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            431: "Request Header Fields Too Large",
            500: "Internal Server Error",
            503: "Service Unavailable",
        }[status]
        header = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(header if head_only else header + body)
        await asyncio.wait_for(writer.drain(), self.timeout_s)


async def start_metrics(
    listen: tuple[str, int] | None,
    registry: CollectorRegistry,
    health: Health,
    what: str,
) -> MetricsServer | None:
    """Start the listener; a port that cannot be bound is logged, not fatal.

    Metrics are for watching the daemon: a second daemon on the same host, or a port
    taken by something else, must not keep the routes from being managed.
    """
    if listen is None:
        return None
    server = MetricsServer(listen[0], listen[1], registry, health)
    try:
        await server.start()
    except OSError as exc:
        log.error(
            "%s metrics: cannot listen on %s:%d: %s; /metrics and /healthz are off",
            what,
            listen[0],
            listen[1],
            exc.strerror or exc,
        )
        return None
    host, port = server.address
    log.info(
        "%s metrics on http://%s/metrics",
        what,
        f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
    )
    return server
