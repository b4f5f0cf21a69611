"""The metrics exporter: listen addresses, the HTTP listener, the agent's and the
controller's collectors over real daemon objects, the Grafana dashboard and the iproute2
name files."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from meshopt.agent.config import RouteSettings, load_config, parse_config
from meshopt.bus.signing import generate_signing_key, save_private_key
from meshopt.controller.config import parse_controller_config
from meshopt.errors import InputError
from meshopt.metrics import AgentMetricsSettings, ControllerMetricsSettings, parse_listen
from meshopt.metrics.server import MetricsServer, start_metrics

from .test_agent_config import real_copy
from .test_controller_core import Rig

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "meshopt.json"


# --- configuration -------------------------------------------------------------------


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_listen("[::1]:9478") == ("::1", 9478)
    assert parse_listen("  ") is None
    assert parse_listen("") is None
    for bad, why in (
        ("9477", "ADDRESS:PORT"),
        ("localhost:9477", "not an IP address"),
        ("::1:9477", r"\[ADDRESS\]:PORT"),
        ("127.0.0.1:0", "1..65535"),
        ("127.0.0.1:70000", "1..65535"),
        ("127.0.0.1:x", "1..65535"),
    ):
        with pytest.raises(InputError, match=why):
            parse_listen(bad)


def test_defaults_are_loopback_and_off_is_possible(tmp_path: Path) -> None:
    """A demanding operator gets metrics at once, and only on loopback."""
    assert AgentMetricsSettings().listen == "127.0.0.1:9477"
    assert ControllerMetricsSettings().listen == "127.0.0.1:9478"
    cfg = load_config(real_copy(tmp_path))
    assert cfg.metrics.listen == "127.0.0.1:9477" and cfg.metrics.status_interval_s == 5.0
    base = {"agent": {"mesh": "m", "node": "a"}}
    assert parse_config({**base, "metrics": {"listen": ""}}).metrics.listen == ""
    with pytest.raises(InputError, match=r"metrics.listen: 'eth0' is not an IP address"):
        parse_config({**base, "metrics": {"listen": "eth0:9477"}})
    with pytest.raises(InputError, match=r"unknown key metrics\.port"):
        parse_config({**base, "metrics": {"port": 9477}})
    with pytest.raises(InputError, match="status_interval_s"):
        parse_config({**base, "metrics": {"status_interval_s": 0.1}})


def test_shipped_example_configs_document_the_metrics_table() -> None:
    for name, port in (("agent.toml", 9477), ("controller.toml", 9478)):
        text = (ROOT / "agents" / name).read_text()
        assert "[metrics]" in text and f'listen = "127.0.0.1:{port}"' in text, name


def test_controller_metrics_key(tmp_path: Path) -> None:
    key = tmp_path / "c.key"
    save_private_key(key, generate_signing_key()[0])
    node_key = generate_signing_key()[1]
    data: dict[str, Any] = {
        "controller": {"mesh": "m", "id": "c1", "signing_key": str(key)},
        "node_keys": {"a": node_key},
    }
    assert parse_controller_config(data).metrics.listen == "127.0.0.1:9478"
    data["metrics"] = {"listen": "[::]:19478"}
    assert parse_controller_config(data).metrics.listen == "[::]:19478"
    data["metrics"] = {"listen": "0.0.0.0"}
    with pytest.raises(InputError, match=r"metrics\.listen"):
        parse_controller_config(data)


# --- the HTTP listener ---------------------------------------------------------------


class One(Collector):
    def __init__(self) -> None:
        self.fail = False

    def collect(self) -> list[Metric]:
        if self.fail:
            raise RuntimeError("collector bug")
        g = GaugeMetricFamily("meshopt_test_value", "A value.")
        g.add_metric([], 42.0)
        return [g]


async def http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def test_listener_serves_metrics_health_and_errors() -> None:
    async def main() -> None:
        collector = One()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        healthy = {"ok": True}
        server = MetricsServer(
            "127.0.0.1",
            0,
            registry,
            lambda: (healthy["ok"], {"broker_connected": False}),
            timeout_s=1.0,
        )
        await server.start()
        port = server.address[1]
        try:
            status, headers, body = await http(port, get("/metrics"))
            assert (
                status == 200
                and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            )
            assert b"meshopt_test_value 42.0" in body
            assert int(headers["Content-Length"]) == len(body)
            status, headers, body = await http(port, get("/healthz"))
            assert status == 200 and json.loads(body) == {
                "status": "ok",
                "broker_connected": False,
            }
            healthy["ok"] = False
            status, _, body = await http(port, get("/healthz"))
            assert status == 503 and json.loads(body)["status"] == "failing"
            status, _, body = await http(port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
            assert status == 200 and body == b""
            assert (await http(port, get("/nothing")))[0] == 404
            assert (await http(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
            assert (await http(port, b"garbage\r\n\r\n"))[0] == 400
            too_long = b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"
            assert (await http(port, too_long))[0] == 431
            collector.fail = True  # a collector bug costs that scrape, nothing else
            assert (await http(port, get("/metrics")))[0] == 500
            collector.fail = False
            assert (await http(port, get("/metrics")))[0] == 200
        finally:
            await server.close()

    asyncio.run(main())


def test_slow_and_excess_clients_cannot_block_the_loop() -> None:
    """Clients that connect and send nothing tie up no more than ``max_clients`` slots,
    each for ``timeout_s`` at most; meanwhile the loop keeps turning and a scrape that
    finds a free slot is served."""

    async def main() -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(One())
        server = MetricsServer(
            "127.0.0.1", 0, registry, lambda: (True, {}), max_clients=2, timeout_s=0.5
        )
        await server.start()
        port = server.address[1]
        try:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await asyncio.sleep(0.1)
            assert server.active == 2
            # A third is refused at once (closed without an answer) ...
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(get("/metrics"))
            # Closed unread: an EOF, or a reset since the request was not read.
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(reader.read(), 5) == b""
            assert server.counters["refused_busy"] == 1
            # ... and the silent ones are dropped after the timeout.
            for r, _ in idle:
                assert await asyncio.wait_for(r.read(), 5) == b""
            assert server.active == 0 and server.counters["errors"] == 2
            assert (await http(port, get("/metrics")))[0] == 200
        finally:
            await server.close()

    asyncio.run(main())


def test_a_port_in_use_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        registry = CollectorRegistry(auto_describe=False)
        first = await start_metrics(("127.0.0.1", 0), registry, lambda: (True, {}), "agent")
        assert first is not None
        try:
            port = first.address[1]
            second = await start_metrics(("127.0.0.1", port), registry, lambda: (True, {}), "agent")
            assert second is None
        finally:
            await first.close()

    asyncio.run(main())
    assert "cannot listen on 127.0.0.1:" in caplog.text and "/healthz are off" in caplog.text


# --- collectors over real daemon objects ---------------------------------------------


def agent_exposition(tmp_path: Path) -> str:
    from prometheus_client.exposition import generate_latest

    from meshopt.agent.daemon import Agent
    from meshopt.metrics.agent import agent_registry

    agent = Agent(load_config(real_copy(tmp_path)))
    return generate_latest(agent_registry(agent)).decode()


def controller_exposition(tmp_path: Path) -> str:
    from prometheus_client.exposition import generate_latest

    from meshopt.controller.daemon import Controller

    rig = Rig().settled()
    key = tmp_path / "ctl.key"
    save_private_key(key, rig.key)
    ctl = Controller(dataclasses.replace(rig.cfg, signing_key=str(key)))
    ctl.core = rig.core  # the settled core: 3 nodes, routes published
    ctl.recompute_seconds.observe(0.003)
    ctl.publishes[("routes", "ok")] = 3
    return generate_latest(ctl.metrics_registry).decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def declared(text: str) -> set[str]:
    """Every series name the exposition declares, with the suffixes of its type."""
    names: set[str] = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        name, kind = m[1], m[2]
        names.add(name)
        if kind == "counter":
            names.add(name if name.endswith("_total") else name + "_total")
        if kind == "histogram":
            names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names | set(samples(text))


def test_agent_collector_names_and_units(tmp_path: Path) -> None:
    text = agent_exposition(tmp_path)
    s = samples(text)
    assert s["meshopt_agent_info"][0][0] == {"mesh": "prod", "node": "fra", "version": "0.1.0"}
    assert s["meshopt_peers"] == [({}, 0.0)]
    tables = {lab["table"]: v for lab, v in s["meshopt_installed_routes"]}
    assert tables == {"fast": 0.0, "bulk": 0.0}
    assert s["meshopt_failovers_total"] == [({}, 0.0)]
    assert s["meshopt_broker_connected"] == [({}, 0.0)]
    assert "meshopt_route_set_version" not in s  # no route set yet: no made-up zero
    names = declared(text)
    for name in (
        "meshopt_peer_up",
        "meshopt_peer_rtt_seconds",
        "meshopt_peer_jitter_seconds",
        "meshopt_peer_loss_ratio",
        "meshopt_peer_capacity_bytes_per_second",
        "meshopt_agent_dropped_total",
        "meshopt_prober_events_total",
        "meshopt_responder_events_total",
    ):
        assert name in names, name
    # Prometheus naming: a prefix, base units, counters end in _total.
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        assert m[1].startswith("meshopt_"), m[1]
        assert not re.search(r"_(ms|mbit|milliseconds|bits)\b", m[1]), m[1]
        assert (m[2] == "counter") == m[1].endswith("_total"), m[1]


def test_controller_collector_sees_the_settled_mesh(tmp_path: Path) -> None:
    s = samples(controller_exposition(tmp_path))
    nodes = {lab["state"]: v for lab, v in s["meshopt_controller_nodes"]}
    assert nodes == {"online": 3.0, "offline": 0.0}
    assert s["meshopt_controller_links"] == [({}, 6.0)]  # 3 nodes, each reports 2 peers
    assert s["meshopt_controller_lease_active"] == [({}, 1.0)]
    roles = {lab["role"]: v for lab, v in s["meshopt_controller_lease_role"]}
    assert roles["active"] == 1.0 and sum(roles.values()) == 1.0
    assert s["meshopt_controller_recomputes_total"][0][1] >= 1
    assert s["meshopt_controller_route_changes_total"][0][1] >= 1
    assert s["meshopt_controller_publishes_total"] == [({"kind": "routes", "result": "ok"}, 3.0)]
    assert s["meshopt_controller_recompute_duration_seconds_count"] == [({}, 1.0)]
    buckets = dict(
        (lab["le"], v) for lab, v in s["meshopt_controller_recompute_duration_seconds_bucket"]
    )
    assert buckets["0.0025"] == 0.0 and buckets["0.005"] == 1.0


# --- Grafana and iproute2 ------------------------------------------------------------


def dashboard_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if "expr" in t] + [
        v["query"] for v in dash["templating"]["list"] if v["type"] == "query"
    ]
    assert len(exprs) >= 20
    return {m for e in exprs for m in re.findall(r"\bmeshopt_[a-z_]+", e)}


def test_every_dashboard_metric_is_exported(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    exported = declared(agent_exposition(tmp_path / "a")) | declared(
        controller_exposition(tmp_path)
    )
    used = dashboard_metrics()
    assert used - exported == set()
    assert {"meshopt_peer_rtt_seconds", "meshopt_controller_nodes"} <= used


def iproute2_names(path: Path) -> dict[int, str]:
    """The file as iproute2 reads it: NUMBER NAME per line, # comments."""
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        number, name = line.split()
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name), name
        out[int(number, 0)] = name
    return out


