"""Backups for the installed routes: an alternate is judged by the route it forwards on.

The policy keeps entries off the best table (ties decided by name, hysteresis), so an
alternate's installed route need not be its best one; these tests build such tables by
hand and check which backup each entry gets.
"""

from __future__ import annotations

import numpy as np

from meshopt.controller.backups import sticky_backups
from meshopt.policy import PolicyConfig
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.backup import add_backups
from meshopt.routing.tables import FloatArray, IntArray, RouteTables

A, B, C, D, E = range(5)


def mesh(n: int, links: dict[tuple[int, int], float]) -> FloatArray:
    cost = np.full((n, n), np.inf)
    np.fill_diagonal(cost, 0.0)
    for (x, y), v in links.items():
        cost[x, y] = cost[y, x] = v
    return cost


def tables(cost: FloatArray) -> RouteTables:
    n = cost.shape[0]
    return add_backups(compute_routes(cost, [str(i) for i in range(n)]), cost, relay_hop_ms=2.0)


def backups(best: RouteTables, hop: IntArray, cost: FloatArray) -> list[IntArray]:
    """The fresh choice, and the one kept against the best table's own backups."""
    assert best.backup is not None
    return [
        sticky_backups(prev, best, hop, cost, PolicyConfig(), relay_hop_ms=2.0)
        for prev in (None, best.backup.copy())
    ]


def _ties(c_a: float) -> FloatArray:
    # e reaches b directly (8 ms); c reaches b via e (8 + 8 ms) or via a (c_a + 8 ms);
    # d is a far corner (50 ms to everyone); a-e and b-c are slow.
    links = {(A, B): 8.0, (B, E): 8.0, (A, C): c_a, (C, E): 8.0, (A, E): 100.0,
             (B, C): 30.0}  # fmt: skip
    links.update({(D, x): 50.0 for x in (A, B, C, E)})
    return mesh(5, links)


def test_a_tie_kept_off_the_best_route_is_judged_by_the_route_it_takes() -> None:
    # c's two routes to b tie (16.0 and 16.1 ms): the best table has c -> e -> b, the
    # policy kept c -> a -> b. For e -> b that makes c (8 + 18.1 ms) an alternate that
    # delivers without passing e; the best table's test calls it a loop and offers d
    # (50 + 50 ms). From the first decision, so noise that reorders c's two routes
    # (and with them the best table's test) moves no backup.
    cost = _ties(8.1)
    best = tables(cost)
    assert best.next_hop[C, B] == E and best.backup is not None and best.backup[E, B] == D
    hop = best.next_hop.copy()
    assert (backups(best, hop, cost)[0][E, B]) == D  # on the best table, d it is
    hop[C, B] = hop[B, C] = A
    for out in backups(best, hop, cost):
        assert out[E, B] == C


def test_an_alternate_held_off_its_best_route_is_not_taken_through_it() -> None:
    # Now c -> a -> b costs 1.5 ms more than c -> e -> b: no tie, the policy keeps it
    # only until the gain is confirmed, and then c's route runs through e. A backup
    # via c would break at that moment: d stays.
    cost = _ties(9.5)
    best = tables(cost)
    hop = best.next_hop.copy()
    hop[C, B] = hop[B, C] = A
    for out in backups(best, hop, cost):
        assert out[E, B] == D


def test_a_backup_whose_installed_route_comes_back_is_replaced() -> None:
    # 0 -> 3 via 1 (10 + 10 ms); the best table's alternate is 2 (12 + 10 ms), but the
    # policy kept 2's own route to 3 via 0 (hysteresis): at a fail-over 0 would hand its
    # packets to 2, which hands them back. 4 (30 + 30 ms) delivers; the direct tunnel
    # (100 ms) is the installed hop's fallback only through a backup, so 4 it is.
    cost = mesh(5, {(0, 1): 10.0, (1, 3): 10.0, (0, 2): 12.0, (2, 3): 10.0, (0, 4): 30.0,
                    (4, 3): 30.0, (0, 3): 100.0})  # fmt: skip
    best = tables(cost)
    assert best.backup is not None and best.backup[0, 3] == 2
    hop = best.next_hop.copy()
    hop[2, 3] = 0  # kept off its best path
    for out in backups(best, hop, cost):
        assert out[0, 3] == 4


def test_a_replacement_held_on_a_route_it_will_leave_through_s_is_passed_over() -> None:
    # As above, and 5 (5 ms from 0) is held on its direct tunnel to 3 (30 ms) where its
    # best route runs 5 -> 0 -> 1 -> 3 (31 ms with the relay hops): cheaper than 4, and
    # its installed route avoids 0, but once the policy moves it, it runs through 0.
    cost = mesh(6, {(0, 1): 10.0, (1, 3): 10.0, (0, 2): 12.0, (2, 3): 10.0, (0, 4): 30.0,
                    (4, 3): 30.0, (0, 3): 100.0, (0, 5): 5.0, (5, 3): 30.0})  # fmt: skip
    best = tables(cost)
    assert best.next_hop[5, 3] == 0 and best.backup is not None and best.backup[0, 3] == 2
    hop = best.next_hop.copy()
    hop[2, 3] = 0
    hop[5, 3] = 3  # held on the direct tunnel
    for out in backups(best, hop, cost):
        assert out[0, 3] == 4
