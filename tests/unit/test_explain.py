"""The controller's "why not" lines: each reason the policy has for keeping a slower path."""

from __future__ import annotations

import numpy as np

from meshopt.controller.explain import pending
from meshopt.policy import Installed, PolicyConfig, decide
from meshopt.routing.allpairs import compute_routes
from meshopt.routing.tables import RouteTables

NAMES = ["a", "b", "c"]
POLICY = PolicyConfig(hold_s=30.0, confirm_s=30.0)


def triangle(ab: float) -> np.ndarray:
    """a-b direct at ``ab`` ms, a-c and c-b at 10 ms each: via c is 20 ms."""
    return np.array([[0.0, ab, 10.0], [ab, 0.0, 10.0], [10.0, 10.0, 0.0]])


def direct(n: int) -> Installed:
    return Installed(next_hop=np.tile(np.arange(n), (n, 1)), since=np.zeros((n, n)))


def judged(ab: float, noise_ms: float, now: float, since: float = 0.0) -> list[str]:
    cost = triangle(ab)
    best: RouteTables = compute_routes(cost, NAMES, relay_hop_ms=0.0)
    installed = direct(3)
    installed.since = np.full((3, 3), since)
    noise = np.full((3, 3), noise_ms)
    np.fill_diagonal(noise, 0.0)
    dec = decide(installed, best, cost, noise, now, POLICY, relay_hop_ms=0.0)
    return pending(NAMES, best, dec, POLICY, now, symmetric=False)


def test_a_gain_inside_the_noise_says_so_with_the_figures() -> None:
    lines = judged(30.0, noise_ms=5.0, now=100.0)
    assert lines, "a-b keeps the 30 ms tunnel against 20 ms via c: it must be listed"
    line = next(x for x in lines if x.startswith("a->b"))
    assert "stays direct (30.00 ms), best via c (20.00 ms): gain 10.00 ms" in line
    # 3 sigma of three links of 5 ms noise each: 3 * sqrt(3 * 25)
    assert "gain within the noise term (large margin 3.00, noise 25.98)" in line


def test_a_large_gain_waits_for_its_hold() -> None:
    lines = judged(30.0, noise_ms=0.1, now=10.0, since=0.0)
    line = next(x for x in lines if x.startswith("a->b"))
    assert "large gain, held 20.0 s more" in line


def test_a_small_gain_is_confirming() -> None:
    # 21 ms against 20: under the 3 ms large margin, over the small one (0.5 ms, 2 %)
    lines = judged(21.0, noise_ms=0.01, now=100.0)
    line = next(x for x in lines if x.startswith("a->b"))
    assert "small gain, confirming 0.0 of 30 s" in line


def test_nothing_pending_once_the_best_is_installed() -> None:
    assert judged(30.0, noise_ms=0.1, now=100.0, since=0.0) == []


def test_a_symmetric_pair_is_listed_once() -> None:
    cost = triangle(30.0)
    best = compute_routes(cost, NAMES, relay_hop_ms=0.0, symmetric=True)
    noise = np.full((3, 3), 5.0)
    np.fill_diagonal(noise, 0.0)
    dec = decide(direct(3), best, cost, noise, 100.0, POLICY, relay_hop_ms=0.0, symmetric=True)
    lines = pending(NAMES, best, dec, POLICY, 100.0, symmetric=True)
    assert [x.split()[0] for x in lines] == ["a->b"]
