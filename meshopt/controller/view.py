"""The controller's picture of the mesh, built from telemetry alone (pure, time injected).

Nodes are known by name; each reports the public keys of its interfaces, and its peers
by their keys, so a peer report is matched to a node through the other node's own
telemetry (this also works in the per-peer layout, where every tunnel end has its own
key). A node is down when its agent says so (the will message) or when its telemetry is
older than ``stale_after_s``; all its links are then down in both directions, so the
policy moves every route through it at once.

Telemetry comes from the broker, which is not a trust boundary (DESIGN "Trust nothing
that arrives"), so the view is where one node's data is kept from hurting the others:

* Every key and every address prefix belongs to exactly one node. A message claiming a
  key (``key_conflict``) or an address equal to or overlapping a prefix of another node
  in the view (``address_conflict``) is refused whole; the current owner keeps it until
  it stops claiming it or is removed (:meth:`MeshView.remove`). Two routes to one
  prefix would make every route set of the mesh unpublishable, and a more specific
  prefix would steal another node's traffic.
* Values the decoder lets through (they are possible) but routing cannot use are
  cleared field by field, as "not measured", and counted in :attr:`MeshView.dropped`;
  the rest of the report still counts. See :func:`usable_peer`.
"""

from __future__ import annotations

import bisect
import ipaddress
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from meshopt.bus.messages import (
    ALIVE_UNKNOWN,
    COLUMNS,
    DELAY_COLUMNS,
    DELAY_UNIT_MS,
    NONE_U16,
    NONE_U32,
    RATIO_UNIT,
    Counters,
    PeerReport,
    PeerTable,
    Telemetry,
)
from meshopt.metric import FloatArray, Metric

log = logging.getLogger("meshopt.controller")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Possible (the decoder takes them) but unusable for routing: such fields are dropped.
MIN_PMTU = 576  # the IPv4 minimum (RFC 791); a smaller path MTU cannot carry a route
MAX_DELAY_MS = 60_000.0  # RTT, jitter, noise: a link a minute away is no link to route on
MAX_BANDWIDTH_MBIT = 1e7  # 10 Tbit/s through one WireGuard tunnel
MAX_RATE_BPS = 1.25e12  # rx_bps/tx_bps: over 1 Tbit/s whether bits or bytes are counted
_DELAY_FIELDS = ("rtt_ms", "rtt_min_ms", "rtt_median_ms", "rtt_p95_ms", "jitter_ms", "noise_ms")


def usable_peer(p: PeerReport) -> tuple[PeerReport, list[str]]:
    """``p`` with every unusable field reset to "not measured", and those fields' names.

    Dropping one field keeps the rest of the report: a node with a broken PMTU probe
    still has its RTTs routed on. A delay beyond ``MAX_DELAY_MS`` reads as no RTT (the
    link costs ``unknown_cost_ms``), a PMTU below ``MIN_PMTU`` as not probed (bulk routes
    then take the default MTU), an absurd bandwidth as unknown (0 in the matrices).
    """
    changes: dict[str, object] = {}
    for name in _DELAY_FIELDS:
        v = getattr(p, name)
        if v is not None and not (math.isfinite(v) and 0.0 <= v <= MAX_DELAY_MS):
            changes[name] = None
    if p.loss is not None and not (math.isfinite(p.loss) and 0.0 <= p.loss <= 1.0):
        changes["loss"] = None
    bw = p.bandwidth_mbit
    if bw is not None and not (math.isfinite(bw) and 0.0 <= bw <= MAX_BANDWIDTH_MBIT):
        changes["bandwidth_mbit"] = None
    if p.pmtu is not None and not MIN_PMTU <= p.pmtu <= 65535:
        changes["pmtu"] = None
    for name in ("rx_bps", "tx_bps"):
        v = getattr(p, name)
        if not (math.isfinite(v) and 0.0 <= v <= MAX_RATE_BPS):
            changes[name] = 0.0  # the field's "no rate" value
    if not changes:
        return p, []
    return msgspec.structs.replace(p, **changes), sorted(changes)


