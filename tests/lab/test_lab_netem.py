"""The netem underlay with real packets between namespaces (root only).

Two groups. The ``pfifo`` tests run wherever namespaces work: they build the whole
underlay (switch namespace, bridge, a veth per node, htb root, a class and a u32
filter per directed pair) with pfifo leaves instead of netem, and check with ping and
iperf3 that traffic crosses the switch in the right class and that htb holds the
configured rate. The ``netem`` tests need a kernel with netem (the development
machines have none) and skip with the probe's reason; they check what only the netem
leaf does: delay, jitter without reordering, loss, and a change within 100 ms.

Everything is named ``monetem<random>...``, and every namespace is deleted after its
test (the session fixture checks that ``ip netns list`` is left as it was found).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from meshopt.lab.netem import (
    NetemError,
    NetemNode,
    NetemSpec,
    NetemUnderlay,
    leaf_options,
    netem_unavailable_reason,
)
from meshopt.lab.netns import (
    create_netns,
    delete_netns,
    list_netns,
    netns_exists,
    netns_run,
    temporary_netns,
    unique_name,
)
from meshopt.lab.shaper import PairParams

from .tools import (
    IP_TCP_HEADERS,
    PingResult,
    assert_change_within_100ms,
    assert_goodput_near,
    iperf3_between,
    ping_from,
    rtt_tolerance,
)

pytestmark = pytest.mark.lab

MTU = 1500


@dataclass
class Rig:
    """A built underlay, its namespaces and the helpers a test started."""

    underlay: NetemUnderlay
    switch: str
    netns: list[str]
    addresses: list[str]
    state_path: Path
    children: list[subprocess.Popen[Any]] = field(default_factory=list)

    def ping(self, src: int, dst: int, count: int, interval: float, *extra: str) -> PingResult:
        return ping_from(self.netns[src], self.addresses[dst], count, interval, *extra)

    def goodput_mbit(self, src: int, dst: int, seconds: int = 3) -> float:
        result = iperf3_between(
            self.netns[dst],
            self.netns[src],
            self.addresses[dst],
            seconds=seconds,
            children=self.children,
        )
        return float(result["end"]["sum_received"]["bits_per_second"]) / 1e6

    def pair_stats(self, src: int, dst: int) -> dict[str, int]:
        for p in self.underlay.stats()["pairs"]:
            if (p["src"], p["dst"]) == (src, dst):
                return {k: v for k, v in p.items() if k not in ("src", "dst")}
        return {"packets": 0, "bytes": 0, "drops": 0, "backlog": 0, "qlen": 0}


RigMaker = Callable[..., Rig]


@pytest.fixture
def make_rig(lab_ok: None, tmp_path: Path) -> Iterator[RigMaker]:
    """``make_rig(n, leaf=..., delay_ms=..., rate_mbit=..., ...)``: a built underlay."""
    created: list[str] = []
    rigs: list[Rig] = []

    def make(
        n: int,
        *,
        leaf: str = "pfifo",
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        rate_mbit: list[list[float | None]] | None = None,
        build: bool = True,
    ) -> Rig:
        base = unique_name("monetem")
        switch = f"{base}sw"
        netns = [f"{base}n{i}" for i in range(n)]
        for ns in (switch, *netns):
            create_netns(ns)
            created.append(ns)
        addresses = [f"172.31.0.{i + 1}" for i in range(n)]
        spec = NetemSpec(
            switch_netns=switch,
            nodes=[NetemNode(f"n{i}", netns[i], f"mou{i}", f"{addresses[i]}/16") for i in range(n)],
            delay_ms=[[0.0 if i == j else delay_ms for j in range(n)] for i in range(n)],
            jitter_ms=[[0.0 if i == j else jitter_ms for j in range(n)] for i in range(n)],
            loss=[[0.0 if i == j else loss for j in range(n)] for i in range(n)],
            rate_mbit=rate_mbit,
            leaf=leaf,
            mtu=MTU,
        )
        state_path = tmp_path / f"{base}.json"
        rig = Rig(NetemUnderlay(spec, state_path), switch, netns, addresses, state_path)
        rigs.append(rig)
        if build:
            rig.underlay.build()
        return rig

    try:
        yield make
    finally:
        for rig in rigs:
            for child in rig.children:  # helpers a test started, by PID
                if child.poll() is None:
                    child.kill()
                    child.wait()
        for ns in reversed(created):  # the switch last: its veths go with it
            if netns_exists(ns):
                delete_netns(ns)


def links(netns: str) -> list[str]:
    out = netns_run(netns, ["ip", "-o", "link", "show"]).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


# --- what runs everywhere: the switch, the classes, the filters, htb ---------------------


def test_probe_leaves_no_namespace_behind(lab_ok: None) -> None:
    before = list_netns()
    reason = netem_unavailable_reason(refresh=True)
    assert list_netns() == before
    assert reason is None or "\n" not in reason


@pytest.mark.parametrize(
    "params",
    [
        PairParams(),
        PairParams(delay_ms=20.0, loss=0.05),
        PairParams(delay_ms=150.0, jitter_ms=2.5, loss=0.000123, rate_mbit=20.0),
        PairParams(delay_ms=0.01, jitter_ms=30.0, loss=1.0, rate_mbit=0.5),
    ],
)
def test_tc_parses_every_netem_leaf_we_emit(lab_ok: None, params: PairParams) -> None:
    """Without netem the kernel refuses the qdisc kind, but only after tc has parsed
    every option: tc's own parse errors (bad unit, missing distribution table) exit
    with 1 and a message of their own, the kernel's refusal with 2."""
    options = leaf_options(params, "netem").split()
    with temporary_netns(prefix="monetem") as ns:
        argv = ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "handle", "2:", *options]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == "Error: Specified qdisc kind is unknown.", proc.stderr


