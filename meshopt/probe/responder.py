"""The UDP echo responder every agent runs on its probe addresses, and the guards it
shares with the train responder (:mod:`meshopt.probe.train`).

It answers REQUESTs only (never a REPLY: two responders cannot ping-pong), with a
header-only REPLY, the cheapest datagram WireGuard can carry (see
:mod:`meshopt.probe.packet`). The reply carries the time between the kernel's receive
stamp and the reply's ``sendto`` so the prober can take this process's scheduling delay
out of the RTT.

A responder must not be a reflector (issue 12), so before a byte goes out:

- **Bound addresses only**, one socket per address, never ``::``. The agent calls
  :meth:`Responder.listen_on` with its probe addresses (``fe80::…%<ifname>``, see
  :mod:`meshopt.agent.probeaddr`): a link-local bind also ties the socket to its
  interface, so nothing arriving from the underlay reaches it. :meth:`Responder.start`
  without addresses listens on loopback (:data:`LOOPBACK`).
- **Current peers only**: ``allowed(source)`` decides; the agent passes a
  :class:`PeerSources` built from its WireGuard peers (probe addresses and AllowedIPs).
  Anything else is dropped and counted ``unknown_source``. Standalone use passes
  :func:`any_source`, explicitly.
- **A budget per source**: a token bucket (:class:`RateLimit`, default 4x the default
  probe rate with 2 s of burst); over it, dropped and counted ``rate_limited``. Garbage
  costs tokens too: a flood is bounded before it is parsed.
- **No amplification**: a reply is never larger than the request that caused it
  (checked for every datagram; counted ``bad_packet.would_amplify`` if it ever were).

Garbage never stops it: every dropped datagram is counted by reason
(``counters["bad_packet"]`` and ``counters["bad_packet.<reason>"]``) and each distinct
reason is logged once on the ``meshopt.probe`` logger. Every datagram read lands in
exactly one of ``echoed``, ``bad_packet``, ``unknown_source``, ``rate_limited`` and
``send_error``.

``python -m meshopt.probe.responder [--host ADDR]... [--interface GLOB]... [--port P]``
runs one until SIGTERM or SIGINT and prints its counters as JSON when it stops. It
binds the ``--host`` addresses, else every address of the interfaces matching
``--interface`` (default ``wg*``: the overlay, never the underlay); with neither
found it refuses to start (``--host ::1`` serves loopback). It answers any source
unless ``--allow PREFIX`` is given, and has no rate limit unless ``--rate`` is (a lab
tool, bound to addresses its operator chose; the agent always limits).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import functools
import ipaddress
import json
import logging
import math
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeAlias

from meshopt.errors import InputError
from meshopt.probe.packet import (
    KINDS,
    MAX_PROBE_BYTES,
    PROBE_PORT,
    ProbeFormatError,
    parse,
    reply_bytes,
)
from meshopt.probe.timestamps import Address, drain_timestamped, open_udp_socket

log = logging.getLogger("meshopt.probe")

DRAIN = 64  # datagrams read per wake-up before yielding to the loop

LOOPBACK = ("127.0.0.1", "::1")  # what start() binds when given no address
DEFAULT_INTERFACES = ("wg*",)  # standalone default: the addresses of these interfaces

# The per-source budget: RATE_FACTOR times the probe rate, and BURST_S seconds of it as
# burst (a prober catching up after a stalled loop, or two agents' restarts overlapping).
DEFAULT_PROBE_INTERVAL_S = 0.33  # ProbeConfig's and the agent's default
RATE_FACTOR = 4.0
BURST_S = 2.0
MAX_SOURCES = 4096  # buckets kept; a full bucket is forgotten (same as none)

SourceAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
AllowedSources: TypeAlias = Callable[[SourceAddress], bool]


# --- guards shared by both responders ---------------------------------------------------


def any_source(source: SourceAddress) -> bool:
    """Allow every source: standalone use, where the bound address is the only wall."""
    return True


@functools.lru_cache(maxsize=256)
def _ifname(index: int) -> str:
    try:
        return socket.if_indextoname(index)
    except OSError:
        return str(index)


def source_of(addr: Address) -> SourceAddress | None:
    """The sender of a datagram as an address: IPv4-mapped as IPv4, link-local with its
    interface name as ``scope_id`` (``fe80::1%wg0``); None if it is not an IP address."""
    host = addr[0].partition("%")[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if len(addr) == 4 and addr[3]:
            return ipaddress.IPv6Address(f"{host}%{_ifname(addr[3])}")
    return ip


@dataclass(frozen=True)
class RateLimit:
    """A token bucket per source: ``rate`` tokens per second, at most ``burst`` saved."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        for name in ("rate", "burst"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise InputError(f"rate limit: {name} must be a positive number, not {value!r}")
        if self.burst < 1:
            raise InputError(f"rate limit: burst must be >= 1, not {self.burst!r}")

    @classmethod
    def for_interval(
        cls, interval_s: float, factor: float = RATE_FACTOR, burst_s: float = BURST_S
    ) -> RateLimit:
        """The echo budget for peers probing every ``interval_s``: ``factor`` times their
        rate, ``burst_s`` seconds of that as burst."""
        rate = factor / interval_s
        return cls(rate, max(1.0, rate * burst_s))


