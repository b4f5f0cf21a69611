"""Spikes and stalls move no route; a real change does (issue 14 items 1-2).

The emulator's ``spike`` fault over socket pairs (no root), then a live mesh: a diamond
where a <-> b relays through c (16 ms RTT + the relay cost, against 24 ms through d and
60 ms direct). One packet in 20 on both of c's used links is held 100-300 ms, and c's
processes (agent and wireguard-go) are stopped twice for 0.6 s, so replies through c
are held and then arrive at once: no route may move (read from the nodes' kernels) and
no agent may declare a peer dead. Then a-c's delay is tripled (a->c->b costs 34 ms),
and a <-> b must move to d.

The agents run with ``probe.dead_after_s = 2``: a 0.6 s stall of a node is near the
default 0.8 s liveness timeout (a separate item of the issue), and this test is about
the estimator, not the liveness timer.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from meshopt.errors import InputError, TopologyError
from meshopt.lab.agents import agent_log
from meshopt.lab.emulator import (
    SPIKE_MS,
    Emulator,
    EmulatorSpec,
    NodeSpec,
    SpecError,
    validate_spec,
)
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import QUIET_AGENT, LiveMesh, wait_until
from meshopt.topology.yamlfile import dump_yaml, parse_yaml
from meshopt.units import parse_spike

from .conftest import new_lab_id
from .tools import emulator_on_sockets, need_tools

# --- the emulator's spike fault, over socket pairs ----------------------------------------


def _ipv4(src: str, dst: str, payload: bytes) -> bytes:
    header = bytes([0x45, 0]) + (20 + len(payload)).to_bytes(2, "big") + bytes(8)
    return header + ipaddress.ip_address(src).packed + ipaddress.ip_address(dst).packed + payload


def _spec(spike: list[list[int]] | None) -> EmulatorSpec:
    return EmulatorSpec(
        lab="spk1",
        control="/tmp/meshopt-spk1/emu.sock",
        nodes=[
            NodeSpec(name="a", netns="mospk1n0", ifname="mospk1u0", address="172.31.0.1/16"),
            NodeSpec(name="b", netns="mospk1n1", ifname="mospk1u1", address="172.31.0.2/16"),
        ],
        delay_ms=[[0, 1], [1, 0]],
        spike=spike,
    )


@pytest.fixture
def spiky() -> Iterator[tuple[Emulator, list[socket.socket]]]:
    """Two nodes, a->b spiking every packet (spike 1), b->a not at all."""
    with emulator_on_sockets(_spec([[0, 1], [0, 0]]), timeout=5.0) as running:
        yield running


def test_spike_holds_packets_and_counts_them(spiky: tuple[Emulator, list[socket.socket]]) -> None:
    emu, (a, b) = spiky
    t0 = time.monotonic()
    for k in range(3):
        a.send(_ipv4("172.31.0.1", "172.31.0.2", bytes([k]) * 8))
    got = [b.recv(2048) for _ in range(3)]
    assert time.monotonic() - t0 >= SPIKE_MS[0] / 1000.0  # each held >= 100 ms
    assert sorted(p[-1] for p in got) == [0, 1, 2]  # held alone: order may change
    b.send(_ipv4("172.31.0.2", "172.31.0.1", b"back"))
    assert a.recv(2048).endswith(b"back")
    pairs = {(p["src"], p["dst"]): p for p in emu.stats()["pairs"]}
    # Counted when scheduled, so before delivery; b->a may not be listed yet (the loop
    # counts a delivered packet after writing it), but it never spiked.
    assert pairs[(0, 1)]["spiked"] == 3 and pairs.get((1, 0), {}).get("spiked", 0) == 0
    assert emu.params()["spike"] == [[0, 1], [0, 0]]
    # Off by a set request: the next packet is not held.
    assert emu.handle_request(b'{"op": "set", "pairs": [["a", "b"]], "spike": 0}')["ok"]
    a.send(_ipv4("172.31.0.1", "172.31.0.2", b"now"))
    assert b.recv(2048).endswith(b"now")
    assert emu.stats()["totals"]["spiked"] == 3


@pytest.mark.parametrize("bad", ['"x"', "-1", "1.5", "true", "10000000"])
def test_bad_spike_requests_are_refused(
    spiky: tuple[Emulator, list[socket.socket]], bad: str
) -> None:
    emu, _ = spiky
    reply = emu.handle_request(b'{"op": "set", "pairs": [[0, 1]], "spike": %s}' % bad.encode())
    assert reply["ok"] is False
    assert "spike" in reply["error"] or "Expected" in reply["error"]
    assert emu.params()["spike"] == [[0, 1], [0, 0]]


def test_spike_spec_and_words_are_checked() -> None:
    with pytest.raises(SpecError, match="spike must be a 2x2"):
        validate_spec(_spec([[0, 1]]), check_system=False)
    with pytest.raises(SpecError, match=r"spike\[0\]\[1\]"):
        validate_spec(msgspec.structs.replace(_spec(None), spike=[[0, -3], [0, 0]]))
    assert [parse_spike(w) for w in ("20", "1/20", "off", "0")] == [20, 20, 0, 0]
    for bad in ("x", "1/0", "-2", "0.5", True, 2_000_000):
        with pytest.raises(InputError, match="bad spike"):
            parse_spike(bad)


# --- the live mesh ------------------------------------------------------------------------

DIAMOND = """\
name: diamond
defaults: {delay: 6ms, jitter: 0.2ms, rate: 100Mbit}
nodes: {a: {}, b: {}, c: {}, d: {}}
underlay:
  a-b: {delay: 30ms}
  a-c: {delay: 4ms}
  c-b: {delay: 4ms}
