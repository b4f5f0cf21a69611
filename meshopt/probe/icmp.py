"""ICMP echo probing of a peer that runs no agent: RTT and loss with kernel timestamps.

Echo requests are built with ``struct`` (the bytes scapy would build) and sent on a raw
socket this module owns (``SOCK_RAW`` with ``IPPROTO_ICMP`` or ``IPPROTO_ICMPV6``: needs
CAP_NET_RAW). The send time is ``time.time_ns()`` just before ``sendto``; the receive
time is the kernel's (``SO_TIMESTAMPNS``), so the event loop's wake-up latency is not in
the RTT. Replies are matched on source, identifier, sequence and payload; anything
else on the raw socket (other pings, neighbour discovery, our own requests on
loopback) is ignored. Scapy's send loops would be far too slow and jittery to time
anything, and the agent must not need scapy at all.

:class:`EchoSocket` is shared with :mod:`meshopt.probe.pmtu`, which sends echoes of a
chosen size with DF set.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket
import statistics
import struct
import time
from dataclasses import dataclass

from meshopt.errors import MeshoptError
from meshopt.probe.timestamps import enable_rx_timestamps, recv_timestamped

ICMP_ECHO_REPLY = 0
ICMPV6_ECHO_REPLY = 129
IPV4_HEADER = 20
IPV6_HEADER = 40
ICMP_ECHO_HEADER = 8


class IcmpError(MeshoptError):
    """ICMP probing cannot run (no raw socket permission, bad address) or failed."""


class PacketTooBig(IcmpError):
    """The local stack refused a packet larger than the interface MTU (EMSGSIZE)."""


@dataclass(frozen=True)
class IcmpResult:
    """Echo replies of one ``icmp_ping`` run; RTTs in ms, in sequence order."""

    address: str
    sent: int
    received: int
    rtts_ms: tuple[float, ...]

    @property
    def loss(self) -> float:
        return 1.0 - self.received / self.sent if self.sent else 0.0

    @property
    def min_ms(self) -> float | None:
        return min(self.rtts_ms) if self.rtts_ms else None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.rtts_ms) if self.rtts_ms else None


def _checksum(data: bytes) -> int:
    """RFC 1071 Internet checksum (one's complement of the one's complement sum)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(v6: bool, ident: int, seq: int, payload: bytes) -> bytes:
    """An ICMP(v6) echo request (ICMPv6's checksum: the kernel fills it).

    Built by hand, not by scapy: the agent's PMTU search must not need scapy (~24 MB
    installed) on every node; tests/unit/test_agent_imports.py checks the bytes
    against scapy's.
    """
    if v6:
        return bytes([128, 0, 0, 0]) + struct.pack("!HH", ident, seq) + payload
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    return struct.pack("!BBHHH", 8, 0, _checksum(head + payload), ident, seq) + payload


def _parse_reply(data: bytes, v6: bool) -> tuple[int, int, bytes] | None:
    """(identifier, sequence, payload) of an echo reply, or None for anything else."""
    if not v6:
        if len(data) < IPV4_HEADER or data[0] >> 4 != 4:
            return None
        data = data[(data[0] & 0x0F) * 4 :]  # raw IPv4 sockets see the IP header
    if len(data) < ICMP_ECHO_HEADER:
        return None
    if data[0] != (ICMPV6_ECHO_REPLY if v6 else ICMP_ECHO_REPLY) or data[1] != 0:
        return None
    return (
        int.from_bytes(data[4:6], "big"),
        int.from_bytes(data[6:8], "big"),
        bytes(data[8:]),
    )


def resolve(address: str) -> tuple[bool, tuple[object, ...]]:
    """(is IPv6, socket address) for a literal address, ``fe80::1%wg0`` included."""
    host, _, scope = address.partition("%")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise IcmpError(f"not an IP address: {address!r}") from exc
    if ip.version == 4:
        return False, (host, 0)
    scope_id = 0
    if scope:
        try:
            scope_id = int(scope) if scope.isdigit() else socket.if_nametoindex(scope)
        except OSError as exc:
            raise IcmpError(f"unknown interface {scope!r} in {address!r}") from exc
    return True, (host, 0, 0, scope_id)


