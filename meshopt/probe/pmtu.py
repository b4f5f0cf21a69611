"""Path MTU through a tunnel: the largest echo that gets an answer with DF set.

Binary search over the IP packet size with ICMP echo requests (built by hand, sent on
a raw socket; see :mod:`meshopt.probe.icmp`). The socket is put in
``IP_PMTUDISC_PROBE`` / ``IPV6_PMTUDISC_PROBE`` mode: every packet carries DF (IPv4;
IPv6 routers never fragment) and the kernel neither fragments locally nor caps the size
by a cached path MTU, so each probe tests the path itself. A size the local interface
refuses (``EMSGSIZE``) counts as too big at once; a size that gets no reply in
``timeout_s`` (twice, in case of loss) counts as too big. Through a WireGuard interface
with MTU 1420 the answer is 1420.
"""

from __future__ import annotations

import os
import socket

from meshopt.probe.icmp import (
    ICMP_ECHO_HEADER,
    EchoSocket,
    IcmpError,
    PacketTooBig,
)

IP_MTU_DISCOVER = 10
IP_PMTUDISC_PROBE = 3
IPV6_MTU_DISCOVER = 23
IPV6_PMTUDISC_PROBE = 3
IPV6_DONTFRAG = 62

IPV4_MIN_MTU = 576
IPV6_MIN_MTU = 1280
DEFAULT_HIGH = 1500
TRIES = 2  # an unanswered size is retried once: a lost echo must not shrink the answer


class PmtuError(IcmpError):
    """The peer does not answer even the smallest size tried: no path MTU to find."""


def _set_probe_mode(es: EchoSocket) -> None:
    if es.v6:
        es.sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_PROBE)
        es.sock.setsockopt(socket.IPPROTO_IPV6, IPV6_DONTFRAG, 1)
    else:
        es.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)


async def _fits(es: EchoSocket, size: int, seq: int, timeout_s: float) -> bool:
    """Does an echo of ``size`` IP bytes (DF set) come back?"""
    payload = os.urandom(size - es.ip_header - ICMP_ECHO_HEADER)
    for attempt in range(TRIES):
        try:
            rtt = await es.echo(seq * TRIES + attempt, payload, timeout_s)
        except PacketTooBig:
            return False
        if rtt is not None:
            return True
    return False


async def discover_pmtu(
    address: str,
    *,
    low: int | None = None,
    high: int = DEFAULT_HIGH,
    timeout_s: float = 0.5,
) -> int:
    """Largest IP packet (bytes, headers included) that reaches ``address`` and gets an
    echo reply, between ``low`` (default 576 for IPv4, 1280 for IPv6) and ``high``.

    Raises :class:`PmtuError` when not even ``low`` gets through.
    """
    with EchoSocket(address) as es:
        if low is None:
            low = IPV6_MIN_MTU if es.v6 else IPV4_MIN_MTU
        smallest = es.ip_header + ICMP_ECHO_HEADER
        if not smallest <= low <= high <= 65535:
            raise IcmpError(f"discover_pmtu: need {smallest} <= low <= high <= 65535")
        _set_probe_mode(es)
        seq = 0
        if not await _fits(es, low, seq, timeout_s):
            raise PmtuError(f"{address} answers no echo of {low} bytes with DF set")
        seq += 1
        if await _fits(es, high, seq, timeout_s):
            return high
        good, bad = low, high  # invariant: good fits, bad does not
        while bad - good > 1:
            seq += 1
            mid = (good + bad) // 2
            if await _fits(es, mid, seq, timeout_s):
                good = mid
            else:
                bad = mid
        return good
