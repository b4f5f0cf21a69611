"""The netem underlay's commands, parsed back: structure, units, asymmetry, changes.

Pure: no namespaces, no tc. The executor runs with a fake ``run_batch`` that records
the batches, so its state handling (the state file, all-or-nothing sets) is tested too.
"""

from __future__ import annotations

import math
import re
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from meshopt.lab import netem
from meshopt.lab.netem import (
    Batch,
    NetemError,
    NetemNode,
    NetemSpec,
    NetemUnderlay,
    choose_underlay_mode,
    class_minor,
    format_loss,
    format_ms,
    format_rate,
    leaf_options,
    netem_build_commands,
    netem_change_commands,
    netem_node_commands,
    netem_remove_commands,
    node_mac,
    parse_leaf_stats,
    queue_limit,
    validate_netem_spec,
)
from meshopt.lab.shaper import PairParams

SW = "motsw"


def make_spec(
    n: int = 3,
    *,
    delay: Any = None,
    jitter: Any = None,
    loss: Any = None,
    rate: Any = None,
    leaf: str = "netem",
    ipv6: bool = False,
) -> NetemSpec:
    """n nodes; by default an asymmetric matrix: delay(i->j) = 10 i + j + 1 ms."""
    nodes = [
        NetemNode(
            name=f"n{i}",
            netns=f"motn{i}",
            ifname=f"mtu{i}",
            address=f"172.31.0.{i + 1}/16",
            address6=f"fd00:31::{i + 1}/64" if ipv6 else None,
        )
        for i in range(n)
    ]
    return NetemSpec(
        switch_netns=SW,
        nodes=nodes,
        delay_ms=delay
        or [[0.0 if i == j else 10.0 * i + j + 1 for j in range(n)] for i in range(n)],
        jitter_ms=jitter,
        loss=loss,
        rate_mbit=rate,
        leaf=leaf,
    )


def words(line: str) -> list[str]:
    return shlex.split(line)


def option(line: str, key: str) -> str:
    """The word after ``key`` in ``line`` (KeyError if absent)."""
    w = words(line)
    if key not in w:
        raise KeyError(f"{key!r} not in {line!r}")
    return w[w.index(key) + 1]


def tc_lines(batches: list[Batch]) -> list[str]:
    (tc,) = [b for b in batches if b.tool == "tc"]
    assert tc.netns == SW
    return list(tc.lines)


def parse_tc(lines: list[str]) -> dict[str, Any]:
    """roots per dev; classes, leaves and filters keyed by (dev, minor)."""
    roots: Counter[str] = Counter()
    classes: dict[tuple[str, int], str] = {}
    leaves: dict[tuple[str, int], str] = {}
    filters: dict[tuple[str, str], int] = {}  # (dev, src ip) -> minor
    for line in lines:
        w = words(line)
        obj, verb, dev = w[0], w[1], option(line, "dev")
        assert verb == "add", line
        if obj == "qdisc" and "root" in w:
            roots[dev] += 1
            assert option(line, "handle") == "1:"
            assert w[w.index("stab") :][:3] == ["stab", "overhead", "-14"]
            assert w[-1] == "htb"
        elif obj == "class":
            assert option(line, "parent") == "1:"
            major, minor = option(line, "classid").split(":")
            assert major == "1"
            key = (dev, int(minor, 16))
            assert key not in classes, f"duplicate class {key}"
            classes[key] = line
        elif obj == "qdisc":
            major, minor = option(line, "parent").split(":")
            handle = option(line, "handle")
            assert major == "1" and handle == f"{minor}:", line  # leaf major == class minor
            key = (dev, int(minor, 16))
            assert key not in leaves, f"duplicate leaf {key}"
            leaves[key] = line
        elif obj == "filter":
            assert option(line, "parent") == "1:" and "u32" in w
            src = option(line, "src")
            flow_major, flow_minor = option(line, "flowid").split(":")
            assert flow_major == "1"
            assert (dev, src) not in filters, f"duplicate filter {dev} {src}"
            filters[(dev, src)] = int(flow_minor, 16)
        else:
            raise AssertionError(f"unexpected tc line {line!r}")
    return {"roots": roots, "classes": classes, "leaves": leaves, "filters": filters}


