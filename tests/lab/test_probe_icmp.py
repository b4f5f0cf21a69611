"""ICMP echo probing and path-MTU discovery from inside a lab node, with real packets.

A node that runs no agent still answers ICMP: its kernel does. The probes run in n1's
namespace as their own process (raw sockets there), towards n2 through wireguard-go.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from meshopt.lab.lab import Lab
from meshopt.lab.plan import WG_MTU

from .tools import calibrate_now, emulated_floor_ms, rtt_tolerance

pytestmark = pytest.mark.lab

DELAY_MS = 5.0

SCRIPT = """
import asyncio, json, sys
from meshopt.errors import MeshoptError
from meshopt.probe.icmp import icmp_ping
from meshopt.probe.pmtu import discover_pmtu

async def main(kind, address, *args):
    if kind == "ping":
        r = await icmp_ping(address, count=int(args[0]), interval_s=float(args[1]),
                            timeout_s=float(args[2]))
        return {"sent": r.sent, "received": r.received, "loss": r.loss,
                "rtts_ms": r.rtts_ms, "median_ms": r.median_ms, "min_ms": r.min_ms}
    return {"pmtu": await discover_pmtu(address, timeout_s=0.3)}

try:
    print(json.dumps(asyncio.run(main(*sys.argv[1:]))))
except MeshoptError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.fixture(scope="module")
def quiet(lab4: Lab) -> Iterator[Lab]:
    """lab4 with n1-n2 at 5 ms one way, no jitter, loss or rate limit."""
    lab4.set(f"n1-n2 delay={DELAY_MS}ms jitter=0 loss=0 rate=unlimited")
    lab4.run("n1", ["ping", "-c", "2", "-i", "0.1", lab4.overlay_ip("n2")])  # handshake
    yield lab4
    lab4.set("n1-n2 delay=5ms jitter=0.2ms loss=0 rate=100Mbit")


def probe(lab: Lab, *args: str) -> dict[str, Any]:
    proc = lab.run("n1", [sys.executable, "-c", SCRIPT, *args], timeout=60)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_icmp_rtt_through_wireguard_matches_the_configured_delay(quiet: Lab) -> None:
    calibrate_now(quiet)
    r = probe(quiet, "ping", quiet.overlay_ip("n2"), "50", "0.01", "1.0")
    assert r["sent"] == 50 and r["received"] >= 48, r
    rtt = 2 * DELAY_MS
    assert abs(r["median_ms"] - rtt) <= rtt_tolerance(rtt), r
    # The delay is really in the path: no faster than the emulator can make it.
    floor = emulated_floor_ms(rtt, tunnel_latency_us=quiet.tunnel_allowance_us)
    assert r["min_ms"] >= floor, (floor, r)


def test_icmp_loss_and_silence(quiet: Lab) -> None:
    quiet.set("n1->n2 loss=30%")
    try:
        r = probe(quiet, "ping", quiet.overlay_ip("n2"), "200", "0.002", "0.5")
    finally:
        quiet.set("n1->n2 loss=0")
    assert r["sent"] == 200 and 0.18 <= r["loss"] <= 0.42, r
    # An overlay address nobody has (wg0 routes it, no peer owns it): all unanswered.
    r = probe(quiet, "ping", "10.99.0.6", "3", "0.01", "0.2")
    assert (r["sent"], r["received"], r["loss"], r["median_ms"]) == (3, 0, 1.0, None)
    # No route at all: one clear error line, no traceback.
    r = probe(quiet, "ping", "10.250.0.1", "3", "0.01", "0.2")
    assert r["error"].startswith("ICMP echo to 10.250.0.1 failed"), r
    r = probe(quiet, "pmtu", "10.99.0.6")
    assert "answers no echo of 576 bytes" in r["error"], r


def test_pmtu_through_wireguard_is_its_mtu(quiet: Lab) -> None:
    assert probe(quiet, "pmtu", quiet.overlay_ip("n2"))["pmtu"] == WG_MTU
    # The underlay itself carries 1,500-byte packets.
    assert probe(quiet, "pmtu", quiet.underlay_ip("n2"))["pmtu"] == 1500
