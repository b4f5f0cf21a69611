"""What a lab's tunnels add to the agents' readings, for the simulator to add too.

Probes in the lab cross wireguard-go and the emulator twice. Both sleep between
packets, and at the agents' rate (one probe each 0.33 s) waking them costs ~0.5 ms per
tunnel and adds ~0.5 ms of spread (a 16-node lab, every link: median RTT 0.49 ms above
the topology's, σ 10 % above). A relayed path crosses two tunnels and a direct one
one, so near-ties between them lean towards the direct path in the lab. A simulator
without it relayed par2<->sao1 of the 16-node mesh in 10 seeds of 10 where 3 lab runs of
3 kept the direct tunnel (docs/twin.md). Medians over links are robust to the few that
were stepped, lossy or just came up.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from meshopt.topology.model import Topology


@dataclass(frozen=True)
class TunnelShare:
    ms: float  # added to every tunnel's RTT
    sigma_ms: float  # σ added to every tunnel's RTT (root-sum-square with the topology's)
    links: int  # directed links it rests on
    # Per tunnel (i < j, the topology's indices): its excess, the mean of both directions'.
    per_tunnel: dict[tuple[int, int], float]
    # How far tunnels differ from each other: the robust σ (1.4826 MAD) of ``per_tunnel``.
    # A relayed path crosses two tunnels and its direct rival one, so which of two paths
    # within a few tenths of a millisecond wins rests on which tunnels they cross.
    spread_ms: float


def tunnel_share(
    readings: Iterable[tuple[str, str, float, float]], topo: Topology
) -> TunnelShare | None:
    """From (node, peer, reported RTT, reported σ) readings of a steady spell: per
    directed link the medians of both against the topology's round trip, then the median
    over links (σ's excess in quadrature, as independent spreads add). None without a
    reading of a known link."""
    per: dict[tuple[int, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    names = set(topo.names)
    for node, peer, rtt, sigma in readings:
        if node not in names or peer not in names or node == peer:
            continue
        if not (math.isfinite(rtt) and math.isfinite(sigma)):
            continue
        rtts, sigmas = per[(topo.index(node), topo.index(peer))]
        rtts.append(rtt)
        sigmas.append(sigma)
    if not per:
        return None
    nominal = topo.rtt_ms()
    jit = topo.jitter_ms
    excess: dict[tuple[int, int], float] = {}
    spread: list[float] = []
    for (i, j), (rtts, sigmas) in per.items():
        excess[(i, j)] = statistics.median(rtts) - float(nominal[i, j])
        spread.append(statistics.median(sigmas) ** 2 - float(jit[i, j] ** 2 + jit[j, i] ** 2))
    both: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (i, j), x in excess.items():
        both[(min(i, j), max(i, j))].append(x)
    per_tunnel = {k: statistics.fmean(v) for k, v in both.items()}
    mid = statistics.median(per_tunnel.values())
    mad = statistics.median(abs(x - mid) for x in per_tunnel.values())
    return TunnelShare(
        ms=max(statistics.median(excess.values()), 0.0),
        sigma_ms=math.sqrt(max(statistics.median(spread), 0.0)),
        links=len(per),
        per_tunnel=per_tunnel,
        spread_ms=1.4826 * mad,
    )