# --- structure ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 20])
def test_every_directed_pair_has_one_class_filter_and_leaf(n: int) -> None:
    spec = make_spec(n)
    t = parse_tc(tc_lines(netem_build_commands(spec)))
    ports = {f"p{j}" for j in range(n)}
    assert set(t["roots"]) == ports and set(t["roots"].values()) == {1}
    expected = {(f"p{j}", class_minor(i)) for i in range(n) for j in range(n) if i != j}
    assert set(t["classes"]) == expected
    assert set(t["leaves"]) == expected
    assert len(t["filters"]) == n * (n - 1)
    for j in range(n):
        for i in range(n):
            if i != j:
                # Port j sends i's packets, by i's source address, to i's class.
                assert t["filters"][(f"p{j}", f"172.31.0.{i + 1}/32")] == class_minor(i)
    # Class ids are hex: node 14's class is 1:10, not node 8's.
    if n == 20:
        assert "classid 1:10 " in t["classes"][("p0", class_minor(14))]
        assert "handle 10:" in t["leaves"][("p0", class_minor(14))]


def test_pair_parameters_respect_the_matrix_direction() -> None:
    n = 3
    spec = make_spec(
        n,
        jitter=[[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]],
        loss=[[0.0, 0.05, 0.0], [0.0, 0.0, 0.001], [0.0, 0.0, 0.0]],
        rate=[[None, 20.0, None], [1.5, None, None], [None, 0.5, None]],
    )
    t = parse_tc(tc_lines(netem_build_commands(spec)))
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            leaf, cls = (
                t["leaves"][(f"p{j}", class_minor(i))],
                t["classes"][(f"p{j}", class_minor(i))],
            )
            w = words(leaf)
            assert w[w.index("handle") + 2] == "netem"
            assert option(leaf, "delay") == format_ms(spec.delay_ms[i][j])
            assert option(leaf, "loss") == format_loss(spec.pair_params(i, j).loss)
            assert option(leaf, "rate") == "100000mbit"  # ordering rate, never the limit
            rate = spec.pair_params(i, j).rate_mbit
            expect = "100000mbit" if math.isinf(rate) else format_rate(rate)
            assert option(cls, "rate") == option(cls, "ceil") == expect
            jitter = spec.pair_params(i, j).jitter_ms
            if jitter > 0:
                assert w[w.index("delay") + 2 : w.index("delay") + 5] == [
                    format_ms(jitter),
                    "distribution",
                    "normal",
                ]
            else:
                assert "distribution" not in w
    # The units, spelled out.
    p01, p10 = t["leaves"][("p1", 2)], t["leaves"][("p0", 3)]
    assert "delay 2.000ms 2.000ms distribution normal loss 5% " in p01
    assert "delay 11.000ms loss 0% " in p10
    assert " loss 0.1% " in t["leaves"][("p2", 3)]
    assert "rate 20mbit ceil 20mbit" in t["classes"][("p1", 2)]
    assert "rate 1.5mbit ceil 1.5mbit" in t["classes"][("p0", 3)]
    assert "rate 500000bit ceil 500000bit" in t["classes"][("p1", 4)]


def test_switch_links_then_qdiscs_then_node_ends() -> None:
    spec = make_spec(3)
    batches = netem_build_commands(spec)
    assert [(b.tool, b.netns) for b in batches] == [
        ("ip", SW),
        ("bridge", SW),
        ("tc", SW),
        ("ip", "motn0"),
        ("ip", "motn1"),
        ("ip", "motn2"),
    ]
    sw = list(batches[0].lines)
    assert sw[0].startswith("link add name br0 type bridge")
    macs = [node_mac(i) for i in range(3)]
    assert len(set(macs)) == 3 and macs[2] == "02:6d:6f:00:00:02"
    assert batches[1].lines == tuple(f"fdb add {macs[i]} dev p{i} master static" for i in range(3))
    for i, node in enumerate(spec.nodes):
        add = (
            f"link add name p{i} mtu 1500 type veth peer name {node.ifname} "
            f"address {macs[i]} netns {node.netns}"
        )
        assert add in sw
        assert sw.index(add) < sw.index(f"link set dev p{i} master br0")
        assert sw.index(f"link set dev p{i} master br0") < sw.index(f"link set dev p{i} up")
        lines = list(batches[3 + i].lines)
        assert f"addr add {node.address} dev {node.ifname}" in lines
        assert f"link set dev {node.ifname} gso_max_segs 1" in lines
        assert f"link set dev {node.ifname} addrgenmode none" in lines
        assert lines[-1] == f"link set dev {node.ifname} up"
        # No ARP: a permanent neighbour for every other node, none for itself.
        neigh = [line for line in lines if line.startswith("neigh ")]
        assert neigh == [
            f"neigh replace 172.31.0.{k + 1} lladdr {macs[k]} dev {node.ifname} nud permanent"
            for k in range(3)
            if k != i
        ]
    assert all(b.argv()[:4] == [b.tool, "-n", b.netns, "-batch"] for b in batches)


