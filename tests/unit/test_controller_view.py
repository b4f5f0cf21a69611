"""The controller's mesh view: telemetry in, cost/noise/bandwidth matrices and liveness out.

Real bus messages (meshopt.bus.messages) with real WireGuard keys; time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from meshopt.bus.messages import PeerReport, Telemetry, encode
from meshopt.controller.view import MeshView, TelemetryRefused
from meshopt.metric import Metric
from meshopt.wireguard.keys import generate_keypair

MESH = "lab"


def new_key() -> str:
    return generate_keypair()[1]


@dataclass
class Node:
    """One agent: its name, interface keys and the peers it reports (by key)."""

    name: str
    index: int
    keys: list[str] = field(default_factory=lambda: [new_key()])
    seq: int = 0

    @property
    def address(self) -> str:
        return f"10.99.0.{self.index}/32"

    def telemetry(
        self, peers: list[PeerReport], *, sent_at: float, full: bool = True, mesh: str = MESH
    ) -> Telemetry:
        self.seq += 1
        t = Telemetry(
            mesh=mesh,
            node=self.name,
            public_key=self.keys[0],
            public_keys=list(self.keys),
            addresses=[self.address],
            seq=self.seq,
            sent_at=sent_at,
            full=full,
            peers=peers,
        )
        encode(t)  # what the view gets has passed the bus checks
        return t


def peer(key: str, rtt_ms: float | None = 10.0, **kw: object) -> PeerReport:
    kw.setdefault("samples", 64)
    return PeerReport(public_key=key, ifname="wg0", rtt_ms=rtt_ms, **kw)  # type: ignore[arg-type]


def cost_of(view: MeshView, now: float, a: str, b: str) -> float:
    m = view.matrices(now)
    return float(m.cost[m.names.index(a), m.names.index(b)])


@pytest.fixture
def trio() -> tuple[Node, Node, Node]:
    return Node("a", 1), Node("b", 2), Node("c", 3)


def full_mesh(view: MeshView, nodes: tuple[Node, ...], rtt: float, now: float) -> None:
    for n in nodes:
        peers = [peer(o.keys[0], rtt) for o in nodes if o is not n]
        view.take(n.name, n.telemetry(peers, sent_at=1000.0 + now), now)


# -- matching peers to nodes --------------------------------------------------------------


def test_peer_report_is_matched_through_the_other_nodes_keys(
    trio: tuple[Node, Node, Node],
) -> None:
    a, b, _ = trio
    view = MeshView(MESH)
    view.take("a", a.telemetry([peer(b.keys[0], 10.0)], sent_at=1.0), now=0.0)
    # b has not spoken yet: a's report of b's key matches no node, so there is no link.
    assert view.names() == ["a"]
    view.take("b", b.telemetry([peer(a.keys[0], 12.0)], sent_at=1.0), now=0.0)
    assert cost_of(view, 0.0, "a", "b") == pytest.approx(10.0)
    assert cost_of(view, 0.0, "b", "a") == pytest.approx(12.0)
    m = view.matrices(0.0)
    assert m.names == ["a", "b"]
    assert np.all(np.diag(m.cost) == 0.0)
    assert m.up.tolist() == [True, True]


def test_per_peer_layout_one_key_per_tunnel_end() -> None:
    # a has one interface (and key) per tunnel; b and c each know only "their" key of a.
    a = Node("a", 1, keys=[new_key(), new_key()])
    b, c = Node("b", 2), Node("c", 3)
    view = MeshView(MESH)
    view.take("a", a.telemetry([peer(b.keys[0], 10.0), peer(c.keys[0], 20.0)], sent_at=1), 0.0)
    view.take("b", b.telemetry([peer(a.keys[0], 11.0), peer(c.keys[0], 30.0)], sent_at=1), 0.0)
    view.take("c", c.telemetry([peer(a.keys[1], 21.0), peer(b.keys[0], 31.0)], sent_at=1), 0.0)
    assert view.node_of_key() == {
        a.keys[0]: "a",
        a.keys[1]: "a",
        b.keys[0]: "b",
        c.keys[0]: "c",
    }
    m = view.matrices(0.0)
    expected = np.array([[0.0, 10.0, 20.0], [11.0, 0.0, 30.0], [21.0, 31.0, 0.0]])
    np.testing.assert_allclose(m.cost, expected)


def test_telemetry_without_public_keys_uses_public_key(trio: tuple[Node, Node, Node]) -> None:
    a, b, _ = trio
    view = MeshView(MESH)
    t = Telemetry(mesh=MESH, node="a", public_key=a.keys[0], seq=1, sent_at=1.0, full=True)
    view.take("a", t, 0.0)
    view.take("b", b.telemetry([peer(a.keys[0], 7.0)], sent_at=1), 0.0)
    assert cost_of(view, 0.0, "b", "a") == pytest.approx(7.0)


def test_delta_telemetry_merges_and_full_snapshot_replaces(
    trio: tuple[Node, Node, Node],
) -> None:
    a, b, _ = trio
    view = MeshView(MESH)
    full_mesh(view, trio, 10.0, 0.0)
    view.take("a", a.telemetry([peer(b.keys[0], 15.0)], sent_at=2000, full=False), 1.0)
    assert cost_of(view, 1.0, "a", "b") == pytest.approx(15.0)
    assert cost_of(view, 1.0, "a", "c") == pytest.approx(10.0)  # kept from the snapshot
    view.take("a", a.telemetry([peer(b.keys[0], 16.0)], sent_at=2001, full=True), 2.0)
    assert cost_of(view, 2.0, "a", "b") == pytest.approx(16.0)
    assert cost_of(view, 2.0, "a", "c") == math.inf  # c is no longer a's peer


def test_every_snapshot_is_read_though_a_new_row_table_may_reuse_a_freed_address(
    trio: tuple[Node, Node, Node],
) -> None:
    """A snapshot's rows replace the last ones, which are freed; the new table can land at
    the freed one's address with the same change count. The matrices must still be built
    from the new rows (they were once cached by ``id``, and a CI run read an old RTT)."""
    view = MeshView(MESH)
    full_mesh(view, trio, 10.0, 0.0)
    a = trio[0]
    for i in range(1, 400):
        rtt = 10.0 + i % 7
        peers = [peer(o.keys[0], rtt) for o in trio if o is not a]
        view.take("a", a.telemetry(peers, sent_at=1000.0 + i, full=True), float(i))
        assert view.nodes["a"].arrays().rtt.tolist() == [rtt, rtt], i
        m = view.matrices(float(i))
        assert m.rtt[m.names.index("a"), m.names.index("b")] == pytest.approx(rtt), i


# -- refused telemetry --------------------------------------------------------------------


def refused(view: MeshView, topic_node: str, t: Telemetry, now: float = 5.0) -> str:
    with pytest.raises(TelemetryRefused) as info:
        view.take(topic_node, t, now)
    return info.value.reason


def test_refusals_name_their_reason_and_change_nothing(trio: tuple[Node, Node, Node]) -> None:
    a, b, c = trio
    view = MeshView(MESH, allowed=["a", "b", "c"])
    full_mesh(view, (a, b), 10.0, 0.0)
    before = view.matrices(5.0)
    stranger = Node("x", 9)
    assert refused(view, "x", stranger.telemetry([peer(a.keys[0])], sent_at=2000)) == (
        "unknown_node"
    )
    assert refused(view, "c", c.telemetry([peer(a.keys[0])], sent_at=2000, mesh="other")) == (
        "wrong_mesh"
    )
    assert refused(view, "b", c.telemetry([peer(a.keys[0])], sent_at=2000)) == "node_mismatch"
    thief = Node("c", 3, keys=[a.keys[0]])  # c claims a's key
    assert refused(view, "c", thief.telemetry([peer(b.keys[0])], sent_at=2000)) == ("key_conflict")
    old = a.telemetry([peer(b.keys[0], 99.0)], sent_at=999.0)  # a's last was sent at 1000
    assert refused(view, "a", old) == "out_of_order"
    same = a.telemetry([peer(b.keys[0], 99.0)], sent_at=1000.0)  # a replay
    assert refused(view, "a", same) == "out_of_order"
    after = view.matrices(5.0)
    assert view.names() == ["a", "b"]
    assert view.node_of_key() == {a.keys[0]: "a", b.keys[0]: "b"}
    np.testing.assert_array_equal(after.cost, before.cost)


def test_refusal_message_carries_the_detail() -> None:
    exc = TelemetryRefused("unknown_node", "x")
    assert exc.reason == "unknown_node"
    assert str(exc) == "unknown_node: x"
    assert str(TelemetryRefused("out_of_order")) == "out_of_order"


def test_empty_allow_list_takes_any_node(trio: tuple[Node, Node, Node]) -> None:
    view = MeshView(MESH)
    full_mesh(view, trio, 10.0, 0.0)
    assert view.names() == ["a", "b", "c"]


def test_newer_telemetry_after_an_older_seq_is_taken(trio: tuple[Node, Node, Node]) -> None:
    # Order is by sent_at: an agent restart resets seq but not the clock.
    a, b, _ = trio
    view = MeshView(MESH)
    full_mesh(view, (a, b), 10.0, 0.0)
    a.seq = 0
    assert view.take("a", a.telemetry([peer(b.keys[0], 20.0)], sent_at=1001.0), 1.0)
    assert cost_of(view, 1.0, "a", "b") == pytest.approx(20.0)


# -- liveness -----------------------------------------------------------------------------


def assert_cut_off(view: MeshView, now: float, node: str) -> None:
    m = view.matrices(now)
    i = m.names.index(node)
    others = [j for j in range(len(m.names)) if j != i]
    assert np.all(np.isinf(m.cost[i, others])), "links from the dead node"
    assert np.all(np.isinf(m.cost[others, i])), "links to the dead node"
    assert np.all(m.bandwidth[i, others] == 0) and np.all(m.bandwidth[others, i] == 0)
    assert not m.up[i]


def test_node_marked_offline_loses_all_links_both_ways(trio: tuple[Node, Node, Node]) -> None:
    view = MeshView(MESH)
    full_mesh(view, trio, 10.0, 0.0)
    assert view.set_offline("c", "will")
    assert not view.set_offline("c", "will"), "already offline"
    assert not view.set_offline("nobody", "will")
    assert view.nodes["c"].offline_reason == "will"
    assert_cut_off(view, 1.0, "c")
    assert cost_of(view, 1.0, "a", "b") == pytest.approx(10.0)  # the others are untouched
    # Its next telemetry brings it back.
    c = trio[2]
    view.take("c", c.telemetry([peer(trio[0].keys[0], 10.0)], sent_at=2000), 2.0)
    assert view.nodes["c"].online
    assert cost_of(view, 2.0, "c", "a") == pytest.approx(10.0)
    assert cost_of(view, 2.0, "a", "c") == pytest.approx(10.0)


def test_stale_node_loses_all_links_both_ways(trio: tuple[Node, Node, Node]) -> None:
    a, b, _ = trio
    view = MeshView(MESH, stale_after_s=15.0)
    full_mesh(view, trio, 10.0, 0.0)
    for now in (5.0, 10.0):  # a and b keep reporting, c fell silent at 0
        for n in (a, b):
            peers = [peer(o.keys[0], 10.0) for o in trio if o is not n]
            view.take(n.name, n.telemetry(peers, sent_at=1000 + now), now)
    assert view.expire(15.0) == [], "exactly stale_after_s is not stale yet"
    assert view.expire(15.5) == ["c"]
    assert view.expire(16.0) == [], "reported once"
    assert view.nodes["c"].offline_reason == "telemetry stale"
    assert_cut_off(view, 15.5, "c")


def test_dead_peer_unknown_rtt_and_bandwidth(trio: tuple[Node, Node, Node]) -> None:
    a, b, c = trio
    metric = Metric(unknown_cost_ms=777.0)
    view = MeshView(MESH, metric=metric)
    view.take(
        "a",
        a.telemetry(
            [
                peer(b.keys[0], 10.0, alive=False, bandwidth_mbit=100.0),
                peer(c.keys[0], None, samples=0),
            ],
            sent_at=1,
        ),
        0.0,
    )
    view.take("b", b.telemetry([peer(a.keys[0], 10.0, bandwidth_mbit=50.0)], sent_at=1), 0.0)
    view.take("c", c.telemetry([peer(a.keys[0], 10.0, alive=True)], sent_at=1), 0.0)
    m = view.matrices(0.0)
    ia, ib, ic = (m.names.index(x) for x in "abc")
    assert m.cost[ia, ib] == math.inf, "alive=False is down whatever its RTT"
    assert m.bandwidth[ia, ib] == 0.0, "no bandwidth on a dead link"
    assert m.cost[ia, ic] == 777.0, "not measured yet: metric.unknown_cost_ms"
    assert m.cost[ic, ia] == pytest.approx(10.0)
    assert m.bandwidth[ib, ia] == 50.0
    assert m.cost[ib, ic] == math.inf, "b does not report c: no link"


def test_cost_uses_the_metric(trio: tuple[Node, Node, Node]) -> None:
    a, b, _ = trio
    view = MeshView(MESH, metric=Metric(jitter_weight=2.0, loss_penalty_ms=200.0))
    view.take("a", a.telemetry([peer(b.keys[0], 10.0, jitter_ms=1.5, loss=0.05)], sent_at=1), 0)
    view.take("b", b.telemetry([peer(a.keys[0], 10.0)], sent_at=1), 0.0)
    # 10 + 2 * 1.5 + 200 * 0.05 / 0.95
    assert cost_of(view, 0.0, "a", "b") == pytest.approx(13.0 + 200 * 0.05 / 0.95)


def loss_noise(loss: float, samples: float, noise_ms: float, penalty: float = 200.0) -> float:
    """Binomial standard error of the loss estimate, through the loss penalty's slope."""
    probes = samples / (1 - loss)  # samples count replies: probes sent = replies / (1 - p)
    sd = math.sqrt(loss * (1 - loss) / probes)
    return math.hypot(noise_ms, penalty / (1 - loss) ** 2 * sd)


