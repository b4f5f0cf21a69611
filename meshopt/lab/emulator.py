"""The lab's underlay ("the Internet"): one user-space process for every pair of nodes.

The kernels this project develops on have no netem, so delay, jitter and loss cannot
be put on veths. Instead every node gets an L3 TUN device (in its own namespace) and
this process forwards between them: a packet read from node i's TUN goes to the node
j owning its destination address, after the directed pair (i, j)'s loss, rate, delay
and jitter (:mod:`meshopt.lab.shaper`). One process serves the whole matrix: a
process per pair would cost n² processes and n² context switches per round of traffic.

Run it as ``python -m meshopt.lab.emulator --spec SPEC.json`` (root, root namespace).
It prints ``READY`` once every TUN is configured and the control socket listens, then
serves until SIGTERM/SIGINT. The TUNs are not persistent, so they vanish when the
process exits, even on a crash.

Spec (JSON; ``EmulatorSpec``)::

    {"lab": "ab12", "seed": 1, "mtu": 1500,
     "control": "/run/meshopt/ab12/emu.sock",
     "nodes": [{"name": "a", "netns": "moab12a", "ifname": "moab12u0",
                "address": "172.31.0.1/16"}, ...],
     "delay_ms": [[0, 5], [5, 0]], "jitter_ms": [[0, 0], [0, 0]],
     "loss": [[0, 0], [0, 0]], "rate_mbit": [[null, 100], [null, null]]}

Matrices are n×n, row = sender, column = receiver; the diagonal is ignored; ``null``
rate means unlimited; ``jitter_ms``, ``loss`` and ``rate_mbit`` may be omitted (0, 0,
unlimited). ``spike`` (optional, 0 = off) is a fault: on pair (i, j) with ``spike`` N,
one packet in N (at random, probability 1/N, from the spec's seed) is held
SPIKE_MS (100-300 ms, uniform) longer than the pair's delay, alone: the packets after
it are not held behind it (a busy host or a retransmitting hop delays one packet; the
estimator must ignore it, see :mod:`meshopt.estimate`). Its count is the pair's
``spiked`` in ``stats``. Optional: ``address6`` per node, ``txqueuelen`` (1000), ``queue_ms`` (50)
and ``queue_min_bytes`` (65536) for the rate queues, ``nice`` (-10: the network should
not wait behind the endpoints it carries), ``read_latency_us`` (60: the emulator's own
per-hop latency, taken off the configured delay), ``tunnel_ports`` and
``tunnel_latency_us`` (UDP ports whose packets also have that much taken off: the
lab's wireguard-go tunnels, see EmulatorSpec). The lab id must appear in every
namespace name, interface name and in the control socket path, so that whatever this
process touches is visibly the lab's.

Control socket: newline-delimited JSON, one reply line per request line::

    {"op": "set", "pairs": [[0, 1], ["a", "c"]], "delay_ms": 20, "rate_mbit": null}
    {"op": "set", "pairs": [["a", "b"]], "spike": 20}
    {"op": "node", "node": 1, "up": false}
    {"op": "tunnel", "latency_us": 310}   (the lab's calibration, :mod:`meshopt.lab.calibrate`)
    {"op": "stats"}   {"op": "params"}   {"op": "ping"}

Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. A ``set``
applies to packets that arrive after it (at once: the loop serves the socket between
packet batches); packets already queued keep their release times. A down node's
packets are dropped both ways, including packets queued towards it.

``stats`` reports, per directed pair that has seen traffic, packets and bytes
delivered and drops by reason (``loss``, ``queue``, ``down``, ``error``: a TUN write
failed), per node the packets to unknown destinations, and ``lag_us``: how late
packets were written compared with their release time (mean, max, count over 1 ms).

Timing: the loop sleeps in ``select()`` on the epoll descriptor (``select`` takes
microseconds; ``epoll.poll()`` rounds up to whole milliseconds in CPython 3.11), with
the thread's timer slack at 1 ns instead of 50 µs. No busy-waiting: see PRE_WAKE_S.
Measured on the 2-core development VM: ping RTT median within ~0.2 ms of the
configured RTT from 1 to 80 ms (0.25 ms of it is the forwarding itself: an idle
process takes ~70 µs to wake for a packet here); the VM sometimes loses the CPU for
5-25 ms, which shows in the tail, not the median.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import heapq
import ipaddress
import itertools
import json
import math
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec

from meshopt.lab.netns import netns_exists
from meshopt.lab.shaper import (
    DEFAULT_QUEUE_MIN_BYTES,
    DEFAULT_QUEUE_MS,
    PairParams,
    PairShaper,
)
from meshopt.lab.tun import check_ifname
from meshopt.lab.underlay import UnderlayNode, check_matrices, check_nodes, pair_params
from meshopt.units import MAX_SPIKE_N

LAB_ID = re.compile(r"[A-Za-z0-9]{1,10}")
READY = "READY"
SUN_PATH_MAX = 107
READ_SIZE = 65536  # a TUN returns one packet per read; 64 KiB covers any MTU
BATCH = 64  # packets read from one TUN before timers and other TUNs get a turn
# Timer strategy (measured on the 2-core development VM, timer slack 1 ns): a
# select() of a few hundred µs wakes ~40-60 µs late, one of 20-40 ms ~100-150 µs
# late (the idle CPU sleeps deeper). So a long wait stops PRE_WAKE_S short of the
# deadline and a second, short one follows; that one aims EARLY_S early, and packets
# due within EARLY_S are released: on average they leave on time, not ~50 µs late.
PRE_WAKE_S = 300e-6
EARLY_S = 40e-6
IDLE_POLL_S = 1.0
# Packets waiting in the emulator across all pairs (~150 MB of 1500-byte packets): a
# safety net against a flood into a long unlimited-rate delay, counted as queue drops.
MAX_QUEUED = 100_000
MAX_REQUEST_BYTES = 1 << 20
SPIKE_MS = (100.0, 300.0)  # how much longer a spiked packet is held
MAX_TUNNEL_LATENCY_US = 10_000.0


def check_tunnel_latency(value: float) -> None:
    """ValueError unless 0 <= ``value`` <= MAX_TUNNEL_LATENCY_US (µs taken off tunnel packets)."""
    if not (math.isfinite(value) and 0.0 <= value <= MAX_TUNNEL_LATENCY_US):
        raise ValueError(f"tunnel_latency_us {value} out of range 0..{MAX_TUNNEL_LATENCY_US:.0f}")


def check_spike(value: object, what: str = "spike") -> int:
    """``spike`` as an int N >= 0 (0: off; one packet in N delayed); ValueError if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a whole number N >= 0 (one packet in N), not {value!r}")
    if not (math.isfinite(value) and value == int(value) and 0 <= value <= MAX_SPIKE_N):
        raise ValueError(
            f"{what} must be a whole number 0..{MAX_SPIKE_N} (one packet in N; 0 off), "
            f"not {value!r}"
        )
    return int(value)


