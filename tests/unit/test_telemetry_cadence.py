"""When an agent sends what, what the steady state costs, and how the controller's view
follows: full snapshots at an interval that stretches with the peer count, change
reports of only the peers that moved, heartbeats, staleness relative to the announced
interval, and matrices built from a node's rows in one vectorised step.

Times are passed in (pure code); sizes are the real signed messages' bytes.
"""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest

from meshopt.agent.config import TelemetrySettings
from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.telemetry import Cadence, Plan, full_interval, signed_telemetry
from meshopt.bench.synthetic import SyntheticMesh
from meshopt.bus.messages import PeerReport, Telemetry, decode, encode, peer_table
from meshopt.bus.signing import generate_signing_key, public_key_b64
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import ControllerCore
from meshopt.controller.view import MeshView, TelemetryRefused, link_cost
from meshopt.metric import Metric
from meshopt.wireguard.keys import generate_keypair

CFG = TelemetrySettings()  # check 1 s, base interval 5 s, 30 peers, at most 120 s
KEYS = [generate_keypair()[1] for _ in range(6)]


def rep(key: str, rtt: float | None = 10.0, **kw: object) -> PeerReport:
    kw.setdefault("alive", True)
    return PeerReport(public_key=key, ifname="wg0", rtt_ms=rtt, samples=64, **kw)  # type: ignore[arg-type]


def reports(*rows: PeerReport) -> dict[str, PeerReport]:
    return {p.public_key: p for p in rows}


# -- the interval rule -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peers", "want"),
    [(0, 5.0), (10, 5.0), (30, 5.0), (60, 10.0), (249, 41.5), (720, 120.0), (999, 120.0)],
)
def test_full_interval_stretches_with_the_peer_count(peers: int, want: float) -> None:
    assert full_interval(peers, CFG) == pytest.approx(want)


def test_full_interval_follows_the_settings() -> None:
    cfg = TelemetrySettings(full_interval_s=2.0, full_peers=10, max_full_interval_s=30.0)
    assert full_interval(5, cfg) == 2.0
    assert full_interval(50, cfg) == 10.0
    assert full_interval(500, cfg) == 30.0


# -- the cadence -------------------------------------------------------------------------


def run(c: Cadence, r: dict[str, PeerReport], now: float) -> Plan | None:
    plan = c.plan(r, now, CFG)
    if plan is not None:
        c.sent(plan, now)
    return plan


def test_first_a_full_snapshot_then_nothing_until_a_heartbeat() -> None:
    c = Cadence()
    r = reports(*(rep(k) for k in KEYS))
    first = run(c, r, 0.0)
    assert first is not None and first.full and len(first.peers) == len(KEYS)
    assert first.interval_s == 5.0
    assert [run(c, r, t) for t in (1.0, 2.0, 3.0, 4.0)] == [None] * 4
    beat = run(c, r, 5.0)
    # Six peers: the snapshot interval is the base 5 s, so the snapshot is due again.
    assert beat is not None and beat.full


def test_snapshots_keep_their_phase_when_checks_run_late_or_shift() -> None:
    """Checks run a little late (timers) and shift (a change report is told at once and
    the next check counts from it). Snapshots stay on their 5 s grid: each within a
    check of a multiple of 5 s. Counted from the check that sent them, they drifted
    by each check's lateness, and one landing a few ms short of 5 s waited a whole
    check: the lab's agents, started within 0.5 s, ended seconds apart."""
    c = Cadence()
    r = reports(*(rep(k) for k in KEYS))
    t, fulls = 0.0, []
    while t < 100.0:
        plan = run(c, r, t)
        if plan is not None and plan.full:
            fulls.append(t)
        t += 1.013 if int(t) % 7 else 1.3  # late, and now and then shifted
    assert len(fulls) >= 20, fulls
    assert all(abs(x - 5.0 * round(x / 5.0)) <= 1.0 for x in fulls), fulls