def test_noise_includes_the_loss_estimates_noise(trio: tuple[Node, Node, Node]) -> None:
    a, b, c = trio
    view = MeshView(MESH)
    view.take(
        "a",
        a.telemetry(
            [
                peer(b.keys[0], 10.0, noise_ms=1.0, loss=0.0),
                peer(c.keys[0], 10.0, noise_ms=1.0, loss=0.05, samples=64),
            ],
            sent_at=1,
        ),
        0.0,
    )
    view.take("b", b.telemetry([peer(a.keys[0], 10.0, loss=0.05, samples=16)], sent_at=1), 0.0)
    view.take("c", c.telemetry([peer(a.keys[0], 10.0, loss=0.05, samples=256)], sent_at=1), 0.0)
    m = view.matrices(0.0)
    ia, ib, ic = (m.names.index(x) for x in "abc")
    assert m.noise[ia, ib] == pytest.approx(1.0), "no loss: just the RTT estimate's noise"
    assert m.noise[ia, ic] == pytest.approx(loss_noise(0.05, 64, 1.0))
    assert m.noise[ia, ic] > 5.0, "5 % loss over 64 samples: ~6 ms of cost noise"
    # Fewer samples, noisier loss estimate (standard error ~ 1/sqrt(n)).
    assert m.noise[ib, ia] == pytest.approx(loss_noise(0.05, 16, 0.0))
    assert m.noise[ib, ia] == pytest.approx(4 * m.noise[ic, ia])
    assert m.noise[ib, ic] == 0.0, "no link, no noise"