class SpecError(ValueError):
    """An emulator spec that cannot be used; the message says where and why."""


class EmulatorError(RuntimeError):
    """The emulator failed to start, or refused a control request."""


# --- spec -----------------------------------------------------------------------


NodeSpec = UnderlayNode  # the emulator's name for it


class EmulatorSpec(msgspec.Struct, forbid_unknown_fields=True):
    lab: str
    control: str
    nodes: list[NodeSpec]
    delay_ms: list[list[float]]
    jitter_ms: list[list[float]] | None = None
    loss: list[list[float]] | None = None
    rate_mbit: list[list[float | None]] | None = None
    spike: list[list[int]] | None = None  # one packet in N delayed SPIKE_MS; 0 off
    seed: int = 1
    mtu: int = 1500
    txqueuelen: int = 1000
    queue_ms: float = DEFAULT_QUEUE_MS
    queue_min_bytes: int = DEFAULT_QUEUE_MIN_BYTES
    # The emulator is the lab's network: it should not queue behind the endpoints it
    # serves. At nice -10 one TCP pair ran at ~1.4 Gbit/s here instead of ~0.85.
    nice: int = -10
    # How long before our read() a packet typically entered its TUN (wake-up and
    # hand-over). Its arrival time is taken as read time minus this, so the configured
    # delay is what the endpoints observe, not delay + the emulator's own latency.
    read_latency_us: float = 60.0
    # UDP packets to these ports (the lab's wireguard-go tunnels) also have
    # ``tunnel_latency_us`` taken off their delay: wireguard-go in user space adds two
    # process wake-ups per packet, ~0.25 ms per direction on the development VM, which
    # kernel WireGuard does not. So the overlay RTT is the configured one, as it would
    # be with kernel WireGuard over a real path.
    tunnel_ports: list[int] = msgspec.field(default_factory=list)
    tunnel_latency_us: float = 0.0

    @property
    def n(self) -> int:
        return len(self.nodes)

    def pair_params(self, i: int, j: int) -> PairParams:
        return pair_params(self, i, j)

    def addresses(self, i: int) -> list[str]:
        node = self.nodes[i]
        return [node.address] + ([node.address6] if node.address6 else [])


