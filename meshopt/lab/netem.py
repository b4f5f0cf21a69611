"""The lab's kernel underlay: a switch namespace, a veth per node, htb + netem per pair.

Where the kernel has netem, the lab can emulate "the Internet" with qdiscs instead of
the user-space emulator (:mod:`meshopt.lab.emulator`): no process in the data path,
kernel timers, line rate. The development machines have no netem, so this module is
built to be checked without it: every command is produced by pure functions (unit
tested by parsing them), and ``leaf="pfifo"`` builds everything but the netem leaves,
so the switch, the veths, the htb classes and the filters are tested with real packets
here; only the netem leaf itself is not.

Topology: a *switch* namespace (named by the caller) holds a bridge ``br0`` and one
veth ``p<i>`` per node; the other end of that veth is the node's underlay interface
(named by the caller, e.g. the plan's ``underlay_if``) in the node's namespace, with
the node's underlay address. A bridge rather than routing: the nodes keep one shared
subnet (``172.31.0.0/16``), as with the emulator. There is no ARP, as there is none on
the emulator's L3 TUNs: each node end gets a fixed MAC (:func:`node_mac`), every node
a permanent neighbour entry for every other, and the bridge a static FDB entry per
port. So no frame is flooded through other pairs' classes, and a node that comes
back up is reachable at once (a failed ARP entry retries only after ~1 s).

Shaping happens once per directed pair (i, j), on the switch port towards j
(``p<j>`` egress), which sees every packet any node sends to j:

- an ``htb`` root (``1:``) with a size table ``stab overhead -14``, so rates count
  IP packets without the Ethernet header, as the emulator's TUNs do;
- one htb class ``1:<i+2>`` (hex) per source node i: rate and ceil = rate(i->j), or
  :data:`CEILING_MBIT` when unlimited;
- a ``u32`` filter matching i's source address (IPv4, and IPv6 when the node has
  one) into that class; anything unmatched (a packet from a foreign address) goes to
  htb's unshaped direct queue;
- a ``netem`` leaf ``<i+2>:`` on the class: delay(i->j), jitter(i->j) as the standard
  deviation of a normal distribution (``delay 20.000ms 2.000ms distribution normal``,
  the emulator's and the simulator's meaning), loss(i->j) per packet.

Jitter without reordering: netem gives each packet its own random delay and sorts its
queue by send time, so jitter reorders packets, unlike one physical path (and unlike
the emulator, which clamps a release to the previous one). netem has one exception:
with its own ``rate`` set, each packet's send time is measured from the last queued
packet's, i.e. ``max(last, now + delay) + size / rate``: exactly the emulator's clamp.
So every netem leaf gets ``rate 100000mbit`` (:data:`CEILING_MBIT`: ~0.1 µs a packet,
no real limit; the pair's rate stays htb's job). It is always given, not only with
jitter, because ``tc qdisc change`` keeps a netem rate it is not told about.

Per-packet fidelity: the node side of each veth has ``gso_max_segs 1``, so TCP and
UDP GSO super-packets (wireguard-go sends UDP GSO) are cut into wire-size packets
before the switch. netem drops whole skbs, so a 64 KB super-packet would lose ~44
packets at once; htb's rate was also 3 % off with them. The price is per-packet
CPU: one TCP flow through the switch moved ~400 Mbit/s on the 2-core development VM
(~13 Gbit/s with GSO; htb itself costs ~5 %). ``split_gso=False`` in the spec keeps
GSO, for throughput tests that need no loss.

Queues: netem's ``limit`` (packets) holds both the packets in flight (the delay) and
those waiting for htb's rate; it is sized like the emulator's rate queue plus the
pair's bandwidth-delay product (see :func:`queue_limit`), assuming 1500-byte packets.

Known noise: htb logs once per netem leaf ``htb: netem qdisc N: is non-work-conserving?``
on first use (netem holds packets that are not due yet). It is harmless.

Scale: n(n-1) classes, filters and leaves, all in one ``tc -batch`` in the switch
namespace; the u32 filters of a port are a linear list of n-1 entries. 16 nodes (240
pairs, pfifo leaves) build in ~0.1 s here, and a change of all 240 pairs is one
``tc`` run of ~10 ms.

Run-time changes (``lab set``) become ``tc class change`` / ``tc qdisc change`` lines
for the changed pairs only, in one ``tc -batch``; a node down is its switch port set
down (packets to and from it are dropped, its queue with them). The current matrices
live in a JSON state file (:class:`NetemSpec`, with a ``.lock`` file beside it), so
``lab set`` from another process sees what the previous one set, as the emulator's
``params`` op does.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import math
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from meshopt.lab.netns import check_netns_name, create_netns, delete_netns, unique_name
from meshopt.lab.shaper import DEFAULT_QUEUE_MIN_BYTES, DEFAULT_QUEUE_MS, PairParams
from meshopt.lab.state import LabError
from meshopt.lab.underlay import UnderlayNode, check_matrices, check_nodes, pair_params

if TYPE_CHECKING:
    from meshopt.lab.emulator import EmulatorClient

NodeRef = int | str
Leaf = Literal["netem", "pfifo"]
LEAVES: tuple[Leaf, ...] = ("netem", "pfifo")

BRIDGE = "br0"
CEILING_MBIT = 100_000.0  # "unlimited": htb's class rate, and netem's ordering rate
ETH_HLEN = 14  # taken off by the size table: rates count IP packets
PACKET_BYTES = 1500  # queue limits are in packets; sized for full-size ones
UNLIMITED_SIZING_MBIT = 10_000.0  # an unlimited pair's in-flight sizing rate
UNLIMITED_QUEUE_PACKETS = 1000  # plus in-flight, for an unlimited pair (a txqueuelen)
MAX_LIMIT = 100_000  # packets per pair, a memory bound (~200 MB of full-size skbs)
MAX_NODES = 1000  # a Linux bridge takes at most 1024 ports
HTB_QUANTUM_MIN, HTB_QUANTUM_MAX = 1514, 200_000  # htb's sane range (it warns outside)
TOOL_TIMEOUT_S = 300.0


class NetemError(LabError):
    """The netem underlay cannot be built or changed; one line for the user."""


# --- availability -------------------------------------------------------------------

_probe_cache: list[str | None] = []


def _tc_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _probe() -> str | None:
    for tool in ("tc", "ip"):
        if shutil.which(tool) is None:
            return f"no {tool} command (install iproute2)"
    if os.geteuid() != 0:
        return "probing netem needs root (it adds a qdisc in a throw-away namespace)"
    ns = unique_name("monetemprobe")
    try:
        create_netns(ns)
    except Exception as exc:
        return f"cannot create a namespace to probe netem in: {exc}"
    try:

        def tc(*args: str) -> subprocess.CompletedProcess[str]:
            argv = ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", *args]
            return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)

        full = tc("delay", "1ms", "1ms", "distribution", "normal")
        if full.returncode == 0:
            return None
        plain = tc("delay", "1ms")
        if plain.returncode != 0:
            return f"the kernel has no netem qdisc (tc: {_tc_error(plain)})"
        return (
            "netem loads, but tc has no 'normal' delay distribution table (iproute2's "
            f"tc/normal.dist), so jitter cannot be emulated (tc: {_tc_error(full)})"
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run tc to probe netem: {exc}"
    finally:
        with contextlib.suppress(Exception):
            delete_netns(ns, missing_ok=True)


def netem_unavailable_reason(*, refresh: bool = False) -> str | None:
    """Why the netem underlay cannot be used here, or None if it can.

    Probes once per process (``refresh`` probes again): adds a netem qdisc with normal
    jitter to ``lo`` in a namespace created for it and deleted at once. Only a real
    ``tc qdisc add`` tells: the module may be missing, or built but not loadable.
    """
    if refresh or not _probe_cache:
        _probe_cache[:] = [_probe()]
    return _probe_cache[0]


def netem_available(*, refresh: bool = False) -> bool:
    """True if this kernel and tc can build the netem underlay (probed once, cached)."""
    return netem_unavailable_reason(refresh=refresh) is None


def choose_underlay_mode(
    requested: str, *, probe: Callable[[], str | None] = netem_unavailable_reason
) -> str:
    """``auto`` -> ``netem`` where it works, else ``emulator``; a forced mode is checked.

    ``probe`` answers why netem cannot be used (None: it can); tests pass their own.
    """
    if requested not in ("auto", "emulator", "netem"):
        raise NetemError(f"bad underlay {requested!r}: use auto, emulator or netem")
    if requested != "emulator":
        reason = probe()
        if reason is None:
            return "netem"
        if requested == "netem":
            raise NetemError(f"--underlay netem: {reason}; use --underlay emulator")
    if not os.path.exists("/dev/net/tun"):
        raise NetemError("the emulated underlay needs /dev/net/tun")
    return "emulator"


# --- the spec (also the run-time state) --------------------------------------------------


NetemNode = UnderlayNode  # netem's name for it: the node end of its veth is ``ifname``


class NetemSpec(msgspec.Struct, forbid_unknown_fields=True):
    """What the underlay is: switch, nodes and the current per-pair matrices.

    Matrices are n x n, row = sender, column = receiver, diagonal ignored; ``None``
    rate is unlimited; ``jitter_ms``, ``loss`` and ``rate_mbit`` may be left out.
    ``up`` (None: all up) is which switch ports are up. The same structure is saved
    as the state file and updated by every change.
    """

    switch_netns: str
    nodes: list[NetemNode]
    delay_ms: list[list[float]]
    jitter_ms: list[list[float]] | None = None
    loss: list[list[float]] | None = None
    rate_mbit: list[list[float | None]] | None = None
    leaf: str = "netem"  # Leaf; "pfifo" tests everything but netem itself
    mtu: int = 1500
    split_gso: bool = True  # per-packet loss and rate; False: GSO throughput (see doc)
    up: list[bool] | None = None

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def names(self) -> list[str]:
        return [node.name for node in self.nodes]

    def is_up(self, i: int) -> bool:
        return True if self.up is None else self.up[i]

    def pair_params(self, i: int, j: int) -> PairParams:
        return pair_params(self, i, j)

    def set_pair(self, i: int, j: int, p: PairParams) -> None:
        """Store ``p`` for (i, j), filling in matrices that were left out."""
        n = self.n
        if self.jitter_ms is None:
            self.jitter_ms = [[0.0] * n for _ in range(n)]
        if self.loss is None:
            self.loss = [[0.0] * n for _ in range(n)]
        if self.rate_mbit is None:
            self.rate_mbit = [[None] * n for _ in range(n)]
        self.delay_ms[i][j] = p.delay_ms
        self.jitter_ms[i][j] = p.jitter_ms
        self.loss[i][j] = p.loss
        self.rate_mbit[i][j] = None if math.isinf(p.rate_mbit) else p.rate_mbit


def validate_netem_spec(spec: NetemSpec) -> None:
    """Raise NetemError for anything wrong with ``spec``, before anything is created."""
    n = spec.n
    if not 1 <= n <= MAX_NODES:
        raise NetemError(f"netem underlay: 1..{MAX_NODES} nodes, not {n}")
    if spec.leaf not in LEAVES:
        raise NetemError(f"netem underlay: leaf {spec.leaf!r} is not one of {LEAVES}")
    if not 68 <= spec.mtu <= 65535:
        raise NetemError(f"netem underlay: mtu {spec.mtu} out of range 68..65535")
    if spec.up is not None and len(spec.up) != n:
        raise NetemError(f"netem underlay: 'up' has {len(spec.up)} entries for {n} nodes")
    try:
        check_netns_name(spec.switch_netns)
    except ValueError as exc:
        raise NetemError(f"netem underlay: switch: {exc}") from None
    try:
        check_nodes(spec.nodes, mtu=spec.mtu, ipv4_address=True, taken_netns={spec.switch_netns})
        check_matrices(spec, n)
    except ValueError as exc:
        raise NetemError(f"netem underlay: {exc}") from None


# --- units ------------------------------------------------------------------------------


def _num(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}".rstrip("0").rstrip(".")
    return text or "0"


def format_ms(ms: float) -> str:
    """tc time with microsecond resolution: ``20.000ms``."""
    return f"{ms:.3f}ms"


def format_loss(fraction: float) -> str:
    """tc percentage: 0.05 -> ``5%``, 0.025 -> ``2.5%``."""
    return f"{_num(fraction * 100.0, 6)}%"


def format_rate(mbit: float) -> str:
    """tc rate (SI: 1mbit = 10^6 bit/s): ``20mbit``, ``1.5mbit``, ``500000bit``."""
    if mbit >= 1.0:
        return f"{_num(mbit, 6)}mbit"
    return f"{max(1, round(mbit * 1e6))}bit"


def queue_limit(p: PairParams) -> int:
    """netem/pfifo ``limit`` in packets: what is in flight plus the rate queue.

    In flight: the pair's rate times its delay (+4 sigma of jitter). Queue: like the
    emulator's rate queue, max(64 KiB, 50 ms of the rate); an unlimited pair never
    queues for its rate, so it gets a txqueuelen's worth and in-flight at 10 Gbit/s.
    """
    hold_s = (p.delay_ms + 4.0 * p.jitter_ms) / 1000.0
    if math.isinf(p.rate_mbit):
        in_flight = UNLIMITED_SIZING_MBIT * 1e6 / 8.0 * hold_s / PACKET_BYTES
        packets = in_flight + UNLIMITED_QUEUE_PACKETS
    else:
        rate_bytes = p.rate_mbit * 1e6 / 8.0
        queue = max(float(DEFAULT_QUEUE_MIN_BYTES), rate_bytes * DEFAULT_QUEUE_MS / 1000.0)
        packets = (rate_bytes * hold_s + queue) / PACKET_BYTES
    return min(MAX_LIMIT, max(2, math.ceil(packets)))


# --- command generation (pure) -----------------------------------------------------------


def port_name(i: int) -> str:
    """Node i's veth end in the switch namespace (private to it: short names do)."""
    return f"p{i}"


