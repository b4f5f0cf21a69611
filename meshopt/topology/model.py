"""The in-memory topology every other part works from.

Per-pair properties live in dense numpy matrices, not per-link objects: a
1,000-node full mesh has a million directed pairs, and the simulator and route
engine want arrays anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from meshopt.errors import TopologyError
from meshopt.topology.names import NODE_NAME as NODE_NAME

FloatMatrix = npt.NDArray[np.float64]
BoolMatrix = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Node:
    name: str
    address: str | None = None  # overlay address (IPv4 or IPv6), assigned by the lab if None
    site: str | None = None
    lat: float | None = None
    lon: float | None = None


@dataclass(frozen=True)
class LinkProps:
    """Underlay properties of one direction of a pair (what netem would apply)."""

    delay_ms: float  # one-way
    jitter_ms: float = 0.0
    loss: float = 0.0  # fraction 0..1
    rate_mbit: float = float("inf")  # inf: not limited


@dataclass
class Topology:
    """Nodes, the directed underlay between every ordered pair, and which pairs tunnel.

    ``delay_ms[i, j]`` is the one-way delay from node i to node j; the round trip of
    the pair is ``delay_ms[i, j] + delay_ms[j, i]``. ``tunnels`` is symmetric.
    """

    name: str
    nodes: list[Node]
    delay_ms: FloatMatrix
    jitter_ms: FloatMatrix
    loss: FloatMatrix
    rate_mbit: FloatMatrix
    tunnels: BoolMatrix
    source: str = "<memory>"
    # A lab fault, not a property of the path: one packet in N held 100-300 ms (0: off).
    # Only the lab's emulator applies it; the simulator does not model it.
    spike: FloatMatrix | None = None
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        self._index = {node.name: i for i, node in enumerate(self.nodes)}
        if len(self._index) != n:
            raise TopologyError("duplicate node names", source=self.source)
        spike = () if self.spike is None else (self.spike,)
        for m in (self.delay_ms, self.jitter_ms, self.loss, self.rate_mbit, self.tunnels, *spike):
            if m.shape != (n, n):
                raise TopologyError(f"matrix shape {m.shape} != ({n}, {n})", source=self.source)
        np.fill_diagonal(self.tunnels, False)

    @classmethod
    def from_links(
        cls,
        name: str,
        nodes: list[Node],
        default: LinkProps,
        links: dict[tuple[str, str], LinkProps] | None = None,
        tunnels: list[tuple[str, str]] | None = None,
        source: str = "<memory>",
    ) -> Topology:
        """Build from per-direction overrides on top of a default (full-mesh tunnels if None)."""
        n = len(nodes)
        topo = cls(
            name=name,
            nodes=nodes,
            delay_ms=np.full((n, n), default.delay_ms),
            jitter_ms=np.full((n, n), default.jitter_ms),
            loss=np.full((n, n), default.loss),
            rate_mbit=np.full((n, n), default.rate_mbit),
            tunnels=np.ones((n, n), dtype=bool) if tunnels is None else np.zeros((n, n), bool),
            source=source,
        )
        for (a, b), props in (links or {}).items():
            topo.set_link(a, b, props)
        for a, b in tunnels or []:
            i, j = topo.index(a), topo.index(b)
            topo.tunnels[i, j] = topo.tunnels[j, i] = True
        topo.__post_init__()
        return topo

    @classmethod
    def from_matrices(
        cls,
        name: str,
        nodes: list[Node],
        delay: FloatMatrix,
        *,
        source: str,
        jitter: FloatMatrix | None = None,
        loss: FloatMatrix | None = None,
        tunnels: BoolMatrix | None = None,
    ) -> Topology:
        """Build from one-way delays (and optional jitter/loss); unlimited rate, full mesh."""
        n = len(nodes)
        delay = np.array(delay, dtype=np.float64)
        jitter = np.zeros((n, n)) if jitter is None else np.array(jitter, dtype=np.float64)
        loss = np.zeros((n, n)) if loss is None else np.array(loss, dtype=np.float64)
        for m in (delay, jitter, loss):
            np.fill_diagonal(m, 0.0)
        return cls(
            name=name,
            nodes=nodes,
            delay_ms=delay,
            jitter_ms=jitter,
            loss=loss,
            rate_mbit=np.full((n, n), np.inf),
            tunnels=~np.eye(n, dtype=bool) if tunnels is None else np.array(tunnels, dtype=bool),
            source=source,
        )

    # --- lookups -----------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def names(self) -> list[str]:
        return [node.name for node in self.nodes]

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise TopologyError(f"unknown node {name!r}", source=self.source) from None

    def node(self, name: str) -> Node:
        return self.nodes[self.index(name)]

    def link(self, a: str, b: str) -> LinkProps:
        i, j = self.index(a), self.index(b)
        return LinkProps(
            delay_ms=float(self.delay_ms[i, j]),
            jitter_ms=float(self.jitter_ms[i, j]),
            loss=float(self.loss[i, j]),
            rate_mbit=float(self.rate_mbit[i, j]),
        )

    def set_link(self, a: str, b: str, props: LinkProps) -> None:
        i, j = self.index(a), self.index(b)
        if i == j:
            raise TopologyError(f"link {a}-{b} joins a node to itself", source=self.source)
        self.delay_ms[i, j] = props.delay_ms
        self.jitter_ms[i, j] = props.jitter_ms
        self.loss[i, j] = props.loss
        self.rate_mbit[i, j] = props.rate_mbit

    def rtt_ms(self) -> FloatMatrix:
        """Round-trip time of every pair over the underlay (direct tunnel), diagonal 0."""
        return self.delay_ms + self.delay_ms.T

    def tunnel_pairs(self) -> Iterator[tuple[str, str]]:
        """Unordered tunnel pairs (a < b by index)."""
        ii, jj = np.nonzero(np.triu(self.tunnels, 1))
        names = self.names
        for i, j in zip(ii.tolist(), jj.tolist(), strict=True):
            yield names[i], names[j]

    def copy(self) -> Topology:
        return Topology(
            name=self.name,
            nodes=list(self.nodes),
            delay_ms=self.delay_ms.copy(),
            jitter_ms=self.jitter_ms.copy(),
            loss=self.loss.copy(),
            rate_mbit=self.rate_mbit.copy(),
            tunnels=self.tunnels.copy(),
            source=self.source,
            spike=None if self.spike is None else self.spike.copy(),
        )

    def rounded(self, ms_decimals: int = 3) -> Topology:
        """A copy with delays and jitter to ``ms_decimals`` (default: microseconds), rates
        likewise and loss to a millionth: what a person writes in a file, not a float's
        seventeen digits. Coordinates keep their precision."""
        topo = self.copy()
        for m in (topo.delay_ms, topo.jitter_ms, topo.rate_mbit):
            finite = np.isfinite(m)
            r = np.round(m[finite], ms_decimals)
            m[finite] = np.where((r == 0) & (m[finite] > 0), m[finite], r)  # keep tiny rates
        topo.loss[:] = np.clip(np.round(topo.loss, 6), 0.0, 1.0)
        return topo

    def components(self) -> list[list[str]]:
        """Node names of each connected part of the tunnel graph, largest first: one
        list for a mesh every node can reach (through relays), more for a partition."""
        seen = [False] * self.n
        parts: list[list[str]] = []
        names = self.names
        for start in range(self.n):
            if seen[start]:
                continue
            seen[start] = True
            stack, part = [start], []
            while stack:
                i = stack.pop()
                part.append(i)
                for j in np.flatnonzero(self.tunnels[i]).tolist():
                    if not seen[j]:
                        seen[j] = True
                        stack.append(j)
            parts.append([names[i] for i in sorted(part)])
        parts.sort(key=len, reverse=True)
        return parts