def test_options_ipv6_down_ports_and_gso() -> None:
    spec = make_spec(2, ipv6=True, leaf="pfifo")
    spec.up = [True, False]
    spec.split_gso = False
    batches = netem_build_commands(spec, ipv6_sysctl=False)
    sw = batches[0].lines
    assert "link set dev p0 up" in sw and "link set dev p1 up" not in sw
    assert not any("addrgenmode" in line for b in batches for line in b.lines)
    assert not any("gso_max_segs" in line for b in batches for line in b.lines)
    assert "addr add fd00:31::1/64 dev mtu0 nodad" in batches[3].lines
    assert (
        f"neigh replace fd00:31::2 lladdr {node_mac(1)} dev mtu0 nud permanent" in batches[3].lines
    )
    t = parse_tc(tc_lines(batches))
    assert t["filters"][("p1", "fd00:31::1/128")] == class_minor(0)
    assert all(option(line, "handle") and " pfifo limit " in line for line in t["leaves"].values())


# --- changes -----------------------------------------------------------------------------


def test_change_lines_carry_every_option_and_only_what_differs() -> None:
    old = PairParams(delay_ms=20.0, jitter_ms=0.0, loss=0.0, rate_mbit=math.inf)
    new = PairParams(delay_ms=150.0, jitter_ms=0.0, loss=0.02, rate_mbit=math.inf)
    # 1 -> 0: on port p0, class of node 1.
    lines = netem_change_commands(1, 0, new, old=old)
    assert lines == [
        f"qdisc change dev p0 parent 1:3 handle 3: netem limit {queue_limit(new)} "
        "delay 150.000ms loss 2% rate 100000mbit"
    ]
    assert netem_change_commands(1, 0, old, old=old) == []
    rated = PairParams(delay_ms=20.0, rate_mbit=5.0)
    lines = netem_change_commands(0, 2, rated, old=old)
    assert (
        lines[0]
        == "class change dev p2 parent 1: classid 1:2 htb rate 5mbit ceil 5mbit quantum 62500"
    )
    assert lines[1].startswith("qdisc change dev p2 parent 1:2 handle 2: netem limit ")
    assert queue_limit(rated) != queue_limit(old)  # the queue follows the rate
    assert len(netem_change_commands(0, 2, rated)) == 2  # no old: both, in full
    with pytest.raises(NetemError, match="itself"):
        netem_change_commands(1, 1, new)


def test_node_and_remove_commands() -> None:
    assert netem_node_commands(4, False) == ["link set dev p4 down"]
    assert netem_node_commands(4, True) == ["link set dev p4 up"]
    assert netem_remove_commands(2) == ["link del dev p0", "link del dev p1", "link del dev br0"]


# --- units and sizing ---------------------------------------------------------------------


def test_units() -> None:
    assert format_ms(20) == "20.000ms" and format_ms(0.0125) == "0.013ms"
    assert format_loss(0.05) == "5%" and format_loss(0.025) == "2.5%"
    assert format_loss(0.0) == "0%" and format_loss(1.0) == "100%"
    assert format_rate(20) == "20mbit" and format_rate(2.5) == "2.5mbit"
    assert format_rate(0.064) == "64000bit" and format_rate(1e-9) == "1bit"
    assert leaf_options(PairParams(), "pfifo") == "pfifo limit 1000"
    with pytest.raises(NetemError):
        leaf_options(PairParams(), "tbf")


