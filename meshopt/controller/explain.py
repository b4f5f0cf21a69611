"""Why an entry is not on its best path: one line per entry, for the controller's log.

A pair that stays on a slower path is the policy working (noise, margins, hold,
confirm time) or a defect; without the figures it was judged on, a slow first
convergence cannot be told from either (docs/estimator.md). Pure: arrays in, text out.
"""

from __future__ import annotations

import math

import numpy as np

from meshopt.policy import Decision, PolicyConfig
from meshopt.routing.tables import NO_ROUTE, RouteTables

__all__ = ["pending"]


def _via(names: list[str], s: int, d: int, hop: int) -> str:
    if hop == NO_ROUTE:
        return "no route"
    return "direct" if hop == d else f"via {names[hop]}"


def pending(
    names: list[str],
    best: RouteTables,
    dec: Decision,
    policy: PolicyConfig,
    now: float,
    *,
    symmetric: bool,
    limit: int = 12,
) -> list[str]:
    """Up to ``limit`` entries left off their best next hop, with the gain, what it had
    to beat (noise term, large and small margins) and the hold or confirm it waits for.
    Symmetric mode lists each pair once (its two entries move together)."""
    if dec.cur is None or dec.new is None or dec.noise_term is None:
        return []
    table = dec.installed.next_hop
    off = table != best.next_hop
    if symmetric:
        off = np.triu(off | off.T, k=1)
    lines: list[str] = []
    since = dec.installed.since
    better = dec.installed.better_since
    for s, d in zip(*np.nonzero(off), strict=True):
        if len(lines) >= limit:
            lines.append(f"... and {int(off.sum()) - limit} more")
            break
        cur, new = float(dec.cur[s, d]), float(dec.new[s, d])
        gain = cur - new
        noise = float(dec.noise_term[s, d])
        large = max(policy.abs_margin_ms, policy.rel_margin * cur)
        small = max(policy.confirm_abs_ms, policy.confirm_rel * cur)
        if not (math.isfinite(cur) and math.isfinite(new)):
            why = "a path without a cost"
        elif gain <= noise:
            why = "gain within the noise term"
        elif gain >= large:
            left = policy.hold_s - (now - float(since[s, d]))
            why = f"large gain, held {max(left, 0.0):.1f} s more"
        elif gain >= small:
            started = float(better[s, d]) if better is not None else math.nan
            waited = now - started if math.isfinite(started) else 0.0
            why = f"small gain, confirming {waited:.1f} of {policy.confirm_s:.0f} s"
        else:
            why = f"gain under the small margin ({small:.2f} ms)"
        lines.append(
            f"{names[s]}->{names[d]} stays {_via(names, s, d, int(table[s, d]))} "
            f"({cur:.2f} ms), best {_via(names, s, d, int(best.next_hop[s, d]))} "
            f"({new:.2f} ms): gain {gain:.2f} ms; {why} "
            f"(large margin {large:.2f}, noise {noise:.2f})"
        )
    return lines