def tun_name(lab: str, index: int) -> str:
    """The conventional TUN name of node ``index`` in ``lab``: ``mo<lab>u<index>``."""
    name = f"mo{lab}u{index}"
    check_ifname(name)
    return name


def validate_spec(spec: EmulatorSpec, *, check_system: bool = True) -> None:
    """Raise SpecError for anything wrong with ``spec`` (before anything is created).

    ``check_system`` also checks that the namespaces exist.
    """
    if not LAB_ID.fullmatch(spec.lab):
        raise SpecError(f"lab id {spec.lab!r} must be 1-10 letters or digits")
    n = spec.n
    if n < 1:
        raise SpecError("nodes: at least one node is needed")
    if not 68 <= spec.mtu <= 65535:
        raise SpecError(f"mtu {spec.mtu} out of range 68..65535")
    if not 1 <= spec.txqueuelen <= 100_000:
        raise SpecError(f"txqueuelen {spec.txqueuelen} out of range 1..100000")
    if not (math.isfinite(spec.queue_ms) and spec.queue_ms > 0) or spec.queue_min_bytes < 65535:
        raise SpecError("queue_ms must be > 0 and queue_min_bytes >= 65535 (one packet)")
    if not 0.0 <= spec.read_latency_us <= 10_000.0:
        raise SpecError(f"read_latency_us {spec.read_latency_us} out of range 0..10000")
    try:
        check_tunnel_latency(spec.tunnel_latency_us)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if any(not 0 < p < 65536 for p in spec.tunnel_ports):
        raise SpecError("tunnel_ports must be UDP ports 1..65535")
    if not -20 <= spec.nice <= 19:
        raise SpecError(f"nice {spec.nice} out of range -20..19")
    control = spec.control
    if not os.path.isabs(control) or len(control.encode()) > SUN_PATH_MAX:
        raise SpecError(f"control {control!r} must be an absolute path of <= {SUN_PATH_MAX} bytes")
    if spec.lab not in control:
        raise SpecError(f"control path {control!r} must contain the lab id {spec.lab!r}")
    try:
        check_nodes(spec.nodes, mtu=spec.mtu)
        check_matrices(spec, n)
        if spec.spike is not None:
            if len(spec.spike) != n or any(len(row) != n for row in spec.spike):
                raise ValueError(f"spike must be a {n}x{n} matrix")
            for i, row in enumerate(spec.spike):
                for j, v in enumerate(row):
                    check_spike(v, f"spike[{i}][{j}]")
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    for k, node in enumerate(spec.nodes):
        for key in ("ifname", "netns"):
            if spec.lab not in getattr(node, key):
                raise SpecError(f"nodes[{k}].{key} must contain the lab id {spec.lab!r}")
    if check_system:
        for k, node in enumerate(spec.nodes):
            if not netns_exists(node.netns):
                raise SpecError(f"nodes[{k}].netns: namespace {node.netns!r} does not exist")


def load_spec(path: str | os.PathLike[str], *, check_system: bool = True) -> EmulatorSpec:
    """Read and validate a spec file; every problem is one SpecError line."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: {exc.strerror or exc}") from None
    try:
        spec = msgspec.json.decode(data, type=EmulatorSpec)
    except msgspec.DecodeError as exc:
        raise SpecError(f"{path}: {exc}") from None
    try:
        validate_spec(spec, check_system=check_system)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    return spec


def write_spec(spec: EmulatorSpec, path: str | os.PathLike[str]) -> None:
    """Write ``spec`` as JSON (validated first, without the system checks)."""
    validate_spec(spec, check_system=False)
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(spec)))


# --- control requests -----------------------------------------------------------

NodeRef = int | str


class SetRequest(msgspec.Struct, tag_field="op", tag="set", forbid_unknown_fields=True):
    pairs: list[tuple[NodeRef, NodeRef]]
    delay_ms: float | msgspec.UnsetType = msgspec.UNSET
    jitter_ms: float | msgspec.UnsetType = msgspec.UNSET
    loss: float | msgspec.UnsetType = msgspec.UNSET
    rate_mbit: float | msgspec.UnsetType | None = msgspec.UNSET
    spike: int | msgspec.UnsetType = msgspec.UNSET


class NodeRequest(msgspec.Struct, tag_field="op", tag="node", forbid_unknown_fields=True):
    node: NodeRef
    up: bool


class StatsRequest(msgspec.Struct, tag_field="op", tag="stats", forbid_unknown_fields=True):
    pass


class ParamsRequest(msgspec.Struct, tag_field="op", tag="params", forbid_unknown_fields=True):
    pass


class PingRequest(msgspec.Struct, tag_field="op", tag="ping", forbid_unknown_fields=True):
    pass


class TunnelRequest(msgspec.Struct, tag_field="op", tag="tunnel", forbid_unknown_fields=True):
    latency_us: float


Request = SetRequest | NodeRequest | StatsRequest | ParamsRequest | PingRequest | TunnelRequest
_request_decoder = msgspec.json.Decoder(Request)


# --- the forwarding process -----------------------------------------------------


def _set_timer_slack_ns(ns: int) -> bool:
    """Shrink this thread's timer slack (default 50 µs) so short sleeps wake on time."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(29, ctypes.c_ulong(ns), 0, 0, 0) == 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when our parent (thread) exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


