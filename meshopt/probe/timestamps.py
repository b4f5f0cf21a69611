"""Kernel receive (``SO_TIMESTAMPNS``) and transmit (``SO_TIMESTAMPING``) stamps.

Python's ``socket`` module has no ``SO_TIMESTAMP*`` constants, so the raw Linux values
are used and the ``struct timespec`` is parsed out of ``recvmsg``'s ancillary data.

Transmit stamps: a user-space send stamp is read before ``sendto`` enters the kernel,
so the system call, the UDP/IP stack and any preemption in between count as round
trip (~40-60 µs median here, milliseconds when the process loses the CPU there). With
:func:`enable_tx_timestamps` the kernel stamps the datagram where the device takes it
(``SCM_TSTAMP_SND``; on devices whose driver does not stamp, such as some virtual ones,
only where it enters the queueing layer, ``SCM_TSTAMP_SCHED``) and returns the stamp
with a copy of the packet on the socket's error queue (:func:`drain_tx_timestamps`).

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
SO_TIMESTAMPING = 37  # asm-generic/socket.h (SO_TIMESTAMPING_OLD)
SCM_TIMESTAMPING = SO_TIMESTAMPING
# linux/net_tstamp.h
SOF_TIMESTAMPING_TX_SOFTWARE = 1 << 1
SOF_TIMESTAMPING_SOFTWARE = 1 << 4
SOF_TIMESTAMPING_TX_SCHED = 1 << 8
SCM_TSTAMP_SND = 0  # ee_info: the driver took the packet
SCM_TSTAMP_SCHED = 1  # ee_info: the packet entered the queueing layer
SO_EE_ORIGIN_TIMESTAMPING = 4
MSG_ERRQUEUE = 0x2000
IP_RECVERR = 11
IPV6_RECVERR = 25
_TIMESPEC = struct.Struct("@ll")  # struct timespec {time_t tv_sec; long tv_nsec;}
# struct sock_extended_err {u32 ee_errno; u8 ee_origin, ee_type, ee_code, ee_pad;
#                           u32 ee_info; u32 ee_data;}
_EXTENDED_ERR = struct.Struct("@IBBBBII")
# Room for SCM_TIMESTAMPNS and, on a socket with SO_TIMESTAMPING's reporting flag, the
# SCM_TIMESTAMPING (three timespecs) the kernel adds to received datagrams too.
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size) + socket.CMSG_SPACE(3 * _TIMESPEC.size)
_ERRQUEUE_ANCILLARY = socket.CMSG_SPACE(3 * _TIMESPEC.size) + socket.CMSG_SPACE(64)

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


def enable_tx_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel for software transmit stamps of every datagram ``sock`` sends.

    False (and the socket unchanged) where the kernel refuses: the caller keeps its
    user-space send stamps.
    """
    flags = SOF_TIMESTAMPING_TX_SOFTWARE | SOF_TIMESTAMPING_TX_SCHED | SOF_TIMESTAMPING_SOFTWARE
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, flags)
    except OSError:
        return False
    return True


def parse_tx_timestamp(ancdata: Iterable[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """``(tx_ns, SCM_TSTAMP_SND | SCM_TSTAMP_SCHED)`` from an error-queue message, or None.

    None for anything that is not a software transmit stamp (an ICMP error, say).
    """
    ts_ns: int | None = None
    kind: int | None = None
    errors = ((socket.IPPROTO_IP, IP_RECVERR), (socket.IPPROTO_IPV6, IPV6_RECVERR))
    for level, ctype, data in ancdata:
        if level == socket.SOL_SOCKET and ctype == SCM_TIMESTAMPING:
            if len(data) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(data)  # [0] is the software stamp
                ts_ns = int(sec) * 1_000_000_000 + int(nsec)
        elif (level, ctype) in errors and len(data) >= _EXTENDED_ERR.size:
            _errno, origin, _t, _c, _p, info, _data = _EXTENDED_ERR.unpack_from(data)
            if origin == SO_EE_ORIGIN_TIMESTAMPING:
                kind = int(info)
    if ts_ns is None or ts_ns == 0 or kind not in (SCM_TSTAMP_SND, SCM_TSTAMP_SCHED):
        return None
    return ts_ns, kind


def drain_tx_timestamps(sock: socket.socket, limit: int) -> Iterator[tuple[bytes, int, int]]:
    """Up to ``limit`` transmit stamps queued on ``sock``'s error queue.

    Each is ``(packet, tx_ns, kind)``: ``packet`` is the sent datagram as the kernel saw
    it at the stamp (network headers included, so the payload is its tail). Stops when
    the queue is empty; other errors propagate to the caller.
    """
    for _ in range(limit):
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(
                2048, _ERRQUEUE_ANCILLARY, MSG_ERRQUEUE | socket.MSG_DONTWAIT
            )
        except BlockingIOError:
            return
        got = parse_tx_timestamp(ancdata)
        if got is not None:
            yield data, got[0], got[1]


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