def test_the_loss_noise_rests_on_the_outcomes_the_agent_says(
    trio: tuple[Node, Node, Node],
) -> None:
    a, b, c = trio
    view = MeshView(MESH)
    # b and c report the same 1.5 % over the same window; c's agent pooled it with its
    # loss memory (meshopt.estimate.pooled_loss): 256 outcomes, half the noise.
    view.take("b", b.telemetry([peer(a.keys[0], 150.0, loss=0.015, samples=63)], sent_at=1), 0)
    view.take(
        "c",
        c.telemetry([peer(a.keys[0], 150.0, loss=0.015, samples=63, loss_outcomes=256)], sent_at=1),
        0.0,
    )
    view.take("a", a.telemetry([peer(b.keys[0], 150.0), peer(c.keys[0], 150.0)], sent_at=1), 0)
    m = view.matrices(0.0)
    ia, ib, ic = (m.names.index(x) for x in "abc")
    assert m.cost[ib, ia] == pytest.approx(m.cost[ic, ia])
    assert m.noise[ib, ia] == pytest.approx(loss_noise(0.015, 63, 0.0))
    assert m.noise[ic, ia] == pytest.approx(loss_noise(0.015, 256 * 0.985, 0.0))
    assert m.noise[ic, ia] == pytest.approx(m.noise[ib, ia] / 2, rel=0.01)


