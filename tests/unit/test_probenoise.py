"""The shape of the lab's probe noise (meshopt.bench.probenoise)."""

from __future__ import annotations

import math

import numpy as np

from meshopt.bench.probenoise import QUANTILES, fit, simulated_readings
from meshopt.topology.model import LinkProps, Node, Topology

NODES = "abcd"


def topo() -> Topology:
    # 0.2 ms σ each way, as demo's links: a round trip's σ is 0.28 ms.
    return Topology.from_links("t", [Node(x) for x in NODES], LinkProps(20.0, 0.2), {})


def readings(values: np.ndarray) -> list[tuple[str, str, float]]:
    pairs = [(a, b) for a in NODES for b in NODES if a != b]
    return [(*pairs[k % len(pairs)], float(x)) for k, x in enumerate(values)]


def log_error(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return float(np.sum((np.log(a) - np.log(b)) ** 2))


def test_a_tail_of_late_probes_is_found_and_fits_better_than_normal_noise() -> None:
    base = [(40.0, math.hypot(0.2, 0.2))]
    lab = simulated_readings(base, 0.1, 0.05, 1.5, seed=7)
    got = fit(readings(lab), topo())
    assert got is not None and got.readings == lab.size
    assert got.late_p > 0.0 and 0.03 <= got.late_mean_ms <= 0.15  # truth: 0.075 ms
    # The late probes' tail: the normal model cannot reach the lab's 99th percentile.
    top = QUANTILES.index(0.99)
    assert abs(got.model[top] / got.lab[top] - 1.0) < 0.1
    assert got.normal[top] < 0.9 * got.lab[top]
    assert log_error(got.model, got.lab) < log_error(got.normal, got.lab)


def test_normal_noise_is_found_normal() -> None:
    lab = simulated_readings([(40.0, math.hypot(0.2, 0.2))], 0.2, 0.0, 0.0, seed=3)
    got = fit(readings(lab), topo())
    assert got is not None
    assert got.late_mean_ms <= 0.02
    assert abs(got.model[2] / got.lab[2] - 1.0) < 0.05  # the medians
    # σ added: 0.2 ms, or a little less where a few late probes make up the rest.
    assert 0.1 <= got.sigma_ms <= 0.25


def test_too_few_readings_unknown_nodes_and_non_numbers_give_none() -> None:
    assert fit([], topo()) is None
    bad = [("a", "zz", 0.3), ("a", "a", 0.3), ("a", "b", math.nan), ("b", "a", 0.0)] * 10
    assert fit(bad, topo()) is None
    assert fit([("a", "b", 0.3)] * 19, topo()) is None


def test_late_probes_lift_a_long_links_sigma_more_than_a_short_ones() -> None:
    """The outlier rule drops a 3 ms late probe on an 8 ms link, keeps it on 80 ms."""
    sigma = math.hypot(0.2, 0.2)
    short = simulated_readings([(8.0, sigma)], 0.0, 0.05, 1.5, seed=1)
    long = simulated_readings([(80.0, sigma)], 0.0, 0.05, 1.5, seed=1)
    assert np.median(long) > 1.2 * np.median(short)
    assert np.quantile(long, 0.9) > 1.2 * np.quantile(short, 0.9)