def test_a_check_a_few_ms_short_of_the_interval_sends_the_snapshot() -> None:
    c = Cadence()
    r = reports(*(rep(k) for k in KEYS))
    assert run(c, r, 0.0) is not None
    assert [run(c, r, t) for t in (1.0, 2.0, 3.0, 4.0)] == [None] * 4
    plan = run(c, r, 4.998)
    assert plan is not None and plan.full
    assert c.last_full == 5.0  # counted from when it was due
    plan = run(c, r, 9.997)
    assert plan is not None and plan.full


def test_between_snapshots_only_changed_peers_go_out_and_heartbeats_are_empty() -> None:
    c = Cadence()
    many = [generate_keypair()[1] for _ in range(60)]  # 60 peers: snapshots every 10 s
    r = reports(*(rep(k) for k in many))
    assert run(c, r, 0.0) is not None
    # Noise below the thresholds (1 ms and 10 %) is not worth a message.
    r2 = dict(r)
    r2[many[3]] = rep(many[3], 10.5)
    assert run(c, r2, 1.0) is None
    # A real step goes out at the next check, alone.
    r3 = dict(r2)
    r3[many[7]] = rep(many[7], 25.0)
    plan = run(c, r3, 2.0)
    assert plan is not None and not plan.full and [p.public_key for p in plan.peers] == [many[7]]
    assert plan.interval_s == 10.0
    # A dead peer goes out at once too.
    r4 = dict(r3)
    r4[many[9]] = rep(many[9], 10.0, alive=False)
    plan = run(c, r4, 3.0)
    assert plan is not None and [p.public_key for p in plan.peers] == [many[9]]
    # Nothing moved: silence, then an empty change report 5 s after the last message.
    assert run(c, r4, 4.0) is None and run(c, r4, 7.0) is None
    beat = run(c, r4, 8.0)
    assert beat is not None and not beat.full and beat.peers == []
    # The snapshot is due 10 s after the last one.
    assert run(c, r4, 9.0) is None
    full = run(c, r4, 10.0)
    assert full is not None and full.full and len(full.peers) == 60


def test_drift_counts_from_what_was_last_published() -> None:
    """Small steps that add up to a significant one are reported, once."""
    c = Cadence()
    r = reports(rep(KEYS[0], 10.0), rep(KEYS[1]))
    run(c, r, 0.0)
    steps = [10.6, 11.2]  # each < 1 ms from the last, 1.2 ms and 12 % from the published
    assert run(c, reports(rep(KEYS[0], steps[0]), rep(KEYS[1])), 1.0) is None
    plan = run(c, reports(rep(KEYS[0], steps[1]), rep(KEYS[1])), 2.0)
    assert plan is not None and [p.rtt_ms for p in plan.peers] == [11.2]
    assert run(c, reports(rep(KEYS[0], 11.3), rep(KEYS[1])), 3.0) is None


def test_a_peer_set_change_or_a_new_session_sends_a_full_snapshot() -> None:
    c = Cadence()
    run(c, reports(rep(KEYS[0]), rep(KEYS[1])), 0.0)
    plan = run(c, reports(rep(KEYS[0])), 1.0)
    assert plan is not None and plan.full and len(plan.peers) == 1
    c.reset()
    plan = run(c, reports(rep(KEYS[0])), 2.0)
    assert plan is not None and plan.full


def test_a_failed_publish_is_retried_at_the_next_check() -> None:
    c = Cadence()
    r = reports(rep(KEYS[0]))
    run(c, r, 0.0)
    moved = reports(rep(KEYS[0], 30.0))
    plan = c.plan(moved, 1.0, CFG)
    assert plan is not None and plan.peers  # ... and the broker did not take it
    again = c.plan(moved, 2.0, CFG)
    assert again is not None and again.peers == plan.peers


@pytest.mark.parametrize(("n", "goal"), [(250, 2000.0), (1000, 5000.0)])
def test_steady_uplink_meets_the_goal(n: int, goal: float) -> None:
    """Issue 15's goals for an agent's steady uplink, from real signed message sizes:
    a node of an n-node mesh (every field an agent fills, 1 % RTT noise) checked every
    second for two snapshot intervals."""
    mesh = SyntheticMesh(n, seed=1)
    key, _ = generate_signing_key()
    core = AgentCore("bench", "n0000", key, [], RouteState(), 1_700_000_000.0)
    rng = random.Random(1)
    c = Cadence()
    sent = 0
    fulls = 0
    window = 2 * math.ceil(full_interval(n - 1, CFG))  # checks fall on whole seconds
    # Reports are the expensive part of this test: one set per 5 s of noise is enough
    # (the checks in between see the same values, as a quiet agent does).
    r: dict[str, PeerReport] = {}
    for t in range(window + 1):
        if t % 5 == 0:
            r = {p.public_key: p for p in mesh.reports(0, rng, sent=t)}
        plan = c.plan(r, float(t), CFG)
        if plan is None:
            continue
        msg = signed_telemetry(
            core, 1_700_000_000.0 + t, public_keys=[mesh.nodes[0].wg_key],
            addresses=[mesh.nodes[0].address], plan=plan, counters={"probe_sent": 10**6},
        )  # fmt: skip
        if t > 0:  # the first snapshot is the start-up one
            sent += len(msg)
            fulls += plan.full
        c.sent(plan, float(t))
    assert fulls == 2  # one interval and two intervals in
    per_s = sent / window
    assert per_s <= goal, per_s


# -- the controller's view ---------------------------------------------------------------


def tel(
    node: str,
    key: str,
    peers: list[PeerReport],
    sent_at: float,
    *,
    full: bool = True,
    interval: float = 40.0,
    index: int = 1,
) -> Telemetry:
    t = Telemetry(
        mesh="lab",
        node=node,
        public_key=key,
        public_keys=[key],
        addresses=[f"10.99.0.{index}/32"],
        seq=int(sent_at * 10) + 1,
        sent_at=sent_at,
        full=full,
        table=peer_table(peers),
        full_interval_s=interval,
    )
    return decode(encode(t), Telemetry)


def test_heartbeats_keep_a_node_online_and_a_missing_snapshot_makes_it_stale() -> None:
    view = MeshView("lab", stale_after_s=15.0)
    a = KEYS[0]
    view.take("a", tel("a", a, [rep(KEYS[1])], 0.0), 0.0)
    for t in range(5, 120, 5):  # heartbeats every 5 s, no snapshot: deltas may be lost
        view.take("a", tel("a", a, [], float(t), full=False), float(t))
        assert view.expire(float(t)) == []
    # Three announced intervals (120 s) without a full snapshot: the picture is stale.
    view.take("a", tel("a", a, [], 121.0, full=False), 121.0)
    assert not view.nodes["a"].online
    assert view.nodes["a"].offline_reason == "no full snapshot"
    view.take("a", tel("a", a, [rep(KEYS[1])], 122.0), 122.0)
    assert view.nodes["a"].online


def test_silence_is_stale_after_stale_after_s_whatever_the_interval() -> None:
    view = MeshView("lab", stale_after_s=15.0)
    view.take("a", tel("a", KEYS[0], [rep(KEYS[1])], 0.0, interval=120.0), 0.0)
    assert view.expire(15.0) == []
    assert view.expire(15.5) == ["a"]
    assert view.nodes["a"].offline_reason == "telemetry stale"


def test_without_an_announced_interval_staleness_is_as_before() -> None:
    view = MeshView("lab", stale_after_s=15.0)
    view.take("a", tel("a", KEYS[0], [rep(KEYS[1])], 0.0, interval=0.0), 0.0)
    assert view.expire(15.0) == [] and view.expire(15.5) == ["a"]


def test_a_retained_snapshot_younger_than_its_interval_is_current() -> None:
    """A controller starting late gets the retained snapshot, up to an interval old."""
    view = MeshView("lab", stale_after_s=15.0)
    wall = 1_000_000.0
    old = tel("a", KEYS[0], [rep(KEYS[1])], wall - 100.0, interval=120.0)
    view.take("a", old, 50.0, wall)
    assert view.nodes["a"].online
    assert view.expire(60.0) == []  # heartbeats will keep it
    older = MeshView("lab", stale_after_s=15.0)
    older.take("a", tel("a", KEYS[0], [rep(KEYS[1])], wall - 200.0, interval=120.0), 50.0, wall)
    assert older.expire(50.0) == ["a"]  # 80 s past its interval: the agent is gone