class _Prefixes:
    """Which node owns which address prefix; finds the owner of an overlapping prefix with
    a dict lookup per prefix length in use and a bisect, not a scan of the whole mesh."""

    def __init__(self) -> None:
        self._exact: dict[tuple[int, int, int], str] = {}  # (version, length, first) -> node
        self._lengths: dict[int, Counter[int]] = {4: Counter(), 6: Counter()}
        self._sorted: dict[int, list[tuple[int, int, str, str]]] = {4: [], 6: []}
        self._of: dict[str, list[Network]] = {}

    def conflict(self, net: Network, node: str) -> tuple[str, str] | None:
        """(owner, its prefix) of a prefix of another node equal to or overlapping ``net``."""
        v, bits = net.version, net.max_prefixlen
        first, last = int(net.network_address), int(net.broadcast_address)
        # Prefixes nest or are disjoint: an overlap either contains ``net``...
        for length, n in self._lengths[v].items():
            if n and length <= net.prefixlen:
                shift = bits - length
                owner = self._exact.get((v, length, first >> shift << shift))
                if owner is not None and owner != node:
                    return owner, self._text(owner, v, length, first >> shift << shift)
        # ... or starts inside it.
        entries = self._sorted[v]
        i = bisect.bisect_left(entries, (first,))
        while i < len(entries) and entries[i][0] <= last:
            if entries[i][2] != node:
                return entries[i][2], entries[i][3]
            i += 1
        return None

    def _text(self, owner: str, v: int, length: int, first: int) -> str:
        for net in self._of.get(owner, []):
            if (net.version, net.prefixlen, int(net.network_address)) == (v, length, first):
                return str(net)
        return "?"  # pragma: no cover - the index and _of agree

    def set(self, node: str, nets: Sequence[Network]) -> None:
        """``node`` owns exactly ``nets`` now (checked by :meth:`conflict` beforehand)."""
        if self._of.get(node) == list(nets):
            return
        self.remove(node)
        for net in nets:
            first = int(net.network_address)
            self._exact[(net.version, net.prefixlen, first)] = node
            self._lengths[net.version][net.prefixlen] += 1
            bisect.insort(
                self._sorted[net.version], (first, int(net.broadcast_address), node, str(net))
            )
        self._of[node] = list(nets)

    def remove(self, node: str) -> None:
        for net in self._of.pop(node, []):
            first = int(net.network_address)
            del self._exact[(net.version, net.prefixlen, first)]
            self._lengths[net.version][net.prefixlen] -= 1
            entries = self._sorted[net.version]
            entry = (first, int(net.broadcast_address), node, str(net))
            i = bisect.bisect_left(entries, entry)
            if i < len(entries) and entries[i] == entry:
                del entries[i]


def _column(table: PeerTable, name: str) -> np.ndarray | None:
    """A table column as a numpy view of its packed bytes (no copy), None when absent."""
    raw: bytes = getattr(table, name)
    return np.frombuffer(raw, dtype=COLUMNS[name]) if raw else None


