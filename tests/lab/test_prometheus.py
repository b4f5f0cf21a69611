"""A real Prometheus scrapes a live lab mesh (issue 13, "Observe it").

topologies/lab4.yaml with an agent in every node and a controller next to the broker.
Debian's ``prometheus`` runs in the lab's management namespace (where the controller
and the broker are), scrapes every agent on its management address and the controller
on its loopback default, once a second, with storage in a temporary directory; it is
started by this test and ended by its PID.

The check is physical: the RTTs each agent exports for each peer (medians of what
Prometheus scraped over 20 s) sit on the emulated underlay's round trip, 2 x the
configured one-way delay: never below what the emulator holds a packet for (the
configured delay less the calibrated tunnel allowance, minus its symmetric jitter), the
fastest probe of a window at most 3 ms above it (WireGuard, the emulator, the receive
path; CPU stalls of this busy VM delay some probes, never all 64 of a window), and
every node ranks its peers as the underlay does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from meshopt.lab import procs
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh, wait_until
from meshopt.lab.netns import netns_argv, netns_run

from .conftest import EXAMPLES, new_lab_id
from .tools import emulated_floor_ms, need_tools

PROMETHEUS_PORT = 19090
AGENT_PORT = 9477
CONTROLLER = "127.0.0.1:9478"  # the controller's default: loopback of the mgmt namespace
DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "meshopt.json"
# Overheads on top of the emulated delay for the fastest probes: WireGuard (userspace)
# twice, the TAP emulator and the receive path. Measured here: 0.2-0.6 ms.
MAX_OVERHEAD_MS = 3.0

FETCH = (
    "import sys, urllib.request, urllib.error\n"
    "try:\n"
    "    r = urllib.request.urlopen(sys.argv[1], timeout=10)\n"
    "    print(r.status); sys.stdout.write(r.read().decode())\n"
    "except urllib.error.HTTPError as e:\n"
    "    print(e.code); sys.stdout.write(e.read().decode())\n"
)


def fetch(lab: Lab, url: str) -> tuple[int, str]:
    """GET ``url`` from inside the management namespace: (status, body)."""
    out = netns_run(lab.plan.mgmt_netns, [sys.executable, "-c", FETCH, url], timeout=20).stdout
    status, _, body = out.partition("\n")
    return int(status), body


def query(lab: Lab, promql: str) -> list[dict[str, Any]]:
    """An instant query against our Prometheus: its result vector."""
    status, body = fetch(
        lab, f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?query={quote(promql)}"
    )
    doc = json.loads(body)
    assert status == 200 and doc["status"] == "success", body
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


@pytest.fixture(scope="module")
def observed(lab_ok: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveMesh]:
    need_tools("mosquitto", "wireguard-go", "prometheus")
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=new_lab_id())
    live = LiveMesh(lab)
    prom: subprocess.Popen[bytes] | None = None
    tmp = tmp_path_factory.mktemp("prometheus")
    try:
        live.start()  # lab agents listen on their management address (lab default)
        targets = [f"{lab.mgmt_ip(n)}:{AGENT_PORT}" for n in live.nodes]
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n"
            "  - job_name: meshopt-agent\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
            "  - job_name: meshopt-controller\n"
            f'    static_configs:\n      - targets: ["{CONTROLLER}"]\n'
        )
        log = (tmp / "prometheus.log").open("wb")
        prom = subprocess.Popen(
            netns_argv(
                lab.plan.mgmt_netns,
                [
                    "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
                    "--log.level=warn",
                ],
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, procs.TAG: lab.plan.lab_id},  # `lab down` ends it if we fail
            process_group=0,  # not a session of its own: see procs.spawn
        )
        log.close()
        live.prometheus_log = tmp / "prometheus.log"  # type: ignore[attr-defined]
        yield live
    finally:
        if prom is not None:
            prom.send_signal(signal.SIGTERM)
            try:
                prom.wait(15)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait(5)
        live.stop()
        lab.down()
        shutil.rmtree(tmp, ignore_errors=True)


def series_ready(live: LiveMesh) -> bool:
    """Every target up, and every agent reporting an RTT for each of its peers."""
    try:
        up = query(live.lab, "up")
        rtts = query(live.lab, "meshopt_peer_rtt_seconds")
    except (AssertionError, ValueError, subprocess.SubprocessError):
        return False
    n = len(live.nodes)
    return len(up) == n + 1 and all(r["value"][1] == "1" for r in up) and len(rtts) == n * (n - 1)


def scraped_ms(live: LiveMesh, promql: str) -> dict[tuple[str, str], float]:
    """(node, peer node) -> value in ms of a per-peer query over agents' series."""
    lab = live.lab
    node_of_target = {f"{lab.mgmt_ip(n)}:{AGENT_PORT}": n for n in live.nodes}
    owner = live.key_owner()
    out: dict[tuple[str, str], float] = {}
    for r in query(lab, promql):
        src = node_of_target[r["metric"]["instance"]]
        out[(src, owner[r["metric"]["peer"]])] = float(r["value"][1]) * 1000
    return out