def test_change_reports_update_only_their_peers() -> None:
    view = MeshView("lab")
    view.take("a", tel("a", KEYS[0], [rep(KEYS[1], 10.0), rep(KEYS[2], 20.0)], 0.0), 0.0)
    view.take("a", tel("a", KEYS[0], [rep(KEYS[2], 50.0)], 1.0, full=False), 1.0)
    view.take("a", tel("a", KEYS[0], [], 2.0, full=False), 2.0)
    rows = view.nodes["a"].peers
    assert (rows[KEYS[1]].rtt_ms, rows[KEYS[2]].rtt_ms) == (10.0, 50.0)
    view.take("a", tel("a", KEYS[0], [rep(KEYS[1], 11.0)], 3.0), 3.0)  # full: replaces
    assert list(view.nodes["a"].peers) == [KEYS[1]]


def test_a_change_report_before_any_snapshot_is_taken() -> None:
    view = MeshView("lab", stale_after_s=15.0)
    view.take("a", tel("a", KEYS[0], [rep(KEYS[1], 10.0)], 0.0, full=False), 0.0)
    assert view.nodes["a"].online and KEYS[1] in view.nodes["a"].peers
    assert view.expire(100.0 - 1e-9) == ["a"]  # silent: stale_after_s still applies


def test_many_change_reports_before_anything_reads_them() -> None:
    view = MeshView("lab")
    view.take("a", tel("a", KEYS[0], [rep(KEYS[1], 10.0)], 0.0), 0.0)
    for i in range(200):
        view.take("a", tel("a", KEYS[0], [rep(KEYS[1], 10.0 + i)], 1.0 + i, full=False), 1.0)
    assert view.nodes["a"].peers[KEYS[1]].rtt_ms == 209.0


# -- vectorised matrices -----------------------------------------------------------------


def reference_matrices(view: MeshView, now: float) -> tuple[np.ndarray, ...]:
    """The matrices as the view computed them before, one link_cost per peer."""
    names = view.names()
    index = {n: i for i, n in enumerate(names)}
    n = len(names)
    cost = np.full((n, n), np.inf)
    noise = np.zeros((n, n))
    bw = np.zeros((n, n))
    rtt = np.full((n, n), np.nan)
    pmtu = np.zeros((n, n))
    up = np.array([view.nodes[x].online for x in names], dtype=bool)
    owner = view.node_of_key()
    for s_name, info in view.nodes.items():
        s = index[s_name]
        if not info.online:
            continue
        age = max(0.0, now - info.last_seen)
        for key, r in info.peers.items():
            d_name = owner.get(key)
            if d_name is None or d_name == s_name or not up[index[d_name]]:
                continue
            d = index[d_name]
            c, sd = link_cost(r, view.metric, age)
            cost[s, d] = c
            noise[s, d] = sd
            if r.bandwidth_mbit is not None and math.isfinite(c):
                bw[s, d] = r.bandwidth_mbit
            if r.rtt_ms is not None and math.isfinite(c):
                rtt[s, d] = r.rtt_ms
            if r.pmtu is not None:
                pmtu[s, d] = r.pmtu
    np.fill_diagonal(cost, 0.0)
    return cost, noise, bw, rtt, pmtu