def node_mac(i: int) -> str:
    """Node i's fixed MAC: locally administered unicast, ``02:6d:6f`` ("mo") + index."""
    return f"02:6d:6f:{(i >> 16) & 0xFF:02x}:{(i >> 8) & 0xFF:02x}:{i & 0xFF:02x}"


def class_minor(i: int) -> int:
    """htb class minor (and netem handle major) of source node i on every port."""
    return i + 2


@dataclass(frozen=True)
class Batch:
    """Lines for one ``ip``, ``bridge`` or ``tc`` ``-batch`` run in one namespace."""

    tool: Literal["ip", "bridge", "tc"]
    netns: str
    lines: tuple[str, ...]
    force: bool = False  # keep going past failing lines (removal of what may not exist)

    def argv(self) -> list[str]:
        return [self.tool, *(["-force"] if self.force else []), "-n", self.netns, "-batch", "-"]


def htb_class_options(p: PairParams) -> str:
    rate_mbit = CEILING_MBIT if math.isinf(p.rate_mbit) else p.rate_mbit
    quantum = min(HTB_QUANTUM_MAX, max(HTB_QUANTUM_MIN, int(rate_mbit * 1e6 / 8.0 / 10.0)))
    rate = format_rate(rate_mbit)
    return f"htb rate {rate} ceil {rate} quantum {quantum}"


def leaf_options(p: PairParams, leaf: Leaf | str = "netem") -> str:
    """The leaf qdisc of a pair: ``netem limit L delay D [J distribution normal] loss P
    rate 100000mbit`` (see the module doc for the rate), or ``pfifo limit L``."""
    limit = queue_limit(p)
    if leaf == "pfifo":
        return f"pfifo limit {limit}"
    if leaf != "netem":
        raise NetemError(f"netem underlay: leaf {leaf!r} is not one of {LEAVES}")
    delay = f"delay {format_ms(p.delay_ms)}"
    if p.jitter_ms > 0.0:
        delay += f" {format_ms(p.jitter_ms)} distribution normal"
    return (
        f"netem limit {limit} {delay} loss {format_loss(p.loss)} rate {format_rate(CEILING_MBIT)}"
    )


def pair_class_line(verb: str, i: int, j: int, p: PairParams) -> str:
    """``class add|change`` of source i on port j."""
    return f"class {verb} dev {port_name(j)} parent 1: classid 1:{class_minor(i):x} " + (
        htb_class_options(p)
    )


def pair_leaf_line(verb: str, i: int, j: int, p: PairParams, leaf: Leaf | str) -> str:
    """``qdisc add|change`` of the leaf under source i's class on port j."""
    m = class_minor(i)
    return f"qdisc {verb} dev {port_name(j)} parent 1:{m:x} handle {m:x}: " + leaf_options(p, leaf)


def pair_filter_lines(i: int, j: int, node: NetemNode) -> list[str]:
    """u32 filters on port j sending node i's packets (by source address) to its class."""
    dev, flow = port_name(j), f"1:{class_minor(i):x}"
    lines = [
        f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
        f"match ip src {ipaddress.ip_interface(node.address).ip}/32 flowid {flow}"
    ]
    if node.address6:
        lines.append(
            f"filter add dev {dev} parent 1: protocol ipv6 prio 2 u32 "
            f"match ip6 src {ipaddress.ip_interface(node.address6).ip}/128 flowid {flow}"
        )
    return lines


def netem_build_commands(spec: NetemSpec, *, ipv6_sysctl: bool = True) -> list[Batch]:
    """Everything to build ``spec``, in order: switch links and FDB, switch qdiscs, the
    node ends (addresses, permanent neighbours).

    The namespaces must exist. ``ipv6_sysctl`` (the kernel has IPv6) switches off IPv6
    link-local autoconfiguration on the bridge, the ports and IPv4-only node ends, so
    no router solicitations cross the switch. Node ends come up last, when shaping is
    already in place.
    """
    validate_netem_spec(spec)
    sw: list[str] = [f"link add name {BRIDGE} type bridge stp_state 0 forward_delay 0"]
    if ipv6_sysctl:
        sw.append(f"link set dev {BRIDGE} addrgenmode none")
    sw.append(f"link set dev {BRIDGE} up")
    for i, node in enumerate(spec.nodes):
        p = port_name(i)
        sw.append(
            f"link add name {p} mtu {spec.mtu} type veth peer name {node.ifname} "
            f"address {node_mac(i)} netns {node.netns}"
        )
        if ipv6_sysctl:
            sw.append(f"link set dev {p} addrgenmode none")
        sw.append(f"link set dev {p} master {BRIDGE}")
        if spec.is_up(i):
            sw.append(f"link set dev {p} up")
    tc: list[str] = []
    for j in range(spec.n):
        tc.append(f"qdisc add dev {port_name(j)} root handle 1: stab overhead -{ETH_HLEN} htb")
        for i, src in enumerate(spec.nodes):
            if i == j:
                continue
            p_ij = spec.pair_params(i, j)
            tc.append(pair_class_line("add", i, j, p_ij))
            tc.append(pair_leaf_line("add", i, j, p_ij, spec.leaf))
            tc.extend(pair_filter_lines(i, j, src))
    fdb = tuple(f"fdb add {node_mac(i)} dev {port_name(i)} master static" for i in range(spec.n))
    batches = [
        Batch("ip", spec.switch_netns, tuple(sw)),
        Batch("bridge", spec.switch_netns, fdb),
        Batch("tc", spec.switch_netns, tuple(tc)),
    ]
    for k, node in enumerate(spec.nodes):
        lines = ["link set dev lo up"]
        if ipv6_sysctl and not node.address6:
            lines.append(f"link set dev {node.ifname} addrgenmode none")
        lines.append(f"addr add {node.address} dev {node.ifname}")
        if node.address6:
            lines.append(f"addr add {node.address6} dev {node.ifname} nodad")
        for i, other in enumerate(spec.nodes):
            if i != k:
                for addr in (other.address, other.address6):
                    if addr:
                        ip = ipaddress.ip_interface(addr).ip
                        lines.append(
                            f"neigh replace {ip} lladdr {node_mac(i)} dev {node.ifname} "
                            "nud permanent"
                        )
        if spec.split_gso:  # else super-packets would be shaped and dropped whole
            lines.append(f"link set dev {node.ifname} gso_max_segs 1")
        lines.append(f"link set dev {node.ifname} up")
        batches.append(Batch("ip", node.netns, tuple(lines)))
    return batches


