"""The scale benchmark's load generator (meshopt.bench.synthetic) and its script.

A synthetic agent's messages must be what a real agent sends: its telemetry verifies
under the controller's key ring (the enrolled identity key) and decodes with the real
decoders; a tiny mesh through a real mosquitto and the real controller process gets
route sets, times a degraded link and a dead node, and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from meshopt.agent.core import AgentCore, RouteState
from meshopt.bench.synthetic import (
    MESH,
    BenchError,
    RunSettings,
    SyntheticMesh,
    ingest_cost,
    proc_cpu_s,
    proc_rss_mb,
    run_once,
)
from meshopt.bus.messages import PeerReport, Telemetry
from meshopt.bus.signing import KeyRing, public_key_b64, verify_status, verify_telemetry
from meshopt.controller.config import parse_node_keys

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_scale.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _telemetry(mesh: SyntheticMesh, i: int, profile: Any = "agent") -> tuple[AgentCore, bytes]:
    node = mesh.nodes[i]
    core = AgentCore(MESH, node.name, node.identity, [], RouteState(), 1.8e9)
    core.new_session(1.8e9)
    peers = mesh.reports(i, random.Random(1), profile=profile)
    msg = core.telemetry(
        1.8e9,
        public_keys=[node.wg_key],
        addresses=[node.address],
        full=True,
        peers=peers,
        counters={},
    )
    return core, msg


def test_synthetic_telemetry_verifies_under_the_enrolled_key() -> None:
    mesh = SyntheticMesh(6, seed=1)
    ring = KeyRing([public_key_b64(mesh.nodes[2].identity)])
    core, msg = _telemetry(mesh, 2)
    t = verify_telemetry(msg, ring, mesh=MESH, node="n0002")
    assert isinstance(t, Telemetry) and t.full and t.public_keys == [mesh.nodes[2].wg_key]
    # Every other node is a peer, by its WireGuard key, with the mesh's RTT (+-10 %).
    assert t.table is not None and t.peers == []  # the compact form, as the agent sends
    rows = t.reports()
    assert [p.public_key for p in rows] == [x.wg_key for x in mesh.nodes if x.index != 2]
    for p in rows:
        j = next(x.index for x in mesh.nodes if x.wg_key == p.public_key)
        assert p.rtt_ms is not None and p.samples == 64 and p.alive is True
        assert abs(p.rtt_ms - mesh.rtt_ms[2, j]) <= 0.1 * mesh.rtt_ms[2, j] + mesh.jitter_ms[2, j]
    # The status goes through the same signer; another node's key does not verify it.
    st = verify_status(core.online(1.8e9), ring, mesh=MESH, node="n0002")
    assert st.online
    other = KeyRing([public_key_b64(mesh.nodes[3].identity)])
    with pytest.raises(Exception, match="unknown_key"):
        verify_telemetry(msg, other, mesh=MESH, node="n0002")


def test_degraded_link_and_lean_profile() -> None:
    mesh = SyntheticMesh(4, seed=1)
    rng = random.Random(0)
    slow = mesh.reports(0, rng, profile="lean", factor={1: 10.0})
    by_key = {p.public_key: p for p in slow}
    p1: PeerReport = by_key[mesh.nodes[1].wg_key]
    assert p1.rtt_ms is not None and p1.rtt_ms >= mesh.rtt_ms[0, 1] * 9 + 100
    assert p1.endpoint is None and p1.rx_bytes == 0  # lean: routing fields only
    full = mesh.reports(0, rng, profile="agent")
    assert all(p.endpoint and p.probes_sent == 0 and p.rtt_p95_ms for p in full)


def test_node_keys_table_enrols_every_node() -> None:
    import tomllib

    mesh = SyntheticMesh(5, seed=2)
    enrolled = parse_node_keys(tomllib.loads(mesh.node_keys_toml())["node_keys"])
    assert [e.node for e in enrolled] == mesh.names
    for e, x in zip(enrolled, mesh.nodes, strict=True):
        assert e.key == public_key_b64(x.identity)
        assert e.wireguard == (x.wg_key,) and e.addresses == (x.address,)


def test_bad_sizes_are_one_line_errors() -> None:
    with pytest.raises(BenchError, match=r"nodes: want 2\.\.5000"):
        SyntheticMesh(1)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "ten"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "want comma-separated integers" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_proc_readings_of_this_process() -> None:
    assert proc_cpu_s(os.getpid()) > 0
    rss, peak = proc_rss_mb(os.getpid())
    assert 0 < rss <= peak


def test_summary_goals_and_exponents() -> None:
    mod = _script()
    run50 = {"steady": {"controller_cpu_pct": 2.0}, "degrade": {"latency_median_s": 0.25}}
    run250 = {"steady": {"controller_cpu_pct": 50.0}, "degrade": {"latency_median_s": 0.5}}
    sizes = {
        "50": {"figures": mod.summarise([run50], 50)},
        "250": {"figures": mod.summarise([run250, run250, run50], 250)},
    }
    cpu = sizes["250"]["figures"]["controller_cpu_pct"]
    assert cpu["median"] == 50.0 and cpu["goal"] == 15.0 and cpu["pass"] is False
    assert sizes["250"]["figures"]["degrade_latency_median_s"]["pass"] is True
    exp = mod.exponents(sizes)
    assert exp["controller_cpu_pct"]["50->250"] == 2.0  # 25x over 5x nodes: N^2
    assert exp["broker_cpu_pct"]["50->250"] is None  # not measured: no exponent
    new = {"sizes": sizes}
    assert mod.compare(new, new)["n=250 controller_cpu_pct"] == 1.0


@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="mosquitto is not installed")
def test_tiny_mesh_end_to_end_through_real_broker_and_controller() -> None:
    """N=5: real mosquitto (broker init files), real controller process, 5 sessions."""
    res = asyncio.run(
        run_once(RunSettings(nodes=5, steady_s=3.0, change_window_s=10.0, quiet_s=1.5))
    )
    assert res["connected"] == 5 and res["nodes_with_routes"] == 5
    assert res["agent_refused"] == {}  # every route set verified as an agent verifies it
    assert res["route_set_bytes_median"] > 0 and res["routes_per_set_median"] >= 4
    steady = res["steady"]
    assert steady["agent_up_bytes_per_s"] > 0 and steady["controller_rss_mb"] > 0
    assert res["telemetry_heartbeat_bytes"] < res["telemetry_snapshot_bytes"]
    deg = res["degrade"]
    assert deg["nodes_updated"] >= 1 and deg["latency_median_s"] is not None
    assert 0 < deg["latency_first_s"] <= deg["latency_median_s"] <= deg["latency_max_s"]
    # The degraded link's own ends stop using it directly.
    assert deg["affected_nodes"] == 2 and deg["affected_fixed"] == 2
    assert deg["affected_latency_max_s"] is not None
    death = res["death"]
    # Every other node routed to the dead one: all four get a new route set.
    assert death["nodes_updated"] == 4 and death["latency_p95_s"] is not None
    # The broker and the controller were stopped (by PID) and reaped.
    for pid in res["pids"].values():
        assert not Path(f"/proc/{pid}").exists()


def test_controller_core_ingests_synthetic_snapshots() -> None:
    """The controller's own code takes every synthetic snapshot (nothing refused)."""
    res = ingest_cost(SyntheticMesh(8, seed=1), "agent", rounds=2)
    assert res["refused"] == {} and res["ingest_ms_per_snapshot"] > 0
    assert res["snapshot_bytes"] > 8 * 40
    assert res["heartbeat_bytes"] < res["change_bytes"] < res["snapshot_bytes"]
    assert res["full_interval_s"] == 5.0  # 7 peers: the base interval


