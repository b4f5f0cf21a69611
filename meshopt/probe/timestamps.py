"""Kernel receive timestamps (``SO_TIMESTAMPNS``) and the error they save.

Python's ``socket`` module has no ``SO_TIMESTAMP*`` constants, so the raw Linux value is
used and the ``struct timespec`` is parsed out of ``recvmsg``'s ancillary data.

Clock choice: the kernel stamps received packets with CLOCK_REALTIME, so the prober's
send timestamps are CLOCK_REALTIME too (``time.time_ns()`` right before ``sendto``).
An RTT is then the difference of two readings of the same clock on the same host; a
clock step (NTP) between them shows up as a negative or absurd RTT, which the prober
drops and counts. Scheduling and liveness use ``time.monotonic()`` instead.

:class:`TimerError` records, for every received packet, how long after the kernel's
stamp user space read it: the bias a user-space-timestamping prober (irtt) would add.
"""

from __future__ import annotations

import socket
import statistics
import struct
import time
from collections import deque
from collections.abc import Iterable, Iterator

from meshopt.probe.stats import quantile

SO_TIMESTAMPNS = 35  # asm-generic/socket.h (SO_TIMESTAMPNS_OLD); Python lacks it
SCM_TIMESTAMPNS = SO_TIMESTAMPNS
_TIMESPEC = struct.Struct("@ll")  # struct timespec {time_t tv_sec; long tv_nsec;}
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)

Address = tuple[str, int] | tuple[str, int, int, int]


def enable_rx_timestamps(sock: socket.socket) -> None:
    """Ask the kernel to stamp every datagram ``sock`` receives (nanoseconds, realtime)."""
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


def parse_rx_timestamp(ancdata: Iterable[tuple[int, int, bytes]]) -> int | None:
    """The ``SCM_TIMESTAMPNS`` stamp in ``ancdata`` as ns since the epoch, or None."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return int(sec) * 1_000_000_000 + int(nsec)
    return None


def drain_timestamped(
    sock: socket.socket, bufsize: int, limit: int
) -> Iterator[tuple[bytes, Address, int | None]]:
    """Up to ``limit`` queued datagrams, then back to the event loop (fairness).

    Stops when nothing is queued; other ``recvmsg`` errors propagate to the caller.
    """
    for _ in range(limit):
        try:
            yield recv_timestamped(sock, bufsize)
        except BlockingIOError:
            return


def recv_timestamped(sock: socket.socket, bufsize: int) -> tuple[bytes, Address, int | None]:
    """One datagram: ``(data, sender, kernel_rx_ns | None)``.

    Raises what ``recvmsg`` raises (``BlockingIOError`` when nothing is queued). A
    datagram longer than ``bufsize`` comes back cut to ``bufsize`` bytes, so read with
    one byte more than the largest size you accept and reject anything that long.
    """
    data, ancdata, _flags, addr = sock.recvmsg(bufsize, _ANCILLARY_BYTES)
    return data, addr, parse_rx_timestamp(ancdata)


class TimerError:
    """Gap between the kernel's rx stamp and user space reading the packet (last ``keep``)."""

    def __init__(self, keep: int = 4096) -> None:
        self._gaps_ns: deque[int] = deque(maxlen=keep)
        self.count = 0  # packets seen since start (not limited to ``keep``)

    def add(self, kernel_rx_ns: int, user_ns: int) -> None:
        self._gaps_ns.append(user_ns - kernel_rx_ns)
        self.count += 1

    def median_us(self) -> float | None:
        if not self._gaps_ns:
            return None
        return statistics.median(self._gaps_ns) / 1000.0

    def p95_us(self) -> float | None:
        if not self._gaps_ns:
            return None
        ordered = sorted(self._gaps_ns)
        return quantile(ordered, 0.95) / 1000.0

    def median_p95_us(self) -> tuple[float, float] | None:
        """Both at the cost of one sort (the agent's full snapshots carry them)."""
        if not self._gaps_ns:
            return None
        ordered = sorted(self._gaps_ns)
        return quantile(ordered, 0.5) / 1000.0, quantile(ordered, 0.95) / 1000.0

    @staticmethod
    def clock_resolution_s() -> float:
        """Resolution of CLOCK_REALTIME, the clock both stamps are read from.

        ``time.get_clock_info("time")`` is that clock (Python has no "realtime" name).
        """
        return time.get_clock_info("time").resolution

    def summary(self) -> dict[str, float | int | None]:
        return {
            "samples": self.count,
            "median_us": self.median_us(),
            "p95_us": self.p95_us(),
            "clock_resolution_s": self.clock_resolution_s(),
        }


def open_udp_socket(host: str, port: int) -> socket.socket:
    """A non-blocking UDP socket bound to ``host``/``port`` with rx timestamps on.

    ``"::"`` gives a dual-stack socket (``IPV6_V6ONLY`` off): it sends to and receives
    from IPv4 (as ``::ffff:a.b.c.d``) and IPv6, link-local included. An IPv4 ``host``
    gives an IPv4 socket; ``fe80::1%wg0`` binds a link-local address on its interface.
    Raises ``OSError`` when the address cannot be bound and ``socket.gaierror`` when it
    is not an address.
    """
    infos = socket.getaddrinfo(
        host,
        port,
        type=socket.SOCK_DGRAM,
        flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
    )
    family, kind, proto, _canon, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setblocking(False)
        enable_rx_timestamps(sock)
        sock.bind(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock
