"""The control plane under attack, in a real lab with its default secure broker.

topologies/lab4.yaml in the single layout, an agent per node, two controllers, and
mosquitto with TLS, per-identity passwords and the ACL that `meshopt broker init` writes.
An attacker with no credentials, a node publishing for another node, and a fuzzer that
holds every key a compromised host could hold (run as the lab's admin identity: the ACL
deliberately opened) all try to move routes; the controllers and agents must keep
running, every honest node's installed routes must stay as they were, and pings must
still follow the optimum. The fuzzer's tally goes to stdout (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest

from meshopt.analysis import Plan
from meshopt.bus.client import client_kwargs
from meshopt.bus.messages import decode_lease, decode_telemetry
from meshopt.bus.signing import load_private_key, unsigned_payload
from meshopt.lab.agents import controller_key, identity_key
from meshopt.lab.lab import Lab
from meshopt.lab.measure import optimum, route_quality
from meshopt.lab.mesh import LiveMesh, wait_until
from meshopt.lab.state import lab_dir

from .conftest import EXAMPLES, new_lab_id
from .hostile import Honest, Hostile, generate
from .tools import controller_tally, need_tools

pytestmark = pytest.mark.lab

NODES = ["n1", "n2", "n3", "n4"]
FUZZ_MESSAGES = 2400


@pytest.fixture(scope="module")
def mesh(lab_ok: None) -> Iterator[LiveMesh]:
    need_tools("mosquitto", "wireguard-go", "ping", "wg", "mosquitto_pub")
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=new_lab_id(), layout="single")
    assert lab.secure_broker, "the lab must run the secure broker by default"
    # The controllers' start-up phase (default 60 s) takes small gains after 5 s: the
    # fuzz test needs a mesh past it, or an honest small gain during the fuzz reads as
    # a route the fuzz moved (busy CI run 19: n1<->n3). 10 s is enough to reach the
    # optimum here; after it, a change holds 30 s and small gains confirm over 30 s.
    live = LiveMesh(lab, controller_settings={"startup_s": 10.0})
    try:
        live.start(controllers=("ctl1", "ctl2"))
        # The optimum (n1-n2-n4, 34 ms; n1-n3-n4 is 40 ms and may come first): the fuzz
        # test compares routes before and after, so they must have settled.
        optimum = ["n1", "n2", "n4"]
        settled = wait_until(lambda: live.path("n1", "n4") == optimum, 90)
        assert settled is not None, f"n1->n4 never took n2:\n{live.logs()}"
        time.sleep(2.0)
        yield live
    finally:
        live.stop()
        lab.down()


async def _read(lab: Lab, identity: str, topic: str, seconds: float) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    async with aiomqtt.Client(
        **client_kwargs(lab.host_broker_settings(identity)), identifier=f"t-{os.urandom(3).hex()}"
    ) as c:
        await c.subscribe(topic, qos=1)
        try:
            async with asyncio.timeout(seconds):
                async for m in c.messages:
                    out.append((m.topic.value, bytes(m.payload)))  # type: ignore[arg-type]
        except TimeoutError:
            pass
    return out


async def _publish(lab: Lab, identity: str, messages: list[Hostile], pace_s: float = 0.0) -> None:
    async with aiomqtt.Client(
        **client_kwargs(lab.host_broker_settings(identity)), identifier=f"t-{os.urandom(3).hex()}"
    ) as c:
        for m in messages:
            await c.publish(m.topic, m.payload, qos=1, retain=m.retain)
            if pace_s:
                await asyncio.sleep(pace_s)


def retained(lab: Lab) -> dict[str, bytes]:
    """Every retained message of the mesh, as the reader sees it."""
    msgs = asyncio.run(_read(lab, "reader", f"meshopt/{lab.plan.name}/#", 2.0))
    return dict(msgs)


def fast_hops(mesh: LiveMesh) -> dict[str, object]:
    """Each node's installed routes and the next hop it forwards to for each destination,
    read from its kernel and WireGuard (AllowedIPs), never from a controller."""
    return {"routes": {n: mesh.installed(n) for n in NODES}, "hops": mesh.next_hops()}


def changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """Every (what, node, destination) whose route or next hop differs."""
    out = []
    for what in ("routes", "hops"):
        b, a = before[what], after[what]
        assert isinstance(b, dict) and isinstance(a, dict)
        for node in sorted(set(b) | set(a)):
            bn, an = b.get(node, {}), a.get(node, {})
            out += [
                f"{what} {node}->{d}" for d in sorted(set(bn) | set(an)) if bn.get(d) != an.get(d)
            ]
    return out


def telling_bound(best: Plan, src: str, dst: str, optimum_ms: float) -> float:
    """Half-way between the optimum's RTT and the next slower path's (paths within 10 %
    of the optimum count as the optimum): a median below it went the optimum's way."""
    names = best.tables.names
    i = {n: k for k, n in enumerate(names)}
    others = [n for n in names if n not in (src, dst)]
    slower = []
    for k in range(len(others) + 1):
        for mid in itertools.permutations(others, k):
            path = [src, *mid, dst]
            rtt = sum(float(best.rtt[i[x], i[y]]) for x, y in itertools.pairwise(path))
            if math.isfinite(rtt) and rtt > optimum_ms * 1.1:
                slower.append(rtt)
    return (optimum_ms + min(slower)) / 2 if slower else math.inf


