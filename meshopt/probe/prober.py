"""The prober: UDP echo probes to every peer, RTT from kernel receive timestamps.

Default rate, and what it trades
================================
A probe is one 30-byte UDP payload each way (:mod:`meshopt.probe.packet`). Through
WireGuard each datagram costs its inner IP packet padded to a multiple of 16 plus
WireGuard's 32 bytes and the outer IP and UDP headers (60 bytes over an IPv4 underlay,
80 over IPv6). Probes go mostly to IPv6 link-local peers, so the inner packet is
40 + 8 + 30 = 78 -> 80 bytes:

==========================  ===============  ================  ===============
inner / underlay            per datagram     request + reply   at 0.33 s (3/s)
==========================  ===============  ================  ===============
IPv6 in IPv4 (usual)        80 + 60 = 140 B  280 B             848 B/s
IPv6 in IPv6                80 + 80 = 160 B  320 B             970 B/s
IPv4 in IPv4                64 + 60 = 124 B  248 B             752 B/s
==========================  ===============  ================  ===============

So the budget of 1 kB/s per peer allows at most 1000 / 280 = 3.6 probes/s (IPv6 in
IPv4) or 3.1 (IPv6 in IPv6); the default ``interval_s = 0.33`` fits both. (0.25 s
would cost 1,120 B/s even over IPv4.) Padding above 2 bytes starts the next 16-byte
step of the request.

A peer is declared dead ``dead_after_s = 0.8`` s after its last reply, checked by a
timer set for that moment (not when replies arrive), so ``on_change(name, False)``
fires about 0.8 s after the last reply: within the 1 s the agent's local fail-over
needs. At 0.33 s between probes one lost probe leaves a 0.66 s gap (tolerated); two
in a row (0.99 s) would declare the peer dead, so with independent loss ``p`` a healthy
peer would be falsely declared dead with probability about ``p**2`` per probe (1 % loss
each way: every 14 minutes per peer in use, a fail-over and a route change each time).
So a probe that is still unanswered :func:`retry_after` it was sent (twice the smoothed
RTT plus 10 ms, at most half the peer's interval: it was lost, not slow) is sent again
once (``retries``): a healthy peer then needs four probes in a row lost (``p**4``; 1 %
each way: once in ten years per peer), a dead one is found at the same moment, and
the retries cost ``p`` of the probes' bytes.

Silence only counts against a peer while we were asking: it is declared dead when, on
top of ``dead_after_s`` without a reply, at least two probes sent after its last reply
are unanswered, the first of them for ``dead_after_s - interval_s`` (a healthy peer's
normal case gives the same 0.8 s). A stalled agent (a busy or paused VM: the loop
wakes seconds late) has sent nothing meanwhile, so it probes again and waits for
answers instead of declaring every peer dead at once; replies that queued up in the
socket during the stall are read before anything is judged.
Faster detection or fewer false alarms cost bytes: ``interval_s = 0.2`` with
``dead_after_s = 0.7`` tolerates two losses (1,400 B/s); ``interval_s = 1`` with
``dead_after_s = 3.5`` costs 280 B/s and takes 3.5 s. :meth:`ProbeConfig.bytes_per_s`
gives the figure for any setting.

Per-peer rates (the probe budget)
=================================
Every peer starts at the config's rate. :meth:`Prober.set_rates` gives peers their own
(:mod:`meshopt.probe.budget`: links in use fast, idle ones slowly); ``dead_after_s``
and the two-unanswered-probes rule above then apply per peer, with its own interval and
dead time, and a peer whose rate changes counts silence afresh from probes sent at the
new rate. A peer promoted to a faster class is probed at once. A slow peer whose
estimator has outliers waiting for confirmation (a step, or a spike) is probed at the
config's rate until they are confirmed or dismissed (``RttEstimator.confirming``).
Slower peers' sends
land on a 50 ms grid (one wake-up carries many probes), any tick also sends the probes
due within ``COALESCE_S`` (15 ms) after it (early, never late, and never a peer twice
in one tick), and the schedule is kept in heaps, so a wake-up costs O(log n) per due
event rather than a walk over every peer.

Timing
======
Send stamps are ``time.time_ns()`` (CLOCK_REALTIME, the kernel's receive-stamp clock)
taken right before ``sendto``; the RTT is the reply's kernel receive stamp minus that,
minus the responder's own turnaround (its kernel receive stamp to its ``sendto``,
carried in the reply). Without ancillary data the prober falls back to the time it
read the reply and counts ``no_kernel_ts``. Scheduling, timeouts and liveness use
``time.monotonic()`` (``dead_since`` is a monotonic time).

Replies are not read as they arrive (no reader on the socket, no wake-up per reply):
they wait in the socket, kernel-stamped, and every timer tick (each send, each due
death or timeout, and at least every ``STALL_TOLERANCE_S``) reads all of them before
it judges anything. The RTT is the stamps', so the wait costs it nothing, and a reply
counts for liveness from its stamp (as a monotonic time), not from when it was read.
``timer_error`` is therefore how long replies waited to be read (up to a tick, by
design): what a prober stamping replies in user space at these moments would add.

Everything arrives on one dual-stack socket bound to ``[::]:0``. A reply whose nonce
is not this prober's, whose seq was never sent (or belongs to a removed target), that
repeats or that comes after ``timeout_s`` is dropped and counted (``wrong_nonce``,
``unknown_seq``, ``duplicate``, ``late``; a late reply still proves the peer alive).

Three things are never held against a peer. Probes sent before it first answered waited
for WireGuard's first handshake (or its agent's start): their replies prove it alive
but are no RTT sample (``early_reply``), and their loss is not counted. Probes sent
while it was declared dead measured the outage, already told as its death: the same,
and when it answers again the losses of the outage's onset (those since its last reply)
leave the window too (:meth:`PeerWindow.forget_outage`), or a node back from 15 s cut
off read 60 % loss, some 400 ms of loss penalty on every link it has, for the ~20 s its
window took to slide past the outage (the routes through it chose among those
inflated links at random). And time the
prober itself did not run: a timer that fires more than ``STALL_TOLERANCE_S`` late (a
stalled process or VM, whose tunnel stalled too) adds that lateness to every peer's
silence budget and every pending probe's timeout (``stalls``).

``python -m meshopt.probe.prober --target n2=10.0.0.2 --duration 5`` probes for a
while and prints the statistics as JSON (``--events``: a JSON line per flip first).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import ipaddress
import itertools
import json
import logging
import math
import os
import socket
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshopt.errors import InputError
from meshopt.probe.budget import IN_USE, Rate
from meshopt.probe.packet import (
    KINDS,
    MAX_PADDING,
    MAX_PROBE_BYTES,
    NONCE_BYTES,
    PROBE_PORT,
    ProbeFormatError,
    parse,
    probe_bytes_per_s,
    request_bytes,
    stamp,
)
from meshopt.probe.stats import (
    DEFAULT_HALF_LIFE_S,
    DEFAULT_JITTER_HALF_LIFE_S,
    PeerWindow,
    ProbeStats,
)
from meshopt.probe.timestamps import TimerError, drain_timestamped, open_udp_socket

log = logging.getLogger("meshopt.probe")

__all__ = ["PROBE_PORT", "ProbeConfig", "Prober", "Target"]

DRAIN = 1024  # replies read per timer tick at most (the rest at the next one)
# A reply read this long after its kernel stamp is taken as having arrived this long
# before it was read, no earlier (a realtime clock step must not move liveness far).
MAX_WAIT_S = 1.0
RECENT = 4096  # answered or timed-out seqs remembered, to tell duplicates and late replies
SLACK_S = 0.001  # a timer that fires this early still counts as due
# A timer this late means the prober itself was not running (a stalled process or VM);
# busy-loop lateness below it is not worth a log line, and crediting it changes nothing.
# The timer also fires at least this often, so at most this much of a stall (its start,
# while the prober waited for its next timer) is not credited.
STALL_TOLERANCE_S = 0.1
GRID_S = 0.05  # slower peers' sends land on this grid: a few wake-ups carry many probes
# A tick also sends the probes due within this much after it (never more than a quarter
# of the peer's interval early): one wake-up carries the sends that fall close together
# instead of one each. Early only, never late: no dead time moves.
COALESCE_S = 0.015
# A path that comes back is probed at once where there is a sign of it, instead of at
# the next scheduled probe (up to an idle interval, 2 s, away): a dead peer whose probe
# reaches our responder, and, when one dead peer answers again, every other dead one
# (a node cut off comes back on all its links at once). At most one such sweep per
# REVIVE_SWEEP_S, and a dead peer is probed early at most once per REVIVE_GAP_S.
REVIVE_SWEEP_S = 1.0
REVIVE_GAP_S = 0.08
_SEQ_MOD = 2**32


@dataclass(frozen=True)
class ProbeConfig:
    interval_s: float = 0.33
    dead_after_s: float = 0.8
    window: int = 64
    timeout_s: float = 1.0  # a probe without a reply by then counts as lost
    port: int = PROBE_PORT
    padding: int = 0
    half_life_s: float = DEFAULT_HALF_LIFE_S  # of the smoothed RTT
    jitter_half_life_s: float = DEFAULT_JITTER_HALF_LIFE_S  # of σ (meshopt.estimate)

    def __post_init__(self) -> None:
        def bad(message: str) -> InputError:
            return InputError(f"probe config: {message}")

        seconds = ("interval_s", "dead_after_s", "timeout_s", "half_life_s", "jitter_half_life_s")
        for name in seconds:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise bad(f"{name} must be a positive number of seconds, got {value!r}")
        if self.dead_after_s <= self.interval_s:
            raise bad(
                f"dead_after_s ({self.dead_after_s}) must exceed interval_s "
                f"({self.interval_s}), or a live peer is declared dead between two probes"
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise bad(f"window must be a whole number of probes >= 1, got {self.window!r}")
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise bad(f"port must be 1..65535, got {self.port!r}")
        if not isinstance(self.padding, int) or not 0 <= self.padding <= MAX_PADDING:
            raise bad(f"padding must be 0..{MAX_PADDING} bytes, got {self.padding!r}")

    def bytes_per_s(self, *, inner_ipv6: bool = True, outer_ipv6: bool = False) -> float:
        """Underlay bytes per second per peer, request and reply, WireGuard included."""
        return probe_bytes_per_s(
            self.interval_s, self.padding, inner_ipv6=inner_ipv6, outer_ipv6=outer_ipv6
        )

    @property
    def rate(self) -> Rate:
        """Every peer's rate until :meth:`Prober.set_rates` says otherwise."""
        return Rate(IN_USE, self.interval_s, self.dead_after_s)


