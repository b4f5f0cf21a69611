"""The UDP echo responder every agent runs on its overlay address.

It answers REQUESTs only (never a REPLY: two responders cannot ping-pong), with a
header-only REPLY: never larger than the request (no amplification), and the cheapest
datagram WireGuard can carry (see :mod:`meshopt.probe.packet`). The reply carries the
time between the kernel's receive stamp and the reply's ``sendto`` so the prober can
take this process's scheduling delay out of the RTT.

Garbage never stops it: every dropped datagram is counted by reason
(``counters["bad_packet"]`` and ``counters["bad_packet.<reason>"]``) and each distinct
reason is logged once on the ``meshopt.probe`` logger.

``python -m meshopt.probe.responder --host :: --port 51899`` runs one until SIGTERM or
SIGINT and prints its counters as JSON when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time

from meshopt.errors import InputError
from meshopt.probe.packet import (
    MAX_PROBE_BYTES,
    PROBE_PORT,
    Kind,
    ProbeFormatError,
    decode,
    encode,
    reply_to,
)
from meshopt.probe.timestamps import Address, drain_timestamped, open_udp_socket

log = logging.getLogger("meshopt.probe")

DRAIN = 64  # datagrams read per wake-up before yielding to the loop


class Responder:
    def __init__(self) -> None:
        self.counters: dict[str, int] = {
            "echoed": 0,
            "bad_packet": 0,
            "no_kernel_ts": 0,
            "send_error": 0,
            "recv_error": 0,
        }
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._logged: set[str] = set()

    async def start(self, host: str = "::", port: int = PROBE_PORT) -> None:
        """Bind ``host``/``port`` (port 0: any free port, see :attr:`port`) and answer."""
        if self._sock is not None:
            raise RuntimeError("responder already started")
        try:
            sock = open_udp_socket(host, port)
        except (OSError, UnicodeError) as exc:
            raise InputError(f"probe responder cannot listen on [{host}]:{port}: {exc}") from exc
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("responder not started")
        return int(self._sock.getsockname()[1])

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None

    def _drop(self, reason: str, addr: object, detail: str) -> None:
        self.counters["bad_packet"] += 1
        key = f"bad_packet.{reason}"
        self.counters[key] = self.counters.get(key, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "probe responder: dropped a datagram from %s: %s (further %s drops are "
                "counted, not logged)",
                addr,
                detail,
                reason,
            )

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            for data, addr, rx_ns in drain_timestamped(sock, MAX_PROBE_BYTES + 1, DRAIN):
                self._answer(sock, data, addr, rx_ns)
        except OSError as exc:
            self.counters["recv_error"] += 1
            log.debug("probe responder: recvmsg failed: %s", exc)

    def _answer(self, sock: socket.socket, data: bytes, addr: Address, rx_ns: int | None) -> None:
        if rx_ns is None:
            self.counters["no_kernel_ts"] += 1
        try:
            request = decode(data)
        except ProbeFormatError as exc:
            self._drop(exc.reason, addr, str(exc))
            return
        if request.kind is not Kind.REQUEST:
            self._drop("not_request", addr, f"a {request.kind.name} is never answered")
            return
        try:
            sent_ns = time.time_ns()
            turnaround = sent_ns - rx_ns if rx_ns is not None else 0
            sock.sendto(encode(reply_to(request, turnaround)), addr)
        except OSError as exc:
            self.counters["send_error"] += 1
            if "send_error" not in self._logged:
                self._logged.add("send_error")
                log.warning("probe responder: cannot reply to %s: %s", addr, exc)
            return
        self.counters["echoed"] += 1


async def _serve(host: str, port: int) -> dict[str, int]:
    responder = Responder()
    await responder.start(host, port)
    print(f"listening on [{host}]:{responder.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        responder.close()
    return responder.counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshopt.probe.responder", description="UDP echo responder"
    )
    parser.add_argument("--host", default="::", help="address to bind (default :: dual stack)")
    parser.add_argument("--port", type=int, default=PROBE_PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        counters = asyncio.run(_serve(args.host, args.port))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(counters, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
