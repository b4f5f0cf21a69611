"""Offline answers (meshopt.analysis): known answers, and what the RIPE Atlas matrix contains."""

from __future__ import annotations

import csv
import gzip
import itertools
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from meshopt.analysis import Plan, node_routes, path_info, plan, relay_gains
from meshopt.metric import Metric
from meshopt.topology.load import load_topology
from meshopt.topology.model import Node, Topology

TOPOLOGIES = Path(__file__).parents[2] / "topologies"
RIPE = Path(__file__).parents[2] / ".." / "shared" / "data" / "ripe-atlas-country-rtt.csv.gz"
needs_ripe = pytest.mark.skipif(not RIPE.is_file(), reason=f"RIPE Atlas data not found at {RIPE}")
RELAY = Metric().relay_hop_ms


# --- small topologies, known answers -------------------------------------------------------


def test_triangle_path_routes_and_gains() -> None:
    topo = load_topology(str(TOPOLOGIES / "triangle.yaml"))
    p = plan(topo)
    info = path_info(p, "a", "b")
    assert [(h.src, h.dst, h.rtt_ms) for h in info.hops] == [("a", "c", 20.0), ("c", "b", 20.0)]
    assert info.relays == ["c"]
    assert (info.rtt_ms, info.direct_rtt_ms, info.gain_ms) == (40.0, 80.0, 40.0)
    # jitter 0.2 ms one way: each link costs RTT + 2 x hypot(0.2, 0.2)
    link = 20.0 + 2 * np.hypot(0.2, 0.2)
    assert info.cost_ms == pytest.approx(2 * link + RELAY)
    assert info.direct_cost_ms == pytest.approx(80.0 + 2 * np.hypot(0.2, 0.2))

    routes = {e.dst: e for e in node_routes(p, "a")}
    b = routes["b"]
    assert (b.next_hop, b.backup, b.path) == ("c", "b", ["a", "c", "b"])
    assert (routes["c"].next_hop, routes["c"].path) == ("c", ["a", "c"])
    assert routes["c"].backup == "b"  # a-b-c: 80 + 20 ms, still loop-free

    g = relay_gains(p)
    assert (g.pairs, g.relayed, g.improved, g.best_gain_ms) == (3, 1, 1, 40.0)


def test_relay_cost_decides_the_triangle() -> None:
    """Relaying a-b saves 40 ms RTT (less 2 x jitter on one more link): a relay hop priced
    above that makes the direct tunnel best, below it keeps the relay."""
    topo = load_topology(str(TOPOLOGIES / "triangle.yaml"))
    assert path_info(plan(topo, Metric(relay_hop_ms=39.0)), "a", "b").relays == ["c"]
    assert path_info(plan(topo, Metric(relay_hop_ms=41.0)), "a", "b").relays == []


def test_ring_has_nothing_to_gain_and_hub_relays_everything() -> None:
    ring = relay_gains(plan(load_topology("gen:ring:n=8,spread=0.3")))
    assert ring.relayed == 0 and ring.improved == 0
    hub = relay_gains(plan(load_topology(str(TOPOLOGIES / "hub.yaml"))))
    assert hub.relayed == hub.no_direct_tunnel == 6  # branch pairs, only through hq
    assert hub.improved == 0  # there is no direct tunnel to improve on


def test_two_regions_crosses_at_the_gateway() -> None:
    """chi -> fra: direct 160 ms RTT; via nyc and the transatlantic paths 102 ms. nyc-fra
    (41 ms one way) is exactly nyc-lon-fra (35 + 6 ms), so the fewer-hop path wins."""
    p = plan(load_topology(str(TOPOLOGIES / "two-regions.yaml")))
    info = path_info(p, "chi", "fra")
    assert info.relays == ["nyc"]
    assert info.rtt_ms == pytest.approx(2 * (10 + 41)) == pytest.approx(2 * (10 + 35 + 6))
    assert info.direct_rtt_ms == 160.0
    # The way back has two equal one-relay paths (via nyc or via lon, 51 ms one way);
    # directed routes pick either. Symmetric mode takes the reverse of the way there.
    back = path_info(p, "fra", "chi")
    assert len(back.relays) == 1 and back.rtt_ms == info.rtt_ms
    sym = plan(load_topology(str(TOPOLOGIES / "two-regions.yaml")), symmetric=True)
    there, back = path_info(sym, "chi", "fra"), path_info(sym, "fra", "chi")
    assert back.relays == list(reversed(there.relays))