class EchoSocket:
    """A raw ICMP(v6) socket sending echo requests and awaiting their replies."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.v6, self.sockaddr = resolve(address)
        family = socket.AF_INET6 if self.v6 else socket.AF_INET
        proto = socket.IPPROTO_ICMPV6 if self.v6 else socket.IPPROTO_ICMP
        try:
            self.sock = socket.socket(family, socket.SOCK_RAW, proto)
        except PermissionError as exc:
            raise IcmpError("ICMP probing needs a raw socket (CAP_NET_RAW or root)") from exc
        self.sock.setblocking(False)
        enable_rx_timestamps(self.sock)
        self.ident = int.from_bytes(os.urandom(2), "big")
        self._host = str(self.sockaddr[0])
        self.bytes_sent = 0
        self.bytes_received = 0
        self.ignored = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> EchoSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ip_header(self) -> int:
        return IPV6_HEADER if self.v6 else IPV4_HEADER

    def send(self, seq: int, payload: bytes) -> int:
        """Send one echo request; returns its send time (ns, CLOCK_REALTIME).

        Raises :class:`PacketTooBig` when the local interface MTU refuses it.
        """
        pkt = echo_request(self.v6, self.ident, seq & 0xFFFF, payload)
        t = time.time_ns()
        try:
            self.sock.sendto(pkt, self.sockaddr)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise PacketTooBig(f"{len(pkt) + self.ip_header} bytes exceed the MTU") from exc
            raise IcmpError(f"ICMP echo to {self.address} failed: {exc}") from exc
        self.bytes_sent += len(pkt) + self.ip_header
        return t

    def _drain(self, wanted: dict[int, bytes], got: dict[int, int]) -> None:
        while True:
            try:
                data, peer, rx_ns = recv_timestamped(self.sock, 65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # an ICMP error queued on the socket; the echo simply goes unanswered
            rx = rx_ns or time.time_ns()
            reply = _parse_reply(data, self.v6)
            if (
                reply is None
                or reply[0] != self.ident
                or str(peer[0]).partition("%")[0] != self._host.partition("%")[0]
                or wanted.get(reply[1]) != reply[2]
            ):
                self.ignored += 1
                continue
            self.bytes_received += len(data) + (self.ip_header if self.v6 else 0)
            got.setdefault(reply[1], rx)

    async def collect(
        self,
        wanted: dict[int, bytes],
        got: dict[int, int],
        deadline: float,
        *,
        until_all: bool = True,
    ) -> None:
        """Receive replies into ``got`` (seq -> rx ns) until the loop time reaches
        ``deadline``, or (``until_all``) every one of ``wanted`` came."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        fd = self.sock.fileno()
        loop.add_reader(fd, ready.set)
        try:
            while True:
                self._drain(wanted, got)
                if until_all and wanted.keys() <= got.keys():
                    return
                left = deadline - loop.time()
                if left <= 0:
                    return
                ready.clear()
                try:
                    await asyncio.wait_for(ready.wait(), left)
                except TimeoutError:
                    self._drain(wanted, got)
                    return
        finally:
            loop.remove_reader(fd)

    async def echo(self, seq: int, payload: bytes, timeout_s: float) -> float | None:
        """One echo: its RTT in ms, or None when no reply came within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        t = self.send(seq, payload)
        got: dict[int, int] = {}
        await self.collect({seq & 0xFFFF: payload}, got, loop.time() + timeout_s)
        rx = got.get(seq & 0xFFFF)
        return None if rx is None else (rx - t) / 1e6


async def icmp_ping(
    address: str,
    *,
    count: int = 5,
    interval_s: float = 0.2,
    timeout_s: float = 1.0,
    payload_bytes: int = 16,
) -> IcmpResult:
    """Ping ``address`` ``count`` times, ``interval_s`` apart; wait ``timeout_s`` after
    the last request for stragglers. RTT = kernel receive time - time just before send.
    """
    if count < 1 or interval_s < 0 or timeout_s <= 0 or not 0 <= payload_bytes <= 65000:
        raise IcmpError("icmp_ping: count >= 1, interval >= 0, timeout > 0, payload 0..65000")
    loop = asyncio.get_running_loop()
    sent_at: dict[int, int] = {}
    payloads: dict[int, bytes] = {}
    got: dict[int, int] = {}
    with EchoSocket(address) as es:
        for seq in range(count):
            payload = os.urandom(payload_bytes)
            payloads[seq] = payload
            sent_at[seq] = es.send(seq, payload)
            if seq < count - 1:
                await es.collect(payloads, got, loop.time() + interval_s, until_all=False)
        await es.collect(payloads, got, loop.time() + timeout_s)
    rtts = tuple(round((got[s] - sent_at[s]) / 1e6, 4) for s in sorted(got))
    return IcmpResult(address=address, sent=count, received=len(rtts), rtts_ms=rtts)