RETRY_MIN_S = 0.03  # never retry sooner: a reply read at the next tick is not lost


def retry_after(srtt_ms: float | None, interval_s: float) -> float | None:
    """Seconds after which an unanswered probe is sent again (None: no RTT known yet,
    the peer's first replies may wait for a handshake)."""
    if srtt_ms is None:
        return None
    return min(max(2.0 * srtt_ms / 1000.0 + 0.01, RETRY_MIN_S), interval_s / 2.0)


def min_unanswered(rate: Rate) -> int:
    """Two unanswered probes where the dead time spans two intervals (the default), else
    one: never later than the configured dead time for a healthy sender."""
    return 2 if rate.dead_after_s >= 2 * rate.interval_s else 1


@dataclass(frozen=True)
class Target:
    """A peer to probe. ``scope``: the interface of a link-local IPv6 address."""

    name: str
    address: str
    scope: str | None = None
    # Seconds before the first probe (on top of the peer's phase) unless ``release``d
    # earlier: lets the other end initiate WireGuard's first handshake alone
    # (meshopt.agent.peers.first_probe_delay). Not part of the target's identity: it
    # matters only before the first probe.
    first_after_s: float = field(default=0.0, compare=False)
    # Where in each idle interval the peer is probed, as a share of it on the wall clock
    # (meshopt.agent.peers.idle_phase: the two ends of a tunnel half an interval apart);
    # None: the phase its fast probes had.
    idle_phase: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise InputError(f"probe target {self.address!r}: empty name")
        if not 0.0 <= self.first_after_s <= 60.0:
            raise InputError(
                f"probe target {self.name}: first_after_s must be in [0, 60], "
                f"not {self.first_after_s!r}"
            )
        if self.idle_phase is not None and not 0.0 <= self.idle_phase < 1.0:
            raise InputError(
                f"probe target {self.name}: idle_phase must be in [0, 1), not {self.idle_phase!r}"
            )
        ip = self._ip()
        if ip.version == 4 and self.scope is not None:
            raise InputError(f"probe target {self.name}: a scope applies to IPv6 only")
        if ip.is_link_local and ip.version == 6 and self.scope is None:
            raise InputError(
                f"probe target {self.name}: link-local {self.address} needs a scope "
                "(the interface name)"
            )

    def _ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        try:
            return ipaddress.ip_address(self.address)
        except ValueError:
            raise InputError(
                f"probe target {self.name}: {self.address!r} is not an IP address"
            ) from None

    def sockaddr(self, port: int) -> tuple[str, int, int, int]:
        """Where to send on a dual-stack socket: IPv4 as ``::ffff:a.b.c.d``."""
        ip = self._ip()
        if ip.version == 4:
            return (f"::ffff:{ip}", port, 0, 0)
        scope_id = 0
        if self.scope is not None:
            if self.scope.isdigit():
                scope_id = int(self.scope)
            else:
                try:
                    scope_id = socket.if_nametoindex(self.scope)
                except OSError:
                    raise InputError(
                        f"probe target {self.name}: no interface {self.scope!r}"
                    ) from None
        return (str(ip), port, 0, scope_id)


