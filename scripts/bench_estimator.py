#!/usr/bin/env python3
"""Choose the RTT estimator by measurement (issue 14 item 2); one JSON object out.

Feeds synthetic RTT series at the prober's rate (0.33 s) to candidate estimators and
reports, per scenario, the error against the true path RTT at every sample's arrival:

* ``clean``: 10 ms, normal noise σ 0.3 ms;
* ``busy``: plus one-sided scheduling noise (exponential, mean 0.3 ms) and, in 2 % of
  samples, a 5-25 ms CPU loss (what the 2-core development VM shows under load);
* ``spikes_1in10`` / ``spikes_1in20``: one sample in N delayed by 100-300 ms;
* ``stall_2s``: three 2 s stalls where every reply is held and all arrive at once at
  the end (the prober's 1 s timeout makes the older ones losses);
* ``step``: a real sustained +50 % at 60 s (and ``step_spiky``: the same with spikes
  1 in 20). ``reflect_50_s`` / ``reflect_90_s``: from the step until the estimate
  reaches half / 90 % of it for good. Goal: the step shows within ~1 s (3 samples).

Figures are medians over ``--seeds`` seeds (default 3). The chosen estimator is the
one meeting every goal with the lowest clean error: ``max_over_ms`` (how far above
the truth the estimate ever went) ≤ max(1 ms, 10 %) on spikes, stalls and the busy
series, ``reflect_90_s`` ≤ 1.5 s and ``reflect_50_s`` ≤ 1.0 s on steps.

It also chooses σ's half-life (``sigma``): on an 80 ms link (σ 0.3 ms) with a busy
host's bursts (every 20 s, 4 s in which each sample is late by an exponential 2 ms
mean: within 5 % of the RTT, so accepted, as the busy 6-node lab's waw showed right
after a relay failed), ``burst_cost_ms`` is how far the cost's 2σ term rose above its
true value (median over bursts); ``sigma_rise_50_s`` is how long a real rise of σ to
3 ms takes to show half of itself for good. The chosen half-life is the longest
before the next one tried lowers the burst's lift by less than 10 %, among those
whose rise shows within 10 s.

    .venv/bin/python scripts/bench_estimator.py [--seeds 3] [--baseline old.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from meshopt.estimate import PLAIN, RobustConfig, RttEstimator, alpha_for, mad_sigma, median

INTERVAL_S = 0.33
HALF_LIFE_S = 2.0
DURATION_S = 120.0
BASE_MS = 10.0
TIMEOUT_S = 1.0
WARMUP_S = 5.0
STEP_AT_S = 60.0
STALLS_AT_S = (30.0, 60.0, 90.0)
STALL_S = 2.0

Sample = tuple[float, float, float]  # arrival time (s), RTT (ms), true RTT (ms)


class Candidate(Protocol):
    def add(self, x: float, now: float) -> None: ...
    def value(self) -> float | None: ...


class Ewma:
    """Today's srtt: a plain EWMA of every sample."""

    def __init__(self) -> None:
        self.e = RttEstimator(alpha_for(HALF_LIFE_S, INTERVAL_S), PLAIN)

    def add(self, x: float, now: float) -> None:
        self.e.add(x, now)

    def value(self) -> float | None:
        return self.e.srtt_ms


class Robust(Ewma):
    """meshopt.estimate.RttEstimator: EWMA of accepted samples, confirmed restarts."""

    def __init__(self, config: RobustConfig | None = None) -> None:
        self.e = RttEstimator(alpha_for(HALF_LIFE_S, INTERVAL_S), config or RobustConfig())


class WindowMedian:
    def __init__(self, n: int) -> None:
        self.w: deque[float] = deque(maxlen=n)

    def add(self, x: float, now: float) -> None:
        self.w.append(x)

    def value(self) -> float | None:
        return median(self.w) if self.w else None


class WindowMin(WindowMedian):
    def value(self) -> float | None:
        return min(self.w) if self.w else None


class HampelEwma:
    """A Hampel identifier over the last 9 samples (3 MAD-σ) replacing outliers by the
    window median, then the plain EWMA: the issue's example."""

    def __init__(self) -> None:
        self.w: deque[float] = deque(maxlen=9)
        self.e = Ewma()

    def add(self, x: float, now: float) -> None:
        y = x
        if len(self.w) >= 5:
            m = median(self.w)
            s = max(mad_sigma(list(self.w)), 0.5, 0.05 * m)
            if abs(x - m) > 3 * s:
                y = m
        self.w.append(x)
        self.e.add(y, now)

    def value(self) -> float | None:
        return self.e.value()