def test_prometheus_scrapes_rtts_that_match_the_underlay(observed: LiveMesh) -> None:
    live, lab = observed, observed.lab
    took = wait_until(lambda: series_ready(live), 60, interval=1.0)
    assert took is not None, (
        f"series never complete: {query(lab, 'up')}\n"
        f"{live.prometheus_log.read_text()[-2000:]}\n{live.logs()}"  # type: ignore[attr-defined]
    )
    time.sleep(25)  # 20 s of scrapes after the first complete one, and margin
    counts = query(lab, "count_over_time(meshopt_peer_rtt_seconds[20s])")
    assert min(int(r["value"][1]) for r in counts) >= 10, counts  # a window, not one sample
    smoothed = scraped_ms(live, "quantile_over_time(0.5, meshopt_peer_rtt_seconds[20s])")
    floor = scraped_ms(live, "quantile_over_time(0.5, meshopt_peer_rtt_min_seconds[20s])")
    # The window median: half the probes of a window must be stalled to move it. The
    # smoothed RTT follows every stall (CI under load: 14.7 ms on a 10 ms path), which
    # is the estimator's open problem (issue 14), not the exporter's.
    median = scraped_ms(live, "quantile_over_time(0.5, meshopt_peer_rtt_median_seconds[20s])")
    pairs = sorted((a, b) for a in live.nodes for b in live.nodes if a != b)
    assert sorted(smoothed) == pairs and sorted(floor) == pairs
    names = list(lab.topo.names)
    configured: dict[tuple[str, str], float] = {}
    report = []
    for src, dst in pairs:
        i, j = names.index(src), names.index(dst)
        rtt = float(lab.topo.delay_ms[i][j] + lab.topo.delay_ms[j][i])
        configured[(src, dst)] = rtt
        # Jitter is N(0, sigma) per direction: a window median sits within hundredths of
        # a ms of the configured RTT, the minimum of 64 samples about 2.5 (at most 5) sigma
        # below it.
        sigma = (float(lab.topo.jitter_ms[i][j]) ** 2 + float(lab.topo.jitter_ms[j][i]) ** 2) ** 0.5
        s, f, m = smoothed[(src, dst)], floor[(src, dst)], median[(src, dst)]
        report.append(
            f"{src}->{dst}: configured {rtt:.1f} ms, smoothed {s:.2f}, median {m:.2f}, min {f:.2f}"
        )
        # Physics: nothing arrives before the emulated delay has passed, which is the
        # configured one less what the emulator expects the tunnel hops to add (the
        # calibrated allowance: fitted to the median ping, so the fastest probes of a
        # window run up to that much under the configured RTT).
        least = emulated_floor_ms(rtt, tunnel_latency_us=lab.tunnel_allowance_us)
        assert s >= least - 3 * sigma and f >= least - 5 * sigma, (report[-1], least)
        # The fastest probe of a window (64 probes, ~21 s) waits on no CPU stall: the
        # overhead left is WireGuard and the emulator (0.2-0.6 ms measured here).
        assert f <= rtt + MAX_OVERHEAD_MS, report[-1]
        # The window median stays the same order of magnitude under load.
        assert m <= rtt * 1.1 + MAX_OVERHEAD_MS, report[-1]
    print("\n".join(report))
    # Each node ranks its peers as the underlay does (pairs 2 ms or more apart).
    for src in live.nodes:
        peers = [d for d in live.nodes if d != src]
        for a in peers:
            for b in peers:
                if configured[(src, a)] + 2 <= configured[(src, b)]:
                    assert median[(src, a)] < median[(src, b)], report


def test_controller_counts_every_node_and_health_endpoints(observed: LiveMesh) -> None:
    live, lab = observed, observed.lab
    n = len(live.nodes)
    assert wait_until(lambda: series_ready(live), 60, interval=1.0) is not None
    nodes = wait_until(
        lambda: (
            [r["value"][1] for r in query(lab, 'meshopt_controller_nodes{state="online"}')]
            == [str(n)]
        ),
        30,
        interval=1.0,
    )
    assert nodes is not None, query(lab, "meshopt_controller_nodes")
    assert [r["value"][1] for r in query(lab, "meshopt_controller_lease_active")] == ["1"]
    links = query(lab, "meshopt_controller_links")
    assert [r["value"][1] for r in links] == [str(n * (n - 1))]
    # Routes reach the agents: the fast table is filled and the versions agree.
    installed = wait_until(
        lambda: len(query(lab, 'meshopt_installed_routes{table="fast"} > 0')) == n, 60, interval=1.0
    )
    assert installed is not None, query(lab, "meshopt_installed_routes")
    assert len(query(lab, "meshopt_route_set_version")) == n
    # /healthz: 200 with the broker connected, from where Prometheus runs.
    for node in live.nodes:
        status, body = fetch(lab, f"http://{lab.mgmt_ip(node)}:{AGENT_PORT}/healthz")
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "ok" and doc["broker_connected"] is True, body
        assert doc["node"] == node and doc["peers"] == n - 1
        assert set(doc["loops"]) >= {"peers", "apply", "telemetry", "bus", "status"}
    status, body = fetch(lab, f"http://{CONTROLLER}/healthz")
    doc = json.loads(body)
    assert status == 200 and doc["broker_connected"] is True and doc["role"] == "active", body
    assert doc["nodes"] == n


def test_every_dashboard_metric_exists_in_prometheus(observed: LiveMesh) -> None:
    live, lab = observed, observed.lab
    assert wait_until(lambda: series_ready(live), 60, interval=1.0) is not None
    status, body = fetch(lab, f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/label/__name__/values")
    assert status == 200, body
    have = set(json.loads(body)["data"])
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bmeshopt_[a-z_]+", e)}
    # Empty here by design: capacity needs [bandwidth] (off in labs, it would load the
    # shared emulator), and a healthy mesh drops nothing (the unit tests check that
    # these families are declared).
    empty = {
        "meshopt_peer_capacity_bytes_per_second",
        "meshopt_agent_dropped_total",
        "meshopt_controller_dropped_total",
    }
    missing = used - have - empty
    assert missing == set(), sorted(have)
