import math

import numpy as np
import pytest

from meshopt.errors import InputError
from meshopt.graph import build_graph, cost_matrix, topology_costs
from meshopt.metric import LinkSample, Metric
from meshopt.topology.model import LinkProps, Node, Topology


def test_cost_is_rtt_plus_jitter_and_loss_penalties() -> None:
    m = Metric()
    assert m.link_cost(LinkSample(rtt_ms=40.0)) == pytest.approx(40.0)
    assert m.link_cost(LinkSample(rtt_ms=40.0, jitter_ms=3.0)) == pytest.approx(46.0)
    # 5% loss: 200 ms * 0.05 / 0.95 extra.
    assert m.link_cost(LinkSample(rtt_ms=40.0, loss=0.05)) == pytest.approx(40 + 200 * 0.05 / 0.95)


def test_dead_and_missing_links_are_explicit() -> None:
    m = Metric()
    assert m.link_cost(LinkSample(rtt_ms=10.0, loss=1.0)) == math.inf
    assert m.link_cost(LinkSample(rtt_ms=math.inf)) == math.inf
    assert m.link_cost(None) == m.unknown_cost_ms


def test_aging_inflates_and_stale_becomes_unknown() -> None:
    m = Metric(fresh_s=10, stale_s=30, aging_penalty=0.5)
    assert m.link_cost(LinkSample(rtt_ms=20.0, age_s=5)) == pytest.approx(20.0)
    assert m.link_cost(LinkSample(rtt_ms=20.0, age_s=20)) == pytest.approx(25.0)
    assert m.link_cost(LinkSample(rtt_ms=20.0, age_s=31)) == m.unknown_cost_ms


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rtt_ms": -1.0},
        {"rtt_ms": math.nan},
        {"rtt_ms": 1.0, "loss": 1.5},
        {"rtt_ms": 1.0, "loss": -0.1},
    ],
)
def test_impossible_samples_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(InputError):
        LinkSample(**kwargs)


def test_graph_keeps_asymmetry_and_drops_down_links() -> None:
    samples = {
        ("a", "b"): LinkSample(rtt_ms=10.0),
        ("b", "a"): LinkSample(rtt_ms=30.0),
        ("a", "c"): LinkSample(rtt_ms=5.0, loss=1.0),
        ("c", "a"): LinkSample(rtt_ms=5.0, age_s=100.0),
    }
    g = build_graph(["a", "b", "c"], samples)
    assert g["a"]["b"]["cost"] == 10.0 and g["b"]["a"]["cost"] == 30.0
    assert not g.has_edge("a", "c")
    assert g["c"]["a"]["state"] == "stale"
    assert g["b"]["c"]["state"] == "missing"
    m = cost_matrix(g)
    assert m[0, 1] == 10.0 and m[1, 0] == 30.0 and m[0, 2] == math.inf


def test_topology_costs_combine_both_directions() -> None:
    nodes = [Node("a"), Node("b")]
    t = Topology.from_links("t", nodes, LinkProps(delay_ms=10.0))
    t.set_link("a", "b", LinkProps(delay_ms=30.0, loss=0.1))
    c = topology_costs(t)
    rt_loss = 1 - 0.9
    expected = 40.0 + 200 * rt_loss / (1 - rt_loss)
    assert c[0, 1] == pytest.approx(expected) and c[1, 0] == pytest.approx(expected)
    assert np.all(np.diag(c) == 0)
