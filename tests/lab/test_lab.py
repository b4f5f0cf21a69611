"""``meshopt lab``: a real WireGuard mesh in namespaces, with real packets (root only).

Fidelity targets through WireGuard are the underlay's: ping RTT within max(0.5 ms, 3 %)
of the configured RTT, TCP goodput within 5 % of the rate (less WireGuard's and TCP's
headers), loss within ±1 point of 5 % over 2,000 packets, a ``lab set`` seen within
100 ms.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshopt.lab.emulator import EmulatorClient
from meshopt.lab.lab import Lab
from meshopt.lab.netns import list_netns
from meshopt.lab.plan import WG_MTU
from meshopt.lab.procs import tagged_pids
from meshopt.lab.state import LABS_ROOT, all_labs, lab_dir
from meshopt.wireguard.userspace import UserspaceBackend

from .conftest import EXAMPLES, RUN_ID, LabMaker
from .tools import (
    IP_TCP_HEADERS,
    PingResult,
    assert_goodput_near,
    calibrate_now,
    iperf3_goodput_mbit,
    ping_from,
    rtt_tolerance,
)

pytestmark = pytest.mark.lab

WG_OVERHEAD = 60  # outer IPv4 20 + UDP 8 + WireGuard 32


@pytest.fixture
def fresh(lab4: Lab) -> Iterator[Lab]:
    """lab4 with n1<->n2 at 5 ms one way, no jitter, loss or rate limit; every node up."""
    lab4.set("n1-n2 delay=5ms jitter=0 loss=0 rate=unlimited")
    yield lab4
    lab4.set("n1-n2 delay=5ms jitter=0.2ms loss=0 rate=100Mbit")
    for node in lab4.topo.names:
        lab4.set(f"node={node} up")


def _ping(
    lab: Lab, src: str, dst: str, count: int, interval: float, *, overlay: bool = True
) -> PingResult:
    addr = lab.overlay_ip(dst) if overlay else lab.underlay_ip(dst)
    return ping_from(lab.netns(src), addr, count, interval)


# --- what lab up builds --------------------------------------------------------------


def test_every_node_reaches_every_other_through_wireguard(lab4: Lab) -> None:
    names = lab4.topo.names
    for a in names:
        state = UserspaceBackend(run_dir=str(lab4.wg_run_dir(a))).get("wg0")
        assert len(state.peers) == len(names) - 1
        for b in names:
            if a != b:
                r = _ping(lab4, a, b, 2, 0.05)
                assert r.received >= 1, (a, b, r.lines[-2:])
    # The pings went through WireGuard: every peer has a handshake and counted bytes.
    for a in names:
        state = UserspaceBackend(run_dir=str(lab4.wg_run_dir(a))).get("wg0")
        for p in state.peers:
            assert p.last_handshake is not None and p.rx_bytes > 0 and p.tx_bytes > 0


def test_node_sees_its_own_wireguard_with_overlay_address(lab4: Lab) -> None:
    out = lab4.run("n2", ["wg", "show", "interfaces"]).stdout.split()
    assert out == ["wg0"]  # its own interface only, though every node's is called wg0
    addr = lab4.run("n2", ["ip", "-o", "addr", "show", "dev", "wg0"]).stdout
    assert f"inet {lab4.overlay_ip('n2')}/29" in addr
    link = lab4.run("n2", ["ip", "-o", "link", "show", "dev", "wg0"]).stdout
    assert f"mtu {WG_MTU}" in link


def test_broker_reachable_over_management_network_when_underlay_is_down(lab4: Lab) -> None:
    """Control traffic does not depend on the underlay: n1 cut off, MQTT still works."""
    lab4.set("node=n1 down")
    try:
        assert _ping(lab4, "n1", "n2", 3, 0.05).received == 0
        # n3 publishes its own telemetry topic (all the ACL lets a node write); n1 reads
        # it with the reader's credentials, over TLS on the management network.
        topic = f"meshopt/{lab4.plan.name}/telemetry/n3"
        sub_args = lab4.mosquitto_cli_args("reader", network=True)
        pub_args = lab4.mosquitto_cli_args("n3", network=True)
        sub = lab4.popen(
            "n1",
            ["mosquitto_sub", *sub_args, "-t", topic, "-C", "1", "-W", "5"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.3)
        deadline = time.monotonic() + 5
        while sub.poll() is None and time.monotonic() < deadline:
            lab4.run("n3", ["mosquitto_pub", *pub_args, "-t", topic, "-m", "hi"])
            time.sleep(0.1)
        out, _ = sub.communicate(timeout=5)
        assert out.strip() == "hi"
    finally:
        lab4.set("node=n1 up")


# --- fidelity through WireGuard ---------------------------------------------------------


@pytest.mark.parametrize("delay_ms", [1.0, 5.0, 20.0])
def test_rtt_through_wireguard(fresh: Lab, delay_ms: float) -> None:
    fresh.set(f"n1-n2 delay={delay_ms}ms")
    _ping(fresh, "n1", "n2", 1, 0.1)  # handshake first
    calibrate_now(fresh)
    r = _ping(fresh, "n1", "n2", 100, 0.01)
    assert r.received >= 95
    median = statistics.median(r.rtts)
    assert abs(median - 2 * delay_ms) <= rtt_tolerance(2 * delay_ms), (delay_ms, median)


@pytest.mark.parametrize("wrong_us", [0.0, 1500.0])
def test_calibration_makes_the_overlay_read_true_again(fresh: Lab, wrong_us: float) -> None:
    """The tunnel allowance ``up`` fitted to this machine, spoiled on purpose (1.5 ms a
    hop reads ~2.5 ms short at 10 ms), is fitted again; n1-n2 (5 ms) reads true."""
    emu = fresh.emulator
    assert isinstance(emu, EmulatorClient)
    fitted = fresh.tunnel_allowance_us
    assert fresh.state.tunnel_latency_us is not None  # ``up`` calibrated
    emu.tunnel_latency(wrong_us)
    try:
        _ping(fresh, "n1", "n2", 1, 0.1)
        if wrong_us > fitted + 500:
            spoiled = statistics.median(_ping(fresh, "n1", "n2", 30, 0.01).rtts)
            assert spoiled < 10.0 - 2 * rtt_tolerance(10.0), spoiled
        cal = fresh.calibrate_tunnels()
        assert cal is not None and fresh.state.tunnel_latency_us == cal.latency_us
        assert emu.params()["tunnel_latency_us"] == cal.latency_us
        r = _ping(fresh, "n1", "n2", 100, 0.01)
        median = statistics.median(r.rtts)
        assert abs(median - 10.0) <= rtt_tolerance(10.0), (cal, median)
        # the pair it measured on is as it was: 5 ms one way, no jitter
        params = emu.params()
        assert params["delay_ms"][0][1] == params["delay_ms"][1][0] == 5.0
        assert params["jitter_ms"][0][1] == 0.0
    finally:
        emu.tunnel_latency(fitted)
        fresh.state.tunnel_latency_us = fitted


def test_rate_through_wireguard(fresh: Lab) -> None:
    """Goodput: the rate applies to underlay packets, which also carry WireGuard's 60 bytes."""
    fresh.set("n1->n2 rate=20Mbit")
    expected = 20e6 * (WG_MTU - IP_TCP_HEADERS) / (WG_MTU + WG_OVERHEAD)
    assert_goodput_near(
        lambda: iperf3_goodput_mbit(
            fresh.netns("n2"), fresh.netns("n1"), fresh.overlay_ip("n2"), seconds=3
        ),
        expected / 1e6,
    )