@dataclass(eq=False)
class _Peer:
    target: Target
    sockaddr: tuple[str, int, int, int]
    window: PeerWindow
    next_send: float
    rate: Rate
    min_unanswered: int
    explicit: bool = False  # the rate came from set_rates (else: the config's)
    last_sent: float | None = None
    last_early: float | None = None  # the last probe _probe_now brought forward
    alive: bool | None = None
    last_reply: float | None = None
    dead_since: float | None = None
    unanswered: int = 0  # probes sent since the last reply
    first_unanswered: float | None = None  # when the first of them was sent
    bytes_sent: int = 0
    bytes_received: int = 0
    not_before: float = 0.0  # no first probe before this (Target.first_after_s)
    heard: bool = False  # its probe came through the tunnel: ours start no handshake


@dataclass(slots=True)
class _Pending:
    peer: _Peer
    send_ns: int
    sent_at: float  # monotonic
    expires_at: float  # sent_at + timeout_s, later by the time the prober was stalled
    # Sent before the peer ever answered (it waited for WireGuard's handshake, or for the
    # peer's agent) or while it was declared dead (an outage): its RTT measures that wait,
    # and its loss is not the path's.
    early: bool = False
    # The monotonic time just before ``send_ns`` was read: the clock-step check measures
    # from here (a process preempted between the stamp and ``sent_at`` under load made
    # real round trips look longer than the monotonic clock allowed).
    stamped_at: float | None = None


@dataclass
class _Recent:
    """Seqs that have an outcome: answered ("done") or timed out ("expired")."""

    # An OrderedDict: dropping the oldest is O(1) (a dict's first key is found by walking
    # past the slots its earlier deletions left, up to a thousand at RECENT = 4096).
    states: OrderedDict[int, tuple[str, _Peer]] = field(default_factory=OrderedDict)

    def add(self, seq: int, state: str, peer: _Peer) -> None:
        states = self.states
        states[seq] = (state, peer)
        states.move_to_end(seq)
        if len(states) > RECENT:
            states.popitem(last=False)