CANDIDATES: dict[str, Callable[[], Candidate]] = {
    "ewma": Ewma,
    "median5": lambda: WindowMedian(5),
    "min3": lambda: WindowMin(3),
    "hampel_ewma": HampelEwma,
    "robust": Robust,
}


# --- series -----------------------------------------------------------------------------


def series(kind: str, seed: int) -> list[Sample]:
    """Samples in arrival order for one scenario."""
    rng = random.Random(f"{kind}:{seed}")
    out: list[Sample] = []
    n = int(DURATION_S / INTERVAL_S)
    spike_n = {"spikes_1in10": 10, "spikes_1in20": 20, "step_spiky": 20}.get(kind, 0)
    for i in range(n):
        sent = i * INTERVAL_S
        truth = BASE_MS * (1.5 if kind.startswith("step") and sent >= STEP_AT_S else 1.0)
        x = truth + rng.gauss(0.0, 0.3)
        if kind == "busy":
            x += rng.expovariate(1 / 0.3)
            if rng.random() < 0.02:
                x += rng.uniform(5.0, 25.0)
        if spike_n and rng.randrange(spike_n) == 0:
            x += rng.uniform(100.0, 300.0)
        x = max(x, 0.01)
        arrival = sent + x / 1000.0
        if kind == "stall_2s":
            for at in STALLS_AT_S:
                if at <= arrival < at + STALL_S:
                    arrival = at + STALL_S + rng.uniform(0.0, 0.0005)
                    x = (arrival - sent) * 1000.0
        if x / 1000.0 > TIMEOUT_S:
            continue  # a loss: the estimators never see it
        out.append((arrival, x, truth))
    out.sort()
    return out


SCENARIOS = ("clean", "busy", "spikes_1in10", "spikes_1in20", "stall_2s", "step", "step_spiky")


def run(make: Callable[[], Candidate], samples: list[Sample], step: bool) -> dict[str, float]:
    est = make()
    errs: list[float] = []
    over = 0.0
    reached: dict[float, float | None] = {0.5: None, 0.9: None}
    t0 = time.perf_counter()
    for arrival, x, truth in samples:
        est.add(x, arrival)
        v = est.value()
        if v is None or arrival < WARMUP_S:
            continue
        if step and arrival >= STEP_AT_S:
            for share in reached:
                level = BASE_MS * (1.0 + 0.5 * share)
                if v < level:
                    reached[share] = None
                elif reached[share] is None:
                    reached[share] = arrival - STEP_AT_S
            if arrival < STEP_AT_S + 2.0:
                continue
        errs.append(abs(v - truth))
        over = max(over, v - truth)
    cost_us = (time.perf_counter() - t0) / max(len(samples), 1) * 1e6
    errs.sort()
    out = {
        "mean_abs_err_ms": statistics.fmean(errs),
        "p99_abs_err_ms": errs[int(0.99 * (len(errs) - 1))],
        "max_over_ms": over,
        "us_per_sample": cost_us,
    }
    if step:
        for share, key in ((0.5, "reflect_50_s"), (0.9, "reflect_90_s")):
            r = reached[share]
            out[key] = r if r is not None else float("inf")
    return out