def test_loss_through_wireguard(fresh: Lab) -> None:
    fresh.set("n1->n2 loss=5%")
    _ping(fresh, "n1", "n2", 3, 0.05)  # handshake first (it could be lost too)
    r = _ping(fresh, "n1", "n2", 2000, 0.002)
    assert r.transmitted == 2000
    assert abs(r.loss - 0.05) <= 0.01, r.loss


def test_set_takes_effect_within_100ms_through_wireguard(fresh: Lab) -> None:
    _ping(fresh, "n1", "n2", 1, 0.1)
    t_set = time.monotonic()
    fresh.set("n1-n2 delay=40ms")
    took = time.monotonic() - t_set
    time.sleep(max(0.0, 0.1 - took))
    r = _ping(fresh, "n1", "n2", 5, 0.02)
    assert r.received == 5 and min(r.rtts) >= 80 - rtt_tolerance(80), r.rtts
    assert took < 0.1


def test_node_and_link_down_and_up(fresh: Lab) -> None:
    # Handshakes first: one lost while the link is down is retried only after 5 s.
    for dst in ("n2", "n3"):
        _ping(fresh, "n1", dst, 1, 0.1)
    _ping(fresh, "n2", "n3", 1, 0.1)
    fresh.set("n1-n2 down")
    assert _ping(fresh, "n1", "n2", 5, 0.02).received == 0
    assert _ping(fresh, "n1", "n3", 2, 0.02).received >= 1  # only that link
    fresh.set("n1-n2 up")
    assert _ping(fresh, "n1", "n2", 5, 0.02).received >= 4
    fresh.set("node=n3 down")
    assert _ping(fresh, "n1", "n3", 3, 0.02, overlay=False).received == 0
    assert _ping(fresh, "n2", "n3", 3, 0.02).received == 0
    fresh.set("node=n3 up")
    assert _ping(fresh, "n2", "n3", 3, 0.02).received >= 2


