"""Live route inspection: a LiveView assembled from bus messages (pure), and the live
``meshopt routes``/``path``/``graph`` against a real mosquitto holding retained messages.

The mesh in these tests: n1-n4 direct measures 80 ms, n1-n2 10 ms and n2-n4 24 ms, and
the controller's route sets send n1 -> n4 (and back) through n2.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiomqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshopt.bus.messages import (
    AgentStatus,
    Lease,
    PeerReport,
    Route,
    RouteSet,
    Telemetry,
    peer_table,
)
from meshopt.bus.signing import generate_signing_key, sign, sign_route_set
from meshopt.bus.topics import Topics
from meshopt.cli.main import main
from meshopt.live import LiveView, assemble, meshes_seen

from .test_bus_client import Broker
from .test_bus_client import broker as broker  # the mosquitto fixture

MESH = "m1"
NODES = ("n1", "n2", "n3", "n4")
RTT = {("n1", "n2"): 10.0, ("n1", "n3"): 30.0, ("n1", "n4"): 80.0, ("n2", "n3"): 20.0,
       ("n2", "n4"): 24.0, ("n3", "n4"): 10.0}  # fmt: skip
ISSUED = 1_700_000_000.0
NODE_KEY = generate_signing_key()[0]  # the live view shows telemetry; the controller checks it
Msg = tuple[str, bytes]


def key(node: str, n: int = 0) -> str:
    return base64.b64encode(bytes([NODES.index(node) + 1, n]) * 16).decode()


def addr(node: str) -> str:
    return f"10.99.0.{NODES.index(node) + 1}/32"


def rtt(a: str, b: str) -> float:
    return RTT[(a, b)] if (a, b) in RTT else RTT[(b, a)]


def telemetry(node: str, mesh: str = MESH, *, skew: Mapping[str, float] | None = None) -> bytes:
    peers = [
        PeerReport(
            public_key=key(p),
            ifname="wg0",
            alive=True,
            rtt_ms=rtt(node, p) + (skew or {}).get(p, 0),
            # The probe budget: links the routes use fast, the rest idle.
            **(
                {"probe_class": "in_use", "probe_interval_s": 0.33, "probe_dead_after_s": 0.8}
                if {node, p} != {"n1", "n4"}
                else {"probe_class": "idle", "probe_interval_s": 2.0, "probe_dead_after_s": 4.848}
            ),
        )
        for p in NODES
        if p != node
    ]
    # As agents send it: the columnar table (meshopt.bus.messages.PeerTable).
    t = Telemetry(mesh=mesh, node=node, public_key=key(node), addresses=[addr(node)], seq=1,
                  sent_at=ISSUED, full=True, table=peer_table(peers))  # fmt: skip
    return sign("telemetry", t, NODE_KEY)


# Next hops: n1 and n4 relay through n2 to each other, everything else direct.
HOPS = {("n1", "n4"): "n2", ("n4", "n1"): "n2"}


def route_set(
    node: str,
    signer: Ed25519PrivateKey,
    *,
    version: int = 5,
    hops: Mapping[tuple[str, str], str] = HOPS,
    mesh: str = MESH,
) -> bytes:
    routes = [
        Route(
            dst=addr(d),
            via=key(hops.get((node, d), d)),
            backup=key(d) if (node, d) in hops else None,
        )
        for d in NODES
        if d != node
    ]
    rs = RouteSet(mesh=mesh, node=node, version=version, issued_at=ISSUED + version,
                  controller="ctl1", term=1, routes=routes)  # fmt: skip
    return sign_route_set(rs, signer)


def mesh_messages(signer: Ed25519PrivateKey, mesh: str = MESH) -> list[Msg]:
    t = Topics(mesh)
    out: list[Msg] = []
    for n in NODES:
        out.append((t.telemetry(n), telemetry(n, mesh)))
        out.append((t.routes(n), route_set(n, signer, mesh=mesh)))
        status = AgentStatus(mesh=mesh, node=n, online=True, since=1.0)
        out.append((t.status(n), sign("status", status, NODE_KEY)))
    lease = Lease(mesh=mesh, controller="ctl1", term=1, issued_at=1.0, expires_at=9e9)
    out.append((t.lease(), sign("lease", lease, NODE_KEY)))
    return out


@pytest.fixture(scope="module")
def signer() -> Ed25519PrivateKey:
    return generate_signing_key()[0]


@pytest.fixture
def view(signer: Ed25519PrivateKey) -> LiveView:
    return assemble(MESH, mesh_messages(signer))


# --- pure assembly ------------------------------------------------------------------


def test_path_follows_each_nodes_route_set_with_measured_rtts(view: LiveView) -> None:
    p = view.path("n1", "n4")
    assert p.complete and p.nodes == ["n1", "n2", "n4"] and p.relays == ["n2"]
    assert [h.rtt_ms for h in p.hops] == [10.0, 24.0]
    assert p.rtt_ms == 34.0 and p.direct_rtt_ms == 80.0 and p.gain_ms == 46.0
    assert p.since == ISSUED + 5
    # How each hop's tunnel is probed, as its source reports it.
    assert [(h.probe_class, h.probe_interval_s, h.probe_dead_after_s) for h in p.hops] == [
        ("in_use", 0.33, 0.8),
        ("in_use", 0.33, 0.8),
    ]
    direct = view.hop("n1", "n4")
    assert (direct.probe_class, direct.probe_interval_s, direct.probe_dead_after_s) == (
        "idle",
        2.0,
        4.848,
    )
    assert view.path("n1", "n3").nodes == ["n1", "n3"]


def test_path_uses_the_relays_own_route_not_the_sources_idea(signer: Ed25519PrivateKey) -> None:
    # n1 hands n4's packets to n2, but n2's own set sends them on through n3.
    msgs = mesh_messages(signer)
    msgs.append(
        (Topics(MESH).routes("n2"), route_set("n2", signer, version=6, hops={("n2", "n4"): "n3"}))
    )
    p = assemble(MESH, msgs).path("n1", "n4")
    assert p.nodes == ["n1", "n2", "n3", "n4"]
    assert p.rtt_ms == 10.0 + 20.0 + 10.0
    assert p.since == ISSUED + 6


def test_loop_and_dead_end_are_reported_not_followed(signer: Ed25519PrivateKey) -> None:
    t = Topics(MESH)
    msgs = mesh_messages(signer)
    msgs.append((t.routes("n2"), route_set("n2", signer, version=6, hops={("n2", "n4"): "n1"})))
    p = assemble(MESH, msgs).path("n1", "n4")
    assert not p.complete and "loop" in p.problem
    assert p.nodes == ["n1", "n2", "?"] and p.rtt_ms is None and p.relays == []
    dead = assemble(MESH, [m for m in mesh_messages(signer) if m[0] != t.routes("n2")])
    p = dead.path("n1", "n4")
    assert not p.complete and p.problem == "n2 has no route set"


def test_routes_name_next_hops_backups_and_destinations(view: LiveView) -> None:
    r = view.routes("n1")
    assert r is not None
    assert (r.version, r.issued_at, r.controller, r.verified, r.online) == (
        5, ISSUED + 5, "ctl1", None, True)  # fmt: skip
    by_dst = {e.dst: e for e in r.routes}
    assert list(by_dst) == ["n2", "n3", "n4"]
    n4 = by_dst["n4"]
    assert (n4.next_hop, n4.backup, n4.relayed, n4.path) == ("n2", "n4", True, ["n1", "n2", "n4"])
    assert (n4.rtt_ms, n4.direct_rtt_ms, n4.prefix, n4.table) == (34.0, 80.0, addr("n4"), "fast")
    assert not by_dst["n2"].relayed and by_dst["n2"].rtt_ms == 10.0


def test_unknown_key_and_prefix_stay_visible(signer: Ed25519PrivateKey) -> None:
    stranger = base64.b64encode(b"\xee" * 32).decode()
    rs = RouteSet(mesh=MESH, node="n1", version=9, issued_at=ISSUED, controller="ctl1", term=1,
                  routes=[Route(dst="10.50.0.0/24", via=stranger)])  # fmt: skip
    msgs = [*mesh_messages(signer), (Topics(MESH).routes("n1"), sign_route_set(rs, signer))]
    r = assemble(MESH, msgs).routes("n1")
    assert r is not None
    [e] = r.routes
    assert (e.dst, e.next_hop, e.path, e.rtt_ms) == (
        "10.50.0.0/24",
        f"key {stranger[:8]}…",
        [],
        None,
    )


def test_garbage_is_skipped_with_one_warning_each(signer: Ed25519PrivateKey) -> None:
    t = Topics(MESH)
    msgs = [
        (t.routes("n3"), b"not json"),
        (t.telemetry("n2"), telemetry("n3")),  # n3's report on n2's topic
        (t.status("n4"), b'{"v": 7}'),
        ("meshopt/other/routes/n1", b"ignored: another mesh"),
        (f"{t.prefix}/junk/n1", b"ignored: not a topic of ours"),
        *mesh_messages(signer),
    ]
    msgs = [m for m in msgs if m[0] != t.routes("n3") or m[1] == b"not json"]
    v = assemble(MESH, msgs)
    assert len(v.warnings) == 3, v.warnings
    assert any("routes/n3" in w and "bad_json" in w for w in v.warnings)
    assert any("telemetry/n2" in w and "wrong_node" in w for w in v.warnings)
    assert any("status/n4" in w and "bad_version" in w for w in v.warnings)
    assert "n3" not in v.route_sets and set(v.route_sets) == {"n1", "n2", "n4"}
    assert v.telemetry["n2"].node == "n2"  # the good snapshot came later and was kept


def test_newest_version_wins_in_any_order(signer: Ed25519PrivateKey) -> None:
    t = Topics(MESH)
    old = (t.routes("n1"), route_set("n1", signer, version=3, hops={}))
    new = (t.routes("n1"), route_set("n1", signer, version=4))
    for order in ([old, new], [new, old]):
        v = assemble(MESH, [*[m for m in mesh_messages(signer) if m[0] != t.routes("n1")], *order])
        assert v.route_sets["n1"].version == 4 and v.path("n1", "n4").relays == ["n2"]


def test_signatures_checked_when_a_key_is_given(signer: Ed25519PrivateKey) -> None:
    msgs = mesh_messages(signer)
    _, public = generate_signing_key()
    none = assemble(MESH, msgs, trusted_keys=[public])
    assert not none.route_sets and len(none.warnings) == 4
    assert all("unknown_key" in w for w in none.warnings)
    ok = assemble(MESH, msgs, trusted_keys=[public, signer.public_key()])
    assert set(ok.verified.values()) == {True} and len(ok.route_sets) == 4


def test_change_reports_update_the_snapshot_they_follow(signer: Ed25519PrivateKey) -> None:
    faster = PeerReport(public_key=key("n2"), ifname="wg0", rtt_ms=12.5)
    change = Telemetry(mesh=MESH, node="n1", public_key=key("n1"), addresses=[addr("n1")], seq=2,
                       sent_at=ISSUED + 1, full=False, peers=[faster])  # fmt: skip
    signed = sign("telemetry", change, NODE_KEY)
    v = assemble(MESH, [*mesh_messages(signer), (Topics(MESH).telemetry("n1"), signed)])
    assert v.measured_rtt("n1", "n2") == 12.5 and v.measured_rtt("n1", "n3") == 30.0


def test_meshes_seen_and_other_meshes_ignored(signer: Ed25519PrivateKey) -> None:
    msgs = mesh_messages(signer) + mesh_messages(signer, "m2") + [("meshopt/bad name/x", b"")]
    assert meshes_seen(msgs) == ["m1", "m2"]
    assert assemble("m2", msgs).mesh == "m2" and len(assemble("m2", msgs).route_sets) == 4


def test_picture_inputs_and_relay_paths(signer: Ed25519PrivateKey) -> None:
    t = Topics(MESH)
    msgs = [*mesh_messages(signer), (t.telemetry("n1"), telemetry("n1", skew={"n2": 5.0}))]
    v = assemble(MESH, msgs)
    topo, labels = v.picture_inputs()
    assert topo.names == list(NODES) and topo.tunnels.sum() == 12
    assert (labels[0, 1], labels[1, 0]) == (15.0, 10.0)  # as each end measured it
    assert topo.rtt_ms()[0, 1] == pytest.approx(12.5)
    assert topo.nodes[3].address == "10.99.0.4"
    # n1 -> n2 -> n4 and n4 -> n2 -> n1 are the same nodes reversed: drawn once
    assert v.relay_paths() == [["n1", "n2", "n4"]]


# --- the CLI against a real broker -----------------------------------------------------


async def _publish(url: str, messages: list[Msg]) -> None:
    from meshopt.bus.client import parse_broker

    b = parse_broker(url)
    port = b.port if b.transport == "tcp" else 1883
    async with aiomqtt.Client(b.host, port, transport=b.transport) as client:
        for topic, payload in messages:
            await client.publish(topic, payload, qos=1, retain=True)


def publish(url: str, messages: list[Msg]) -> None:
    asyncio.run(asyncio.wait_for(_publish(url, messages), 30))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def live(broker: Broker, signer: Ed25519PrivateKey) -> Iterator[Broker]:
    publish(broker.tcp_url, mesh_messages(signer))
    yield broker


def test_cli_routes_json_from_the_broker(live: Broker, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "routes", "--broker", live.tcp_url, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["mesh"] == MESH and list(data["nodes"]) == list(NODES)
    n1 = data["nodes"]["n1"]
    assert (n1["version"], n1["controller"], n1["verified"]) == (5, "ctl1", None)
    assert n1["since"] == ISSUED + 5 and n1["since_iso"].startswith("2023-11-1")
    n4 = next(r for r in n1["routes"] if r["dst"] == "n4")
    assert n4["next_hop"] == "n2" and n4["relayed"] and n4["path"] == ["n1", "n2", "n4"]
    assert (n4["rtt_ms"], n4["direct_rtt_ms"]) == (34.0, 80.0)
    assert data["lease"]["controller"] == "ctl1" and data["warnings"] == []


def test_cli_routes_table_for_one_node_over_the_unix_socket(
    live: Broker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHOPT_BROKER", live.unix_url)
    code, out, err = cli(capsys, "routes", "--node", "n1")
    assert code == 0, err
    assert "routes of n1: version 5 from ctl1" in out and "unverified" in out
    assert "n1 → n2 → n4" in out and "34.0 ms" in out and "80.0 ms" in out
    assert "routes of n2" not in out


def test_cli_path_live_and_offline_forms(
    live: Broker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHOPT_BROKER", live.tcp_url)
    code, out, err = cli(capsys, "path", "n1", "n4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["path"] == ["n1", "n2", "n4"] and data["relays"] == ["n2"]
    assert [h["rtt_ms"] for h in data["hops"]] == [10.0, 24.0]
    assert (data["rtt_ms"], data["direct_rtt_ms"], data["gain_ms"]) == (34.0, 80.0, 46.0)
    assert [h["probe_class"] for h in data["hops"]] == ["in_use", "in_use"]
    assert [h["probe_dead_after_s"] for h in data["hops"]] == [0.8, 0.8]
    code, out, err = cli(capsys, "path", "n4", "n1")
    assert code == 0, err
    assert "path: n4 → n2 → n1 via n2" in out and "relaying saves 46.0 ms (58%)" in out
    assert "in use: every 0.33 s, dead after 0.8 s" in out
    # three arguments: the offline form, from the topology file
    lab4 = str(Path(__file__).resolve().parents[2] / "topologies" / "lab4.yaml")
    code, out, err = cli(capsys, "path", lab4, "n1", "n4", "--json")
    assert code == 0, err
    assert json.loads(out)["relays"] == ["n2"] and "direct_cost_ms" in json.loads(out)
    code, out, err = cli(capsys, "path", lab4, "n1", "n4", "--mesh", MESH)
    assert code == 2 and "--mesh: only for the live form" in err
    code, out, err = cli(capsys, "path", "n1", "n9")
    assert code == 2 and "no node 'n9' in mesh m1 (nodes: n1, n2, n3, n4)" in err


def test_cli_graph_draws_the_relay(
    live: Broker, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "mesh.svg"
    code, out, err = cli(
        capsys, "graph", "--broker", live.tcp_url, "--out", str(out_file), "--json"
    )
    assert code == 0, err
    assert json.loads(out)["relay_paths"] == [["n1", "n2", "n4"]]
    ids = {e.attrib.get("id") for e in ET.parse(out_file).getroot().iter()}
    assert {"relay-n1-n2", "relay-n2-n4"} <= ids
    text = out_file.read_text()
    assert "80 ms" in text and "24 ms" in text


def test_cli_verifies_with_a_controller_key(
    live: Broker, capsys: pytest.CaptureFixture[str], signer: Ed25519PrivateKey
) -> None:
    good = base64.b64encode(signer.public_key().public_bytes_raw()).decode()
    code, out, err = cli(capsys, "routes", "--broker", live.tcp_url, "--controller-key", good)
    assert code == 0, err
    assert out.count("signature verified") == 4
    _, other = generate_signing_key()
    code, out, err = cli(capsys, "routes", "--broker", live.tcp_url, "--controller-key", other)
    assert code == 2 and err.count("meshopt: warning: skipped") == 4
    assert "no route sets for mesh m1" in err and "Traceback" not in err


def test_cli_garbage_on_the_broker_is_a_warning(
    live: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(live.tcp_url, [(Topics(MESH).routes("n5"), b"\x00garbage")])
    code, out, err = cli(capsys, "routes", "--broker", live.tcp_url, "--json")
    assert code == 0
    assert err.startswith("meshopt: warning: skipped meshopt/m1/routes/n5: bad_json")
    assert len(json.loads(out)["warnings"]) == 1


def test_cli_chooses_the_mesh(
    live: Broker, capsys: pytest.CaptureFixture[str], signer: Ed25519PrivateKey
) -> None:
    publish(live.tcp_url, [(Topics("m2").status("x1"), b"{}")])
    code, out, err = cli(capsys, "routes", "--broker", live.tcp_url)
    assert code == 2
    assert (
        err.strip()
        == f"meshopt: error: several meshes on {live.tcp_url} (m1, m2): pick one with --mesh"
    )
    code, out, err = cli(capsys, "routes", "--broker", live.tcp_url, "--mesh", "m2")
    assert code == 3  # nothing published there: unavailable
    assert f"no route sets for mesh m2 on {live.tcp_url} — is a controller running?" in err
    assert "warning: skipped meshopt/m2/status/x1" in err
    code, out, err = cli(capsys, "path", "n1", "n4", "--broker", live.tcp_url, "--mesh", MESH)
    assert code == 0 and "n1 → n2 → n4" in out


def test_cli_empty_or_unreachable_broker(
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start = time.monotonic()
    code, _, err = cli(capsys, "routes", "--broker", broker.tcp_url)
    assert code == 3 and time.monotonic() - start < 3
    assert (
        err.strip()
        == f"meshopt: error: no meshopt mesh seen on {broker.tcp_url} — is a controller running?"
    )
    broker.stop()
    code, _, err = cli(capsys, "graph", "--broker", broker.tcp_url, "--out", "x.svg")
    assert code == 3 and err.startswith(f"meshopt: error: cannot read the broker {broker.tcp_url}")


# --- one JSON schema for the offline and the live form ---------------------------------


def _shape(doc: dict[str, object]) -> dict[str, object]:
    """The keys of a routes/path document, of its first node and first route or hop."""
    shape: dict[str, object] = {"top": sorted(doc)}
    nodes = doc.get("nodes")
    if isinstance(nodes, dict):
        node = next(iter(nodes.values()))
        shape["node"] = sorted(node)
        shape["route"] = sorted(node["routes"][0])
    hops = doc.get("hops")
    if isinstance(hops, list):
        shape["hop"] = sorted(hops[0])
    return shape


def test_offline_and_live_json_share_one_schema(
    live: Broker, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The same four nodes and RTTs as a topology file: the same keys, ``source`` apart."""
    lines = ["a,b,rtt_ms", *(f"{a},{b},{ms}" for (a, b), ms in RTT.items())]
    csv = tmp_path / "m1.csv"
    csv.write_text("\n".join(lines) + "\n")
    docs = {}
    for form, where in (("offline", [str(csv)]), ("live", ["--broker", live.tcp_url])):
        code, out, err = cli(capsys, "routes", *where, "--json")
        assert code == 0, err
        routes = json.loads(out)
        a, b = ("n1", "n4")
        path_argv = [*where[:1], a, b] if form == "offline" else [a, b, *where]
        code, out, err = cli(capsys, "path", *path_argv, "--json")
        assert code == 0, err
        docs[form] = (routes, json.loads(out))
    (off_routes, off_path), (live_routes, live_path) = docs["offline"], docs["live"]
    assert _shape(off_routes) == _shape(live_routes)
    assert _shape(off_path) == _shape(live_path)
    assert (off_routes["schema"], live_routes["schema"]) == ("meshopt.routes/1",) * 2
    assert (off_path["schema"], live_path["schema"]) == ("meshopt.path/1",) * 2
    assert (off_routes["source"], live_routes["source"]) == ("offline", "live")
    assert (off_path["source"], live_path["source"]) == ("offline", "live")
    # both forms agree on this mesh: n1 reaches n4 through n2
    assert off_path["path"] == live_path["path"] == ["n1", "n2", "n4"]
    assert off_path["reachable"] is live_path["reachable"] is True
    assert off_path["rtt_ms"] == live_path["rtt_ms"] == 34.0