def _median_dicts(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def goals_met(figures: dict[str, dict[str, float]]) -> dict[str, bool]:
    bound = max(1.0, 0.1 * BASE_MS)
    return {
        "ignores_spikes": all(
            figures[s]["max_over_ms"] <= bound for s in ("spikes_1in10", "spikes_1in20")
        ),
        "ignores_stalls": figures["stall_2s"]["max_over_ms"] <= bound,
        "ignores_busy_tail": figures["busy"]["max_over_ms"] <= bound,
        "follows_steps": all(
            figures[s]["reflect_50_s"] <= 1.0 and figures[s]["reflect_90_s"] <= 1.5
            for s in ("step", "step_spiky")
        ),
    }


SIGMA_HALF_LIVES_S = (2.0, 5.0, 10.0, 20.0)
SIGMA_BASE_MS = 80.0
SIGMA_MS = 0.3
SIGMA_RISE_MS = 3.0
BURST_EVERY_S = 20.0
BURST_S = 4.0
BURST_MEAN_MS = 2.0


def sigma_series(kind: str, seed: int) -> list[tuple[float, float]]:
    """(arrival, RTT) at the prober's rate on a long link: ``bursts`` or ``rise``."""
    rng = random.Random(f"sigma:{kind}:{seed}")
    out = []
    for i in range(int(DURATION_S / INTERVAL_S)):
        t = i * INTERVAL_S
        sigma = SIGMA_RISE_MS if kind == "rise" and t >= STEP_AT_S else SIGMA_MS
        x = SIGMA_BASE_MS + rng.gauss(0.0, sigma)
        if kind == "bursts" and t >= BURST_EVERY_S and t % BURST_EVERY_S < BURST_S:
            x += rng.expovariate(1 / BURST_MEAN_MS)
        out.append((t + x / 1000.0, x))
    return out


def sigma_run(half_life_s: float, seed: int) -> dict[str, float]:
    def estimator() -> RttEstimator:
        return RttEstimator(
            alpha_for(HALF_LIFE_S, INTERVAL_S),
            RobustConfig(),
            var_alpha=alpha_for(half_life_s, INTERVAL_S),
        )

    est = estimator()
    lifts: dict[int, float] = {}
    for at, x in sigma_series("bursts", seed):
        est.add(x, at)
        if at >= BURST_EVERY_S:
            n = int(at // BURST_EVERY_S)
            lifts[n] = max(lifts.get(n, 0.0), 2.0 * ((est.std() or 0.0) - SIGMA_MS))
    est = estimator()
    reached: float | None = None
    for at, x in sigma_series("rise", seed):
        est.add(x, at)
        if at < STEP_AT_S:
            continue
        if (est.std() or 0.0) < (SIGMA_MS + SIGMA_RISE_MS) / 2:
            reached = None
        elif reached is None:
            reached = at - STEP_AT_S
    return {
        "burst_cost_ms": statistics.median(lifts.values()),
        "sigma_rise_50_s": float("inf") if reached is None else reached,
    }


def sigma_choice(seeds: int) -> dict[str, Any]:
    figures = {
        f"{h:g}": _median_dicts([sigma_run(h, seed) for seed in range(1, seeds + 1)])
        for h in SIGMA_HALF_LIVES_S
    }
    lift = [figures[f"{h:g}"]["burst_cost_ms"] for h in SIGMA_HALF_LIVES_S]
    fits = [figures[f"{h:g}"]["sigma_rise_50_s"] <= 10.0 for h in SIGMA_HALF_LIVES_S]
    chosen = None
    for i, h in enumerate(SIGMA_HALF_LIVES_S):
        if not fits[i]:
            break
        chosen = h
        if i + 1 < len(lift) and lift[i + 1] > 0.9 * lift[i]:
            break
    return {"half_lives_s": figures, "chosen_half_life_s": chosen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="an earlier run's JSON, shown beside")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        print("bench_estimator: --seeds must be >= 1", file=sys.stderr)
        return 2
    baseline: dict[str, Any] | None = None
    if args.baseline is not None:
        try:
            baseline = json.loads(args.baseline.read_text())
        except (OSError, ValueError) as exc:
            print(f"bench_estimator: cannot read {args.baseline}: {exc}", file=sys.stderr)
            return 2
    data = {kind: [series(kind, seed) for seed in range(1, args.seeds + 1)] for kind in SCENARIOS}
    results: dict[str, Any] = {}
    for name, make in CANDIDATES.items():
        figures = {
            kind: _median_dicts([run(make, s, kind.startswith("step")) for s in data[kind]])
            for kind in SCENARIOS
        }
        results[name] = {"scenarios": figures, "goals": goals_met(figures)}
    passing = [n for n, r in results.items() if all(r["goals"].values())]
    chosen = min(
        passing, key=lambda n: results[n]["scenarios"]["clean"]["mean_abs_err_ms"], default=None
    )
    report: dict[str, Any] = {
        "interval_s": INTERVAL_S,
        "base_ms": BASE_MS,
        "seeds": args.seeds,
        "candidates": results,
        "passing": passing,
        "chosen": chosen,
        "sigma": sigma_choice(args.seeds),
    }
    if baseline is not None:
        report["baseline"] = {
            "chosen": baseline.get("chosen"),
            "candidates": baseline.get("candidates"),
        }
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0 if chosen == "robust" else 1


if __name__ == "__main__":
    sys.exit(main())