# --- layouts, bad input, clean-up --------------------------------------------------------


def test_per_peer_layout(make_lab: LabMaker) -> None:
    lab = make_lab(str(EXAMPLES / "triangle.yaml"), layout="per-peer", seed=7)
    assert lab.status()["seed"] == 7
    if lab.status()["underlay"] == "emulator":  # the emulator draws from the lab's seed
        spec = json.loads((lab_dir(lab.plan.lab_id) / "emu.json").read_text())
        assert spec["seed"] == 7
    ifs = lab.run("a", ["wg", "show", "interfaces"]).stdout.split()
    assert sorted(ifs) == ["wg-b", "wg-c"]
    allowed = lab.run("a", ["wg", "show", "wg-b", "allowed-ips"]).stdout
    assert "0.0.0.0/0" in allowed
    for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
        assert _ping(lab, a, b, 2, 0.05).received >= 1
    route = lab.run("a", ["ip", "route", "get", lab.overlay_ip("c")]).stdout
    assert "dev wg-c" in route


def test_bad_input_leaves_nothing(make_lab: LabMaker, lab4: Lab) -> None:
    from meshopt.errors import MeshoptError

    before = list_netns()
    procs_before = tagged_pids()
    with pytest.raises(MeshoptError, match="already up"):
        make_lab(str(EXAMPLES / "triangle.yaml"), name=lab4.plan.name)
    with pytest.raises(MeshoptError, match="too many"):
        make_lab("gen:geo:n=300,seed=1", name=f"huge{RUN_ID}")
    with pytest.raises(MeshoptError, match="unknown node"):
        lab4.set("n1-zz delay=5ms")
    with pytest.raises(MeshoptError, match="unknown unit"):
        lab4.set("n1-n2 delay=5parsecs")
    with pytest.raises(MeshoptError, match="unknown node"):
        lab4.run("nope", ["true"])
    assert list_netns() == before
    assert tagged_pids() == procs_before


def test_failed_up_rolls_back(lab_ok: None, tmp_path: Path) -> None:
    """An interruption while WireGuard starts (Ctrl-C) removes what was already built."""
    before = list_netns()
    procs_before = tagged_pids()
    seen: list[str] = []

    def interrupt(msg: str) -> None:
        seen.append(msg)
        if msg.startswith("wireguard"):
            assert len(list_netns()) > len(before)  # it really had built something
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Lab.up(str(EXAMPLES / "lab4.yaml"), name=f"rb{RUN_ID}", progress=interrupt)
    assert seen[-1].startswith("failed")
    assert list_netns() == before
    assert not any(s.name == f"rb{RUN_ID}" for s in all_labs())
    assert tagged_pids() == procs_before


