"""A node whose links die one after another: routes towards it are not moved to relays
(meshopt.controller.deaths), in the watch itself and through the route engine."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from meshopt.bus.messages import PeerReport
from meshopt.controller.deaths import DeathWatch
from meshopt.controller.engine import Computed, RouteEngine
from meshopt.policy import PolicyConfig
from tests.unit.test_controller_engine import Links, Mesh, both

INF = np.inf


def _cost(n: int, dead: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    c = np.full((n, n), 10.0)
    np.fill_diagonal(c, 0.0)
    for i, j in dead:
        c[i, j] = INF
    return c


def test_the_first_picture_notes_nothing_and_a_death_is_a_pair() -> None:
    w = DeathWatch(window_s=5.0)
    names = ["a", "b", "c"]
    w.observe(names, _cost(3, [(0, 1)]), 0.0)  # never seen alive: not a death
    assert not w.noted(names).any()
    w.observe(names, _cost(3), 1.0)
    w.observe(names, _cost(3, [(0, 2)]), 2.0)  # a reports c dead
    w.observe(names, _cost(3, [(0, 2), (2, 0)]), 3.0)  # then c reports a: the same link
    noted = w.noted(names)
    assert noted[0, 2] and noted[2, 0] and noted.sum() == 2
    assert not w.collapsing(names, 3.0).any(), "one link is no collapse"
    w.observe(names, _cost(3), 4.0)  # alive again: forgotten
    assert not w.noted(names).any()


def test_two_deaths_within_the_window_collapse_the_node_until_it_settles() -> None:
    w = DeathWatch(window_s=5.0)
    names = ["a", "b", "c", "d"]
    w.note("b", "a", 10.0)
    w.note("a", "c", 13.0)
    assert list(w.collapsing(names, 13.0)) == [True, False, False, False]
    assert w.collapsing(names, 18.0)[0]
    w.note("d", "a", 17.0)  # a third one, 4 s later: chained to the others
    assert w.collapsing(names, 21.9)[0]
    assert not w.collapsing(names, 22.1).any(), "settled: 5 s without another death"


def test_deaths_farther_apart_than_the_window_are_no_collapse() -> None:
    w = DeathWatch(window_s=5.0)
    names = ["a", "b", "c"]
    w.note("a", "b", 0.0)
    w.note("a", "c", 6.0)
    assert not w.collapsing(names, 6.0).any()


def test_names_that_change_between_pictures_are_matched_by_name() -> None:
    w = DeathWatch()
    w.observe(["a", "b", "c"], _cost(3), 0.0)
    # c left, d joined (never seen alive: not a death); a-b died.
    w.observe(["a", "b", "d"], _cost(3, [(0, 1), (0, 2)]), 1.0)
    assert w.noted(["a", "b", "d"]).tolist() == [
        [False, True, False],
        [True, False, False],
        [False, False, False],
    ]


# a is reached directly from everyone (10 ms); b reaches e through a (b-e is 50 ms).
STAR = both(
    {
        **{(x, y): 10.0 for x in "abcde" for y in "abcde" if x < y},
        ("b", "e"): 50.0,
    }
)


def _report(mesh: Mesh, links: Links, dead: set[tuple[str, str]], now: float) -> None:
    """Every node's snapshot, with the links in ``dead`` reported dead by both ends."""
    mesh.sent_at += 1.0
    for x, node in mesh.nodes.items():
        peers = []
        for (s, y), rtt in links.items():
            if s != x:
                continue
            gone = (x, y) in dead or (y, x) in dead
            peers.append(
                PeerReport(
                    public_key=mesh.key(y, x),
                    ifname="wg0",
                    rtt_ms=None if gone else rtt,
                    samples=64,
                    alive=not gone,
                )
            )
        mesh.view.take(x, node.telemetry(peers, sent_at=mesh.sent_at), now)


def _run(window_s: float, *, symmetric: bool = False) -> tuple[Mesh, list[Computed]]:
    mesh = Mesh("abcde")
    engine = RouteEngine(PolicyConfig(hold_s=30.0), symmetric=symmetric)
    engine.deaths.window_s = window_s
    out = []
    dead: set[tuple[str, str]] = set()
    for t, gone in ((0.0, None), (1.0, ("b", "a")), (1.5, ("c", "a")), (2.0, ("d", "a"))):
        if gone is not None:
            dead.add(gone)
        _report(mesh, STAR, dead, t)
        out.append(engine.compute(mesh.view, t))
    return mesh, out