class Prober:
    def __init__(
        self,
        config: ProbeConfig | None = None,
        *,
        on_change: Callable[[str, bool], None] | None = None,
        on_step: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config if config is not None else ProbeConfig()
        self._clock = clock  # injected by tests that drive the schedule by hand
        self.on_change = on_change
        # Called with the peer's name when its estimator confirms a change of level (a
        # step): the agent tells the controller at once instead of at its next check.
        self.on_step = on_step
        self.nonce = os.urandom(NONCE_BYTES)
        self.timer_error = TimerError()
        self.counters: dict[str, int] = {
            "sent": 0,
            "bad_packet": 0,
            "wrong_nonce": 0,
            "unknown_seq": 0,
            "duplicate": 0,
            "late": 0,
            "no_kernel_ts": 0,
            "clock_step": 0,
            "send_error": 0,
            "recv_error": 0,
            "stalls": 0,
            "early_reply": 0,
            "retries": 0,
        }
        self._peers: dict[str, _Peer] = {}
        # (time, tie, peer) heaps, checked lazily: an entry whose peer was dropped, whose
        # send time moved or whose dead time passed is skipped when it comes up. One tick
        # costs O(log n) per due event, not a walk over every peer.
        self._sends: list[tuple[float, int, _Peer]] = []
        self._deaths: list[tuple[float, int, _Peer]] = []
        self._retries: list[tuple[float, int]] = []  # (when, seq) of probes to send again
        self._tie = itertools.count()
        self._pending: dict[int, _Pending] = {}  # in send order
        self._recent = _Recent()
        self._next_seq = int.from_bytes(os.urandom(4), "big")
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None  # when the armed timer is due
        self._logged: set[str] = set()
        self._swept_at: float | None = None  # the last sweep of the dead peers
        self._wall_offset = time.time() - clock()  # idle phases are on the wall clock
        self.coalesce_s = COALESCE_S  # 0: every send in a tick of its own (tests)

    # -- life cycle ------------------------------------------------------------------
    async def start(self) -> None:
        if self._sock is not None:
            raise RuntimeError("prober already started")
        try:
            sock = open_udp_socket("::", 0)
        except OSError as exc:
            raise InputError(f"prober cannot open its dual-stack UDP socket: {exc}") from exc
        self._loop = asyncio.get_running_loop()
        # No reader on the socket: replies wait there, kernel-stamped, until the next
        # timer tick reads them all (a wake-up per reply was a third of the agent's).
        self._sock = sock
        self._arm(self._clock())

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def local_port(self) -> int:
        if self._sock is None:
            raise RuntimeError("prober not started")
        return int(self._sock.getsockname()[1])

    # -- targets ---------------------------------------------------------------------
    def set_targets(self, targets: Iterable[Target]) -> None:
        """Probe exactly these from now on; a removed or changed target's state is dropped.

        Raises InputError (and changes nothing) for duplicate names or an unknown scope.
        """
        wanted: dict[str, tuple[Target, tuple[str, int, int, int]]] = {}
        for t in targets:
            if t.name in wanted:
                raise InputError(f"probe targets: {t.name!r} given twice")
            wanted[t.name] = (t, t.sockaddr(self.config.port))
        for name, peer in list(self._peers.items()):
            if name not in wanted or wanted[name][0] != peer.target:
                self._drop_peer(name)
        now = self._clock()
        rate = self.config.rate
        for name, (t, addr) in wanted.items():
            if name not in self._peers:
                window = PeerWindow(
                    self.config.window,
                    self.config.half_life_s,
                    interval_s=self.config.interval_s,
                    jitter_half_life_s=self.config.jitter_half_life_s,
                )
                # Each peer at its own phase of the interval: probes sent together queue
                # behind each other (one wireguard-go, one responder) and read high.
                start = now + t.first_after_s
                first = start + self._phase(name) * min(rate.interval_s, 1.0)
                peer = _Peer(t, addr, window, first, rate, min_unanswered(rate))
                peer.not_before = start
                self._peers[name] = peer
                self._push_send(peer)
        if self._sock is not None:
            self._arm(now)

    def set_rates(self, rates: Mapping[str, Rate], now: float | None = None) -> None:
        """Probe these peers at these rates (others keep theirs); see meshopt.probe.budget.

        A peer whose rate changes starts counting silence afresh at its new rate (judged
        only on probes sent at that rate); one promoted to a faster class is probed at
        once, any other one new interval after its last probe. Unknown names are ignored.
        """
        now = self._clock() if now is None else now
        changed = False
        for name, rate in rates.items():
            peer = self._peers.get(name)
            if peer is None:
                continue
            peer.explicit = True
            if rate != peer.rate:
                self._set_rate(peer, rate, now)
                changed = True
        if changed and self._sock is not None:
            self._arm(now)

    def release(self, name: str, now: float | None = None) -> bool:
        """``name``'s probe reached our responder: probe it now if its first probe is
        still held (``Target.first_after_s``: the tunnel has a session, so a probe starts
        no handshake) or if it is declared dead (its path is back). True if a probe was
        brought forward."""
        peer = self._peers.get(name)
        now = self._clock() if now is None else now
        if peer is None:
            return False
        peer.heard = True
        if peer.alive is False:
            moved = self._probe_now(peer, now)
        elif peer.last_sent is not None or peer.not_before <= now:
            return False
        else:
            peer.not_before = now
            moved = self._probe_now(peer, now)
        if moved and self._sock is not None:
            self._arm(now)
        return moved

    def _probe_now(self, peer: _Peer, now: float, *, sweep: bool = False) -> bool:
        """Bring ``peer``'s next probe forward to ``now`` (the caller re-arms the timer,
        or is the timer: replies are read just before its sends). ``sweep``: another
        dead peer answered, so a probe this one was sent just before is as likely lost
        in the outage as not: only an early probe that recent holds it back (a fast
        link whose probe left 60 ms before its node's outage ended was found 0.26 s
        after the node's other links, and its routes moved twice)."""
        if peer.last_early is not None and now - peer.last_early < REVIVE_GAP_S:
            return False
        if not sweep and peer.last_sent is not None and now - peer.last_sent < REVIVE_GAP_S:
            return False
        if peer.next_send <= now:
            return False  # due anyway
        peer.last_early = now
        peer.next_send = now
        self._push_send(peer)
        return True

    def reconfigure(self, config: ProbeConfig) -> None:
        """A new config (a reload): peers without a rate of their own take its rate."""
        self.config = config
        now = self._clock()
        for peer in self._peers.values():
            if not peer.explicit and peer.rate != config.rate:
                self._set_rate(peer, config.rate, now)
        if self._sock is not None:
            self._arm(now)

    def _set_rate(self, peer: _Peer, rate: Rate, now: float) -> None:
        # A promotion (another class, faster) is probed at once; a budget that merely
        # re-spaces a class keeps each peer's phase (no burst of every idle peer).
        promoted = rate.cls != peer.rate.cls and rate.interval_s < peer.rate.interval_s
        peer.rate = rate
        peer.min_unanswered = min_unanswered(rate)
        # Silence is judged on probes sent at this rate: probes sent slowly before a
        # promotion must not make the first fast probe look like the second lost one.
        peer.unanswered = 0
        peer.first_unanswered = None
        if peer.last_sent is None:
            # Never probed yet: first probe at a spread-out moment within one interval
            # (at most 1 s), so hundreds of new idle peers do not all go in one burst.
            start = max(now, peer.not_before)
            if rate.interval_s > self.config.interval_s:
                offset = self._phase(peer.target.name) * min(rate.interval_s, 1.0)
                peer.next_send = self._snap(peer, start + offset)
            else:
                peer.next_send = max(min(peer.next_send, now), peer.not_before)
        elif promoted:
            peer.next_send = now
        else:
            peer.next_send = self._next_slow(peer, peer.last_sent, rate.interval_s, now)
        self._push_send(peer)

    def _next_slow(self, peer: _Peer, last: float, interval: float, now: float) -> float:
        """The send after ``last`` at a slow ``interval``: on the peer's idle phase if it
        has one (the first such moment at least half an interval after ``last``), else
        one interval after it."""
        phase = peer.target.idle_phase
        if phase is None or interval <= self.config.interval_s:
            return self._snap(peer, max(last + interval, now))
        wall = max(last + interval / 2, now) + self._wall_offset
        k = math.ceil(wall / interval - phase)
        return self._snap(peer, (k + phase) * interval - self._wall_offset)

    def _interval(self, peer: _Peer) -> float:
        """The peer's send interval: its rate's, or the fast one while its estimator
        has outliers waiting for confirmation."""
        interval = peer.rate.interval_s
        fast = self.config.interval_s
        if interval > fast and peer.window.estimator.confirming:
            return fast
        return interval

    def _phase(self, name: str) -> float:
        """Where in its interval ``name`` is probed, in [0, 1): fixed per peer, and
        different for each prober (so a node's peers do not all probe it at once)."""
        return zlib.crc32(self.nonce + name.encode()) / 2**32

    def _snap(self, peer: _Peer, t: float) -> float:
        """Slow peers' sends on a shared grid (many probes per wake-up); fast ones as is."""
        if self._interval(peer) <= self.config.interval_s:
            return t
        return math.ceil(t / GRID_S) * GRID_S

    def _push_send(self, peer: _Peer) -> None:
        heapq.heappush(self._sends, (peer.next_send, next(self._tie), peer))

    def _push_death(self, peer: _Peer) -> None:
        dies_at = self._dies_at(peer)
        if peer.alive and dies_at is not None:
            heapq.heappush(self._deaths, (dies_at, next(self._tie), peer))

    def _current(self, peer: _Peer) -> bool:
        return self._peers.get(peer.target.name) is peer

    def _drop_peer(self, name: str) -> None:
        peer = self._peers.pop(name)
        for seq in [s for s, p in self._pending.items() if p.peer is peer]:
            del self._pending[seq]

    @property
    def targets(self) -> list[Target]:
        return [p.target for p in self._peers.values()]

    # -- what it knows ---------------------------------------------------------------
    def stats(self, name: str) -> ProbeStats | None:
        peer = self._peers.get(name)
        return peer.window.stats() if peer is not None else None

    def alive(self, name: str) -> bool | None:
        """True/False once the peer has replied at least once; None before (or unknown)."""
        peer = self._peers.get(name)
        return peer.alive if peer is not None else None

    def rate(self, name: str) -> Rate | None:
        """How the peer is probed now (class, interval, dead time); None if unknown."""
        peer = self._peers.get(name)
        return peer.rate if peer is not None else None

    def probes_per_s(self) -> float:
        """Probes per second sent at the current rates, all peers together."""
        return sum(1.0 / p.rate.interval_s for p in self._peers.values())

    def dead_since(self, name: str) -> float | None:
        """``time.monotonic()`` when the peer was declared dead; None unless dead now."""
        peer = self._peers.get(name)
        return peer.dead_since if peer is not None else None

    def bytes_sent(self, name: str) -> int:
        """UDP payload bytes sent to the peer (see ``ProbeConfig.bytes_per_s`` for wire)."""
        peer = self._peers.get(name)
        return peer.bytes_sent if peer is not None else 0

    def bytes_received(self, name: str) -> int:
        peer = self._peers.get(name)
        return peer.bytes_received if peer is not None else 0

    def snapshot(self) -> dict[str, Any]:
        """Everything above as plain data (for JSON)."""
        peers: dict[str, Any] = {}
        for name, peer in self._peers.items():
            peers[name] = {
                "address": peer.target.address,
                "scope": peer.target.scope,
                "alive": peer.alive,
                "dead_since": peer.dead_since,
                "class": peer.rate.cls,
                "interval_s": peer.rate.interval_s,
                "dead_after_s": peer.rate.dead_after_s,
                "bytes_sent": peer.bytes_sent,
                "bytes_received": peer.bytes_received,
                "stats": dataclasses.asdict(peer.window.stats()),
            }
        return {
            "config": dataclasses.asdict(self.config),
            "bytes_per_s_ipv6_in_ipv4": self.config.bytes_per_s(),
            "peers": peers,
            "counters": dict(self.counters),
            "timer_error": self.timer_error.summary(),
        }

    # -- timer: sends, timeouts, deaths ----------------------------------------------
    def _arm(self, now: float) -> None:
        if self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            # A caller re-arming after a stall (the agent's poll or a route set ran before
            # this timer's late callback) must not erase the lateness: credit it here.
            if self._wake_at is not None and now - self._wake_at > STALL_TOLERANCE_S:
                self._credit_stall(now - self._wake_at, now)
        wake = self._next_wake(now)
        delay = max(0.0, wake - now)
        self._wake_at = now + delay
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _next_wake(self, now: float) -> float:
        wake = now + STALL_TOLERANCE_S  # often enough to tell a stall from an idle wait
        sends, deaths = self._sends, self._deaths
        while sends and (not self._current(sends[0][2]) or sends[0][2].next_send != sends[0][0]):
            heapq.heappop(sends)  # stale: dropped peer or moved send time
        if sends:
            wake = min(wake, sends[0][0])
        while deaths and not (self._current(deaths[0][2]) and deaths[0][2].alive):
            heapq.heappop(deaths)
        if deaths:
            wake = min(wake, deaths[0][0])  # maybe stale (a reply came): a wasted wake-up
        retries = self._retries
        while retries and retries[0][1] not in self._pending:
            heapq.heappop(retries)  # answered (or expired) meanwhile
        if retries:
            wake = min(wake, retries[0][0])
        for pending in self._pending.values():  # the oldest times out first
            wake = min(wake, pending.expires_at)
            break
        return wake

    def _dies_at(self, peer: _Peer) -> float | None:
        """When ``peer`` is due to be declared dead, None while too few probes are out."""
        rate = peer.rate
        if peer.last_reply is None or peer.first_unanswered is None:
            return None
        if peer.unanswered < peer.min_unanswered:
            return None
        return max(
            peer.last_reply + rate.dead_after_s,
            peer.first_unanswered + rate.dead_after_s - rate.interval_s,
        )

    def _on_timer(self) -> None:
        self._timer = None
        # Replies are read here, before anything is judged: those that arrived since the
        # last tick, and those that queued while this loop was late (a stall), with
        # their kernel stamps.
        self._read_replies()
        now = self._clock()
        # Late since the timer was due: a stall before this wake-up or during the read.
        late = now - self._wake_at if self._wake_at is not None else 0.0
        if late > STALL_TOLERANCE_S:
            self._credit_stall(late, now)
        try:
            self._tick(now)
        finally:
            if self._sock is not None:
                after = self._clock()
                # Stopped inside this tick (a tick's work is milliseconds): no timer was
                # armed to wake late, so the stall is credited here or never.
                if after - now > STALL_TOLERANCE_S:
                    self._credit_stall(after - now, after)
                self._arm(after)

    def _credit_stall(self, late: float, now: float) -> None:
        """The prober woke ``late`` seconds after its timer was due: its process (or the
        whole machine) was stalled, and so, likely, were the tunnel and the peers' replies.
        That silence is its own, not the peers': it is taken off every peer's silence and
        every pending probe's timeout, so a stall is never read as a dead peer or as loss.
        A peer that really died meanwhile is found one dead time after the stall."""
        self.counters["stalls"] += 1
        if late >= 0.5:
            log.info("prober: woke %.2f s late (stalled); that silence is not the peers'", late)
        for peer in self._peers.values():
            if peer.last_reply is not None:
                peer.last_reply = min(now, peer.last_reply + late)
            if peer.first_unanswered is not None:
                peer.first_unanswered = min(now, peer.first_unanswered + late)
        for pending in self._pending.values():
            pending.expires_at += late

    def _tick(self, now: float) -> None:
        due = now + SLACK_S
        while self._pending:
            seq, pending = next(iter(self._pending.items()))
            if pending.expires_at > due:
                break
            del self._pending[seq]
            self._recent.add(seq, "expired", pending.peer)  # a late reply still proves life
            if pending.early:
                # Sent before the peer first answered (its agent or tunnel was still
                # coming up) or while it was dead. Counting these as loss would make a
                # new or returning peer look lossy for a whole window.
                continue
            pending.peer.window.add_loss(seq, now)
        retries = self._retries
        while retries and retries[0][0] <= due:
            _, seq = heapq.heappop(retries)
            waiting = self._pending.get(seq)
            # Unanswered (replies were read before this tick): lost, not slow. Once.
            if waiting is not None and self._current(waiting.peer) and waiting.peer.alive:
                self.counters["retries"] += 1
                self._send(waiting.peer, retry=True)
        deaths = self._deaths
        while deaths and deaths[0][0] <= due:
            _, _, peer = heapq.heappop(deaths)
            if not (self._current(peer) and peer.alive):
                continue
            dies_at = self._dies_at(peer)
            if dies_at is None:
                continue  # it replied meanwhile
            if dies_at > due:
                heapq.heappush(deaths, (dies_at, next(self._tie), peer))
                continue
            peer.alive = False
            peer.dead_since = now
            self._notify(peer.target.name, False)
        sends = self._sends
        early = due + self.coalesce_s
        while sends and sends[0][0] <= early:
            at, _, peer = sends[0]
            if not self._current(peer) or peer.next_send != at:
                heapq.heappop(sends)
                continue
            interval = self._interval(peer)
            if at > due and at > now + interval / 4:
                break  # a fast peer is not probed twice in one tick
            heapq.heappop(sends)
            self._send(peer)
            if peer.target.idle_phase is not None and interval > self.config.interval_s:
                peer.next_send = self._next_slow(peer, now, interval, now)
            else:
                peer.next_send += interval
                if peer.next_send <= now:  # fell behind (a stalled loop): no burst, same phase
                    behind = math.ceil((now - peer.next_send) / interval + 1e-9)
                    peer.next_send += behind * interval
                peer.next_send = self._snap(peer, peer.next_send)
            self._push_send(peer)
            self._push_death(peer)

    def _send(self, peer: _Peer, *, retry: bool = False) -> None:
        sock = self._sock
        if sock is None:
            return
        seq = self._next_seq
        self._next_seq = (seq + 1) % _SEQ_MOD
        data = request_bytes(self.nonce, seq, self.config.padding)
        # Stamped after encoding and sent at once; the bookkeeping comes after the send
        # (a reply is only read by a later timer tick): the stamp is the moment of the
        # sendto, not of the Python work around it.
        stamped_at = self._clock()
        send_ns = time.time_ns()
        stamp(data, send_ns)
        try:
            sock.sendto(data, peer.sockaddr)
        except OSError as exc:  # unreachable, no route, buffer full: the probe is lost
            failed: OSError | None = exc
        else:
            failed = None
        sent_at = self._clock()
        self._pending[seq] = _Pending(
            peer,
            send_ns,
            sent_at,
            sent_at + self.config.timeout_s,
            early=(peer.alive is None and not peer.heard) or peer.alive is False,
            stamped_at=stamped_at,
        )
        if not retry and peer.alive:
            after = retry_after(peer.window.estimator.srtt_ms, self._interval(peer))
            if after is not None:
                heapq.heappush(self._retries, (sent_at + after, seq))
        peer.last_sent = sent_at
        if peer.unanswered == 0:
            peer.first_unanswered = sent_at
        peer.unanswered += 1
        peer.window.add_sent(seq, sent_at)
        self.counters["sent"] += 1
        if failed is not None:
            self.counters["send_error"] += 1
            self._log_once(
                f"send:{failed.errno}", "probe to %s failed: %s", peer.target.name, failed
            )
            return
        peer.bytes_sent += len(data)

    def _notify(self, name: str, alive: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(name, alive)
        except Exception:
            log.exception("prober: on_change(%r, %r) failed", name, alive)

    # -- replies ---------------------------------------------------------------------
    def _read_replies(self) -> None:
        """Every reply queued since the last tick. The RTT is the kernel's receive stamp's,
        so the read time costs it nothing; a reply's arrival (for liveness) is its stamp
        too, as a monotonic time: ``now`` less how long it waited in the socket."""
        sock = self._sock
        if sock is None:
            return
        clock, timer_error = self._clock, self.timer_error
        try:
            for data, addr, rx_ns in drain_timestamped(sock, MAX_PROBE_BYTES + 1, DRAIN):
                user_ns = time.time_ns()
                now = clock()
                if rx_ns is None:
                    self.counters["no_kernel_ts"] += 1
                    rx_ns = user_ns
                    arrived = now
                else:
                    timer_error.add(rx_ns, user_ns)
                    arrived = now - min(max(user_ns - rx_ns, 0) / 1e9, MAX_WAIT_S)
                self._handle(data, addr, rx_ns, now, arrived)
        except OSError as exc:
            self.counters["recv_error"] += 1
            self._log_once("recv", "prober: recvmsg failed: %s", exc)

    def _handle(
        self, data: bytes, addr: object, rx_ns: int, now: float, arrived: float | None = None
    ) -> None:
        """One datagram read at ``now`` that reached the socket at ``arrived`` (default:
        ``now``), both monotonic; ``rx_ns`` its kernel receive stamp (realtime)."""
        if arrived is None:
            arrived = now
        try:
            kind, nonce, seq, send_ns, turnaround_ns, _ = parse(data)
        except ProbeFormatError as exc:
            self._bad(exc.reason, addr, str(exc))
            return
        if kind != 2:
            self._bad("not_reply", addr, f"a {KINDS[kind].name} sent to the prober")
            return
        if nonce != self.nonce:
            self._count("wrong_nonce", addr, "a reply with another prober's nonce")
            return
        pending = self._pending.get(seq)
        if pending is None:
            state, peer = self._recent.states.get(seq, ("unknown", None))
            if state == "done":
                self._count("duplicate", addr, f"a second reply to seq {seq}")
            elif (
                state == "expired"
                and peer is not None
                and self._peers.get(peer.target.name) is peer
            ):
                self._count("late", addr, f"a reply after timeout_s to seq {seq}")
                self._replied(peer, arrived)
            else:
                self._count("unknown_seq", addr, f"a reply to seq {seq}, never sent")
            return
        if send_ns != pending.send_ns:
            self._bad("bad_echo", addr, f"seq {seq} echoes another send time")
            return
        del self._pending[seq]
        peer = pending.peer
        peer.bytes_received += len(data)
        self._recent.add(seq, "done", peer)
        self._replied(peer, arrived)
        # Both stamps are CLOCK_REALTIME: a step between them (NTP) shows as a span the
        # monotonic clock does not agree with. A turnaround longer than the whole round
        # trip is a responder's lie.
        span_ns = rx_ns - pending.send_ns
        since = pending.sent_at if pending.stamped_at is None else pending.stamped_at
        if not 0 < span_ns <= (now - since + SLACK_S) * 1e9:
            self._count("clock_step", addr, f"a round trip of {span_ns} ns (clock stepped)")
            return
        rtt_ns = span_ns - turnaround_ns
        if rtt_ns <= 0:
            self._bad("bad_turnaround", addr, f"turnaround {turnaround_ns} ns >= RTT")
            return
        if pending.early:
            # Queued behind WireGuard's first handshake, or sent into an outage: proof of
            # life, not an RTT (under load a handshake retried after 5 s flushed replies
            # of 700 ms into the estimate of an 80 ms tunnel).
            self.counters["early_reply"] += 1
            return
        estimator = peer.window.estimator
        steps = estimator.changes
        peer.window.add_reply(seq, rtt_ns / 1e6, arrived)
        if estimator.changes != steps and self.on_step is not None:
            self.on_step(peer.target.name)
        fast = self._interval(peer)
        if fast < peer.rate.interval_s:
            # A slow (idle) link read an outlier: probe it fast until the estimator
            # confirms the change or dismisses it (a step confirmed in ~1 s, not ~6 s).
            last = peer.last_sent if peer.last_sent is not None else now
            soon = max(now, last + fast)
            if soon < peer.next_send:
                peer.next_send = soon
                self._push_send(peer)

    def _replied(self, peer: _Peer, now: float) -> None:
        peer.last_reply = now
        peer.unanswered = 0
        peer.first_unanswered = None
        if peer.alive is False:
            # A path that comes back is presumed the one it was: its estimate stays (a
            # changed one is a step, confirmed in ~3 samples) and the outage's losses
            # go. Started afresh, it had no RTT until the next reply, and the controller
            # priced the link as unknown (1 s) meanwhile: the returning node's routes
            # went via whichever of its links answered first, and back 0.5 s later.
            peer.window.forget_outage()
            peer.alive = True
            peer.dead_since = None
            self._notify(peer.target.name, True)
            self._sweep_dead(now)
        elif peer.alive is None:
            peer.alive = True
        # No re-arm needed: a reply only moves the peer's dead deadline later, and the
        # timer always fires by the next send.

    def _sweep_dead(self, now: float) -> None:
        """A dead peer answered again: probe the other dead ones now. When this node was
        the one cut off, its links came back together, and each found at its own next
        probe (0-2 s apart) would move its routes once per link as they revive."""
        if self._swept_at is not None and now - self._swept_at < REVIVE_SWEEP_S:
            return
        self._swept_at = now
        for peer in self._peers.values():
            if peer.alive is False:
                self._probe_now(peer, now, sweep=True)

    def _bad(self, reason: str, addr: object, detail: str) -> None:
        key = f"bad_packet.{reason}"
        self.counters["bad_packet"] += 1
        self.counters[key] = self.counters.get(key, 0) + 1
        self._log_once(key, "prober: dropped a datagram from %s: %s", addr, detail)

    def _count(self, key: str, addr: object, detail: str) -> None:
        self.counters[key] += 1
        self._log_once(key, "prober: dropped %s from %s", detail, addr)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message + " (further ones are counted, not logged)", *args)


# -- command line ----------------------------------------------------------------------
def _parse_target(text: str) -> Target:
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = text, text
    address, _, scope = rest.partition("%")
    return Target(name, address, scope or None)


def _print_change(name: str, alive: bool) -> None:
    """One JSON line per alive/dead flip; ``t`` is ``time.monotonic()`` (host-wide)."""
    line = {"event": "change", "name": name, "alive": alive, "t": time.monotonic()}
    print(json.dumps(line), flush=True)


async def _probe_for(
    config: ProbeConfig, targets: list[Target], duration: float, events: bool
) -> dict[str, Any]:
    prober = Prober(config, on_change=_print_change if events else None)
    prober.set_targets(targets)
    await prober.start()
    try:
        await asyncio.sleep(duration)
    finally:
        await prober.close()
    return prober.snapshot()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshopt.probe.prober",
        description="Probe UDP echo responders for a while; print statistics as JSON.",
    )
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        help="NAME=ADDRESS[%%SCOPE] (or just ADDRESS); repeat for more",
    )
    parser.add_argument("--duration", type=float, default=5.0)
    defaults = ProbeConfig()
    parser.add_argument("--interval", type=float, default=defaults.interval_s)
    parser.add_argument("--dead-after", type=float, default=defaults.dead_after_s)
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s)
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--padding", type=int, default=defaults.padding)
    parser.add_argument(
        "--events", action="store_true", help="print a JSON line when a peer dies or returns"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        config = ProbeConfig(
            interval_s=args.interval,
            dead_after_s=args.dead_after,
            window=args.window,
            timeout_s=args.timeout,
            port=args.port,
            padding=args.padding,
        )
        targets = [_parse_target(t) for t in args.target]
        result = asyncio.run(_probe_for(config, targets, args.duration, args.events))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