def netem_change_commands(
    i: int,
    j: int,
    new: PairParams,
    *,
    old: PairParams | None = None,
    leaf: Leaf | str = "netem",
) -> list[str]:
    """``tc -batch`` lines (switch namespace) giving the directed pair i->j ``new``.

    With ``old``, only what differs is changed (a rate change touches the htb class, a
    delay/jitter/loss change the leaf; the leaf's limit follows both). Each line
    carries every option of its object: ``tc qdisc change`` of netem resets what it is
    not given (delay, jitter, loss) to zero.
    """
    if i == j:
        raise NetemError(f"netem underlay: pair [{i}, {j}] joins a node to itself")
    lines = []
    cls = pair_class_line("change", i, j, new)
    if old is None or cls != pair_class_line("change", i, j, old):
        lines.append(cls)
    qdisc = pair_leaf_line("change", i, j, new, leaf)
    if old is None or qdisc != pair_leaf_line("change", i, j, old, leaf):
        lines.append(qdisc)
    return lines


def netem_node_commands(i: int, up: bool) -> list[str]:
    """``ip -batch`` lines (switch namespace): node i's switch port down or up.

    Down: the bridge stops forwarding to the port, the node's end loses its carrier
    (its packets are dropped), and the port's queued packets are dropped. The qdiscs
    stay configured and apply again when the port comes up.
    """
    return [f"link set dev {port_name(i)} {'up' if up else 'down'}"]