@dataclass
class _Conn:
    sock: socket.socket
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)


class Emulator:
    """The forwarding loop, its TUNs and its control socket (see the module doc)."""

    def __init__(self, spec: EmulatorSpec) -> None:
        self.spec = spec
        n = spec.n
        self.names = [node.name for node in spec.nodes]
        self.shapers: list[list[PairShaper]] = [
            [
                PairShaper(
                    spec.pair_params(i, j) if i != j else PairParams(),
                    random.Random(f"{spec.seed}:{i}:{j}"),
                    queue_ms=spec.queue_ms,
                    queue_min_bytes=spec.queue_min_bytes,
                )
                for j in range(n)
            ]
            for i in range(n)
        ]
        self.addr_to_node: dict[bytes, int] = {}
        for i in range(n):
            for text in spec.addresses(i):
                self.addr_to_node[ipaddress.ip_interface(text).ip.packed] = i
        self.up = [True] * n
        self.unknown = [0] * n
        self.spike = [
            [spec.spike[i][j] if spec.spike is not None and i != j else 0 for j in range(n)]
            for i in range(n)
        ]
        self.spiked = [[0] * n for _ in range(n)]
        self._spike_rng = random.Random(f"{spec.seed}:spike")
        self.read_latency_s = spec.read_latency_us / 1e6
        self.tunnel_latency_s = spec.tunnel_latency_us / 1e6
        self.tunnel_ports = frozenset(p.to_bytes(2, "big") for p in spec.tunnel_ports)
        self.fds: list[int] = []
        self._fd_node: dict[int, int] = {}
        self._heap: list[tuple[float, int, int, bytes, PairShaper, int]] = []
        self._seq = itertools.count()
        self._ep = select.epoll()
        self._handlers: dict[int, Callable[[int], None]] = {}
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        # Wakes the loop for stop() and for signals (signal.set_wakeup_fd).
        self._wakeup_r, self._wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._wakeup_r, select.EPOLLIN)
        self._handlers[self._wakeup_r] = self._on_wakeup
        self._signals = False
        self._stop = False
        self._started = time.monotonic()
        self.lag_count = 0
        self.lag_sum = 0.0
        self.lag_max = 0.0
        self.late_1ms = 0

    # -- set-up and tear-down --------------------------------------------------
    def setup(self) -> None:
        """Create and configure every TUN, then listen on the control socket."""
        from meshopt.lab.tun import configure_in_netns, iproute, move_to_netns, open_tun

        spec = self.spec
        fds: list[int] = []
        try:
            with iproute() as ipr:
                for i, node in enumerate(spec.nodes):
                    if ipr.link_lookup(ifname=node.ifname):
                        raise EmulatorError(f"interface {node.ifname} exists already")
                    fds.append(open_tun(node.ifname))
                    move_to_netns(ipr, node.ifname, node.netns)
                    configure_in_netns(
                        node.netns,
                        node.ifname,
                        spec.addresses(i),
                        mtu=spec.mtu,
                        txqueuelen=spec.txqueuelen,
                    )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.attach_devices(fds)
        self._listen(spec.control)

    def attach_devices(self, fds: Sequence[int]) -> None:
        """Use ``fds[i]`` as node i's device: one packet per read() and per write().

        ``setup()`` passes TUNs; tests pass SOCK_SEQPACKET socket pairs, which keep
        packet boundaries the same way, to run the loop without root. The emulator owns
        the descriptors from now on and closes them in ``close()``.
        """
        if len(fds) != len(self.names):
            raise ValueError(f"{len(fds)} devices for {len(self.names)} nodes")
        for i, fd in enumerate(fds):
            os.set_blocking(fd, False)
            self.fds.append(fd)
            self._fd_node[fd] = i
            self._ep.register(fd, select.EPOLLIN)

    def _listen(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale socket of a dead emulator of this lab
            else:
                raise EmulatorError(f"control socket {path} is in use by another emulator")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(16)
        sock.setblocking(False)
        self._listener = sock
        self._ep.register(sock.fileno(), select.EPOLLIN)
        self._handlers[sock.fileno()] = self._accept

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT end the loop cleanly (main thread only)."""
        signal.set_wakeup_fd(self._wakeup_w, warn_on_full_buffer=False)
        self._signals = True

        def stop(signum: int, frame: FrameType | None) -> None:
            self._stop = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def _on_wakeup(self, events: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wakeup_r, 512)

    def stop(self) -> None:
        """End ``run()`` soon; callable from another thread."""
        self._stop = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wakeup_w, b"\0")

    @property
    def stopping(self) -> bool:
        return self._stop

    def close(self) -> None:
        """Close everything; the TUN devices disappear with their descriptors."""
        for conn in list(self._conns.values()):
            self._drop_conn(conn)
        if self._listener is not None:
            path = self.spec.control
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        if self._wakeup_w >= 0:
            if self._signals:
                signal.set_wakeup_fd(-1)
            os.close(self._wakeup_r)
            os.close(self._wakeup_w)
            self._wakeup_r = self._wakeup_w = -1
        self._ep.close()

    # -- the loop ----------------------------------------------------------------
    def run(self) -> None:
        """Forward until stopped: read every ready TUN, release every due packet."""
        _set_timer_slack_ns(1)
        ep = self._ep
        epfd = ep.fileno()
        heap = self._heap
        sel = select.select
        mono = time.monotonic
        fd_node = self._fd_node
        handlers = self._handlers
        drain = self._drain
        release = self._release
        while not self._stop:
            if heap:
                wait = heap[0][0] - mono() - EARLY_S
                if wait > 0:
                    sel([epfd], [], [], wait - PRE_WAKE_S if wait > 2 * PRE_WAKE_S else wait)
                events = ep.poll(0)
            else:
                events = ep.poll(IDLE_POLL_S)
            for fd, ev in events:
                node = fd_node.get(fd)
                if node is not None:
                    drain(node, fd)
                else:
                    handler = handlers.get(fd)
                    if handler is not None:
                        handler(ev)
            if heap:
                release()

    def _drain(self, i: int, fd: int) -> None:
        """Read up to BATCH packets from node i's TUN and schedule them."""
        read = os.read
        addr = self.addr_to_node
        row = self.shapers[i]
        up = self.up
        fds = self.fds
        heap = self._heap
        push = heapq.heappush
        seq = self._seq
        mono = time.monotonic
        src_up = up[i]
        read_latency = self.read_latency_s
        tunnel_ports = self.tunnel_ports
        tunnel_extra = self.tunnel_latency_s
        spike_row = self.spike[i]
        unknown = 0
        for _ in range(BATCH):
            try:
                pkt = read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                self._tun_failed(i, fd, exc)
                break
            version = pkt[0] >> 4 if pkt else 0
            if version == 4:
                j = addr.get(pkt[16:20])
            elif version == 6:
                j = addr.get(pkt[24:40])
            else:
                j = None
            if j is None or j == i:
                unknown += 1
                continue
            shaper = row[j]
            if not (src_up and up[j]):
                shaper.drop_down += 1
                continue
            arrival = mono() - read_latency
            if tunnel_ports and version == 4 and pkt[9] == 17:
                ihl = (pkt[0] & 0x0F) * 4
                if pkt[ihl + 2 : ihl + 4] in tunnel_ports:
                    arrival -= tunnel_extra
            when = shaper.schedule(arrival, len(pkt))
            if when is not None:
                if spike_row[j] and self._spike_rng.random() * spike_row[j] < 1.0:
                    when += self._spike_rng.uniform(*SPIKE_MS) / 1000.0
                    self.spiked[i][j] += 1
                if len(heap) >= MAX_QUEUED:
                    shaper.drop_queue += 1
                    continue
                push(heap, (when, next(seq), fds[j], pkt, shaper, j))
        if unknown:
            self.unknown[i] += unknown

    def _release(self) -> None:
        """Write every packet whose release time has come to its destination TUN."""
        heap = self._heap
        pop = heapq.heappop
        write = os.write
        up = self.up
        now = time.monotonic()
        horizon = now + EARLY_S
        lag_sum = 0.0
        lag_max = self.lag_max
        count = 0
        late = 0
        while heap and heap[0][0] <= horizon:
            when, _, fd, pkt, shaper, j = pop(heap)
            if up[j]:
                try:
                    write(fd, pkt)
                except OSError:
                    shaper.drop_error += 1
                else:
                    shaper.sent_packets += 1
                    shaper.sent_bytes += len(pkt)
            else:
                shaper.drop_down += 1
            lag = now - when
            lag_sum += lag
            count += 1
            if lag > lag_max:
                lag_max = lag
            if lag > 0.001:
                late += 1
        self.lag_sum += lag_sum
        self.lag_count += count
        self.lag_max = lag_max
        self.late_1ms += late

    def _tun_failed(self, i: int, fd: int, exc: OSError) -> None:
        print(f"emulator: node {self.names[i]}: TUN read failed: {exc}", file=sys.stderr)
        with contextlib.suppress(OSError):
            self._ep.unregister(fd)
        self._fd_node.pop(fd, None)

    # -- control socket ----------------------------------------------------------
    def _accept(self, events: int) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                print(f"emulator: accept failed: {exc}", file=sys.stderr)
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            fd = sock.fileno()
            self._conns[fd] = conn
            self._ep.register(fd, select.EPOLLIN)
            self._handlers[fd] = functools.partial(self._serve, conn)

    def _drop_conn(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0:
            with contextlib.suppress(OSError):
                self._ep.unregister(fd)
            self._handlers.pop(fd, None)
            self._conns.pop(fd, None)
        conn.sock.close()

    def _serve(self, conn: _Conn, events: int) -> None:
        if events & select.EPOLLOUT:
            self._flush(conn)
        if not events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop_conn(conn)
            return
        if not data:
            self._drop_conn(conn)
            return
        conn.inbuf += data
        while True:
            end = conn.inbuf.find(b"\n")
            if end < 0:
                break
            line = bytes(conn.inbuf[:end])
            del conn.inbuf[: end + 1]
            if line.strip():
                conn.outbuf += msgspec.json.encode(self.handle_request(line)) + b"\n"
        if len(conn.inbuf) > MAX_REQUEST_BYTES:
            conn.outbuf += b'{"ok":false,"error":"request line too long"}\n'
            conn.inbuf.clear()
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop_conn(conn)
            return
        mask = select.EPOLLIN | (select.EPOLLOUT if conn.outbuf else 0)
        with contextlib.suppress(OSError):
            self._ep.modify(fd, mask)

    def handle_request(self, line: bytes) -> dict[str, Any]:
        """One control request to one reply; never raises for bad input."""
        try:
            req = _request_decoder.decode(line)
        except msgspec.DecodeError as exc:
            return {"ok": False, "error": f"bad request: {exc}"}
        try:
            return self._apply(req)
        except (ValueError, KeyError, IndexError) as exc:
            return {"ok": False, "error": str(exc)}

    def _node(self, ref: NodeRef) -> int:
        if isinstance(ref, str):
            if ref not in self.names:
                raise ValueError(f"unknown node {ref!r}")
            return self.names.index(ref)
        if not 0 <= ref < len(self.names):
            raise ValueError(f"node index {ref} out of range 0..{len(self.names) - 1}")
        return ref

    def _apply(self, req: Request) -> dict[str, Any]:
        if isinstance(req, PingRequest):
            return {"ok": True, "lab": self.spec.lab, "nodes": len(self.names)}
        if isinstance(req, StatsRequest):
            return {"ok": True, **self.stats()}
        if isinstance(req, ParamsRequest):
            return {"ok": True, **self.params()}
        if isinstance(req, TunnelRequest):
            check_tunnel_latency(req.latency_us)
            self.tunnel_latency_s = req.latency_us / 1e6
            return {"ok": True, "tunnel_latency_us": req.latency_us}
        if isinstance(req, NodeRequest):
            i = self._node(req.node)
            self.up[i] = req.up
            return {"ok": True, "node": i, "up": req.up}
        changes: dict[str, float] = {}
        for key in ("delay_ms", "jitter_ms", "loss"):
            value = getattr(req, key)
            if value is not msgspec.UNSET:
                changes[key] = value
        if req.rate_mbit is not msgspec.UNSET:
            changes["rate_mbit"] = math.inf if req.rate_mbit is None else req.rate_mbit
        spike = None if req.spike is msgspec.UNSET else check_spike(req.spike)
        if not req.pairs:
            raise ValueError("set: 'pairs' is empty")
        pairs = []
        for a, b in req.pairs:
            i, j = self._node(a), self._node(b)
            if i == j:
                raise ValueError(f"set: pair [{a}, {b}] joins a node to itself")
            pairs.append((i, j))
        # Validate every pair's new parameters before changing any: all or nothing.
        new = [(i, j, replace(self.shapers[i][j].params, **changes)) for i, j in pairs]
        for i, j, params in new:
            self.shapers[i][j].set_params(params)
            if spike is not None:
                self.spike[i][j] = spike
        return {"ok": True, "pairs": len(new)}

    # -- reports -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of every pair that has seen traffic, per-node state, timer lag."""
        n = len(self.names)
        pairs = []
        totals: dict[str, int] = {}
        for i in range(n):
            for j in range(n):
                counters = self.shapers[i][j].counters()
                for key, value in counters.items():
                    totals[key] = totals.get(key, 0) + value
                counters["spiked"] = self.spiked[i][j]
                totals["spiked"] = totals.get("spiked", 0) + self.spiked[i][j]
                if any(counters.values()):
                    pairs.append({"src": i, "dst": j, **counters})
        times = os.times()
        return {
            "lab": self.spec.lab,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "cpu_s": round(times.user + times.system, 3),
            "nodes": [
                {"index": i, "name": self.names[i], "up": self.up[i], "unknown": self.unknown[i]}
                for i in range(n)
            ],
            "pairs": pairs,
            "totals": {**totals, "unknown": sum(self.unknown)},
            "queued": len(self._heap),
            "lag_us": {
                "mean": round(self.lag_sum / self.lag_count * 1e6, 1) if self.lag_count else 0.0,
                "max": round(self.lag_max * 1e6, 1),
                "over_1ms": self.late_1ms,
                "count": self.lag_count,
            },
        }

    def params(self) -> dict[str, Any]:
        """The current matrices, in the spec's format (null: unlimited rate)."""
        n = len(self.names)
        p = [[self.shapers[i][j].params for j in range(n)] for i in range(n)]
        return {
            "names": list(self.names),
            "up": list(self.up),
            "delay_ms": [[x.delay_ms for x in row] for row in p],
            "jitter_ms": [[x.jitter_ms for x in row] for row in p],
            "loss": [[x.loss for x in row] for row in p],
            "rate_mbit": [
                [None if math.isinf(x.rate_mbit) else x.rate_mbit for x in row] for row in p
            ],
            "spike": [list(row) for row in self.spike],
            "tunnel_latency_us": round(self.tunnel_latency_s * 1e6, 1),
        }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m meshopt.lab.emulator``: 0 ok, 2 bad spec, 1 failure."""
    parser = argparse.ArgumentParser(
        prog="python -m meshopt.lab.emulator", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--spec", required=True, help="the lab's emulator spec (JSON)")
    parser.add_argument(
        "--check", action="store_true", help="validate the spec and exit (creates nothing)"
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="exit (SIGTERM) when this process, our parent, dies: no orphaned emulators",
    )
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _die_with_parent()
        if os.getppid() != args.parent_pid:  # the parent died before prctl took effect
            print("emulator: parent exited before start-up", file=sys.stderr)
            return 1
    try:
        spec = load_spec(args.spec)
        tag = os.environ.get("MESHOPT_LAB")
        if tag is not None and tag != spec.lab:
            raise SpecError(f"MESHOPT_LAB={tag} but the spec is for lab {spec.lab}")
    except SpecError as exc:
        print(f"emulator: bad spec: {exc}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    if spec.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, spec.nice)
        except OSError as exc:
            print(f"emulator: cannot set nice {spec.nice}: {exc}", file=sys.stderr)
    emu = Emulator(spec)
    try:
        emu.install_signal_handlers()
        try:
            emu.setup()
        except (OSError, EmulatorError, ValueError) as exc:
            print(f"emulator: set-up failed: {exc}", file=sys.stderr)
            return 1
        if emu.stopping:
            return 0  # SIGTERM during set-up: never announce readiness
        print(READY, flush=True)
        emu.run()
    finally:
        emu.close()
    return 0


# --- launcher and client ----------------------------------------------------------


def start_emulator(
    spec_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = 30.0,
    log_path: str | os.PathLike[str] | None = None,
    die_with_parent: bool = True,
    detach: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the emulator for ``spec_path`` and return once it printed READY.

    The process runs with ``MESHOPT_LAB=<lab id>`` in its environment (``env`` adds to
    the current one). Its stderr goes to ``log_path`` (default: the spec path with
    ``.log``), so a chatty emulator can never block on a full pipe. With
    ``die_with_parent`` the kernel sends it SIGTERM if the caller dies, so a crashed
    test run cannot leave it (and its TUNs) behind; Linux ties this to the *thread*
    that started it, so call this from a thread that lives as long as the lab (or pass
    False). ``detach`` puts it in a process group of its own (not a session: see
    :func:`meshopt.lab.procs.spawn`), off the caller's terminal, for a lab that
    outlives the command that built it. On failure or timeout the process is ended and
    EmulatorError carries its stderr; a bad spec raises SpecError before anything starts.
    """
    spec_path = Path(spec_path)
    spec = load_spec(spec_path, check_system=False)
    log = Path(log_path) if log_path is not None else spec_path.with_suffix(".log")
    full_env = {**os.environ, **(env or {}), "MESHOPT_LAB": spec.lab}
    argv = [sys.executable, "-m", "meshopt.lab.emulator", "--spec", str(spec_path)]
    if die_with_parent:
        argv += ["--parent-pid", str(os.getpid())]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            env=full_env,
            process_group=0 if detach else None,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = b""
    ok = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
        if READY.encode() + b"\n" in seen:
            ok = True
            break
    if ok:
        return proc
    reason = "exited" if proc.poll() is not None else f"not ready after {timeout:g} s"
    stop_emulator(proc)
    err = log.read_text(errors="replace").strip() if log.exists() else ""
    raise EmulatorError(
        f"emulator for lab {spec.lab} {reason} (status {proc.returncode}): {err or 'no stderr'}"
    )


def stop_emulator(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM the emulator (by its PID), wait, SIGKILL if it hangs; its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


class EmulatorClient:
    """Blocking client of the control socket (one connection, one request at a time)."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = 5.0) -> None:
        self.path = str(path)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise EmulatorError(f"cannot reach the emulator at {self.path}: {exc}") from None
            self._sock = sock
        return self._sock

    def request(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request, return its reply; EmulatorError if it says ok: false."""
        return self.request_raw(json.dumps(message).encode())

    def request_raw(self, line: bytes) -> dict[str, Any]:
        """Send one raw line (no newline) and decode the reply line."""
        sock = self._connect()
        try:
            sock.sendall(line + b"\n")
            while b"\n" not in self._buf:
                chunk = sock.recv(65536)
                if not chunk:
                    raise EmulatorError("the emulator closed the control connection")
                self._buf += chunk
        except OSError as exc:
            self.close()
            raise EmulatorError(f"control request failed: {exc}") from None
        reply_line, _, self._buf = self._buf.partition(b"\n")
        reply: dict[str, Any] = json.loads(reply_line)
        if not reply.get("ok"):
            raise EmulatorError(str(reply.get("error", "request refused")))
        return reply

    def ping(self) -> dict[str, Any]:
        return self.request({"op": "ping"})

    def set(
        self,
        pairs: Sequence[tuple[NodeRef, NodeRef]],
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        loss: float | None = None,
        rate_mbit: float | msgspec.UnsetType | None = msgspec.UNSET,
        spike: int | None = None,
    ) -> dict[str, Any]:
        """Change the given directed pairs; omitted values stay (rate None: unlimited;
        spike 0: off)."""
        message: dict[str, Any] = {"op": "set", "pairs": [list(p) for p in pairs]}
        if spike is not None:
            message["spike"] = spike
        for key, value in (("delay_ms", delay_ms), ("jitter_ms", jitter_ms), ("loss", loss)):
            if value is not None:
                message[key] = value
        if rate_mbit is not msgspec.UNSET:
            message["rate_mbit"] = None if rate_mbit is None or math.isinf(rate_mbit) else rate_mbit
        return self.request(message)

    def node_state(self, node: NodeRef, up: bool) -> dict[str, Any]:
        return self.request({"op": "node", "node": node, "up": up})

    def stats(self) -> dict[str, Any]:
        return self.request({"op": "stats"})

    def params(self) -> dict[str, Any]:
        return self.request({"op": "params"})

    def tunnel_latency(self, latency_us: float) -> dict[str, Any]:
        """Take ``latency_us`` off every tunnel packet's delay from now on."""
        return self.request({"op": "tunnel", "latency_us": latency_us})

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._buf = b""

    def __enter__(self) -> EmulatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
