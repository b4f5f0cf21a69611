"""What one relay hop costs beyond the two tunnels' RTTs: the measurement behind
``meshopt.metric.RELAY_HOP_MS``.

A link's RTT (what the controller routes on) already carries both ends' WireGuard
work: the sender's encrypt, the relay's decrypt, and back. A relayed path a -> b -> c
adds only what b does between its two tunnels: the kernel forwarding the packet from
one tunnel to the other (twice per round trip, instead of answering it once) and one
more pass through its WireGuard process's queue. So the relay hop's price is

    RTT(a -> c via b) - RTT(a -> b) - RTT(b -> c)

measured with ICMP pings over the overlay of a 3-node lab whose a-c tunnel is far
slower than the relay (the controller relays a -> c through b). Rounds interleave the
three pings so that machine load hits them alike; the figure is the median over
rounds. Run as root::

    .venv/bin/python -m meshopt.bench.relayhop [--rounds 5] [--count 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

TOPOLOGY = """\
name: relayhop
defaults: {delay: 1ms, jitter: 0ms, rate: 1000Mbit}
nodes:
  a: {}
  b: {}
  c: {}
underlay:
  a-c: {delay: 20ms}
"""


def relay_cost(ac: list[float], ab: list[float], bc: list[float]) -> float | None:
    """The relay's own share of a relayed round trip (ms), from the three pings' RTTs."""
    if not (ac and ab and bc):
        return None
    return statistics.median(ac) - statistics.median(ab) - statistics.median(bc)


def measure(rounds: int = 5, count: int = 40) -> dict[str, Any]:
    from meshopt.lab.lab import Lab
    from meshopt.lab.mesh import LiveMesh, wait_until

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "relayhop.yaml"
        path.write_text(TOPOLOGY)
        lab = Lab.up(str(path), name="relayhop", layout="single")
        return _measure(lab, LiveMesh(lab), wait_until, rounds, count)


def _measure(lab: Any, mesh: Any, wait_until: Any, rounds: int, count: int) -> dict[str, Any]:
    try:
        mesh.start()
        relayed = wait_until(lambda: mesh.path("a", "c") == ["a", "b", "c"], 60, interval=0.5)
        if relayed is None:
            return {"ok": False, "why": "a -> c never went through b"}
        per_round: list[float] = []
        for _ in range(rounds):
            ac = mesh.ping("a", "c", count=count, interval=0.02)
            ab = mesh.ping("a", "b", count=count, interval=0.02)
            bc = mesh.ping("b", "c", count=count, interval=0.02)
            cost = relay_cost(ac, ab, bc)
            if cost is not None:
                per_round.append(cost)
        return {
            "ok": bool(per_round),
            "relay_hop_ms": statistics.median(per_round) if per_round else None,
            "per_round_ms": per_round,
            "rounds": rounds,
            "count": count,
        }
    finally:
        mesh.stop()
        lab.down()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=40)
    args = ap.parse_args(argv)
    out = measure(args.rounds, args.count)
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
