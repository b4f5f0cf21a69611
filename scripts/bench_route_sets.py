#!/usr/bin/env python3
"""Signed route-set sizes and CPU at large mesh sizes, JSON on stdout (issue 15).

For each destination count: one node's route set as the controller builds it for a
full mesh (one in ten destinations relayed, every fast route with a backup, and with
``--bulk`` a bulk route per destination with TCP settings), its size as JSON would be
signed, its size as it is signed now (packed above the JSON limit), and the CPU of
signing it (the controller's ``sign_route_set``) and of verifying it (the agent's
``verify_route_set``), medians of ``--runs``. A set that does not fit even packed is
reported as refused (the controller counts it and does not publish it).

    .venv/bin/python scripts/bench_route_sets.py [--sizes 1000,1400,2000,3000] [--no-bulk]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    BusMessageError,
    Route,
    RouteSet,
    decode_signed,
    is_msgpack,
)
from meshopt.bus.signing import generate_signing_key, sign_route_set, verify_route_set
from meshopt.wireguard.keys import generate_keypair


def route_set(peers: Sequence[str], bulk: bool) -> RouteSet:
    routes = []
    for i, k in enumerate(peers):
        dst = f"10.{100 + i // 65536}.{(i // 256) % 256}.{i % 256}/32"
        via = peers[i - 1] if i % 10 == 9 else k
        backup = k if via != k else peers[(i + 1) % len(peers)]
        routes.append(Route(dst=dst, via=via, backup=backup))
        if bulk:
            routes.append(
                Route(dst=dst, via=via, table="bulk", mtu=1420, advmss=1380,
                      window=4_194_304 if i % 3 else 1_048_576, initcwnd=40, initrwnd=40)
            )  # fmt: skip
    return RouteSet(mesh="m", node="n0", version=7, issued_at=time.time(), controller="ctl1",
                    term=3, routes=routes)  # fmt: skip


def measure(destinations: int, bulk: bool, runs: int) -> dict[str, Any]:
    peers = [generate_keypair()[1] for _ in range(destinations)]
    rs = route_set(peers, bulk)
    key, pub = generate_signing_key()
    json_bytes = len(msgspec.json.encode(rs))
    out: dict[str, Any] = {
        "destinations": destinations,
        "routes": len(rs.routes),
        "json_signed_bytes": 4 * ((json_bytes + 2) // 3) + 300,  # base64 in the envelope
    }
    sign_s, verify_s = [], []
    try:
        for _ in range(runs):
            t0 = time.process_time()
            data = sign_route_set(rs, key)
            t1 = time.process_time()
            back = verify_route_set(data, [pub], mesh="m", node="n0")
            t2 = time.process_time()
            sign_s.append(t1 - t0)
            verify_s.append(t2 - t1)
    except BusMessageError as exc:
        out["refused"] = f"{exc.reason}: {exc.detail}"
        return out
    out.update(
        signed_bytes=len(data),
        packed=is_msgpack(decode_signed(data).payload),
        fits=len(data) <= MAX_PAYLOAD_BYTES,
        same_routes=back == rs,
        sign_ms=round(1e3 * statistics.median(sign_s), 2),
        verify_ms=round(1e3 * statistics.median(verify_s), 2),
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="1000,1400,2000,3000", help="destination counts")
    p.add_argument("--no-bulk", action="store_true", help="fast routes only")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x]
    except ValueError:
        print(f"error: --sizes {args.sizes!r}: give counts like 1000,2000", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 2 or max(sizes) > 8000 or args.runs < 1:
        print("error: --sizes 2..8000, --runs >= 1", file=sys.stderr)
        return 2
    doc = {
        "benchmark": "route_sets",
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bulk": not args.no_bulk,
        "max_payload_bytes": MAX_PAYLOAD_BYTES,
        "sizes": [measure(n, not args.no_bulk, args.runs) for n in sizes],
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