# --- the RIPE Atlas country matrix ---------------------------------------------------------


def ripe_rtts(names: list[str], min_count: int = 100) -> dict[tuple[str, str], float]:
    """rtt_avg of every usable row, read straight from the file (both orders)."""
    wanted = set(names)
    out: dict[tuple[str, str], float] = {}
    with gzip.open(RIPE, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            a, b = row["cty1"], row["cty2"]
            if a != b and a in wanted and b in wanted and int(row["rtt_cnt"]) >= min_count:
                out[a, b] = out[b, a] = float(row["rtt_avg"])
    return out


@pytest.fixture(scope="module")
def ripe() -> tuple[Plan, dict[tuple[str, str], float]]:
    if not RIPE.is_file():
        pytest.skip(f"RIPE Atlas data not found at {RIPE}")
    topo = load_topology(str(RIPE))
    # RTT only (no jitter term), so every cost can be checked against rtt_avg itself.
    return plan(topo, Metric(jitter_weight=0.0)), ripe_rtts(topo.names)


@needs_ripe
def test_ripe_relaying_finds_every_one_relay_improvement_in_the_matrix(
    ripe: tuple[Plan, dict[tuple[str, str], float]],
) -> None:
    p, raw = ripe
    names = p.topo.names
    n = len(names)
    # The matrix as the file gives it, independent of the importer.
    m = np.full((n, n), np.inf)
    np.fill_diagonal(m, 0.0)
    for (a, b), rtt in raw.items():
        m[names.index(a), names.index(b)] = rtt
    tunnels = np.isfinite(m) & ~np.eye(n, dtype=bool)
    assert (tunnels == p.topo.tunnels).all()
    # Best path with exactly one relay, straight from the file: min over c of m[a,c] + m[c,b].
    one_relay = np.min(m[:, :, None] + m[None, :, :], axis=1) + RELAY
    cost = p.tables.cost
    off = ~np.eye(n, dtype=bool)
    # The engine never does worse than the direct tunnel or than any single relay ...
    assert (cost[off] <= np.minimum(m, one_relay)[off] + 1e-9).all()
    # ... and every pair that the matrix lets a relay improve is improved.
    better = tunnels & (one_relay < m - 1e-9)
    g = relay_gains(p, top=25)
    assert g.improved >= int(np.triu(better, 1).sum()) > 1000
    assert g.improved <= int(np.triu(tunnels, 1).sum())
    assert 0 < g.median_gain_ms <= g.mean_gain_ms <= g.best_gain_ms  # a long tail of big wins
    assert 0 < g.median_gain_pct < 100 and g.best_gain_pct < 100


@needs_ripe
def test_ripe_top_gains_are_made_of_the_matrix_rtts(
    ripe: tuple[Plan, dict[tuple[str, str], float]],
) -> None:
    p, raw = ripe
    g = relay_gains(p, top=25)
    assert len(g.top) == 25
    assert [t.gain_ms for t in g.top] == sorted((t.gain_ms for t in g.top), reverse=True)
    for t in g.top:
        hops = list(itertools.pairwise(t.path))
        assert t.path[0] == t.a and t.path[-1] == t.b and len(hops) >= 2
        assert t.direct_ms == pytest.approx(raw[t.a, t.b])
        assert t.routed_ms == pytest.approx(sum(raw[h] for h in hops))
        assert t.gain_ms > 0 and t.routed_ms < t.direct_ms
        info = path_info(p, t.a, t.b)
        # relayed cost = the hops' RTTs plus one relay cost per relay node
        assert info.cost_ms == pytest.approx(t.routed_ms + RELAY * (len(hops) - 1))
        assert info.cost_ms < info.direct_cost_ms  # relaying is worth its cost


@needs_ripe
def test_ripe_routes_match_networkx_shortest_paths(
    ripe: tuple[Plan, dict[tuple[str, str], float]],
) -> None:
    p, raw = ripe
    g = nx.DiGraph()
    for (a, b), rtt in raw.items():
        g.add_edge(a, b, weight=rtt + RELAY)  # one relay cost per hop, minus one at the end
    rng = np.random.default_rng(0)
    names = p.topo.names
    for a in rng.choice(names, size=8, replace=False).tolist():
        dist = nx.single_source_dijkstra_path_length(g, a)
        i = names.index(a)
        for b, d in dist.items():
            if b != a:
                got = p.tables.cost[i, names.index(b)]
                assert got == pytest.approx(d - RELAY)


@needs_ripe
def test_ripe_with_the_default_metric_relays_only_when_it_pays() -> None:
    """With jitter in the metric, relayed routes are cheaper than their direct tunnel by
    the metric, and most relayed pairs are faster in RTT too."""
    topo = load_topology(f"{RIPE}?min_count=1000")
    p = plan(topo)
    n = topo.n
    relayed = p.tables.relayed() & topo.tunnels
    assert relayed.sum() > 100
    direct_cost = p.link_cost
    assert (p.tables.cost[relayed] < direct_cost[relayed]).all()
    g = relay_gains(p)
    assert g.improved > 0.5 * np.triu(relayed | relayed.T, 1).sum()
    assert g.pairs == n * (n - 1) // 2


# --- the entry-by-entry walk against the tables ------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_route_entries_say_what_the_tables_say(seed: int) -> None:
    """node_routes and path_info walk plain lists for speed: every entry, unreachable ones
    and sparse tunnels included, must match the RouteTables it came from."""
    rng = np.random.default_rng(seed)
    n = 30
    delay = rng.uniform(1.0, 60.0, (n, n))
    delay = (delay + delay.T) / 2
    tunnels = np.triu(rng.random((n, n)) < 0.25, 1)
    tunnels = tunnels | tunnels.T
    tunnels[n - 2 :, :] = tunnels[:, n - 2 :] = False  # an island: unreachable pairs
    tunnels[n - 2, n - 1] = tunnels[n - 1, n - 2] = True
    nodes = [Node(f"n{i}") for i in range(n)]
    p = plan(Topology.from_matrices("t", nodes, delay, source="test", tunnels=tunnels))
    t = p.tables
    assert t.backup is not None
    unreachable = 0
    for s, name in enumerate(p.topo.names):
        for e in node_routes(p, name):
            d = p.topo.index(e.dst)
            idx = t.path(s, d)
            assert e.path == ([p.topo.names[i] for i in idx] if idx else [name])
            nh, bk = int(t.next_hop[s, d]), int(t.backup[s, d])
            assert e.next_hop == (None if nh < 0 else p.topo.names[nh])
            assert e.backup == (None if bk < 0 else p.topo.names[bk])
            rtt = [float(p.rtt[x, y]) for x, y in itertools.pairwise(idx)]
            assert e.rtt_ms == (sum(rtt) if idx else float("inf"))
            assert (e.cost_ms, e.direct_rtt_ms) == (float(t.cost[s, d]), float(p.rtt[s, d]))
            info = path_info(p, name, e.dst)
            assert [h.dst for h in info.hops] == e.path[1:]
            assert info.direct_cost_ms == float(p.link_cost[s, d])
            unreachable += not idx
    assert unreachable == 2 * 2 * (n - 2)
