"""Route quality's split between the route and the lab (pure: a plan, no namespaces)."""

from __future__ import annotations

import pytest

from meshopt.analysis import Plan, plan
from meshopt.bench.convergence import RunResult, _quality_verdict, kept, missing
from meshopt.lab.measure import PairQuality, path_rtt
from meshopt.topologies import packaged
from meshopt.topology.load import load_topology


@pytest.fixture(scope="module")
def triangle_plan() -> Plan:
    return plan(load_topology(str(packaged("triangle.yaml"))))


def test_path_rtt_sums_the_configured_tunnels(triangle_plan: Plan) -> None:
    assert path_rtt(triangle_plan, ["a", "b"]) == pytest.approx(80.0)
    assert path_rtt(triangle_plan, ["a", "c", "b"]) == pytest.approx(40.0)
    for broken in (["a"], ["a", "?"], ["a", "c", "?"], ["a", "zz"]):
        assert path_rtt(triangle_plan, broken) is None


def quality(path: list[str], path_ms: float | None, achieved: float | None) -> PairQuality:
    return PairQuality("a", "b", 80.0, 40.0, ["a", "c", "b"], achieved, path, path_ms=path_ms)


def test_a_slow_ping_on_the_right_path_is_the_labs_overhead_not_the_routes() -> None:
    q = quality(["a", "c", "b"], 40.0, 43.5)  # 8.75 % over the optimum by ping
    assert q.path_within() and q.overhead_ms == pytest.approx(3.5)
    assert (q.error or 0) > 0.05
    # The direct tunnel is outside the goal by its configured RTT, whatever pings say.
    assert not quality(["a", "b"], 80.0, 41.0).path_within()
    # max(5 %, 1 ms): a 1 ms detour on a short path is within.
    short = PairQuality("a", "b", 9.0, 8.0, ["a", "b"], 9.0, ["a", "c", "b"], path_ms=9.0)
    assert short.path_within() and not short.path_within(abs_ms=0.5)
    assert not quality(["a", "?"], None, None).path_within()
    assert quality(["a", "?"], None, None).overhead_ms is None


def test_the_verdict_names_whose_miss_it_is() -> None:
    ok = RunResult(pairs=6, within_goal=6, path_within_goal=6)
    lab = RunResult(pairs=6, within_goal=4, path_within_goal=6)
    route = RunResult(pairs=6, within_goal=4, path_within_goal=5)
    assert _quality_verdict([ok, ok]).startswith("every pair within the goal")
    assert "2 ping readings" in _quality_verdict([ok, lab])
    assert _quality_verdict([ok, lab, route]).startswith("1 pair readings on a path outside")


def test_the_pairs_a_reading_misses_are_named_with_the_path_taken(triangle_plan: Plan) -> None:
    # The triangle's a-b tunnel is 80 ms and a-c-b 40 ms: a->b and b->a direct are misses.
    direct = {"a": {"b": "b", "c": "c"}, "b": {"a": "a", "c": "c"}, "c": {"a": "a", "b": "b"}}
    assert missing(triangle_plan, direct, 1.0, 0.05) == ["a->b via a-b", "b->a via b-a"]
    assert kept(triangle_plan, direct, 1.0, 0.05) == 4
    relayed = {**direct, "a": {"b": "c", "c": "c"}, "b": {"a": "c", "c": "c"}}
    assert missing(triangle_plan, relayed, 1.0, 0.05) == []
    looped = {**relayed, "c": {"a": "a", "b": "a"}}
    assert missing(triangle_plan, looped, 1.0, 0.05) == ["a->b via a-c-?", "c->b via c-a-?"]


def test_the_policys_margins_are_gains_on_the_current_path_not_overshoots_of_the_optimum() -> None:
    from meshopt.lab.measure import near_optimum, path_cost, policy_keeps

    bench8 = plan(load_topology(str(packaged("bench8.yaml"))))
    via_a, via_b = ["c", "a", "f"], ["c", "b", "f"]  # 42 and 38 ms RTT configured
    cur, opt = path_cost(bench8, via_a), path_cost(bench8, via_b)
    assert 1.10 * opt < cur < opt / 0.90  # over the optimum by 10 %+, a gain under 10 %
    # decide() moves only on gain >= 10 % of cur: a small gain, kept until confirmed
    assert policy_keeps(bench8, via_a, 3.0, 0.10)
    assert not near_optimum(bench8, via_a, 3.0, 0.10)
    # c-h direct (30 ms) against c-a-h (26 ms): a large gain either way
    assert not policy_keeps(bench8, ["c", "h"], 3.0, 0.10)
    assert not policy_keeps(bench8, via_a, 0.5, 0.02)  # the small margins do move it
    assert not policy_keeps(bench8, ["c", "a", "?"], 3.0, 0.10)