def random_view(seed: int) -> MeshView:
    rng = random.Random(seed)
    n = 12
    keys = [generate_keypair()[1] for _ in range(n)]
    stranger = generate_keypair()[1]
    view = MeshView("lab", metric=Metric(fresh_s=1.0, stale_s=3.0))
    for i in range(n):
        peers = []
        for j in range(n):
            if j == i or rng.random() < 0.1:
                continue
            kind = rng.random()
            peers.append(
                PeerReport(
                    public_key=keys[j],
                    ifname="wg0",
                    alive=None if kind < 0.1 else kind > 0.2,
                    rtt_ms=None if kind < 0.3 else round(rng.uniform(0.1, 300.0), 2),
                    jitter_ms=None if rng.random() < 0.3 else round(rng.uniform(0, 5), 2),
                    noise_ms=None if rng.random() < 0.3 else round(rng.uniform(0, 2), 2),
                    loss=None if rng.random() < 0.3 else rng.choice([0.0, 0.01, 0.3, 1.0]),
                    samples=rng.randint(0, 100),
                    bandwidth_mbit=None if rng.random() < 0.5 else rng.uniform(1, 1000),
                    pmtu=None if rng.random() < 0.5 else rng.choice([1280, 1420]),
                )
            )
        peers.append(PeerReport(public_key=stranger, ifname="wg0", rtt_ms=1.0))
        t = Telemetry(
            mesh="lab", node=f"n{i}", public_key=keys[i], addresses=[f"10.99.0.{i}/32"],
            seq=1, sent_at=1.0, full=True, table=peer_table(peers), full_interval_s=10.0,
        )  # fmt: skip
        view.take(f"n{i}", decode(encode(t), Telemetry), float(rng.randint(0, 4)))
    view.set_offline("n3", "test")
    return view


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_matrices_equal_the_per_link_costs(seed: int) -> None:
    view = random_view(seed)
    m = view.matrices(4.5)
    for got, want in zip(
        (m.cost, m.noise, m.bandwidth, m.rtt, m.pmtu), reference_matrices(view, 4.5), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_matrices_follow_a_change_made_to_the_rows() -> None:
    view = random_view(7)
    view.matrices(4.5)  # arrays built and cached
    info = view.nodes["n1"]
    key = next(iter(info.peers))
    info.peers[key] = msgspec.structs.replace(info.peers[key], alive=False)
    m = view.matrices(4.5)
    np.testing.assert_array_equal(m.cost, reference_matrices(view, 4.5)[0])
    d = view.names().index(view.node_of_key()[key])
    assert m.cost[view.names().index("n1"), d] == math.inf


# -- through the controller core ---------------------------------------------------------


def test_controller_core_takes_snapshots_changes_and_heartbeats() -> None:
    mesh = SyntheticMesh(4, seed=1)
    cfg = ControllerConfig(
        mesh="bench", id="ctl1", signing_key="/unused",
        node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in mesh.nodes),
    )  # fmt: skip
    core = ControllerCore(cfg, generate_signing_key()[0])
    x = mesh.nodes[0]
    ag = AgentCore("bench", x.name, x.identity, [], RouteState(), 1_700_000_000.0)
    peers = mesh.reports(0, random.Random(1))
    wall = 1_700_000_000.0
    for i, plan in enumerate(
        (
            Plan(True, peers, 5.0),
            Plan(False, [msgspec.structs.replace(peers[1], rtt_ms=444.0)], 5.0),
            Plan(False, [], 5.0),
        )
    ):
        msg = signed_telemetry(
            ag, wall + i, public_keys=[x.wg_key], addresses=[x.address], plan=plan, counters={}
        )
        core.on_message(f"meshopt/bench/telemetry/{x.name}", msg, False, float(i), wall + i)
    assert core.dropped() == {}
    info = core.view.nodes[x.name]
    assert info.full_interval_s == 5.0 and info.online
    assert info.peers[peers[1].public_key].rtt_ms == 444.0
    assert info.peers[peers[2].public_key].rtt_ms == pytest.approx(peers[2].rtt_ms, abs=0.005)