def lease_holder(lab: Lab) -> str:
    raw = retained(lab)[f"meshopt/{lab.plan.name}/controller/lease"]
    return decode_lease(unsigned_payload(raw, "lease")).controller


def test_broker_refuses_clients_without_credentials(mesh: LiveMesh) -> None:
    lab = mesh.lab
    anonymous = client_kwargs(lab.host_broker_settings("reader"))
    anonymous.pop("username", None)
    anonymous.pop("password", None)

    async def connect(kwargs: dict[str, object]) -> None:
        async with aiomqtt.Client(**kwargs, identifier="t-anon"):  # type: ignore[arg-type]
            pass

    with pytest.raises(aiomqtt.MqttError):
        asyncio.run(connect(anonymous))
    wrong = {**anonymous, "username": "n1", "password": "not-the-password"}
    with pytest.raises(aiomqtt.MqttError):
        asyncio.run(connect(wrong))
    # On the nodes' TLS listener: no client certificate, no connection, even with the
    # right password; with its certificate n1 gets in.
    ca = str(lab.broker_pki / "ca.crt")
    topic = f"meshopt/{lab.plan.name}/telemetry/n1"
    base = ["mosquitto_pub", "-h", lab.broker_host, "-p", str(lab.broker_port), "-t", topic]
    no_cert = [*base, "--cafile", ca, "-u", "n1", "-P", lab.broker_password("n1"), "-m", "x"]
    assert lab.run("n1", no_cert).returncode != 0
    plain = ["mosquitto_pub", "-h", lab.broker_host, "-p", "8883", "-t", topic, "-m", "x"]
    assert lab.run("n1", plain).returncode != 0
    cert = ["--cert", str(lab.broker_pki / "clients/n1/client.crt")]
    cert += ["--key", str(lab.broker_pki / "clients/n1/client.key")]
    assert lab.run("n1", [*no_cert, *cert]).returncode == 0, "n1's own credentials refused"


def test_acl_binds_each_identity_to_its_own_topics(mesh: LiveMesh) -> None:
    lab = mesh.lab
    m = f"meshopt/{lab.plan.name}"
    marker = f"acl-{os.urandom(4).hex()}".encode()

    def msg(topic: str, tag: str) -> Hostile:
        return Hostile(f"{m}/{topic}", marker + tag.encode(), False, "acl")

    async def run() -> list[tuple[str, bytes]]:
        reader = asyncio.create_task(_read(lab, "reader", f"{m}/#", 4.0))
        await asyncio.sleep(1.0)
        # n2 speaking for n1, for the controller and as a controller: all refused.
        forbidden = [msg("telemetry/n1", "a"), msg("status/n1", "b"), msg("routes/n1", "c")]
        forbidden += [msg("controller/lease", "d"), msg("controller/status/ctl1", "e")]
        await _publish(lab, "n2", forbidden)
        await _publish(lab, "reader", [msg("telemetry/n3", "f"), msg("routes/n3", "g")])
        await _publish(lab, "n2", [msg("telemetry/n2", "ok")])  # its own topic: delivered
        return await reader

    seen = [p for _, p in asyncio.run(run()) if p.startswith(marker)]
    assert seen == [marker + b"ok"], seen


def capture(mesh: LiveMesh) -> Honest:
    lab = mesh.lab
    m = f"meshopt/{lab.plan.name}"
    msgs = retained(lab)
    wg = {w.node: w.public_key for w in lab.state.wg}
    return Honest(
        mesh=lab.plan.name,
        nodes={n: load_private_key(identity_key(lab, n)[0]) for n in NODES},
        controller=load_private_key(controller_key(lab)[0]),
        addresses={n: f"{lab.overlay_ip(n)}/32" for n in NODES},
        wireguard=wg,
        telemetry={n: msgs[f"{m}/telemetry/{n}"] for n in NODES},
        status={n: msgs[f"{m}/status/{n}"] for n in NODES},
        routes={n: msgs[f"{m}/routes/{n}"] for n in NODES},
        lease=msgs.get(f"{m}/controller/lease"),
        now=time.time(),
    )