DEFAULT_ECHO_LIMIT = RateLimit.for_interval(DEFAULT_PROBE_INTERVAL_S)  # 12.1/s, burst 24


class SourceBuckets:
    """Token buckets by source. The table is bounded: sources idle long enough to have a
    full bucket are forgotten (oldest first); a new source finding it still full is
    refused, so a spoofed-source flood costs memory only up to ``max_sources``."""

    def __init__(
        self,
        limit: RateLimit,
        max_sources: int = MAX_SOURCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.max_sources = max_sources
        self.clock = clock
        self._buckets: OrderedDict[SourceAddress, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, source: SourceAddress) -> bool:
        """Spend one token of ``source``'s bucket; False when it has none."""
        now = self.clock()
        rate, burst = self.limit.rate, self.limit.burst
        entry = self._buckets.pop(source, None)
        if entry is None:
            self._forget_idle(now)
            if len(self._buckets) >= self.max_sources:
                return False
            tokens = burst
        else:
            tokens = min(burst, entry[0] + (now - entry[1]) * rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[source] = (tokens, now)  # re-inserted last: ordered by last use
        return allowed

    def _forget_idle(self, now: float) -> None:
        full_after = self.limit.burst / self.limit.rate
        while self._buckets:
            source, (_, last) = next(iter(self._buckets.items()))
            if now - last < full_after:
                return
            del self._buckets[source]


class PeerLike(Protocol):
    """What :meth:`PeerSources.from_peers` reads of a peer (the agent's ``PeerInfo``)."""

    @property
    def probe_address(self) -> str: ...

    @property
    def allowed_ips(self) -> Sequence[str]: ...

    @property
    def ifname(self) -> str: ...


class PeerSources:
    """``allowed(source)`` for the agent: the addresses current WireGuard peers send from.

    Built from ``(prefix, ifname)`` entries: a peer's probe address and each of its
    AllowedIPs, on the peer's interface (``ifname`` None: any interface). A link-local
    source (one with a ``scope_id``) must match an entry of its own interface; a global
    source any entry. WireGuard already drops tunnel packets from outside the sending
    peer's AllowedIPs, so this is the second wall: it refuses what reaches the socket
    any other way. Lookups cost one set probe per distinct prefix length.
    """

    def __init__(self, entries: Iterable[tuple[str, str | None]] = ()) -> None:
        self._scoped: set[tuple[int, int, int, str | None]] = set()
        self._any: set[tuple[int, int, int]] = set()
        lengths: dict[int, set[int]] = {4: set(), 6: set()}
        for prefix, ifname in entries:
            head, _, scope = prefix.partition("%")
            address, slash, plen = head.partition("/")
            try:
                net = ipaddress.ip_network(f"{address}{slash}{plen}", strict=False)
            except ValueError:
                log.debug("peer sources: not a prefix: %r", prefix)
                continue
            key = (net.version, net.prefixlen, int(net.network_address))
            self._any.add(key)
            self._scoped.add((*key, ifname or scope or None))
            lengths[net.version].add(net.prefixlen)
        self._lengths = {v: tuple(sorted(ls, reverse=True)) for v, ls in lengths.items()}

    @classmethod
    def from_peers(cls, peers: Iterable[PeerLike]) -> PeerSources:
        """Every peer's probe address (/128) and AllowedIPs, on that peer's interface."""
        entries: list[tuple[str, str | None]] = []
        for p in peers:
            entries.append((f"{p.probe_address}/128", p.ifname))
            entries.extend((prefix, p.ifname) for prefix in p.allowed_ips)
        return cls(entries)

    def __len__(self) -> int:
        return len(self._any)

    def __call__(self, source: SourceAddress) -> bool:
        version = source.version
        bits = 32 if version == 4 else 128
        value = int(source)
        scope = source.scope_id if isinstance(source, ipaddress.IPv6Address) else None
        for plen in self._lengths[version]:
            key = (version, plen, value >> (bits - plen) << (bits - plen))
            if scope is None:
                if key in self._any:
                    return True
            elif (*key, scope) in self._scoped or (*key, None) in self._scoped:
                return True
        return False


class Listeners:
    """One bound UDP socket per address, each read by ``on_readable(sock)``.

    :meth:`listen_on` reconciles with a new list: new addresses bound, vanished ones
    closed, kept ones untouched (an interface re-created under the same name has a new
    index, hence a new key, and is bound again). Port 0 takes a free port for the first
    address and the same port for the others.
    """

    def __init__(
        self,
        what: str,
        on_readable: Callable[[socket.socket], None],
        opener: Callable[[str, int], socket.socket] = open_udp_socket,
    ) -> None:
        self.what = what
        self._on_readable = on_readable
        self._opener = opener
        self._socks: dict[tuple[object, ...], tuple[str, socket.socket]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._port: int | None = None

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def port(self) -> int:
        if self._port is None or (self._port == 0 and not self._socks):
            raise RuntimeError(f"{self.what} not started")
        if self._port == 0:
            return int(next(iter(self._socks.values()))[1].getsockname()[1])
        return self._port

    @property
    def addresses(self) -> list[str]:
        return [host for host, _ in self._socks.values()]

    def start(self, loop: asyncio.AbstractEventLoop, port: int) -> None:
        if self._loop is not None:
            raise RuntimeError(f"{self.what} already started")
        self._loop, self._port = loop, port

    def listen_on(self, hosts: Iterable[str]) -> list[tuple[str, Exception]]:
        """Bind exactly ``hosts``; the ones that failed, with why (the rest are bound)."""
        if self._loop is None or self._port is None:
            raise RuntimeError(f"{self.what} not started")
        _ifname.cache_clear()  # interfaces come and go: names are looked up afresh
        wanted: dict[tuple[object, ...], str] = {}
        failed: list[tuple[str, Exception]] = []
        for host in hosts:
            try:
                wanted[self._key(host)] = host
            except (OSError, UnicodeError) as exc:
                failed.append((host, exc))
        for key in [k for k in self._socks if k not in wanted]:
            self._close_one(key)
        for key, host in wanted.items():
            if key in self._socks:
                continue
            try:
                sock = self._opener(host, self._bind_port())
            except (OSError, UnicodeError) as exc:
                failed.append((host, exc))
                continue
            self._socks[key] = (host, sock)
            self._loop.add_reader(sock.fileno(), self._on_readable, sock)
        return failed

    def _bind_port(self) -> int:
        if self._port == 0 and self._socks:
            return self.port
        return self._port or 0

    @staticmethod
    def _key(host: str) -> tuple[object, ...]:
        infos = socket.getaddrinfo(
            host, 0, type=socket.SOCK_DGRAM, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE
        )
        family, _, _, _, sockaddr = infos[0]
        return (family, *sockaddr)

    def _close_one(self, key: tuple[object, ...]) -> None:
        _, sock = self._socks.pop(key)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sock.fileno())
        sock.close()

    def close(self) -> None:
        for key in list(self._socks):
            self._close_one(key)
        self._loop = None
        self._port = None


def hosts_arg(host: str | Iterable[str]) -> list[str]:
    return [host] if isinstance(host, str) else list(host)


async def interface_addresses(patterns: Sequence[str]) -> list[str]:
    """Every address of the interfaces matching ``patterns`` (link-local ones scoped:
    ``fe80::1%wg0``): the standalone default, the overlay rather than the underlay."""
    from pyroute2 import AsyncIPRoute  # only the command line needs netlink

    names = {index: name for index, name in socket.if_nameindex()}
    out: list[str] = []
    ipr = AsyncIPRoute()
    try:
        await ipr.setup_endpoint()
        async for msg in await ipr.addr("dump"):
            name = names.get(int(msg["index"]))
            addr = msg.get("address")
            if name is None or not isinstance(addr, str):
                continue
            if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            ip = ipaddress.ip_address(addr)
            out.append(f"{addr}%{name}" if ip.is_link_local and ip.version == 6 else addr)
    finally:
        ipr.close()
    return out


def add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host``, ``--interface``, ``--allow``, ``--rate`` and ``--burst``: how the
    standalone responders choose their addresses, sources and budget."""
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="address to bind (repeatable; fe80::1%%wg0 for link-local)",
    )
    parser.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="GLOB",
        help="without --host: bind every address of these interfaces (default: wg*)",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="answer only sources in these prefixes (repeatable; default: any source)",
    )
    parser.add_argument("--rate", type=float, help="per-source budget, per second (default: none)")
    parser.add_argument("--burst", type=float, help="per-source burst (default: 2 s of --rate)")


async def listen_hosts(args: argparse.Namespace) -> list[str]:
    """The addresses the command line asks for; InputError when there are none."""
    if args.host:
        return list(args.host)
    patterns = args.interface or list(DEFAULT_INTERFACES)
    try:
        hosts = await interface_addresses(patterns)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the addresses of {','.join(patterns)}: {exc}") from exc
    if not hosts:
        raise InputError(
            f"no address on an interface matching {','.join(patterns)}: "
            "give --host (e.g. --host ::1 for loopback) or --interface"
        )
    return hosts


def limit_arg(args: argparse.Namespace) -> RateLimit | None:
    if args.rate is None:
        return None
    return RateLimit(args.rate, args.burst if args.burst is not None else args.rate * BURST_S)


def allowed_arg(args: argparse.Namespace) -> AllowedSources:
    return PeerSources((p, None) for p in args.allow) if args.allow else any_source


# --- the echo responder -----------------------------------------------------------------


MAX_JUDGED: Final = 4096  # senders remembered as parsed and judged


class Responder:
    """Answers probe REQUESTs on its bound addresses (see the module doc for the guards).

    ``limit``: the per-source budget (None: no limit); ``allowed``: which sources are
    answered (default all: the agent passes its :class:`PeerSources`, and may replace
    :attr:`allowed` whenever its peers change).
    """

    def __init__(
        self,
        *,
        limit: RateLimit | None = DEFAULT_ECHO_LIMIT,
        allowed: AllowedSources = any_source,
    ) -> None:
        self.counters: dict[str, int] = {
            "echoed": 0,
            "bad_packet": 0,
            "unknown_source": 0,
            "rate_limited": 0,
            "no_kernel_ts": 0,
            "send_error": 0,
            "recv_error": 0,
            "bind_error": 0,
        }
        # Each sender's address, parsed and judged, by (host, scope id): parsing it
        # (ipaddress, and the interface name of a link-local one) was most of what an
        # echo cost. Emptied whenever ``allowed`` is replaced, and when full (a flood of
        # spoofed sources costs a re-parse, never memory).
        self._judged: dict[tuple[str, int], SourceAddress | None] = {}
        self.allowed = allowed
        # Told of each datagram admitted from an allowed sender: a probe from a peer
        # proves its tunnel has a session (the agent's prober then stops holding its own
        # first probe; meshopt.agent.peers) and its path works (a peer the prober holds
        # dead is probed at once, not at its next probe up to 2 s away).
        self.on_heard: Callable[[SourceAddress], None] | None = None
        self.buckets = SourceBuckets(limit) if limit is not None else None
        self._listeners = Listeners("probe responder", self._on_readable)
        self._logged: set[str] = set()

    @property
    def allowed(self) -> AllowedSources:
        return self._allowed

    @allowed.setter
    def allowed(self, value: AllowedSources) -> None:
        self._allowed = value
        self._judged.clear()

    async def start(self, host: str | Iterable[str] = LOOPBACK, port: int = PROBE_PORT) -> None:
        """Bind every address in ``host`` on ``port`` (0: a free port, see :attr:`port`)
        and answer. InputError, with nothing left bound, if one cannot be bound. The
        agent starts with no address and calls :meth:`listen_on`."""
        self._listeners.start(asyncio.get_running_loop(), port)
        failed = self._listeners.listen_on(hosts_arg(host))
        if failed:
            self.close()
            where, exc = failed[0]
            raise InputError(f"probe responder cannot listen on [{where}]:{port}: {exc}")

    def listen_on(self, hosts: Iterable[str]) -> None:
        """Listen on exactly ``hosts`` from now on (the agent: its probe addresses).
        An address that cannot be bound is counted (``bind_error``), logged once, and
        tried again at the next call; the others are served."""
        for host, exc in self._listeners.listen_on(hosts):
            self.counters["bind_error"] += 1
            self._log_once(f"bind {host}", "probe responder: cannot listen on %s: %s", host, exc)

    @property
    def port(self) -> int:
        return self._listeners.port

    @property
    def addresses(self) -> list[str]:
        """The addresses listened on."""
        return self._listeners.addresses

    def close(self) -> None:
        self._listeners.close()

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)

    def _drop(self, reason: str, addr: object, detail: str) -> None:
        self.counters["bad_packet"] += 1
        key = f"bad_packet.{reason}"
        self.counters[key] = self.counters.get(key, 0) + 1
        self._log_once(
            reason,
            "probe responder: dropped a datagram from %s: %s (further %s drops are "
            "counted, not logged)",
            addr,
            detail,
            reason,
        )

    def _on_readable(self, sock: socket.socket) -> None:
        try:
            for data, addr, rx_ns in drain_timestamped(sock, MAX_PROBE_BYTES + 1, DRAIN):
                self._answer(sock, data, addr, rx_ns)
        except OSError as exc:
            self.counters["recv_error"] += 1
            log.debug("probe responder: recvmsg failed: %s", exc)

    def _source(self, addr: Address) -> SourceAddress | None:
        """The sender if it is an allowed source, else None (judged once per sender)."""
        key = (addr[0], addr[3] if len(addr) == 4 else 0)
        try:
            return self._judged[key]
        except KeyError:
            pass
        source = source_of(addr)
        if source is not None and not self._allowed(source):
            source = None
        if len(self._judged) >= MAX_JUDGED:
            self._judged.clear()
        self._judged[key] = source
        return source

    def _admit(self, addr: Address) -> bool:
        source = self._source(addr)
        if source is None:
            self.counters["unknown_source"] += 1
            self._log_once(
                "unknown_source",
                "probe responder: dropped a datagram from %s, not a current peer (further "
                "unknown_source drops are counted, not logged)",
                addr,
            )
            return False
        if self.buckets is not None and not self.buckets.take(source):
            self.counters["rate_limited"] += 1
            self._log_once(
                "rate_limited",
                "probe responder: %s is over its budget (further rate_limited drops are "
                "counted, not logged)",
                addr,
            )
            return False
        if self.on_heard is not None:
            try:
                self.on_heard(source)
            except Exception:
                log.exception("probe responder: on_heard(%s) failed", source)
        return True

    def _answer(self, sock: socket.socket, data: bytes, addr: Address, rx_ns: int | None) -> None:
        if not self._admit(addr):
            return
        if rx_ns is None:
            self.counters["no_kernel_ts"] += 1
        try:
            request = parse(data)
        except ProbeFormatError as exc:
            self._drop(exc.reason, addr, str(exc))
            return
        if request[0] != 1:
            self._drop("not_request", addr, f"a {KINDS[request[0]].name} is never answered")
            return
        sent_ns = time.time_ns()
        turnaround = sent_ns - rx_ns if rx_ns is not None else 0
        reply = reply_bytes(request, turnaround)
        if len(reply) > len(data):  # cannot happen with this format; never amplify
            self._drop("would_amplify", addr, f"a {len(reply)}-byte reply to {len(data)}")
            return
        try:
            sock.sendto(reply, addr)
        except OSError as exc:
            self.counters["send_error"] += 1
            self._log_once("send_error", "probe responder: cannot reply to %s: %s", addr, exc)
            return
        self.counters["echoed"] += 1


async def _serve(args: argparse.Namespace) -> dict[str, int]:
    responder = Responder(limit=limit_arg(args), allowed=allowed_arg(args))
    await responder.start(await listen_hosts(args), args.port)
    where = ", ".join(f"[{h}]:{responder.port}" for h in responder.addresses)
    print(f"listening on {where}", flush=True)
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
    add_listen_arguments(parser)
    parser.add_argument("--port", type=int, default=PROBE_PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        counters = asyncio.run(_serve(args))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(counters, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