def test_down_removes_processes_started_in_the_lab(make_lab: LabMaker) -> None:
    lab = make_lab(str(EXAMPLES / "triangle.yaml"))
    sleeper = lab.popen("a", ["sleep", "600"])
    lab_id = lab.plan.lab_id
    assert tagged_pids(lab_id)
    lab.down()
    assert sleeper.wait(5) is not None
    assert not tagged_pids(lab_id)
    assert not any(ns.startswith(f"ml{lab_id}") for ns in list_netns())
    assert not (LABS_ROOT / lab_id).exists()


def test_kernel_wireguard(make_lab: LabMaker) -> None:
    """Kernel WireGuard where the module is loaded; here a clear refusal otherwise."""
    from meshopt.lab.state import LabError
    from meshopt.wireguard.kernel import kernel_unavailable_reason

    reason = kernel_unavailable_reason()
    if reason is not None:
        before = list_netns()
        with pytest.raises(LabError, match="no WireGuard kernel module"):
            make_lab(str(EXAMPLES / "triangle.yaml"), wireguard="kernel")
        assert list_netns() == before
        pytest.skip(f"kernel WireGuard lab not run: {reason}")
    lab = make_lab(str(EXAMPLES / "triangle.yaml"), wireguard="kernel")
    assert lab.status()["wireguard"] == "kernel"
    for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
        assert _ping(lab, a, b, 2, 0.05).received >= 1


def test_netem_underlay(make_lab: LabMaker) -> None:
    """The kernel underlay where netem exists; here a clear refusal and nothing left."""
    from meshopt.lab.netem import netem_unavailable_reason
    from meshopt.lab.state import LabError

    reason = netem_unavailable_reason()
    if reason is not None:
        before = list_netns()
        with pytest.raises(LabError, match="no netem"):
            make_lab(str(EXAMPLES / "lab4.yaml"), underlay="netem")
        assert list_netns() == before
        pytest.skip(f"netem lab not run: {reason}")
    lab = make_lab(str(EXAMPLES / "lab4.yaml"), underlay="netem")
    assert lab.status()["underlay"] == "netem"
    _ping(lab, "n1", "n2", 1, 0.1)
    r = _ping(lab, "n1", "n2", 50, 0.01)
    assert abs(statistics.median(r.rtts) - 10.0) <= rtt_tolerance(10.0)
    lab.set("n1-n2 delay=20ms")
    r = _ping(lab, "n1", "n2", 20, 0.01)
    assert abs(statistics.median(r.rtts) - 40.0) <= rtt_tolerance(40.0)


def test_underlay_keeps_its_timing_on_a_busy_machine(fresh: Lab) -> None:
    """The emulator stands in for the network, which does not queue behind user
    processes: it runs SCHED_FIFO, and with two spinning processes (load 2 on these
    2-core machines) it still releases its packets on time. Under nice -10 alone 18 %
    left more than 1 ms late. wireguard-go runs at nice -10, never real-time: every
    thread of it, including those its runtime starts later."""
    import os

    from meshopt.bench.cpuload import cpu_load, lag_window
    from meshopt.lab.procs import WIREGUARD_NICE

    for p in fresh.state.procs:
        if p.role == "emulator":
            assert os.sched_getscheduler(p.pid) == os.SCHED_FIFO, p.role
        elif p.role.startswith("wg:"):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                assert os.sched_getscheduler(int(tid)) == os.SCHED_OTHER, p.role
                assert os.getpriority(os.PRIO_PROCESS, int(tid)) == WIREGUARD_NICE, p.role
    _ping(fresh, "n1", "n2", 1, 0.1)  # handshake first
    with cpu_load(2):
        before = fresh.emulator.stats()
        r = _ping(fresh, "n1", "n2", 100, 0.02)
        window = lag_window(before, fresh.emulator.stats())
    assert r.received >= 95
    # Not ping's own RTT: ping itself (and the kernel's deferred softirq work) queues
    # behind the load, and once read a 13 ms median here with the machine at load 9.
    assert window["packets"] >= 190 and window["ok"], window