@pytest.mark.parametrize("symmetric", [False, True], ids=["per-direction", "symmetric"])
def test_routes_towards_a_collapsing_node_are_not_moved_to_relays(symmetric: bool) -> None:
    mesh, (c0, c1, c2, c3) = _run(5.0, symmetric=symmetric)
    assert mesh.hop(c0, "b", "e") == "a"
    # One link dead: b's route to a takes a relay, as before.
    assert mesh.hop(c1, "b", "a") in {"c", "d", "e"}
    # A second one 0.5 s later: a collapses. b's relay through c broke: it falls back to
    # its own (dead) tunnel, the plain route its agent's fail-over also takes, not to d.
    assert mesh.hop(c2, "b", "a") == "a" and mesh.hop(c2, "c", "a") == "a"
    assert mesh.hop(c3, "b", "a") == "a" and mesh.hop(c3, "d", "a") == "a"
    # Working paths towards a stay; routes *through* a moved as always.
    assert mesh.hop(c3, "e", "a") == "a"
    assert mesh.hop(c1, "b", "e") != "a"
    if symmetric:  # one decision per pair: both direct, or both through one relay
        for c in (c1, c2, c3):
            for x in "bcde":
                there, back = mesh.hop(c, "a", x), mesh.hop(c, x, "a")
                assert (there, back) == (x, "a") or there == back, (x, there, back)


@pytest.mark.parametrize("symmetric", [False, True], ids=["per-direction", "symmetric"])
def test_without_the_rule_the_route_towards_a_hops_from_relay_to_relay(symmetric: bool) -> None:
    """What the rule prevents (window 0: no two deaths are ever close enough)."""
    mesh, (_, c1, c2, c3) = _run(0.0, symmetric=symmetric)
    hops = [mesh.hop(c, "b", "a") for c in (c1, c2, c3)]
    assert hops[1] not in {"a", "b", hops[0]}, hops


@pytest.mark.parametrize("settle", [5.1, 9.0])
def test_once_settled_a_node_still_alive_is_reached_over_relays_again(settle: float) -> None:
    mesh = Mesh("abcde")
    engine = RouteEngine(PolicyConfig(hold_s=30.0))
    dead = {("b", "a"), ("c", "a")}
    _report(mesh, STAR, set(), 0.0)
    engine.compute(mesh.view, 0.0)
    _report(mesh, STAR, dead, 1.0)
    c = engine.compute(mesh.view, 1.0)
    assert mesh.hop(c, "b", "a") == "a"  # collapsing: both died at once
    _report(mesh, STAR, dead, 1.0 + settle)
    c = engine.compute(mesh.view, 1.0 + settle)
    assert mesh.hop(c, "b", "a") in {"d", "e"}, "a lives on over d and e"


def test_the_urgent_path_moves_no_entry_towards_a_collapsing_node() -> None:
    from meshopt.controller.urgent import urgent_fix
    from meshopt.routing.allpairs import compute_routes
    from meshopt.topology.generators import generate

    n = 40
    cost = np.array(generate(f"gen:geo:n={n},seed=3").rtt_ms(), dtype=float)
    np.fill_diagonal(cost, 0.0)
    nh = compute_routes(cost, relay_hop_ms=2.0).next_hop
    x = 0
    # Two of x's links die (its agent still up): the entries over them are broken.
    direct = [s for s in range(1, n) if nh[s, x] == x][:2]
    after = cost.copy()
    bad = np.zeros((n, n), dtype=bool)
    for s in direct:
        after[s, x] = after[x, s] = np.inf
        bad[s, x] = bad[x, s] = True
    alive = np.zeros(n, dtype=bool)
    plain = urgent_fix(nh, after, np.zeros((n, n)), bad, alive, PolicyConfig())
    assert {(s, x) for s in direct} <= set(zip(plain.s.tolist(), plain.d.tolist(), strict=True))
    held = np.arange(n) == x
    fix = urgent_fix(nh, after, np.zeros((n, n)), bad, alive, PolicyConfig(), held=held)
    assert fix.s.size and not (fix.d == x).any(), "nothing towards x moves"
    # Routes through x over the dead links still move, as without the rule.
    others = plain.d != x
    assert set(zip(plain.s[others].tolist(), plain.d[others].tolist(), strict=True)) == set(
        zip(fix.s.tolist(), fix.d.tolist(), strict=True)
    )