class TelemetryRefused(Exception):
    """Telemetry the view will not take; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class _Rows(dict[str, PeerReport]):
    """A node's peer rows; counts changes so the arrays built from them know when to rebuild
    (a caller may change the dict it got from :attr:`NodeInfo.peers`)."""

    version = 0

    def __setitem__(self, key: str, value: PeerReport) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.version += 1

    def update(self, *args: Any, **kwargs: PeerReport) -> None:
        super().update(*args, **kwargs)
        self.version += 1

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> tuple[str, PeerReport]:
        self.version += 1
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.version += 1
        return super().setdefault(key, default)


@dataclass
class _PeerArrays:
    """One node's peer rows as arrays (NaN: not measured), for a vectorised matrix row."""

    keys: list[str]
    alive: np.ndarray  # 1 alive, 0 dead, -1 unknown
    rtt: FloatArray
    jitter: FloatArray
    loss: FloatArray
    noise: FloatArray
    samples: FloatArray
    sent: FloatArray  # probes sent to the peer so far
    loss_n: FloatArray  # outcomes the loss rests on (0: not told)
    bandwidth: FloatArray
    pmtu: FloatArray
    version: int  # the rows' change count when they were built (-1: from a table)
    dst: np.ndarray | None = None  # node index per peer (-1: none), for ``layout``
    layout: int = -1
    table: PeerTable | None = None  # the snapshot's table they were built from, if so
    # The rows they were built from, held and compared by identity: an id() (as once) can
    # be a freed dict's, and a new snapshot's rows with the same count passed for old ones.
    rows: _Rows | None = None

    @classmethod
    def of(cls, rows: _Rows) -> _PeerArrays:
        return cls.of_reports(list(rows), list(rows.values()), rows.version, rows)

    @classmethod
    def of_reports(
        cls, keys: list[str], reps: list[PeerReport], version: int = -1, rows: _Rows | None = None
    ) -> _PeerArrays:
        """From reports in a list (a change report's peers: a key may come twice)."""

        def col(name: str) -> FloatArray:
            return np.array(
                [np.nan if (v := getattr(p, name)) is None else v for p in reps], dtype=np.float64
            )

        return cls(
            keys=keys,
            alive=np.array([-1 if p.alive is None else int(p.alive) for p in reps], dtype=np.int8),
            rtt=col("rtt_ms"),
            jitter=col("jitter_ms"),
            loss=col("loss"),
            noise=col("noise_ms"),
            samples=np.array([p.samples for p in reps], dtype=np.float64),
            sent=np.array([p.probes_sent for p in reps], dtype=np.float64),
            loss_n=np.array([p.loss_outcomes for p in reps], dtype=np.float64),
            bandwidth=col("bandwidth_mbit"),
            pmtu=col("pmtu"),
            version=version,
            rows=rows,
        )

    @classmethod
    def of_table(cls, table: PeerTable) -> _PeerArrays:
        """The same arrays straight from a snapshot's columns, with what
        :func:`usable_peer` clears cleared (NaN): no PeerReport per peer. At 1000 peers
        the rows cost ~5 ms a node, and a recompute after start-up read every node's."""
        n = len(table)

        def scaled(name: str, unit: float, none: int, top: float) -> FloatArray:
            raw = _column(table, name)
            if raw is None:
                return np.full(n, np.nan)
            # round(v * unit, nd) as the rows have it is the double nearest v / (1 / unit)
            # (counts of 0.01 ms or 1e-4): one correctly rounded division gives it exactly.
            v = raw.astype(np.float64) / round(1.0 / unit)
            return np.where((raw == none) | (v < 0.0) | (v > top), np.nan, v)

        def plain(name: str) -> FloatArray:
            raw = _column(table, name)
            return np.zeros(n) if raw is None else raw.astype(np.float64)

        alive_raw = _column(table, "alive")
        if alive_raw is None:
            alive = np.full(n, -1, dtype=np.int8)
        else:
            alive = np.where(alive_raw == ALIVE_UNKNOWN, -1, alive_raw == 1).astype(np.int8)
        bw_raw = _column(table, "bandwidth")
        if bw_raw is None:
            bw = np.full(n, np.nan)
        else:
            bw = bw_raw.astype(np.float64)
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(bw) | (bw < 0.0) | (bw > MAX_BANDWIDTH_MBIT)
            bw = np.where(bad, np.nan, bw)
        pm_raw = _column(table, "pmtu")
        if pm_raw is None:
            pmtu = np.full(n, np.nan)
        else:
            pmtu = pm_raw.astype(np.float64)
            pmtu = np.where(pmtu < MIN_PMTU, np.nan, pmtu)
        keys = _KEY_LISTS.get(table.keys)
        if keys is None:
            if len(_KEY_LISTS) >= _MAX_KEY_LISTS:
                _KEY_LISTS.clear()
            keys = _KEY_LISTS[table.keys] = table.key_list()
        return cls(
            keys=list(keys),
            alive=alive,
            rtt=scaled("rtt", DELAY_UNIT_MS, NONE_U32, MAX_DELAY_MS),
            jitter=scaled("jitter", DELAY_UNIT_MS, NONE_U32, MAX_DELAY_MS),
            loss=scaled("loss", RATIO_UNIT, NONE_U16, 1.0),
            noise=scaled("noise", DELAY_UNIT_MS, NONE_U32, MAX_DELAY_MS),
            samples=plain("samples"),
            sent=plain("probes_sent"),
            loss_n=plain("loss_outcomes"),
            bandwidth=bw,
            pmtu=pmtu,
            version=-1,
            table=table,
        )


# A node's peers' keys in base64, by the table's packed keys: every snapshot of a node
# repeats them (999 base64 encodings a snapshot at 1000 nodes). Bounded.
_KEY_LISTS: dict[bytes, list[str]] = {}
_MAX_KEY_LISTS = 8192

# Deltas taken before a node's rows are next read are kept as layers; past this many the
# rows are built at once (bounds memory when nothing reads them, e.g. before routing).
_MAX_LAYERS = 64


@dataclass
class NodeInfo:
    """One node as its telemetry describes it.

    Its peer reports are kept as the tables they came in (taking a snapshot is O(1) in
    Python) and turned into ``peers`` rows only when something reads them, once per
    snapshot; change reports taken in between are applied on top, in order.
    """

    name: str
    public_keys: list[str]
    addresses: list[str]
    last_seen: float  # monotonic time of the last telemetry (of any kind)
    online: bool = True
    seq: int = -1
    sent_at: float = -math.inf
    offline_reason: str = ""
    full_interval_s: float = 0.0  # announced by the agent; 0: not announced
    last_full: float = -math.inf  # monotonic time of the last full snapshot
    _rows: _Rows | None = field(default=None, repr=False)
    _layers: list[PeerTable | dict[str, PeerReport]] = field(default_factory=list, repr=False)
    _arrays: _PeerArrays | None = field(default=None, repr=False)

    @property
    def peers(self) -> dict[str, PeerReport]:
        """The node's peer reports by peer public key (fields unusable for routing cleared)."""
        if self._rows is None or self._layers:
            rows = _Rows() if self._rows is None else self._rows
            for layer in self._layers:
                if isinstance(layer, dict):
                    rows.update(layer)
                else:
                    for p in layer.rows():
                        rows[p.public_key] = usable_peer(p)[0]
            self._rows = rows
            self._layers = []
        return self._rows

    @peers.setter
    def peers(self, rows: dict[str, PeerReport]) -> None:
        self._rows = rows if isinstance(rows, _Rows) else _Rows(rows)
        self._layers = []

    def _table_only(self) -> PeerTable | None:
        """The snapshot's table when it is all there is (no rows built, no table-less
        peers, no change report on top), else None."""
        layers = self._layers
        if (
            self._rows is None
            and len(layers) == 2
            and isinstance(layers[0], dict)
            and not layers[0]
            and isinstance(layers[1], PeerTable)
        ):
            return layers[1]
        return None

    def arrays(self) -> _PeerArrays:
        """The peer rows as arrays, built once per change of the rows (straight from
        the columns while the node's picture is one snapshot's table)."""
        table = self._table_only()
        if table is not None:
            a = self._arrays
            if a is None or a.table is not table:
                a = self._arrays = _PeerArrays.of_table(table)
            return a
        self.peers  # noqa: B018 - apply pending layers
        rows = self._rows
        assert rows is not None
        a = self._arrays
        if a is None or a.rows is not rows or a.version != rows.version:
            a = self._arrays = _PeerArrays.of(rows)
        return a

    def peer_keys(self) -> list[str]:
        """The peers' public keys, in the order of :attr:`peers` (without building the
        rows while the picture is one snapshot's table)."""
        return self.arrays().keys

    def snapshot(self, rows: dict[str, PeerReport], table: PeerTable | None) -> None:
        """Replace every peer report (a full snapshot): rows, then the table over them."""
        self._rows = None
        self._layers = [rows] if table is None else [rows, table]

    def change(self, rows: dict[str, PeerReport], table: PeerTable | None) -> None:
        """Apply a change report over what is there."""
        if rows:
            self._layers.append(rows)
        if table is not None and len(table):
            self._layers.append(table)
        if len(self._layers) > _MAX_LAYERS:
            self.peers  # noqa: B018 - build the rows now

    def picture_stale(self, now: float, stale_after_s: float) -> bool:
        """No full snapshot for three of the intervals the agent announced: deltas may
        have been lost in between, so its peer reports can no longer be trusted."""
        if self.full_interval_s <= 0.0:
            return False
        return now - self.last_full > max(stale_after_s, 3.0 * self.full_interval_s)


@dataclass
class Matrices:
    names: list[str]
    cost: FloatArray  # metric cost per link, inf where down or absent, 0 on the diagonal
    noise: FloatArray  # standard deviation of each link's cost estimate (ms)
    bandwidth: FloatArray  # Mbit/s per link, 0 where unknown or down
    up: np.ndarray  # bool per node
    rtt: FloatArray  # measured (smoothed) RTT per link in ms, nan where unknown
    pmtu: FloatArray  # path MTU through each tunnel, 0 where not measured
    # The jitter term inside each link's cost (jitter_weight * sigma, 0 where unknown or
    # down): the policy combines it per path as a root-sum-square (policy.rss_path_cost).
    jitter: FloatArray | None = None


def warmed_up(
    first_seen: float | None, now: float, warmup_s: float, measured: Callable[[], bool]
) -> bool:
    """The controller's warm-up rule: route once ``warmup_s`` have passed since the first
    telemetry, or earlier once ``measured()`` says every link has enough samples (asked
    only when the clock has not decided: it walks every link)."""
    if first_seen is None:
        return False
    return now - first_seen >= warmup_s or measured()


class MeshView:
    def __init__(
        self,
        mesh: str,
        *,
        metric: Metric | None = None,
        stale_after_s: float = 15.0,
        allowed: Sequence[str] = (),
    ) -> None:
        self.mesh = mesh
        self.metric = metric or Metric()
        self.stale_after_s = stale_after_s
        self.allowed = set(allowed)
        self.nodes: dict[str, NodeInfo] = {}
        self.first_seen: float | None = None
        # Fields cleared as unusable and addresses given twice in one message, by reason
        # ("<field>_unusable", "duplicate_address"); the first of each reason is logged.
        # Cumulative: a caller counts what one ``take`` dropped as the difference.
        self.dropped = Counters("controller ignored telemetry values", log)
        self._prefixes = _Prefixes()
        # Which node holds which key (a take checks its claims against it in O(keys),
        # not by walking the mesh), and a count bumped whenever that may have changed.
        self._key_owner: dict[str, str] = {}
        self._layout = 0

    def node_of_key(self) -> dict[str, str]:
        return {k: n.name for n in self.nodes.values() for k in n.public_keys}

    def take(self, topic_node: str, t: Telemetry, now: float, wall: float | None = None) -> bool:
        """Take one telemetry message; True if the graph may have changed (False for a
        heartbeat: nothing to recompute).

        With ``wall`` (the receiver's clock, like ``sent_at``), a message's age counts: a
        retained snapshot of an agent that died long ago is stale at once, not live for
        another ``stale_after_s``.

        Raises TelemetryRefused (nothing changed) for a message that cannot be taken,
        e.g. ``key_conflict`` or ``address_conflict``; unusable fields and repeated
        addresses are left out and counted in :attr:`dropped` instead.
        """
        arrived = now
        seen = now
        if wall is not None:
            # A retained snapshot is the agent's newest one while it is younger than the
            # interval the agent announced; only the age beyond that counts against it.
            age = min(max(0.0, wall - t.sent_at), max(self.stale_after_s, t.full_interval_s) * 10)
            now -= age
            seen = arrived - max(0.0, age - t.full_interval_s)
        if t.mesh != self.mesh:
            raise TelemetryRefused("wrong_mesh", f"{t.mesh!r}")
        if t.node != topic_node:
            raise TelemetryRefused("node_mismatch", f"{t.node!r} on the topic of {topic_node!r}")
        if self.allowed and t.node not in self.allowed:
            raise TelemetryRefused("unknown_node", t.node)
        keys = t.public_keys or [t.public_key]
        for k in keys:
            o = self._key_owner.get(k)
            if o is not None and o != t.node:
                raise TelemetryRefused("key_conflict", f"{t.node} claims a key of {o}")
        info = self.nodes.get(t.node)
        if info is not None and t.sent_at <= info.sent_at:
            # An old message delivered late, or replayed: newer data is already in.
            raise TelemetryRefused("out_of_order", f"{t.node} seq {t.seq}")
        addresses, nets, duplicates = self._claim(t.node, t.addresses)
        # Nothing is refused past this point: what follows changes the view.
        if duplicates:
            self.dropped.count("duplicate_address", f"{t.node}: {duplicates[0]}", len(duplicates))
        peers: dict[str, PeerReport] = {}
        for p in t.peers:
            usable, dropped = usable_peer(p)
            for name in dropped:
                self.dropped.count(f"{name}_unusable", f"{t.node}: {name}={getattr(p, name)!r}")
            peers[p.public_key] = usable
        if t.table is not None:
            self._count_unusable(t.node, t.table)
        self._prefixes.set(t.node, nets)
        if self.first_seen is None:
            self.first_seen = seen
        # A heartbeat (an empty change report from a node that is online and claims what
        # it claimed) changes nothing a route depends on.
        changed = (
            t.full
            or bool(peers)
            or (t.table is not None and len(t.table) > 0)
            or info is None
            or not info.online
            or info.public_keys != list(keys)
            or info.addresses != addresses
        )
        if info is None:
            # A change report first: the agent's next full snapshot is due within its interval.
            info = NodeInfo(t.node, list(keys), addresses, seen, last_full=now)
            self.nodes[t.node] = info
            self._set_keys(info, list(keys))
        elif info.public_keys != list(keys):
            self._set_keys(info, list(keys))
        info.addresses = addresses
        info.last_seen = seen
        info.seq = t.seq
        info.sent_at = t.sent_at
        if t.full_interval_s > 0.0 or t.full:
            info.full_interval_s = t.full_interval_s
        if t.full:
            info.snapshot(peers, t.table)
            info.last_full = now
        else:
            info.change(peers, t.table)
        online = not info.picture_stale(arrived, self.stale_after_s)
        changed = changed or online != info.online
        info.online = online
        if not online:
            info.offline_reason = "no full snapshot"
        return changed

    def _count_unusable(self, node: str, table: PeerTable) -> None:
        """Count the table's values routing cannot use (one numpy test per column); the
        rows drop them when built (:func:`usable_peer`)."""
        over = int(MAX_DELAY_MS / DELAY_UNIT_MS)
        for col, name in DELAY_COLUMNS.items():
            c = _column(table, col)
            if c is not None:
                n = int(np.count_nonzero((c > over) & (c != NONE_U32)))
                if n:
                    self.dropped.count(f"{name}_unusable", f"{node}: {n} peers", n)
        checks: list[tuple[str, str, float, float]] = [
            ("bandwidth", "bandwidth_mbit", 0.0, MAX_BANDWIDTH_MBIT),
            ("rx_bps", "rx_bps", 0.0, MAX_RATE_BPS),
            ("tx_bps", "tx_bps", 0.0, MAX_RATE_BPS),
        ]
        for col, name, lo, hi in checks:
            c = _column(table, col)
            if c is not None:
                n = int(np.count_nonzero((c < lo) | (c > hi)))
                if n:
                    self.dropped.count(f"{name}_unusable", f"{node}: {n} peers", n)
        pm = _column(table, "pmtu")
        if pm is not None:
            n = int(np.count_nonzero((pm != 0) & (pm < MIN_PMTU)))
            if n:
                self.dropped.count("pmtu_unusable", f"{node}: {n} peers", n)

    def _claim(
        self, node: str, claimed: Sequence[str]
    ) -> tuple[list[str], list[Network], list[str]]:
        """(addresses, their prefixes, duplicates left out) of ``node``'s claim, or
        TelemetryRefused("address_conflict") if a prefix overlaps another node's."""
        addresses: list[str] = []
        nets: list[Network] = []
        duplicates: list[str] = []
        seen: set[Network] = set()
        for text in claimed:
            try:
                net = ipaddress.ip_network(text, strict=True)
            except ValueError:
                # The decoder passes only prefixes; a caller that skipped it gets a refusal.
                raise TelemetryRefused("bad_address", f"{node}: {text[:60]!r}") from None
            if net in seen:
                duplicates.append(text)
                continue
            hit = self._prefixes.conflict(net, node)
            if hit is not None:
                raise TelemetryRefused(
                    "address_conflict", f"{node} claims {text}, overlapping {hit[1]} of {hit[0]}"
                )
            seen.add(net)
            addresses.append(text)
            nets.append(net)
        return addresses, nets, duplicates

    def _set_keys(self, info: NodeInfo, keys: list[str]) -> None:
        """``info`` holds exactly ``keys`` now (checked for conflicts beforehand)."""
        for k in info.public_keys:
            if self._key_owner.get(k) == info.name:
                del self._key_owner[k]
        for k in keys:
            self._key_owner[k] = info.name
        info.public_keys = keys
        self._layout += 1

    def remove(self, node: str) -> bool:
        """Forget ``node`` (decommissioned): its keys and addresses are free to claim again."""
        info = self.nodes.pop(node, None)
        if info is None:
            return False
        self._set_keys(info, [])
        self._prefixes.remove(node)
        return True

    def measured(self, min_samples: int = 1) -> bool:
        """Every online node reports ``min_samples`` RTT samples for each of its peers."""
        for info in self.nodes.values():
            if not info.online:
                continue
            a = info.arrays()
            if not a.keys or bool(np.isnan(a.rtt).any()) or bool((a.samples < min_samples).any()):
                return False
        return True

    def ready(self, now: float, warmup_s: float, min_samples: int = 8) -> bool:
        """Enough is known to route: all links measured, or ``warmup_s`` since the first report.

        Routing on half a picture would install routes around links nobody has measured
        yet (they cost ``unknown_cost_ms``), or on one or two samples, and the policy
        would then hold those choices for ``hold_s``.
        """
        return warmed_up(self.first_seen, now, warmup_s, lambda: self.measured(min_samples))

    def set_offline(self, node: str, reason: str) -> bool:
        info = self.nodes.get(node)
        if info is None or not info.online:
            return False
        info.online = False
        info.offline_reason = reason
        return True

    def expire(self, now: float) -> list[str]:
        """Nodes whose telemetry went stale now; they are marked offline.

        Stale: nothing heard for ``stale_after_s`` (agents send at least an empty change
        report every ``full_interval_s``), or no full snapshot for three of the intervals
        the agent announces (:meth:`NodeInfo.picture_stale`).
        """
        out = []
        for info in self.nodes.values():
            if not info.online:
                continue
            if now - info.last_seen > self.stale_after_s:
                info.online = False
                info.offline_reason = "telemetry stale"
                out.append(info.name)
            elif info.picture_stale(now, self.stale_after_s):
                info.online = False
                info.offline_reason = "no full snapshot"
                out.append(info.name)
        return out

    def names(self) -> list[str]:
        return sorted(self.nodes)

    def matrices(self, now: float) -> Matrices:
        """The routing matrices; one vectorised row per online node (see :func:`link_cost`
        for what a single link costs: this computes the same for all of a node's peers)."""
        names = self.names()
        index = {n: i for i, n in enumerate(names)}
        n = len(names)
        cost = np.full((n, n), np.inf)
        noise = np.zeros((n, n))
        bw = np.zeros((n, n))
        rtt = np.full((n, n), np.nan)
        pmtu = np.zeros((n, n))
        jterm = np.zeros((n, n))
        up = np.array([self.nodes[x].online for x in names], dtype=bool)
        key_index: dict[str, int] | None = None
        m = self.metric
        for s_name, info in self.nodes.items():
            if not info.online:
                continue
            s = index[s_name]
            a = info.arrays()
            if not a.keys:
                continue
            if a.dst is None or a.layout != self._layout:
                if key_index is None:
                    key_index = {
                        k: index[x.name] for x in self.nodes.values() for k in x.public_keys
                    }
                a.dst = np.array([key_index.get(k, -1) for k in a.keys], dtype=np.intp)
                a.layout = self._layout
            dst = a.dst
            ok = (dst >= 0) & (dst != s)
            ok[ok] = up[dst[ok]]
            if not ok.any():
                continue
            d = dst[ok]
            r = a.rtt[ok]
            jit = np.nan_to_num(a.jitter[ok], nan=0.0)
            age = max(0.0, now - info.last_seen)
            c, sd, term = link_matrices(
                m, r, jit, a.loss[ok], a.noise[ok], a.samples[ok], a.sent[ok], a.loss_n[ok],
                a.alive[ok] == 0, np.full(len(r), age),
            )  # fmt: skip
            unknown = np.isnan(r)
            cost[s, d] = c
            noise[s, d] = sd
            finite = np.isfinite(c)
            b = a.bandwidth[ok]
            has_bw = finite & ~np.isnan(b)
            bw[s, d[has_bw]] = b[has_bw]
            has_rtt = finite & ~unknown
            rtt[s, d[has_rtt]] = r[has_rtt]
            jterm[s, d[has_rtt]] = term[has_rtt]
            pm = a.pmtu[ok]
            has_pm = ~np.isnan(pm)
            pmtu[s, d[has_pm]] = pm[has_pm]
        np.fill_diagonal(cost, 0.0)
        return Matrices(names, cost, noise, bw, up, rtt, pmtu, jterm)


def link_matrices(
    metric: Metric,
    rtt: FloatArray,
    jitter: FloatArray,
    loss: FloatArray,
    noise: FloatArray,
    samples: FloatArray,
    sent: FloatArray,
    loss_n: FloatArray,
    dead: npt.NDArray[np.bool_],
    age_s: FloatArray,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """(cost, its standard deviation, the jitter term inside the cost) of reported links,
    any shape: what :meth:`MeshView.matrices` computes per node's row and the simulator
    for the whole mesh at once (the one implementation of the controller's link price).

    Inputs are the telemetry's fields as arrays: ``rtt`` NaN where not measured (the
    link costs ``unknown_cost_ms``), ``jitter``, ``loss`` and ``noise`` NaN where not
    reported, ``dead`` where the agent says the peer is dead (inf). The loss has the
    young link's lost first probes forgiven (:func:`handshake_loss_discounted`); the
    deviation combines the RTT estimate's noise, the loss estimate's (over the
    ``loss_n`` outcomes it rests on, where 0 the window's ``samples / (1 - loss)``,
    through the loss penalty) and the jitter term's (:func:`jitter_noise_ms`).
    The jitter term is 0 where the RTT is unknown or the link dead.
    """
    m = metric
    jit = np.nan_to_num(jitter, nan=0.0)
    p = handshake_loss_discounted(np.minimum(np.nan_to_num(loss, nan=0.0), 1.0), samples, sent)
    nz = np.nan_to_num(noise, nan=0.0)
    c = m.link_costs(rtt, jit, p, age_s)
    q = np.maximum(1.0 - p, 1e-3)
    n = loss_outcomes(loss_n, samples, q)
    loss_sd = np.sqrt(p * (1.0 - p) / n)
    slope = m.loss_penalty_ms / q**2
    jsd = jitter_noise_ms(m.jitter_weight * jit, samples)
    sd = np.sqrt(nz**2 + (slope * loss_sd) ** 2 + jsd**2)
    unknown = np.isnan(rtt)
    c = np.where(unknown, m.unknown_cost_ms, c)
    sd = np.where(unknown, 0.0, sd)
    c = np.where(dead, np.inf, c)
    sd = np.where(dead, 0.0, sd)
    with np.errstate(invalid="ignore"):
        term = np.where(np.isfinite(c) & ~unknown, np.minimum(m.jitter_weight * jit, c), 0.0)
    return np.asarray(c, dtype=np.float64), np.asarray(sd, dtype=np.float64), term


def loss_outcomes(loss_n: FloatArray, samples: FloatArray, q: FloatArray) -> FloatArray:
    """How many probe outcomes a loss estimate rests on: as the agent told it
    (``loss_n``, with its loss memory), else the window's (``samples / q``, ``q`` the
    share answered) from an agent that does not tell it."""
    out: FloatArray = np.where(loss_n > 0, loss_n, np.maximum(samples, 1.0) / q)
    return out


# The agents' default probe window: while a link has sent no more probes than this, its
# first probes (sent before the tunnel answered) are still in the window.
YOUNG_PROBES = 64
# Losses forgiven meanwhile: probes sent before the peer's agent answered (agents start
# a second or so apart: at 0.33 s that is up to 3 probes) and the one that waited for
# WireGuard's handshake.
YOUNG_FORGIVEN = 3


def handshake_loss_discounted(
    loss: FloatArray, samples: FloatArray, sent: FloatArray
) -> FloatArray:
    """Loss with up to YOUNG_FORGIVEN lost probes forgiven while the link is young
    (``sent`` <= YOUNG_PROBES).

    The first probes over a fresh tunnel wait for WireGuard's handshake and for the
    peer's agent to start answering, and are often counted lost. One such loss among 19
    probes reads as 5 % loss: 11 ms of loss penalty on every link of that node and, the
    estimate resting on a single event, 11 ms of noise, which kept relays 30 ms better
    from being taken for 20 s in the lab (bench8). A link with real loss shows it in
    full once its window has slid past its first probes (~21 s at 0.33 s)."""
    p = np.asarray(loss, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        outcomes = np.where(p < 1.0, np.maximum(samples, 0.0) / (1.0 - p), 0.0)
        lost = np.rint(p * outcomes)
        young = (sent > 0) & (sent <= YOUNG_PROBES) & (lost >= 1.0) & (p < 1.0)
        forgiven = np.maximum(lost - YOUNG_FORGIVEN, 0.0)
        out = np.where(young, forgiven / np.maximum(outcomes, 1.0), p)
    res: FloatArray = np.clip(out, 0.0, 1.0)
    return res


# The jitter term's estimate is noisy too: sigma from an EWMA of squared deviations
# (West) over about (2 - a) / a samples, a = 0.11 at the prober's 0.33 s and 2 s
# half-life: ~17 samples. Its relative standard error is 1 / sqrt(2 n): ~0.17 in steady
# state, and larger while few samples are in (the first routes rest on 3).
_SIGMA_EFFECTIVE_SAMPLES = 17.0


def jitter_noise_ms(term: FloatArray, samples: FloatArray) -> FloatArray:
    """Standard deviation of each link's jitter term (``jitter_weight * sigma``) from how
    many samples its sigma rests on: honest uncertainty for the policy's noise test,
    not a fixed share of the term as extra hysteresis."""
    n = np.clip(np.nan_to_num(samples, nan=1.0), 2.0, _SIGMA_EFFECTIVE_SAMPLES)
    out: FloatArray = term / np.sqrt(2.0 * (n - 1.0))
    return out


def link_cost(rep: PeerReport, metric: Metric, age_s: float) -> tuple[float, float]:
    """(cost, its standard deviation) of one reported link; inf when it is dead:
    :func:`link_matrices` for one link."""

    def one(x: float | None) -> FloatArray:
        return np.array([math.nan if x is None else float(x)])

    cost, sd, _ = link_matrices(
        metric,
        rtt=one(rep.rtt_ms),
        jitter=one(rep.jitter_ms),
        loss=one(rep.loss),
        noise=one(rep.noise_ms),
        samples=one(rep.samples),
        sent=one(rep.probes_sent),
        loss_n=one(rep.loss_outcomes),
        dead=np.array([rep.alive is False]),
        age_s=one(age_s),
    )
    return float(cost[0]), float(sd[0])
