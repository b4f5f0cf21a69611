"""Packet-train capacity through real WireGuard (wireguard-go) over the emulated underlay.

A TrainResponder runs in n2, the estimator in n1, each as its own process in the node's
namespace (``python -m meshopt.probe.train``). The underlay serialises at the configured
rate counting whole underlay packets, so a train of ``packet_bytes`` IP packets should
measure ``rate * packet_bytes / (padded packet + 60)``: that is the expectation, derived
here and never typed in. Goal (issue 4 item 7): within 10 % of it and of iperf3 on the same
path, with far fewer bytes than iperf3 spends.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from meshopt.bench.cpuload import lag_window
from meshopt.lab.lab import Lab
from meshopt.lab.plan import WG_MTU
from meshopt.probe.train import (
    TRAIN_PORT,
    WG_IPV4_OVERHEAD,
    probe_level_mbit,
    tunnel_packet_bytes,
)

from .tools import IP_TCP_HEADERS, iperf3_between

pytestmark = pytest.mark.lab

TOLERANCE = 0.10


@pytest.fixture(scope="module")
def trains(lab4: Lab) -> Iterator[Lab]:
    """lab4 with a train responder in n2 and a clean n1-n2 (no jitter, delay or loss)."""
    lab4.set("n1-n2 delay=5ms jitter=0 loss=0 rate=unlimited")
    server = lab4.popen(
        "n2",
        [sys.executable, "-m", "meshopt.probe.train", "--serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().split() == ["READY", str(TRAIN_PORT)]
        lab4.run("n1", ["ping", "-c", "2", "-i", "0.1", lab4.overlay_ip("n2")])  # handshake
        yield lab4
    finally:
        server.terminate()
        server.wait(10)
        lab4.set("n1-n2 delay=5ms jitter=0.2ms loss=0 rate=100Mbit")


def estimate(lab: Lab, *extra: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "meshopt.probe.train", "--json"]
    proc = lab.run("n1", [*argv, "--estimate", lab.overlay_ip("n2"), *extra], timeout=30)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.mark.parametrize("rate_mbit", [10, 20, 50, 100])
def test_estimate_within_10_percent_of_the_rate(trains: Lab, rate_mbit: int) -> None:
    trains.set(f"n1-n2 rate={rate_mbit}Mbit")
    before = trains.emulator.stats()
    est = estimate(trains)
    timing = lag_window(before, trains.emulator.stats())
    expected = probe_level_mbit(rate_mbit, est["packet_bytes"], WG_IPV4_OVERHEAD)
    off = abs(est["capacity_mbit"] / expected - 1)
    if timing["measured"] and not timing["ok"]:
        # The lab itself lost its timing while the trains ran (a busy machine: CI once
        # read 69 of 95 Mbit/s with the CI, a test run and the lab on two cores): the
        # underlay was not the configured one, so no figure can be judged against it,
        # but the estimate must not claim to be sure of a wrong figure.
        assert off <= TOLERANCE or est["confidence"] < 0.5, (est, expected, timing)
    else:
        assert off <= TOLERANCE, (est, expected, timing)
    # Confidence reflects the trains' scatter, which the shared VM's CPU stalls add to
    # at high rates; at 10 Mbit/s (48 ms trains) the trains agree.
    assert 0.0 < est["confidence"] <= 1.0, est
    if rate_mbit == 10:
        assert est["confidence"] >= 0.8, est
    # Bounded cost: under 5 % of what a 10 s iperf3 test sends at this rate.
    assert est["bytes_spent"] <= 0.05 * rate_mbit * 1e6 / 8 * 10, est
    assert est["duration_s"] < 2.0, est


def test_estimate_agrees_with_iperf3_and_costs_far_less(trains: Lab) -> None:
    trains.set("n1-n2 rate=20Mbit")
    est = estimate(trains)
    tcp = iperf3_between(trains.netns("n2"), trains.netns("n1"), trains.overlay_ip("n2"))
    goodput = tcp["end"]["sum_received"]["bits_per_second"] / 1e6
    # Both on the underlay's scale: TCP segments of WG_MTU carry WG_MTU - 52 bytes of data.
    iperf_underlay = goodput * (WG_MTU + WG_IPV4_OVERHEAD) / (WG_MTU - IP_TCP_HEADERS)
    pb = est["packet_bytes"]
    est_underlay = est["capacity_mbit"] * tunnel_packet_bytes(pb, WG_IPV4_OVERHEAD) / pb
    assert abs(est_underlay / iperf_underlay - 1) <= TOLERANCE, (est, goodput)
    iperf_bytes = tcp["end"]["sum_sent"]["bytes"]  # a 3 s run; the default is 10 s
    assert est["bytes_spent"] * 20 < iperf_bytes, (est["bytes_spent"], iperf_bytes)


def test_estimate_at_a_silent_peer_is_one_clear_error(trains: Lab) -> None:
    argv = [sys.executable, "-m", "meshopt.probe.train", "--estimate"]
    proc = trains.run("n1", [*argv, trains.overlay_ip("n3"), "--trains", "2", "--timeout", "0.3"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