def test_packets_cross_the_switch_in_their_pair_class(make_rig: RigMaker) -> None:
    r = make_rig(3)
    # Each node has only its end of the veth: there is no other way out.
    assert sorted(links(r.netns[0])) == ["lo", "mou0"]
    assert sorted(links(r.switch)) == ["br0", "lo", "p0", "p1", "p2"]
    before = {(i, j): r.pair_stats(i, j)["packets"] for i in range(3) for j in range(3) if i != j}
    assert r.ping(0, 1, 20, 0.01).received == 20
    assert r.ping(2, 0, 10, 0.01).received == 10
    after = {pair: r.pair_stats(*pair)["packets"] for pair in before}
    delta = {pair: after[pair] - before[pair] for pair in before}
    # Requests in class 0->1 on port p1, replies in class 1->0 on port p0; 2<->0 alike.
    # Nothing else: no ARP (permanent neighbours), no flooding (static FDB entries).
    assert delta == {(0, 1): 20, (1, 0): 20, (2, 0): 10, (0, 2): 10, (1, 2): 0, (2, 1): 0}


def test_htb_class_holds_the_rate_one_way_and_changes_at_run_time(make_rig: RigMaker) -> None:
    """0->1 limited (20 then 100 Mbit/s), 1->0 not: goodput within 5 % of the rate
    less TCP/IP headers (htb counts IP bytes: the size table takes off Ethernet's)."""
    rate = [[None, 20.0, None], [None, None, None], [None, None, None]]
    r = make_rig(3, rate_mbit=rate)

    def check(rate_mbit: float) -> float:
        expected = rate_mbit * (MTU - IP_TCP_HEADERS) / MTU
        return assert_goodput_near(lambda: r.goodput_mbit(0, 1), expected)

    check(20.0)
    # The other direction has its own class: unlimited.
    assert r.goodput_mbit(1, 0) > 3 * 20.0
    # A change through the state file, as a later `lab set` in another process makes it.
    other = NetemUnderlay.load(r.state_path)
    t0 = time.monotonic()
    other.set([("n0", "n1")], rate_mbit=100.0)
    assert time.monotonic() - t0 < 0.1
    assert r.underlay.params()["rate_mbit"][0] == [None, 100.0, None]
    check(100.0)
    # A flow from another source to the same node is in another class: not limited.
    r.underlay.set([(0, 1)], rate_mbit=5.0)
    assert r.goodput_mbit(2, 1) > 3 * 20.0


def test_node_down_drops_both_ways_and_up_restores(make_rig: RigMaker) -> None:
    r = make_rig(3)
    assert r.ping(0, 1, 5, 0.01).received == 5
    r.underlay.node_state("n1", False)
    assert r.ping(0, 1, 10, 0.01, "-W", "0.3").received == 0  # (a later -W wins)
    assert r.ping(1, 0, 10, 0.01, "-W", "0.3").received == 0
    assert r.ping(0, 2, 10, 0.01).received == 10  # the others are unaffected
    assert r.underlay.params()["up"] == [True, False, True]
    assert NetemUnderlay.load(r.state_path).params()["up"] == [True, False, True]
    r.underlay.node_state(1, True)
    # Back at once: no STP delay on the port, no ARP to retry.
    assert r.ping(0, 1, 10, 0.01).received == 10
    assert r.ping(1, 0, 10, 0.01).received == 10


