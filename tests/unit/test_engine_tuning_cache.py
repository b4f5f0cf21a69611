"""Bulk TCP settings are remembered per quantised path (issue 15, N = 1000): the same
settings as computing them afresh, and one shared dict per distinct path value."""

from __future__ import annotations

import math
import socket

from meshopt.controller.engine import _tuning
from meshopt.install.tuning import tcp_tuning


def _fresh(rtt: float | None, bw: float | None, pmtus: tuple[int, ...], dst: str, hops: int):  # type: ignore[no-untyped-def]
    q_rtt = float(2 ** math.ceil(math.log2(rtt))) if rtt is not None and rtt > 0 else None
    q_bw = float(1.25 ** math.floor(math.log(bw, 1.25))) if bw is not None else None
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    measured = all(pmtus) and min(pmtus) >= (1280 if family == socket.AF_INET6 else 576)
    return tcp_tuning(
        [p + 80 for p in pmtus] if measured else None, family, q_bw, q_rtt, relay_hops=hops - 1
    )


def test_remembered_tuning_equals_a_fresh_one() -> None:
    cases = [
        (12.3, 80.0, (1420,), "10.0.0.1/32", 1),
        (12.9, 81.0, (1420, 1420), "10.0.0.1/32", 2),
        (None, 80.0, (1420,), "10.0.0.1/32", 1),
        (40.0, None, (0,), "fd00::1/128", 1),
        (0.0, 5.0, (1000, 1000), "fd00::1/128", 2),  # IPv6 over a narrow path: untuned MTU
        (250.0, 3000.0, (1500, 1500, 1500), "10.0.0.2/32", 3),
    ]
    for rtt, bw, pmtus, dst, hops in cases:
        assert _tuning(rtt, bw, pmtus, dst, hops) == _fresh(rtt, bw, pmtus, dst, hops)
    # Values in the same quantisation step share the settings object.
    a = _tuning(12.3, 80.0, (1420,), "10.0.0.1/32", 1)
    b = _tuning(13.1, 81.0, (1420,), "10.0.0.9/32", 1)
    assert a is b
    assert _tuning(1.0, 1.0, (1420,), "10.0.0.1/32", 0) is None