def test_cost_of_an_ageing_report_rises(trio: tuple[Node, Node, Node]) -> None:
    view = MeshView(MESH, metric=Metric(fresh_s=10.0, stale_s=30.0, aging_penalty=0.5))
    full_mesh(view, trio, 10.0, 0.0)
    assert cost_of(view, 10.0, "a", "b") == pytest.approx(10.0)
    assert cost_of(view, 20.0, "a", "b") == pytest.approx(12.5)  # half way: +25 %


# -- readiness ----------------------------------------------------------------------------


def test_ready_needs_min_samples_on_every_link_or_the_warmup(
    trio: tuple[Node, Node, Node],
) -> None:
    view = MeshView(MESH)
    assert not view.ready(100.0, warmup_s=10.0), "nothing heard yet"

    def report(now: float, samples: int, rtt: float | None = 10.0) -> None:
        for n in trio:
            peers = [peer(o.keys[0], rtt, samples=samples) for o in trio if o is not n]
            view.take(n.name, n.telemetry(peers, sent_at=1000 + now), now)

    report(1.0, samples=3)
    assert not view.ready(2.0, warmup_s=10.0, min_samples=8)
    assert view.ready(2.0, warmup_s=10.0, min_samples=3)
    assert view.ready(11.0, warmup_s=10.0, min_samples=8), "warm-up counts from first report"
    report(3.0, samples=8)
    assert view.ready(3.0, warmup_s=10.0, min_samples=8)
    report(4.0, samples=100, rtt=None)  # samples but no RTT yet
    assert not view.ready(4.0, warmup_s=10.0, min_samples=1)


def test_ready_ignores_offline_nodes_and_waits_for_nodes_without_peers(
    trio: tuple[Node, Node, Node],
) -> None:
    a, b, c = trio
    view = MeshView(MESH)
    full_mesh(view, (a, b), 10.0, 0.0)
    view.take("c", c.telemetry([peer(a.keys[0], 10.0, samples=1)], sent_at=1000), 0.0)
    assert not view.ready(1.0, warmup_s=10.0, min_samples=8)
    view.set_offline("c", "will")
    assert view.ready(1.0, warmup_s=10.0, min_samples=8), "c is gone: a and b are measured"
    lonely = MeshView(MESH)
    lonely.take("a", a.telemetry([], sent_at=2000), 0.0)
    assert not lonely.ready(1.0, warmup_s=10.0), "a node with no peers measured nothing"
    assert lonely.ready(10.0, warmup_s=10.0)