def test_failed_build_leaves_nothing_in_the_namespaces(make_rig: RigMaker) -> None:
    r = make_rig(3, build=False)
    delete_netns(r.netns[2])  # the last node's veth cannot be made
    with pytest.raises(NetemError, match=r.netns[2]) as info:
        r.underlay.build()
    assert "\n" not in str(info.value)
    assert links(r.switch) == ["lo"]
    assert links(r.netns[0]) == ["lo"] and links(r.netns[1]) == ["lo"]
    assert not r.state_path.exists()


def test_sixteen_nodes_build_quickly(make_rig: RigMaker) -> None:
    """The issue's scale point: 16 nodes, 240 classes, filters and leaves."""
    t0 = time.monotonic()
    r = make_rig(16)
    build_s = time.monotonic() - t0  # includes creating the 17 namespaces
    assert build_s < 10.0, build_s
    classes = netns_run(r.switch, ["tc", "class", "show", "dev", "p5"]).stdout.splitlines()
    filters = netns_run(r.switch, ["tc", "filter", "show", "dev", "p5"]).stdout
    assert len(classes) == 15
    assert len(re.findall(r"flowid 1:", filters)) == 15
    assert r.ping(15, 3, 3, 0.01).received == 3
    t0 = time.monotonic()
    r.underlay.set([(i, j) for i in range(16) for j in range(16) if i != j], rate_mbit=50.0)
    assert time.monotonic() - t0 < 1.0  # all 240 pairs in one tc run


# --- what needs netem ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def netem_ok(lab_ok: None) -> None:
    reason = netem_unavailable_reason()
    if reason:
        pytest.skip(f"netem underlay: {reason}")


@pytest.mark.parametrize("delay_ms", [1.0, 20.0])
def test_netem_rtt_follows_the_matrix_per_direction(
    netem_ok: None, make_rig: RigMaker, delay_ms: float
) -> None:
    r = make_rig(3, leaf="netem", delay_ms=delay_ms)
    r.underlay.set([(2, 0)], delay_ms=2 * delay_ms)
    for dst, expected in ((1, 2 * delay_ms), (2, 3 * delay_ms)):
        result = r.ping(0, dst, 50, 0.01)
        assert result.received >= 45, result.lines[-3:]
        median = statistics.median(result.rtts)
        assert abs(median - expected) <= rtt_tolerance(expected), (dst, expected, median)


def test_netem_loss_one_direction(netem_ok: None, make_rig: RigMaker) -> None:
    r = make_rig(2, leaf="netem", delay_ms=1.0)
    r.underlay.set([(0, 1)], loss=0.05)
    before = r.pair_stats(0, 1)["drops"]
    result = r.ping(0, 1, 2000, 0.002, "-q")
    assert result.transmitted == 2000
    lost = result.transmitted - result.received
    assert abs(lost / result.transmitted - 0.05) <= 0.01, lost
    assert lost <= r.pair_stats(0, 1)["drops"] - before <= lost + 2
    assert r.pair_stats(1, 0)["drops"] == 0


def test_netem_jitter_varies_delay_without_reordering(netem_ok: None, make_rig: RigMaker) -> None:
    r = make_rig(2, leaf="netem", delay_ms=20.0)
    r.underlay.set([(0, 1)], jitter_ms=4.0)
    result = r.ping(0, 1, 300, 0.02)
    assert result.received >= 295
    seqs = [int(m[1]) for line in result.lines if (m := re.search(r"icmp_seq=(\d+)", line))]
    assert seqs == sorted(seqs), "netem reordered packets despite its ordering rate"
    # RTT = 40 ms + N(0, 4 ms) (one direction jitters); the order clamp trims a little.
    assert abs(statistics.median(result.rtts) - 40.0) <= 2.0
    assert 2.0 <= statistics.pstdev(result.rtts) <= 5.0


def test_netem_leaf_with_htb_rate(netem_ok: None, make_rig: RigMaker) -> None:
    rate = [[None, 20.0], [None, None]]
    r = make_rig(2, leaf="netem", delay_ms=5.0, rate_mbit=rate)
    expected = 20.0 * (MTU - IP_TCP_HEADERS) / MTU
    assert_goodput_near(lambda: r.goodput_mbit(0, 1), expected)


def test_netem_set_takes_effect_within_100ms(netem_ok: None, make_rig: RigMaker) -> None:
    old, new = 20.0, 5.0  # one-way; RTT 40 ms -> 10 ms
    r = make_rig(2, leaf="netem", delay_ms=old)
    assert_change_within_100ms(
        r.netns[0],
        r.addresses[1],
        old,
        new,
        lambda: NetemUnderlay.load(r.state_path).set([(0, 1), (1, 0)], delay_ms=new),
        r.children,
    )