def test_next_due_is_the_next_heartbeat_or_snapshot() -> None:
    c = Cadence()
    r = reports(*(rep(k) for k in KEYS))
    run(c, r, 100.0)
    # Six peers: snapshot every 5 s; the heartbeat would be due half a check earlier.
    assert c.next_due(len(r), CFG) == pytest.approx(104.5)
    many = 240  # 40 s snapshots: the heartbeat comes first
    c2 = Cadence(last_full=100.0, last_sent=130.0)
    assert c2.next_due(many, CFG) == pytest.approx(134.5)
    c3 = Cadence(last_full=100.0, last_sent=138.0)  # the snapshot: half a check early too
    assert c3.next_due(many, CFG) == pytest.approx(139.5)


def test_a_key_a_node_gave_up_may_be_claimed_by_another() -> None:
    view = MeshView("lab")
    view.take("a", tel("a", KEYS[0], [], 0.0), 0.0)
    with pytest.raises(TelemetryRefused, match="key_conflict"):
        view.take("b", tel("b", KEYS[0], [], 0.0, index=2), 0.0)
    view.take("a", tel("a", KEYS[1], [], 1.0), 1.0)  # a moved to another key
    view.take("b", tel("b", KEYS[0], [], 1.0, index=2), 1.0)
    assert view.node_of_key() == {KEYS[1]: "a", KEYS[0]: "b"}
    view.remove("a")
    view.take("c", tel("c", KEYS[1], [], 2.0, index=3), 2.0)
    assert view.node_of_key()[KEYS[1]] == "c"


def test_interval_settings_are_read_and_checked() -> None:
    from meshopt.agent.config import check_config, parse_config
    from meshopt.errors import InputError

    base = {"agent": {"mesh": "m", "node": "a"}}
    cfg = parse_config({**base, "telemetry": {"full_peers": 50, "max_full_interval_s": 60}})
    assert (cfg.telemetry.full_peers, cfg.telemetry.max_full_interval_s) == (50, 60.0)
    for bad, message in (
        ({"max_full_interval_s": 2.0}, "max_full_interval_s must be >="),
        ({"full_peers": 0}, "full_peers must be at least 1"),
    ):
        with pytest.raises(InputError, match=message):
            check_config(parse_config({**base, "telemetry": bad}))


def test_a_heartbeat_changes_nothing_to_recompute() -> None:
    view = MeshView("lab", stale_after_s=15.0)
    assert view.take("a", tel("a", KEYS[0], [rep(KEYS[1])], 0.0), 0.0)  # first: new node
    assert not view.take("a", tel("a", KEYS[0], [], 5.0, full=False), 5.0)
    assert view.take("a", tel("a", KEYS[0], [rep(KEYS[1], 50.0)], 6.0, full=False), 6.0)
    assert view.take("a", tel("a", KEYS[0], [rep(KEYS[1])], 7.0), 7.0)  # a full snapshot
    view.set_offline("a", "agent lost")
    assert view.take("a", tel("a", KEYS[0], [], 8.0, full=False), 8.0)  # back online


def test_controller_recomputes_for_a_change_not_for_a_heartbeat() -> None:
    mesh = SyntheticMesh(3, seed=1)
    cfg = ControllerConfig(
        mesh="bench", id="ctl1", signing_key="/unused",
        node_keys=tuple(Enrolment(x.name, public_key_b64(x.identity)) for x in mesh.nodes),
    )  # fmt: skip
    core = ControllerCore(cfg, generate_signing_key()[0])
    x = mesh.nodes[0]
    ag = AgentCore("bench", x.name, x.identity, [], RouteState(), 1_700_000_000.0)
    peers = mesh.reports(0, random.Random(1))
    wall = 1_700_000_000.0

    def send(i: int, plan: Plan) -> None:
        msg = signed_telemetry(
            ag, wall + i, public_keys=[x.wg_key], addresses=[x.address], plan=plan, counters={}
        )
        core.on_message(f"meshopt/bench/telemetry/{x.name}", msg, False, float(i), wall + i)

    send(0, Plan(True, peers, 5.0))
    assert core.dirty_since == 0.0
    core.dirty_since = None  # as after a recompute
    send(1, Plan(False, [], 5.0))
    assert core.dirty_since is None and core.dropped() == {}
    send(2, Plan(False, peers[:1], 5.0))
    assert core.dirty_since == 2.0