def agent_tally(lab: Lab) -> dict[str, int]:
    out: Counter[str] = Counter()
    m = f"meshopt/{lab.plan.name}"
    msgs = retained(lab)
    for n in NODES:
        t = decode_telemetry(unsigned_payload(msgs[f"{m}/telemetry/{n}"], "telemetry"))
        out.update({k: v for k, v in t.counters.items() if k.startswith("routeset_")})
    return dict(out)


def test_fuzzed_control_plane_keeps_every_honest_route(mesh: LiveMesh) -> None:
    lab = mesh.lab
    honest = capture(mesh)
    before = fast_hops(mesh)
    agents_before = agent_tally(lab)
    ctl_before = {c: sum(controller_tally(lab, c).values()) for c in mesh.controllers}
    messages = list(generate(honest, seed=11, n=FUZZ_MESSAGES))
    assert len(messages) >= 2000
    started = time.monotonic()
    asyncio.run(_publish(lab, "admin", messages, pace_s=0.002))
    took = time.monotonic() - started
    time.sleep(3.0)  # let every daemon drain its queue, and the honest nodes report again
    dead = [n for n, p in {**mesh.agents, **mesh.controllers}.items() if p.poll() is not None]
    assert not dead, f"died: {dead}\n{mesh.logs()}"
    after = fast_hops(mesh)
    moved = changes(before, after)
    assert not moved, f"installed routes moved: {moved}"
    ctl_refused = {c: sum(controller_tally(lab, c).values()) - ctl_before[c] for c in ctl_before}
    reasons = {c: controller_tally(lab, c) for c in ctl_before}
    # A restarted controller reads the hostile retained messages again and survives.
    holder = lease_holder(lab)
    mesh.stop_controller(holder, kill=True)
    mesh.start_controller(holder)
    time.sleep(4.0)
    dead = [n for n, p in mesh.controllers.items() if p.poll() is not None]
    assert not dead, f"restarted controller died: {dead}\n{mesh.logs()}"
    assert fast_hops(mesh) == before
    # Every pair still forwarded on the optimum: the path read from the nodes is one the
    # policy keeps, and real packets take it. A direct pair's ping median must be nearer
    # its own RTT than the next slower path's (how close it comes to the optimum itself
    # is the lab's timing on a busy VM, not the routes' doing); a relayed pair's pings
    # must be forwarded by the relay, and by no other node.
    best = optimum(mesh)
    quality = route_quality(mesh, count=10)
    bad = [
        (q.src, q.dst, q.path, q.achieved_ms, q.optimum_ms)
        for q in quality
        if not q.policy_optimal
        or q.achieved_ms is None
        or (len(q.path) == 2 and q.achieved_ms >= telling_bound(best, q.src, q.dst, q.optimum_ms))
    ]
    assert not bad, bad
    for q in quality:
        if len(q.path) > 2:
            relays = set(q.path[1:-1])
            before_fwd = {n: mesh.forwarded(n) for n in NODES}
            rtts = mesh.ping(q.src, q.dst, count=20, interval=0.02)
            fwd = {n: mesh.forwarded(n) - before_fwd[n] for n in NODES}
            assert len(rtts) >= 15, (q.src, q.dst, rtts)
            for n in NODES:
                if n in relays:
                    assert fwd[n] >= 2 * len(rtts), (q.src, q.dst, n, fwd)
                elif n not in (q.src, q.dst):
                    assert fwd[n] < 5, (q.src, q.dst, n, fwd)
    agents_after = agent_tally(lab)
    agent_refused = {
        k: v - agents_before.get(k, 0)
        for k, v in agents_after.items()
        if v > agents_before.get(k, 0)
    }
    assert sum(agent_refused.values()) > 0 and all(v > 0 for v in ctl_refused.values())
    tally = {
        "messages": len(messages),
        "by_attack": dict(Counter(m.what for m in messages)),
        "publish_s": round(took, 1),
        "controller_refused": ctl_refused,
        "controller_reasons": reasons,
        "agents_refused": agent_refused,
        "crashes": len(dead),
        "route_changes": len(moved),
    }
    print("\nfuzz tally:", json.dumps(tally, sort_keys=True))
    Path(lab_dir(lab.plan.lab_id) / "fuzz-tally.json").write_text(json.dumps(tally))