def test_synthetic_agent_sends_what_the_agents_cadence_plans() -> None:
    """Full snapshot first, then (values moving only by noise) heartbeats; an injected
    change sends a change report of the changed peer alone."""
    from meshopt.bench.synthetic import SyntheticAgent
    from meshopt.bus.client import BrokerSettings

    mesh = SyntheticMesh(40, seed=1)  # 39 peers: snapshots every 6.5 s
    from meshopt.bus.signing import generate_signing_key

    ctl = public_key_b64(generate_signing_key()[0])
    ag = SyntheticAgent(mesh, 0, BrokerSettings(), ctl, rng=random.Random(1))
    first = ag.plan()
    assert first is not None and first.full and len(first.peers) == 39
    assert first.interval_s == pytest.approx(6.5)
    ag.cadence.sent(first, 0.0)
    # The plan reads the clock: put the last snapshot an hour ahead (not due, however
    # slow this run) and the last message long ago (the heartbeat is due).
    ag.cadence.last_full, ag.cadence.last_sent = time.monotonic() + 3600.0, -1e9
    beat = ag.plan()
    assert beat is not None and not beat.full and beat.peers == []
    ag.factor[3] = 10.0
    change = ag.plan()
    assert change is not None and [p.public_key for p in change.peers] == [mesh.nodes[3].wg_key]


def test_synthetic_heartbeats_do_not_rebuild_every_peer_report() -> None:
    """At N = 1000 building 999 peer reports for each heartbeat check took the whole
    generator: while nothing was injected and no snapshot is due, the agent's cadence
    can only answer a heartbeat or nothing, and the synthetic agent answers it without
    building the reports; an injected change still builds them (and is reported). Its
    MQTT keepalive is the agent daemon's, not the bus default."""
    from meshopt.agent.daemon import AGENT_KEEPALIVE_S
    from meshopt.bench.synthetic import SyntheticAgent
    from meshopt.bus.client import BrokerSettings
    from meshopt.bus.signing import generate_signing_key

    mesh = SyntheticMesh(40, seed=1)
    ctl = public_key_b64(generate_signing_key()[0])
    ag = SyntheticAgent(mesh, 0, BrokerSettings(), ctl, rng=random.Random(1))
    assert ag.bus.keepalive_s == AGENT_KEEPALIVE_S == 10
    first = ag.plan()
    assert first is not None and first.full and ag.snapshots == 1
    ag.cadence.sent(first, time.monotonic())
    ag.cadence.last_full = time.monotonic() + 3600.0  # no snapshot due
    assert ag.plan() is None and ag.snapshots == 1  # nothing due, nothing built
    ag.cadence.last_sent = -1e9
    beat = ag.plan()
    assert beat is not None and not beat.full and beat.peers == [] and ag.snapshots == 1
    ag.factor[5] = 10.0
    change = ag.plan()
    assert change is not None and ag.snapshots == 2
    assert [p.public_key for p in change.peers] == [mesh.nodes[5].wg_key]
    # Once that change is sent, checks are cheap again.
    ag.cadence.sent(change, time.monotonic())
    ag._sent_factor = dict(ag.factor)
    ag.cadence.last_sent = -1e9
    again = ag.plan()
    assert again is not None and again.peers == [] and ag.snapshots == 2


def test_generator_check_cost_reports_both_ways() -> None:
    from meshopt.bench.synthetic import generator_check_cost

    cost = generator_check_cost(SyntheticMesh(30, seed=1), rounds=3)
    assert cost["check_ms"] < cost["built_ms"]  # the heartbeat builds nothing now
    assert cost["core_share_pct"] <= cost["core_share_pct_built"]
