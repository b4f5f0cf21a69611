"""The controller in the closed loop: real agents, real mosquitto, wireguard-go (issue 5).

One mesh for the module (topologies/lab4.yaml, single layout) with two controllers,
ctl1 and ctl2, sharing one signing key: one holds the lease, the other stands by. The
controllers accept telemetry only from n1..n4. Tests restore what they change.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from meshopt.bus.messages import decode_lease, decode_route_set, decode_telemetry
from meshopt.bus.signing import load_private_key, unsigned_payload
from meshopt.lab.agents import controller_log, identity_key
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh, wait_until

from .conftest import EXAMPLES, new_lab_id
from .hostile import sign_raw
from .test_agent import bus_publish, bus_read
from .tools import controller_tally, need_tools

NODES = ["n1", "n2", "n3", "n4"]


@pytest.fixture(scope="module")
def mesh(lab_ok: None) -> Iterator[LiveMesh]:
    need_tools("mosquitto", "wireguard-go", "ping", "wg", "mosquitto_sub", "mosquitto_pub")
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=new_lab_id(), layout="single")
    live = LiveMesh(lab, controller_settings={"nodes": NODES})
    try:
        # The control plane first, as the benchmarks start it: on the broker and holding
        # the lease before any agent runs.
        live.start_controllers(("ctl1", "ctl2"))
        assert active(lab) in ("ctl1", "ctl2")
        live.start_agents()
        relayed = wait_until(lambda: len(live.path("n1", "n4")) == 3, 40)
        assert relayed is not None, f"n1->n4 never relayed:\n{live.logs()}"
        time.sleep(2.0)
        yield live
    finally:
        live.stop()
        lab.down()


def lease(lab: Lab) -> Any:
    raw = bus_read(lab, f"meshopt/{lab.plan.name}/controller/lease")[0]
    return decode_lease(unsigned_payload(raw, "lease"))


def route_set(lab: Lab, node: str) -> Any:
    raw = bus_read(lab, f"meshopt/{lab.plan.name}/routes/{node}")[0]
    return decode_route_set(unsigned_payload(raw, "routes"))


def active(lab: Lab) -> str:
    return str(lease(lab).controller)


def test_one_controller_publishes_and_routes_are_measured(mesh: LiveMesh) -> None:
    lab = mesh.lab
    holder = active(lab)
    assert holder in ("ctl1", "ctl2")
    sets = {n: route_set(lab, n) for n in NODES}
    # Every route set comes from the lease holder, in its term, and is for its node.
    assert {rs.controller for rs in sets.values()} == {holder}
    assert {rs.term for rs in sets.values()} == {lease(lab).term}
    assert all(rs.node == n for n, rs in sets.items())
    # The relayed pair is what the pings see: 2 x 17 or 2 x 20 ms instead of 80 ms.
    # The fastest of 20 is the path's delay (a busy CPU only adds to a ping): 80 ms or
    # more on the direct tunnel.
    rtts = mesh.ping("n1", "n4", count=20)
    assert rtts and min(rtts) < 45.0, sorted(rtts)


def test_the_lab_keeps_every_process_in_the_session_that_built_it(mesh: LiveMesh) -> None:
    """A session is a scheduling group of its own (the kernel's autogroups), and beside a
    busy lab such groups starved for seconds: the controller and the broker had their
    own, and telemetry reached the controller 0.4-2 s late (see procs.spawn). The
    daemons lead process groups of their own, which a terminal's Ctrl-C never reaches."""
    lab = mesh.lab
    ours = os.getsid(0)
    daemons = {f"controller {c}": p.pid for c, p in mesh.controllers.items()}
    daemons |= {p.role: p.pid for p in lab.state.procs if p.role in ("broker", "emulator")}
    assert len(daemons) == 4, daemons
    every = daemons | {f"agent {n}": p.pid for n, p in mesh.agents.items()}
    every |= {p.role: p.pid for p in lab.state.procs}
    assert {what: os.getsid(pid) for what, pid in every.items()} == dict.fromkeys(every, ours)
    assert {what: os.getpgid(pid) for what, pid in daemons.items()} == daemons


def test_next_hops_read_over_uapi_are_what_wg_show_lists(mesh: LiveMesh) -> None:
    """The benchmarks read AllowedIPs from wireguard-go's UAPI sockets (milliseconds for a
    whole mesh); ``wg show`` in each node lists the same, relayed prefixes included."""
    assert mesh.lab.state.wireguard == "userspace"
    relay = mesh.path("n1", "n4")[1]
    for node in NODES:
        shown: dict[str, list[str]] = {}
        for line in mesh.lab.run(node, ["wg", "show", "all", "allowed-ips"]).stdout.splitlines():
            _, key, *prefixes = line.split()
            shown[key] = sorted(p for p in prefixes if p != "(none)")
        read = {k: sorted(v) for k, v in mesh.allowed_ips(node).items()}
        assert read == shown, node
    owner = {w.public_key: w.node for w in mesh.lab.state.wg}
    n4 = f"{mesh.lab.overlay_ip('n4')}/32"
    assert [owner[k] for k, v in mesh.allowed_ips("n1").items() if n4 in v] == [relay]


def test_dead_agent_is_taken_out_of_the_graph(mesh: LiveMesh) -> None:
    relay = mesh.path("n1", "n4")[1]
    others = [(a, b) for a in NODES for b in NODES if a != b and relay not in (a, b)]

    def through_relay() -> list[tuple[str, str]]:
        hops = mesh.next_hops()
        return [(a, b) for a, b in others if relay in mesh.path_from(hops, a, b)[1:-1]]

    mesh.stop_agent(relay, kill=True)  # the will message tells the controller at once
    try:
        # Each node installs its own route set when it arrives, so the pairs leave the
        # relay one node at a time: the bound is on the last of them.
        gone = wait_until(lambda: not through_relay(), 10)
        assert gone is not None, f"{through_relay()} still through {relay}\n{mesh.logs()}"
        assert gone < 5.0
        assert relay not in mesh.path("n1", "n4")
        # The pairs' own ends fail over too (the relay's responder died with its agent),
        # so the controller's word on it can come after they left: waited for, not read.
        line = f"node {relay} offline"
        told = wait_until(lambda: line in controller_log(mesh.lab, active(mesh.lab)), 10)
        assert told is not None, mesh.logs()
    finally:
        mesh.start_agent(relay)
    assert wait_until(lambda: len(mesh.path("n1", "n4")) == 3, 30) is not None


def fast(rs: Any) -> list[tuple[str, str]]:
    return sorted((r.dst, r.via) for r in rs.routes if r.table == "fast")


def test_bad_telemetry_is_refused_and_the_loop_keeps_running(
    mesh: LiveMesh, tmp_path: Path
) -> None:
    """Telemetry that would move routes if believed, each refused for its own reason:
    signed by n3's real key but impossible, for a node nobody enrolled, on another
    node's topic, unsigned, or not JSON at all."""
    lab = mesh.lab
    name = lab.plan.name
    holder = active(lab)
    n3_key = load_private_key(identity_key(lab, "n3")[0])
    good = msgspec.to_builtins(
        decode_telemetry(
            unsigned_payload(bus_read(lab, f"meshopt/{name}/telemetry/n3")[0], "telemetry")
        )
    )
    seq = good["seq"] + 10**6  # newer than anything n3 sent: only the content is wrong

    def variant(**changes: Any) -> bytes:
        return json.dumps({**good, "seq": seq, "sent_at": time.time(), **changes}).encode()

    peer0 = {**good["peers"][0], "rtt_ms": -5.0}
    lossy = {**good["peers"][0], "loss": 1.5}

    # The comparison below needs routes that have no reason to move: every node routes
    # to all three others (an agent restarted by an earlier test may still be joining)
    # and n1-n4 is on its optimum (n2; after a fail-over it may still be on n3, which
    # the policy leaves once its hold time is over).
    def settled() -> bool:
        complete = all(len(fast(route_set(lab, n))) == 3 for n in NODES)
        return complete and mesh.path("n1", "n4") == ["n1", "n2", "n4"]

    assert wait_until(settled, 60) is not None, {n: fast(route_set(lab, n)) for n in NODES}
    before_sets = {n: fast(route_set(lab, n)) for n in NODES}
    before = controller_tally(lab, holder)
    for topic, payload, who in (
        (
            f"meshopt/{name}/telemetry/ghost",
            sign_raw("telemetry", variant(node="ghost"), n3_key),
            "admin",
        ),
        (f"meshopt/{name}/telemetry/n3", sign_raw("telemetry", variant(peers=[peer0]), n3_key), ""),
        (f"meshopt/{name}/telemetry/n3", sign_raw("telemetry", variant(peers=[lossy]), n3_key), ""),
        (f"meshopt/{name}/telemetry/n2", sign_raw("telemetry", variant(), n3_key), "admin"),
        (f"meshopt/{name}/telemetry/n3", variant(), ""),
        (f"meshopt/{name}/telemetry/n3", b"\xff not json", ""),
    ):
        bus_publish(lab, topic, payload, tmp_path, who=who)
    want = {
        "telemetry_unknown_node": 1,
        "telemetry_bad_value": 2,
        "telemetry_unknown_key": 1,
        "telemetry_bad_schema": 1,
        "telemetry_bad_json": 1,
    }

    def short() -> dict[str, int]:
        now = controller_tally(lab, holder)
        return {k: n for k, n in want.items() if now.get(k, 0) - before.get(k, 0) < n}

    assert wait_until(lambda: not short(), 10, interval=0.5) is not None, short()
    assert mesh.controllers[holder].poll() is None, "the controller died on bad input"
    # Still the only publisher, still renewing its lease, and nothing about the ghost.
    first = lease(lab)
    renewed = wait_until(lambda: lease(lab).expires_at > first.expires_at, 3.0, interval=0.2)
    assert renewed is not None, "the lease was not renewed within its term"
    assert lease(lab).controller == holder
    assert {n: fast(route_set(lab, n)) for n in NODES} == before_sets


def test_standby_takes_over_and_routes_stay(mesh: LiveMesh) -> None:
    lab = mesh.lab
    holder = active(lab)
    standby = "ctl2" if holder == "ctl1" else "ctl1"
    installed = {n: mesh.installed(n) for n in NODES}
    t0 = time.monotonic()
    mesh.stop_controller(holder, kill=True)
    took = wait_until(lambda: active(lab) == standby, 10, interval=0.2)
    assert took is not None, mesh.logs()
    assert time.monotonic() - t0 < 5.0
    # Routes stayed in place meanwhile (agents are fail-static).
    assert {n: mesh.installed(n) for n in NODES} == installed
    # The new controller acts: a node going away is routed around under its name.
    relay = mesh.path("n1", "n4")[1]
    mesh.stop_agent(relay, kill=True)
    try:
        assert wait_until(lambda: relay not in mesh.path("n1", "n4"), 10) is not None
        # n1 fails over on its own too: the new holder's set is waited for, not read.
        assert wait_until(lambda: route_set(lab, "n1").controller == standby, 10) is not None
    finally:
        mesh.start_agent(relay)
        mesh.start_controller(holder)  # back as the standby
    assert wait_until(lambda: len(mesh.path("n1", "n4")) == 3, 30) is not None
    time.sleep(2.0)
    assert active(lab) == standby  # the restarted one did not take the lease back