def test_iproute2_files_match_the_agent_defaults() -> None:
    from meshopt.install.model import RTPROT_MESHOPT

    tables = iproute2_names(ROOT / "packaging/iproute2/rt_tables.d/meshopt.conf")
    protos = iproute2_names(ROOT / "packaging/iproute2/rt_protos.d/meshopt.conf")
    r = RouteSettings()
    assert tables == {r.fast_table: "meshopt-fast", r.bulk_table: "meshopt-bulk"}
    assert protos == {RTPROT_MESHOPT: "meshopt"}
    assert 0 < RTPROT_MESHOPT < 256 and all(0 < t < 2**32 for t in tables)


def test_agent_health_fails_when_a_loop_stops(tmp_path: Path) -> None:
    from meshopt.agent.daemon import Agent
    from meshopt.metrics.agent import agent_health

    agent = Agent(load_config(real_copy(tmp_path)))

    async def main() -> None:
        forever = asyncio.create_task(asyncio.sleep(3600), name="peers")
        ended = asyncio.create_task(asyncio.sleep(0), name="apply")
        await ended
        ok, detail = agent_health(agent, {"peers": forever})
        assert ok and detail["loops"] == {"peers": "running"}
        assert detail["broker_connected"] is False and detail["node"] == "fra"
        ok, detail = agent_health(agent, {"peers": forever, "apply": ended})
        assert not ok and detail["loops"]["apply"] == "stopped"
        assert agent_health(agent, {})[0] is False  # not started yet: not healthy
        forever.cancel()

    asyncio.run(main())