"""


def _on_optimum(hops: dict[str, dict[str, str]]) -> bool:
    """Every pair direct but a <-> b, which relays through c (the diamond's optimum)."""
    want = {("a", "b"): ["a", "c", "b"], ("b", "a"): ["b", "c", "a"]}
    return LiveMesh.direct_but(hops, want)


def _step_lines(lab: Lab) -> int:
    """Confirmed RTT steps in the logs of a and c, the ends of the link that changes."""
    return sum(len(re.findall(r"RTT stepped to", agent_log(lab, n))) for n in "ac")


def _dead_lines(lab: Lab) -> int:
    return sum(len(re.findall(r"peer \S+ DEAD", agent_log(lab, n))) for n in "abcd")


def test_spikes_and_stalls_move_no_route_but_a_real_change_does(
    lab_ok: None, tmp_path: Path
) -> None:
    need_tools("mosquitto", "wireguard-go", "wg", "ip")
    topo = tmp_path / "diamond.yaml"
    topo.write_text(DIAMOND)
    lab = Lab.up(str(topo), name=new_lab_id(), underlay="emulator")
    live = LiveMesh(lab, agent_sections={**QUIET_AGENT, "probe": {"dead_after_s": 2.0}})
    try:
        live.start()
        # Every pair on its optimum before the faults (a fixed wait raced the last pairs:
        # CI saw a<->d still relayed through c, then take its direct tunnel mid-test).
        settled = wait_until(lambda: _on_optimum(live.next_hops()), 40, interval=0.5)
        assert settled is not None, f"never every pair on its optimum:\n{live.logs()}"
        time.sleep(3.0)  # a route set still in flight would land now
        hops = live.next_hops()
        assert _on_optimum(hops), (hops, live.logs())
        installed = {n: live.installed(n) for n in live.nodes}
        dead = _dead_lines(lab)

        lab.set("a-c spike=20")
        lab.set("c-b spike=1/20")
        for _ in range(2):
            time.sleep(3.0)
            stalled = lab.stall("c", 0.6)
            assert len(stalled) >= 2  # the agent and wireguard-go at least
        time.sleep(4.0)
        spiked = sum(p["spiked"] for p in lab.emulator.stats()["pairs"])
        assert spiked >= 3, "the spike fault delayed (almost) nothing"

        assert live.next_hops() == hops, live.logs()
        assert {n: live.installed(n) for n in live.nodes} == installed
        assert _dead_lines(lab) == dead, live.logs()

        lab.set("a-c spike=off")
        lab.set("c-b spike=off")
        steps = _step_lines(lab)
        lab.set("a-c delay=12ms")  # x3: a->c->b 24 + 8 ms, a->d->b 24 ms

        # Both directions, read in one snapshot: a and b each install their own route
        # set when it arrives, so one direction can move a moment before the other.
        def via_d() -> bool:
            hops = live.next_hops()
            return live.path_from(hops, "a", "b") == ["a", "d", "b"] and live.path_from(
                hops, "b", "a"
            ) == ["b", "d", "a"]

        moved = wait_until(via_d, 25, interval=0.5)
        assert moved is not None, f"a<->b stayed on c after a-c tripled:\n{live.logs()}"
        # The confirmed step is in the agents' logs (where a slow re-route is explained).
        assert _step_lines(lab) > steps, live.logs()
    finally:
        live.stop()
        lab.down()


def test_spike_in_topology_files() -> None:
    topo = parse_yaml(DIAMOND + "  a-d: {spike: 20}\n  d->b: {spike: 1/50}\n")
    assert topo.spike is not None
    i = {n: k for k, n in enumerate(topo.names)}
    assert topo.spike[i["a"], i["d"]] == topo.spike[i["d"], i["a"]] == 20
    assert topo.spike[i["d"], i["b"]] == 50 and topo.spike[i["b"], i["d"]] == 0
    assert int(topo.spike.sum()) == 90
    again = parse_yaml(dump_yaml(topo))
    assert again.spike is not None and (again.spike == topo.spike).all()
    plain = parse_yaml(DIAMOND)
    assert plain.spike is None and "spike" not in dump_yaml(plain)
    with pytest.raises(TopologyError, match="bad spike 'often'"):
        parse_yaml(DIAMOND + "  a-d: {spike: often}\n")


def test_lab_set_refuses_bad_faults(lab_ok: None, tmp_path: Path) -> None:
    """One-line errors, before anything changes (no agents needed); a topology file's
    spikes reach the emulator."""
    need_tools("wireguard-go", "ip")
    topo = tmp_path / "diamond.yaml"
    topo.write_text(DIAMOND + "  a-d: {spike: 20}\n")
    lab = Lab.up(str(topo), name=new_lab_id(), underlay="emulator", broker=False)
    try:
        for text, message in (
            ("a-c spike=often", "bad spike"),
            ("a-c spike=0.5", "bad spike"),
            ("node=c spike=20", "for a link"),
            ("node=c stall=forever", "stall"),
            ("node=c stall=0s", "0 < S"),
            ("a-c stall=1s", "node=NAME stall"),
            ("node=x stall=1s", "node=NAME stall"),
        ):
            with pytest.raises(InputError, match=message):
                lab.set(text)
        expected = [[0] * 4 for _ in range(4)]
        expected[0][3] = expected[3][0] = 20  # a-d, from the file
        assert lab.emulator.params()["spike"] == expected
        # With another change in the same command, both apply; off turns it off.
        lab.set("a->c spike=5 delay=7ms")
        params = lab.emulator.params()
        assert params["spike"][0][2] == 5 and params["spike"][2][0] == 0
        assert params["delay_ms"][0][2] == 7.0 and params["delay_ms"][2][0] == 4.0
        lab.set("a-d spike=off")
        assert lab.emulator.params()["spike"][0][3] == 0
    finally:
        lab.down()