def test_queue_limit_covers_delay_and_rate_queue() -> None:
    # 20 Mbit/s, 100 ms: 250 KB in flight + 125 KB (50 ms) queue = 250 packets.
    assert queue_limit(PairParams(delay_ms=100.0, rate_mbit=20.0)) == 250
    # Slow link: at least 64 KiB of queue.
    assert queue_limit(PairParams(rate_mbit=1.0)) == math.ceil(65536 / 1500)
    # Unlimited: a txqueuelen, plus what 10 Gbit/s puts in flight over the delay.
    assert queue_limit(PairParams()) == 1000
    assert queue_limit(PairParams(delay_ms=10.0)) == 1000 + math.ceil(1e10 / 8 * 0.01 / 1500)
    assert queue_limit(PairParams(delay_ms=10.0, jitter_ms=5.0)) > queue_limit(
        PairParams(delay_ms=10.0)
    )
    assert queue_limit(PairParams(delay_ms=60_000.0)) == netem.MAX_LIMIT


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: setattr(s.nodes[1], "name", "n0"), "name: 'n0' is used twice"),
        (lambda s: setattr(s.nodes[1], "netns", SW), "netns: 'motsw' is used twice"),
        (lambda s: setattr(s.nodes[0], "ifname", "x" * 16), "interface name"),
        (lambda s: setattr(s.nodes[0], "address", "172.31.0.1"), "must be IPv4 with a prefix"),
        (lambda s: setattr(s.nodes[0], "address", "fd00::1/64"), "must be IPv4"),
        (lambda s: setattr(s.nodes[1], "address", "172.31.0.1/16"), "used twice"),
        (lambda s: setattr(s.nodes[0], "address6", "10.0.0.1/8"), "must be IPv6"),
        (lambda s: setattr(s, "delay_ms", [[0.0, 1.0]]), "delay_ms must be a 3x3"),
        (lambda s: setattr(s, "loss", [[0.0, 2.0, 0], [0, 0, 0], [0, 0, 0]]), "pair \\[0, 1\\]"),
        (lambda s: s.delay_ms[2].__setitem__(0, -1.0), "pair \\[2, 0\\]"),
        (lambda s: setattr(s, "leaf", "tbf"), "leaf"),
        (lambda s: setattr(s, "up", [True]), "'up' has 1"),
        (lambda s: setattr(s, "switch_netns", "a/b"), "switch"),
    ],
)
def test_bad_specs_are_one_line_errors(change: Any, message: str) -> None:
    spec = make_spec(3)
    change(spec)
    with pytest.raises(NetemError, match=message) as info:
        validate_netem_spec(spec)
    assert "\n" not in str(info.value)
    with pytest.raises(NetemError):
        netem_build_commands(spec)


# --- availability -----------------------------------------------------------------------


def test_choose_underlay_mode() -> None:
    assert choose_underlay_mode("auto", probe=lambda: None) == "netem"
    assert choose_underlay_mode("netem", probe=lambda: None) == "netem"
    with pytest.raises(NetemError, match="--underlay netem: no netem here"):
        choose_underlay_mode("netem", probe=lambda: "no netem here")
    with pytest.raises(NetemError, match="bad underlay"):
        choose_underlay_mode("tap", probe=lambda: None)

    def never() -> str | None:
        raise AssertionError("the emulator needs no netem probe")

    if Path("/dev/net/tun").exists():
        assert choose_underlay_mode("auto", probe=lambda: "no netem") == "emulator"
        assert choose_underlay_mode("emulator", probe=never) == "emulator"


