"""Busy processes beside a benchmark: the shared, stalling VM our users run on.

``with cpu_load(2): ...`` starts two Python processes spinning on a core each and ends
exactly those (by the PIDs it started) when the block ends, whatever happens in it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from meshopt.errors import InputError

MAX_LOAD = 64
SPIN = "while True: pass"


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[list[int]]:
    """N spinning processes for the block's duration; yields their PIDs."""
    if not 0 <= n <= MAX_LOAD:
        raise InputError(f"--cpu-load {n}: give 0..{MAX_LOAD} busy processes")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in procs:
            p.wait()


def lag_window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The emulator's own timing over a window, from two ``stats`` replies.

    A packet released more than 1 ms after its due time is the lab failing to emulate
    the underlay, not a routing decision; the benchmark reports the share so that a
    figure lost to an overloaded lab is not blamed on the controller.
    """
    if "lag_us" not in after:
        return {"measured": False, "why": "the underlay (netem) reports no timer lag"}
    b, a = before.get("lag_us") or {}, after["lag_us"]
    count = int(a.get("count", 0)) - int(b.get("count", 0))
    late = int(a.get("over_1ms", 0)) - int(b.get("over_1ms", 0))
    share = late / count if count > 0 else None
    return {
        "measured": True,
        "packets": count,
        "late_over_1ms": late,
        "late_share": share,
        "goal": "<= 0.01 (1 % of packets more than 1 ms late)",
        "ok": share is not None and share <= 0.01,
    }