def netem_remove_commands(n: int) -> list[str]:
    """``ip -force -batch`` lines (switch namespace) deleting the ports and the bridge.

    Deleting a veth end deletes its peer in the node's namespace too. Deleting the
    switch namespace does all of this at once; this is for a failed build.
    """
    return [f"link del dev {port_name(i)}" for i in range(n)] + [f"link del dev {BRIDGE}"]


# --- the control interface shared with the emulator --------------------------------------


class UnderlayControl(Protocol):
    """What the lab needs from an underlay at run time: the emulator client's methods.

    ``set`` changes directed pairs (values left out stay; ``rate_mbit`` None or inf is
    unlimited, left out it stays), ``node_state`` takes a node down or up,
    ``params`` returns ``{"names", "up", "delay_ms", "jitter_ms", "loss", "rate_mbit"}``
    (matrices, None rate = unlimited) and ``stats`` per-pair counters.
    """

    def set(
        self,
        pairs: Sequence[tuple[NodeRef, NodeRef]],
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        loss: float | None = None,
        rate_mbit: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> dict[str, Any]: ...

    def node_state(self, node: NodeRef, up: bool) -> dict[str, Any]: ...

    def params(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


if TYPE_CHECKING:

    def _emulator_is_underlay_control(client: EmulatorClient) -> UnderlayControl:
        return client  # mypy checks that the emulator's client fits the protocol


# --- the executor -------------------------------------------------------------------------


def run_batch(batch: Batch) -> None:
    """Run one batch (one process); NetemError with tc's/ip's last error line."""
    if not batch.lines:
        return
    try:
        proc = subprocess.run(
            batch.argv(),
            input="\n".join(batch.lines) + "\n",
            capture_output=True,
            text=True,
            check=False,
            timeout=TOOL_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NetemError(f"{batch.tool} in {batch.netns}: {exc}") from None
    if proc.returncode != 0 and not batch.force:
        raise NetemError(f"{batch.tool} in {batch.netns}: {_tc_error(proc)}")


def _ipv6_sysctl() -> bool:
    return os.path.isdir("/proc/sys/net/ipv6")


class NetemUnderlay:
    """Builds a :class:`NetemSpec` and changes it at run time (an ``UnderlayControl``).

    With ``state_path``, the current spec is kept in that file (written by ``build``,
    updated under a lock by every change, re-read before each operation), so any
    process can :meth:`load` it and continue; without it the state is this object's.
    """

    def __init__(self, spec: NetemSpec, state_path: str | os.PathLike[str] | None = None) -> None:
        validate_netem_spec(spec)
        self.spec = spec
        self.state_path = Path(state_path) if state_path is not None else None

    @classmethod
    def load(cls, state_path: str | os.PathLike[str]) -> NetemUnderlay:
        """The underlay whose state ``build`` saved at ``state_path``."""
        return cls(_read_spec(Path(state_path)), state_path)

    # -- building --------------------------------------------------------------------
    def build(self) -> None:
        """Create bridge, veths, addresses and qdiscs; on failure remove them again."""
        batches = netem_build_commands(self.spec, ipv6_sysctl=_ipv6_sysctl())
        try:
            for batch in batches:
                run_batch(batch)
            if self.state_path is not None:
                _write_spec(self.spec, self.state_path)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Delete the ports (and so the node ends) and the bridge; missing ones are fine."""
        lines = netem_remove_commands(self.spec.n)
        run_batch(Batch("ip", self.spec.switch_netns, tuple(lines), force=True))

    # -- state -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, write: bool) -> Iterator[NetemSpec]:
        """The current spec, re-read from the state file under its lock; saved if written."""
        if self.state_path is None:
            yield self.spec
            return
        lock = self.state_path.with_name(self.state_path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.spec = _read_spec(self.state_path)
            yield self.spec
            if write:
                _write_spec(self.spec, self.state_path)
        finally:
            os.close(fd)

    def _index(self, spec: NetemSpec, ref: NodeRef) -> int:
        if isinstance(ref, str):
            if ref not in spec.names:
                raise NetemError(f"netem underlay: unknown node {ref!r}")
            return spec.names.index(ref)
        if not 0 <= ref < spec.n:
            raise NetemError(f"netem underlay: node index {ref} out of range 0..{spec.n - 1}")
        return ref

    # -- UnderlayControl ---------------------------------------------------------------
    def set(
        self,
        pairs: Sequence[tuple[NodeRef, NodeRef]],
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        loss: float | None = None,
        rate_mbit: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> dict[str, Any]:
        """Change directed pairs now (one ``tc -batch``); all are checked before any changes."""
        changes: dict[str, float] = {}
        for key, value in (("delay_ms", delay_ms), ("jitter_ms", jitter_ms), ("loss", loss)):
            if value is not None:
                changes[key] = float(value)
        if rate_mbit is not msgspec.UNSET:
            changes["rate_mbit"] = math.inf if rate_mbit is None else float(rate_mbit)
        if not pairs:
            raise NetemError("netem underlay: set: no pairs given")
        with self._locked(write=True) as spec:
            new: list[tuple[int, int, PairParams, PairParams]] = []
            for a, b in pairs:
                i, j = self._index(spec, a), self._index(spec, b)
                if i == j:
                    raise NetemError(f"netem underlay: set: pair [{a}, {b}] joins a node to itself")
                old = spec.pair_params(i, j)
                fields = {
                    "delay_ms": old.delay_ms,
                    "jitter_ms": old.jitter_ms,
                    "loss": old.loss,
                    "rate_mbit": old.rate_mbit,
                    **changes,
                }
                try:
                    new.append((i, j, old, PairParams(**fields)))
                except ValueError as exc:
                    raise NetemError(f"netem underlay: set: {exc}") from None
            lines: list[str] = []
            for i, j, old, p in new:
                lines += netem_change_commands(i, j, p, old=old, leaf=spec.leaf)
            run_batch(Batch("tc", spec.switch_netns, tuple(lines)))
            for i, j, _, p in new:
                spec.set_pair(i, j, p)
        return {"ok": True, "pairs": len(new)}

    set_pairs = set

    def node_state(self, node: NodeRef, up: bool) -> dict[str, Any]:
        """Node down (its switch port down: dropped both ways) or up again."""
        with self._locked(write=True) as spec:
            i = self._index(spec, node)
            run_batch(Batch("ip", spec.switch_netns, tuple(netem_node_commands(i, up))))
            if spec.up is None:
                spec.up = [True] * spec.n
            spec.up[i] = up
        return {"ok": True, "node": i, "up": up}

    def params(self) -> dict[str, Any]:
        """The current matrices, as the emulator's ``params`` op returns them."""
        with self._locked(write=False) as spec:
            n = spec.n
            p = [[spec.pair_params(i, j) for j in range(n)] for i in range(n)]
            return {
                "ok": True,
                "underlay": "netem",
                "leaf": spec.leaf,
                "names": spec.names,
                "up": [spec.is_up(i) for i in range(n)],
                "delay_ms": [[x.delay_ms for x in row] for row in p],
                "jitter_ms": [[x.jitter_ms for x in row] for row in p],
                "loss": [[x.loss for x in row] for row in p],
                "rate_mbit": [
                    [None if math.isinf(x.rate_mbit) else x.rate_mbit for x in row] for row in p
                ],
            }

    def stats(self) -> dict[str, Any]:
        """Per-pair leaf counters from ``tc -s``: packets and bytes sent, drops, backlog.

        netem counts its random losses and its full-queue drops together (``drops``);
        packets dropped at a down port are not counted anywhere.
        """
        with self._locked(write=False) as spec:
            names, up = spec.names, [spec.is_up(i) for i in range(spec.n)]
            ns = spec.switch_netns
        argv = ["tc", "-s", "-j", "-n", ns, "qdisc", "show"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NetemError(f"tc in {ns}: {exc}") from None
        if proc.returncode != 0:
            raise NetemError(f"tc in {ns}: {_tc_error(proc)}")
        pairs, totals = parse_leaf_stats(json.loads(proc.stdout or "[]"), len(names))
        return {
            "ok": True,
            "underlay": "netem",
            "nodes": [{"index": i, "name": names[i], "up": up[i]} for i in range(len(names))],
            "pairs": pairs,
            "totals": totals,
        }

    def close(self) -> None:
        """Nothing to close (every operation runs its own ``tc``/``ip``)."""


STAT_KEYS = ("packets", "bytes", "drops", "backlog", "qlen")


def parse_leaf_stats(
    qdiscs: list[dict[str, Any]], n: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Pairs with traffic and totals, from ``tc -s -j qdisc show`` of the switch."""
    pairs = []
    totals = dict.fromkeys(STAT_KEYS, 0)
    for q in qdiscs:
        dev, parent = str(q.get("dev", "")), str(q.get("parent", ""))
        if not (dev.startswith("p") and dev[1:].isdigit() and parent.startswith("1:")):
            continue
        j, i = int(dev[1:]), int(parent[2:], 16) - class_minor(0)
        if not (0 <= i < n and 0 <= j < n) or i == j:
            continue
        counters = {key: int(q.get(key, 0)) for key in STAT_KEYS}
        for key, value in counters.items():
            totals[key] += value
        if counters["packets"] or counters["drops"]:
            pairs.append({"src": i, "dst": j, **counters})
    pairs.sort(key=lambda p: (p["src"], p["dst"]))
    return pairs, totals


def _read_spec(path: Path) -> NetemSpec:
    """The saved spec, its types checked; values were validated when it was written
    (a full check costs ~50 ms at 250 nodes: too much for every ``set``)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=NetemSpec)
    except (OSError, msgspec.DecodeError) as exc:
        raise NetemError(f"netem underlay state {path}: {exc}") from None


def _write_spec(spec: NetemSpec, path: Path) -> None:
    """Atomically: a reader sees the old state or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(spec)))
    os.replace(tmp, path)
