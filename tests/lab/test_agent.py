"""The agent in a real lab: wireguard-go, a real mosquitto, real packets (issue 4).

One mesh for the module: topologies/lab4.yaml in the single-interface layout, an agent
in every node and a controller next to the broker. n1-n4 direct is 40 ms one way while
n1-n2-n4 is 5 + 12 ms and n1-n3-n4 15 + 5 ms, so the controller relays n1<->n4 (through
n2 normally; n3 is within the anti-flap margin, so early estimates may settle there).
Tests that change the mesh put it back before they end.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from meshopt.bench.tunnelshare import tunnel_share
from meshopt.bus.messages import Route, RouteSet, decode_route_set, decode_telemetry
from meshopt.bus.signing import (
    generate_signing_key,
    load_private_key,
    sign_route_set,
    unsigned_payload,
)
from meshopt.lab.agents import controller_key
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh, wait_until
from meshopt.lab.state import lab_dir
from meshopt.lab.tap import TelemetryTap
from meshopt.topology.load import load_topology

from .conftest import EXAMPLES, new_lab_id
from .tools import need_tools


def bus_read(lab: Lab, topic: str, *, count: int = 1, timeout: float = 15) -> list[bytes]:
    """Messages on ``topic`` (retained ones first), read with mosquitto_sub on the host
    as the lab's reader (read-only on the broker's ACL)."""
    need_tools("mosquitto_sub")
    proc = subprocess.run(
        [
            *("mosquitto_sub", *lab.mosquitto_cli_args("reader"), "-t", topic),
            *("-C", str(count), "-W", str(int(timeout)), "-N"),
        ],
        capture_output=True,
        timeout=timeout + 5,
    )
    return [m for m in proc.stdout.split(b"\n") if m] if b"\n" in proc.stdout else [proc.stdout]


def publisher(lab: Lab, topic: str) -> str:
    """Who may send on ``topic``, as a compromised sender would: a node on its own
    telemetry/status, a controller (ctl3, which no test runs) on route sets and the
    controller topics, else the lab's admin (what no identity may send: the broker's ACL
    refuses it, so only a broken ACL lets it through to the daemons)."""
    kind, _, name = topic.removeprefix(f"meshopt/{lab.plan.name}/").partition("/")
    if kind in ("telemetry", "status") and name in [n.name for n in lab.plan.nodes]:
        return name
    if kind in ("routes", "controller"):
        return "ctl3"
    return "admin"


def bus_publish(
    lab: Lab, topic: str, payload: bytes, tmp: Path, *, retain: bool = False, who: str = ""
) -> None:
    need_tools("mosquitto_pub")
    f = tmp / "payload"
    f.write_bytes(payload)
    login = lab.mosquitto_cli_args(who or publisher(lab, topic))
    argv = ["mosquitto_pub", *login, "-t", topic, "-f", str(f), "-q", "1"]
    subprocess.run(argv + (["-r"] if retain else []), check=True, timeout=10)


def telemetry(lab: Lab, node: str) -> dict[str, Any]:
    """The next telemetry message of ``node`` (published at least every 10 s)."""
    for _ in range(3):
        msgs = bus_read(lab, f"meshopt/{lab.plan.name}/telemetry/{node}")
        if msgs and msgs[0]:
            t = decode_telemetry(unsigned_payload(msgs[0], "telemetry"))
            out: dict[str, Any] = msgspec.to_builtins(t)
            return out
    raise AssertionError(f"no telemetry from {node}")


# What the module's lab looked like once it was up, before any test disturbed it.
AT_START: dict[str, list[str]] = {}


def handshake_retries(lab: Lab) -> list[str]:
    """wireguard-go's lines for a first handshake that got no answer and was retried."""
    return [
        f"{log.name}: {line}"
        for log in sorted(lab_dir(lab.plan.lab_id).glob("wg-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "Handshake did not complete" in line
    ]


@pytest.fixture(scope="module")
def mesh(lab_ok: None) -> Iterator[LiveMesh]:
    need_tools("mosquitto", "wireguard-go", "ping", "wg")
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=new_lab_id(), layout="single")
    live = LiveMesh(lab)
    try:
        live.start()
        relayed = wait_until(lambda: len(live.path("n1", "n4")) == 3, 40)
        assert relayed is not None, f"n1->n4 never relayed:\n{live.logs()}"
        time.sleep(3.0)  # let the first few route sets (taken on young estimates) settle
        AT_START["handshake_retries"] = handshake_retries(lab)
        yield live
    finally:
        live.stop()
        lab.down()


def test_agents_probe_each_other_through_the_tunnels(mesh: LiveMesh) -> None:
    def probed(t: dict[str, Any]) -> bool:
        # Reports omit default fields: a peer whose only replies so far queued behind
        # WireGuard's first handshake is alive with no RTT sample, and has no "samples".
        return len(t["peers"]) == 3 and all(
            p.get("alive") is True
            and p.get("samples", 0) >= 5
            and p.get("handshake_age_s") is not None
            for p in t["peers"]
        )

    # The first message read may be the retained snapshot of a few seconds ago (CI once
    # saw one with 3 samples): read newer ones for a while before judging.
    t = telemetry(mesh.lab, "n1")
    deadline = time.monotonic() + 15
    while not probed(t) and time.monotonic() < deadline:
        time.sleep(1)
        t = telemetry(mesh.lab, "n1")
    owner = mesh.key_owner()
    rtt = {owner[p["public_key"]]: p for p in t["peers"]}
    assert set(rtt) == {"n2", "n3", "n4"}
    for p in rtt.values():
        assert p.get("alive") is True, t
        assert p.get("samples", 0) >= 5 and p.get("handshake_age_s") is not None, t
    # n2 and n3 are routed direct: the probes agree with ping on the same tunnel (ping
    # right after; both carry this VM's scheduling noise alike). Compared: the smoothed
    # RTT the controller routes on (half-life 2 s), not the median of the 64-sample
    # window, which still holds the agents' start-up ~20 s earlier: CI read that median
    # 11.0 ms against a 9.96 ms ping on a loaded machine.
    for peer in ("n2", "n3"):
        ping = mesh.median_rtt("n1", peer, count=20)
        assert ping is not None
        got = rtt[peer]["rtt_ms"]
        assert got == pytest.approx(ping, abs=max(1.0, 0.05 * ping)), (peer, rtt[peer])
    # n4 is relayed, yet the probes measure the direct tunnel (probe addresses are never
    # relayed): about 80 ms, while pings through the relay take 34-40 ms.
    ping4 = mesh.median_rtt("n1", "n4", count=20)
    assert ping4 is not None and ping4 < 50.0
    assert rtt["n4"]["rtt_median_ms"] > 75.0
    assert t["counters"].get("probe_no_kernel_ts", 0) == 0
    assert t["addresses"] == [f"{mesh.lab.overlay_ip('n1')}/32"]


def test_the_telemetry_tap_reads_what_every_agent_reported(mesh: LiveMesh) -> None:
    """The twin benchmark's tap: every node's signed reports decoded, peers named, and
    what the tunnels add to the topology's RTT small and measured, not assumed."""
    need_tools("mosquitto_sub", "stdbuf")
    owner = mesh.key_owner()
    with TelemetryTap(mesh.lab) as tap:

        def everyone() -> bool:
            return {h.node for h in tap.heard(owner) if h.report.rtt_ms} == set(mesh.nodes)

        assert wait_until(everyone, 25, interval=0.5) is not None
    heard = tap.heard(owner)
    assert {h.peer for h in heard} == set(mesh.nodes)
    topo = load_topology(str(EXAMPLES / "lab4.yaml"))
    nominal = topo.rtt_ms()
    for h in heard:
        if h.report.rtt_ms and h.report.alive:
            want = float(nominal[topo.index(h.node), topo.index(h.peer)])
            assert want <= h.report.rtt_ms + 1.0 and h.report.rtt_ms < want + 5.0, h
    share = tunnel_share(
        [(h.node, h.peer, h.report.rtt_ms, h.report.jitter_ms or 0.0) for h in heard
         if h.report.rtt_ms and h.report.alive], topo,
    )  # fmt: skip
    assert share is not None and share.links == 12
    assert 0.0 <= share.ms < 3.0 and share.sigma_ms < 3.0, share


def test_the_agents_start_loses_no_handshake(mesh: LiveMesh) -> None:
    """Four agents starting together: both ends of a tunnel initiating WireGuard's first
    handshake at once lose it for 5 s (each drops the answer to its own initiation), so
    the end with the larger key waits until the other end's probe reaches it. A retry
    at the start is that collision (CI once saw n1-n4 unmeasured 15 s after the start)."""
    assert "handshake_retries" in AT_START
    assert AT_START["handshake_retries"] == [], AT_START["handshake_retries"]


def relay(mesh: LiveMesh) -> tuple[str, str]:
    """(the node relaying n1<->n4, the other candidate)."""
    path = mesh.path("n1", "n4")
    assert len(path) == 3 and mesh.path("n4", "n1") == path[::-1], path
    return path[1], ({"n2", "n3"} - {path[1]}).pop()


def test_relayed_route_carries_the_traffic(mesh: LiveMesh) -> None:
    via, other = relay(mesh)
    assert mesh.installed("n1")[mesh.lab.overlay_ip("n4")] == "wg0"
    before = {n: mesh.forwarded(n) for n in (via, other)}
    rtts = mesh.ping("n1", "n4", count=50, interval=0.02)
    after = {n: mesh.forwarded(n) for n in (via, other)}
    assert len(rtts) >= 45  # n2-n4 has 0.5 % loss; a VM stall can cost a few more
    # Every request and reply went through the relay; the other node saw none of it.
    assert after[via] - before[via] >= 2 * len(rtts)
    assert after[other] - before[other] < 5
    # 2 x (5 + 12) or 2 x (15 + 5) ms over the relay, instead of 80 ms direct. The
    # fastest of 50 is the path's delay: CPU contention only ever adds to a ping (the
    # relay's wireguard-go and the emulator are processes), so a median is the load's.
    want = {"n2": 34.0, "n3": 40.0}[via]
    assert min(rtts) == pytest.approx(want, abs=2.0), sorted(rtts)


def test_bad_route_sets_are_dropped_and_counted(mesh: LiveMesh, tmp_path: Path) -> None:
    """Sets a controller identity may publish (the ACL lets them through) but the agent
    must refuse: each would move n1's traffic if it were installed."""
    lab = mesh.lab
    topic = f"meshopt/{lab.plan.name}/routes/n1"
    current = decode_route_set(unsigned_payload(bus_read(lab, topic)[0], "routes"))
    key_path, _ = controller_key(lab)
    key = load_private_key(key_path)
    stranger = generate_signing_key()[0]
    owner_n4 = next(k for k, n in mesh.key_owner().items() if n == "n4")
    # Everything through n4: what an attacker would install to detour n1's traffic.
    moved = [Route(dst=r.dst, via=owner_n4) for r in current.routes if r.table == "fast"]
    assert any(r.via != owner_n4 for r in current.routes if r.table == "fast")

    def signed(routes: list[Route], version: int, k: Any = key, term: int | None = None) -> bytes:
        return sign_route_set(
            RouteSet(
                mesh=lab.plan.name,
                node="n1",
                version=version,
                issued_at=time.time(),
                controller="test",
                term=current.term if term is None else term,
                routes=routes,
            ),
            k,
        )

    unknown_peer = generate_signing_key()[1]
    bad_routes = [
        *current.routes,
        Route(dst="10.250.0.9/32", via=owner_n4),  # outside the mesh
        Route(dst="10.99.0.6/32", via=unknown_peer),  # in the mesh, but not a peer of n1
    ]
    want = [
        "routeset_bad_json",
        "routeset_too_large",
        "routeset_unknown_key",
        "routeset_replay",
        "route_outside_mesh",
        "route_unknown_peer",
        "routeset_old_term",
        "routeset_term_jump",
        "routeset_wrong_node",
    ]
    before = telemetry(lab, "n1")["counters"]
    for payload in (
        b"\x00garbage{",
        b"{" * 300_000,
        signed(moved, current.version + 10**9, stranger),  # wrong key
        signed(moved, current.version - 1),  # replay of an older version
        signed(bad_routes, current.version + 1),  # signed, but two routes are impossible
        signed(moved, current.version + 2, term=current.term - 1),  # a deposed controller
        signed(moved, current.version + 3, term=2**62),  # a term no clock explains
        sign_route_set(  # a valid set for n2, replayed on n1's topic
            RouteSet(
                mesh=lab.plan.name,
                node="n2",
                version=current.version + 4,
                issued_at=time.time(),
                controller="test",
                term=current.term,
                routes=moved,
            ),
            key,
        ),
    ):
        bus_publish(lab, topic, payload, tmp_path)

    def rose() -> list[str]:
        now = telemetry(lab, "n1")["counters"]
        return [r for r in want if now.get(r, 0) <= before.get(r, 0)]

    assert wait_until(lambda: not rose(), 30, interval=0.5) is not None, rose()
    assert mesh.agents["n1"].poll() is None, "the agent died on bad input"
    # Of the forged sets (each names controller "test") only the one with two impossible
    # routes is accepted, and those two are dropped: the rest are n1's own routes. The
    # live controller may move n1's routes meanwhile (a busy machine's estimates drift
    # in the up to 30 s this waits), so the table itself is not expected to stand still.
    log = (lab_dir(lab.plan.lab_id) / "agents" / "n1.log").read_text(errors="replace")
    sets = re.findall(r"route set v(\d+) from (\S+):", log)
    assert any(who != "test" for _, who in sets), "the agent logs no route set"
    assert [int(v) for v, who in sets if who == "test"] == [current.version + 1]
    assert "10.250.0.9/32" not in [p for ps in mesh.allowed_ips("n1").values() for p in ps]


def test_dead_next_hop_fails_over_before_the_controller_answers(mesh: LiveMesh) -> None:
    """Controller stopped (fail-static): the agents alone move n1<->n4 off the dead relay."""
    lab = mesh.lab
    via, _ = relay(mesh)
    mesh.stop_controller("ctl1")
    try:
        installed = mesh.installed("n1")
        time.sleep(1.5)
        assert mesh.installed("n1") == installed, "routes changed without the controller"
        replies: list[float] = []
        stop = threading.Event()

        def pinger() -> None:
            proc = lab.popen(
                "n1",
                ["ping", "-n", "-D", "-i", "0.02", "-W", "1", lab.overlay_ip("n4")],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                if "time=" in line:
                    replies.append(float(line[1 : line.index("]")]))
                if stop.is_set():
                    break
            proc.terminate()
            proc.wait(5)

        t = threading.Thread(target=pinger)
        t.start()
        time.sleep(1.0)
        cut = time.time()
        lab.set(f"node={via} down")
        back = wait_until(lambda: mesh.path("n1", "n4") == ["n1", "n4"], 5)
        time.sleep(1.0)
        stop.set()
        t.join(10)
        assert back is not None, mesh.logs()
        gaps = [b - a for a, b in itertools.pairwise(replies) if b > cut - 0.1]
        outage = max(gaps)
        # Declared dead 0.8 s after the last reply, then routes and AllowedIPs move.
        assert outage < 1.5, f"outage {outage:.2f} s"
        assert [r for r in replies if r > cut + outage], "no replies after the fail-over"
        # The relay comes back: the route set (still via n2) is followed again.
        lab.set(f"node={via} up")
        assert wait_until(lambda: mesh.path("n1", "n4") == ["n1", via, "n4"], 15) is not None
    finally:
        mesh.start_controller("ctl1")


def test_agent_restart_leaves_no_duplicates_or_orphans(mesh: LiveMesh) -> None:
    lab = mesh.lab
    routes = mesh.installed("n1")
    allowed = mesh.allowed_ips("n1")
    before = telemetry(lab, "n1")["session"]
    mesh.stop_agent("n1", kill=True)  # a crash: nothing is withdrawn
    assert mesh.installed("n1") == routes
    mesh.start_agent("n1")
    # Up and publishing again: a telemetry of the new session, not the retained one of
    # the crashed agent (a SIGTERM before the new agent is up would find no handler).
    restarted = wait_until(lambda: telemetry(lab, "n1")["session"] != before, 30, interval=0.5)
    assert restarted is not None, mesh.logs()
    time.sleep(2.0)
    out = lab.run("n1", ["ip", "-j", "route", "show", "table", "7701"]).stdout
    dsts = [r["dst"] for r in json.loads(out)]
    assert sorted(dsts) == sorted(set(dsts)) == sorted(routes)
    # Every prefix exactly once, none left behind, none lost. Which peer carries a
    # relayed destination may differ from before the crash: the controller goes on
    # improving routes meanwhile (n1 -> n4 through n2 or n3 is a 15 % choice), and the
    # restarted agent installs what the current route set says.
    before_prefixes = sorted(p for ps in allowed.values() for p in ps)
    prefixes = sorted(p for ps in mesh.allowed_ips("n1").values() for p in ps)
    assert prefixes == before_prefixes
    assert len(prefixes) == len(set(prefixes))
    assert mesh.path("n1", "n4")[-1] == "n4"  # delivered, not looping or dropped
    # A clean stop withdraws: no route of ours left, AllowedIPs back to the lab's own.
    mesh.stop_agent("n1")
    assert mesh.installed("n1") == {}
    owner = mesh.key_owner()
    for key, prefixes in mesh.allowed_ips("n1").items():
        assert prefixes == [f"{lab.overlay_ip(owner[key])}/32"]
    mesh.start_agent("n1")
    assert wait_until(lambda: len(mesh.path("n1", "n4")) == 3, 20) is not None


def test_peers_removed_and_added_in_wireguard_are_followed(mesh: LiveMesh) -> None:
    """No peer list of its own: a peer removed with `wg` disappears from the telemetry,
    and comes back (probed again) when it is added back."""
    lab = mesh.lab
    owner = mesh.key_owner()
    key = next(k for k, n in owner.items() if n == "n3")
    dump = lab.run("n1", ["wg", "show", "wg0", "dump"]).stdout.splitlines()
    fields = next(line.split("\t") for line in dump[1:] if line.startswith(key))
    endpoint, allowed = fields[2], fields[3]

    def peers() -> set[str]:
        return {owner[p["public_key"]] for p in telemetry(lab, "n1")["peers"]}

    lab.run("n1", ["wg", "set", "wg0", "peer", key, "remove"], check=True)
    try:
        assert wait_until(lambda: peers() == {"n2", "n4"}, 20, interval=0.5) is not None
    finally:
        lab.run(
            "n1",
            ["wg", "set", "wg0", "peer", key, "endpoint", endpoint, "allowed-ips", allowed],
            check=True,
        )

    def back() -> bool:
        n3 = [p for p in telemetry(lab, "n1")["peers"] if owner[p["public_key"]] == "n3"]
        return bool(n3) and n3[0].get("alive") is True

    assert wait_until(back, 30, interval=0.5) is not None