def test_probe_reason_is_cached_and_names_a_missing_tc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None)
    monkeypatch.setattr(netem, "_probe_cache", [])
    assert netem.netem_unavailable_reason() == "no tc command (install iproute2)"
    assert not netem.netem_available()
    monkeypatch.setattr(netem.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert netem.netem_unavailable_reason() == "no tc command (install iproute2)"  # cached
    assert "needs root" in (netem.netem_unavailable_reason(refresh=True) or "")


# --- the executor, with the tools faked ---------------------------------------------------


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[Batch]:
    batches: list[Batch] = []
    monkeypatch.setattr(netem, "run_batch", batches.append)
    return batches


def test_executor_keeps_state_for_other_processes(ran: list[Batch], tmp_path: Path) -> None:
    state = tmp_path / "netem.json"
    u = NetemUnderlay(make_spec(3), state)
    u.build()
    assert [b.tool for b in ran] == ["ip", "bridge", "tc", "ip", "ip", "ip"]
    ran.clear()
    other = NetemUnderlay.load(state)  # e.g. a later `meshopt lab set`
    assert other.set([("n0", "n1"), (1, 0)], delay_ms=150.0, loss=0.02) == {"ok": True, "pairs": 2}
    (batch,) = ran
    assert batch.tool == "tc" and batch.netns == SW
    assert [line.split()[:4] for line in batch.lines] == [
        ["qdisc", "change", "dev", "p1"],
        ["qdisc", "change", "dev", "p0"],
    ]
    params = u.params()  # the first object sees the change
    assert params["names"] == ["n0", "n1", "n2"]
    assert params["delay_ms"][0][1] == params["delay_ms"][1][0] == 150.0
    assert params["delay_ms"][0][2] == 3.0 and params["delay_ms"][2][0] == 21.0
    assert params["loss"][0][1] == 0.02 and params["loss"][0][2] == 0.0
    assert params["rate_mbit"][0][1] is None and params["up"] == [True, True, True]
    ran.clear()
    u.set([(0, 1)], rate_mbit=5.0)
    assert ran[0].lines[0].startswith("class change dev p1 parent 1: classid 1:2 htb rate 5mbit")
    assert "delay 150.000ms loss 2%" in ran[0].lines[1]  # the rest of the pair kept
    assert other.params()["rate_mbit"][0][1] == 5.0
    u.set([(0, 1)], rate_mbit=None)
    assert other.params()["rate_mbit"][0][1] is None
    ran.clear()
    assert other.node_state("n2", False) == {"ok": True, "node": 2, "up": False}
    assert ran == [Batch("ip", SW, ("link set dev p2 down",))]
    assert u.params()["up"] == [True, True, False]
    saved = msgspec.json.decode(state.read_bytes(), type=NetemSpec)
    assert saved.up == [True, True, False] and saved.delay_ms[1][0] == 150.0


def test_executor_set_is_all_or_nothing(ran: list[Batch]) -> None:
    u = NetemUnderlay(make_spec(3))
    before = u.params()
    for pairs, kwargs, message in [
        ([(0, 1), (0, "zz")], {"delay_ms": 1.0}, "unknown node 'zz'"),
        ([(0, 1), (0, 7)], {"delay_ms": 1.0}, "out of range"),
        ([(0, 1), (2, 2)], {"delay_ms": 1.0}, "itself"),
        ([(0, 1)], {"loss": 1.5}, "loss"),
        ([(0, 1)], {"rate_mbit": 0.0}, "rate_mbit"),
        ([], {"delay_ms": 1.0}, "no pairs"),
    ]:
        with pytest.raises(NetemError, match=message):
            u.set(pairs, **kwargs)
    assert ran == [] and u.params() == before
    with pytest.raises(NetemError, match="unknown node"):
        u.node_state("zz", False)


def test_build_failure_removes_what_was_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[Batch] = []

    def run(batch: Batch) -> None:
        ran.append(batch)
        if batch.tool == "tc":
            raise NetemError("tc in motsw: boom")

    monkeypatch.setattr(netem, "run_batch", run)
    state = tmp_path / "netem.json"
    with pytest.raises(NetemError, match="boom"):
        NetemUnderlay(make_spec(2), state).build()
    assert ran[-1] == Batch(
        "ip", SW, ("link del dev p0", "link del dev p1", "link del dev br0"), force=True
    )
    assert ran[-1].argv() == ["ip", "-force", "-n", SW, "-batch", "-"]
    assert not state.exists()


def test_leaf_stats_are_mapped_to_pairs() -> None:
    def leaf(dev: str, minor: str, packets: int, drops: int = 0) -> dict[str, Any]:
        return {
            "kind": "netem",
            "handle": f"{minor}:",
            "parent": f"1:{minor}",
            "dev": dev,
            "packets": packets,
            "bytes": 98 * packets,
            "drops": drops,
            "backlog": 0,
            "qlen": 0,
        }

    qdiscs = [
        {"kind": "noqueue", "dev": "br0", "root": True, "packets": 9},
        {"kind": "htb", "handle": "1:", "dev": "p1", "root": True, "packets": 12},
        leaf("p1", "2", 10, drops=2),  # 0 -> 1
        leaf("p0", "10", 1),  # 14 -> 0 (hex minor)
        leaf("p0", "3", 0),  # 1 -> 0, no traffic: left out
    ]
    pairs, totals = parse_leaf_stats(qdiscs, 16)
    assert pairs == [
        {"src": 0, "dst": 1, "packets": 10, "bytes": 980, "drops": 2, "backlog": 0, "qlen": 0},
        {"src": 14, "dst": 0, "packets": 1, "bytes": 98, "drops": 0, "backlog": 0, "qlen": 0},
    ]
    assert totals["packets"] == 11 and totals["drops"] == 2


def test_leaf_lines_round_trip_through_tc_syntax() -> None:
    """Every produced line is plain words tc/ip batch mode can split (no quoting)."""
    spec = make_spec(4, jitter=[[0.0, 1.0, 0, 0]] + [[0.0] * 4] * 3, ipv6=True)
    for batch in netem_build_commands(spec):
        for line in batch.lines:
            assert re.fullmatch(r"[A-Za-z0-9_.:/%\- ]+", line), line
            assert words(line) == line.split()


def test_unreadable_state_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(NetemError, match="netem underlay state"):
        NetemUnderlay.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"switch_netns": 3}')
    with pytest.raises(NetemError, match="netem underlay state") as info:
        NetemUnderlay.load(bad)
    assert "\n" not in str(info.value)
    spec = make_spec(2)
    spec.leaf = "tbf"  # well-typed but invalid: load() validates in full
    bad.write_bytes(msgspec.json.encode(spec))
    with pytest.raises(NetemError, match="leaf"):
        NetemUnderlay.load(bad)
