"""Calibrate the lab's tunnels: measure what they add on this machine and take it off.

The emulator takes an allowance off every tunnel packet's delay so that a ping through
the overlay reads the configured RTT, as it would with kernel WireGuard over a real
path. What wireguard-go (and the emulator's own hand-over) really adds depends on the
machine: ~0.25 ms a direction on the development VM, ~0.6 ms on the CI machine, where
a configured 10 ms path read 10.55-10.8 ms with the fixed allowance. So a lab that
comes up pings through one of its tunnels, at a delay it sets for the purpose, and
sets the allowance to what makes that ping read true, then puts the pair back.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshopt.lab.emulator import EmulatorClient, EmulatorError

_log = logging.getLogger(__name__)

ONE_WAY_MS = 4.0  # the pair's delay while measuring: above any allowance, and under 10 ms
# of RTT, where ping prints hundredths (from 10 ms on, tenths)
COUNT = 30  # pings a round
# The interval the lab's tests and users ping at. What wireguard-go adds depends on how
# long its processes sleep between packets: after a fit at 5 ms, the same path read
# 0.1 ms higher at 10 ms and 0.3 ms higher at 50 ms here, and a CI machine, whose
# tunnels add twice as much, read a 10 ms path 0.6 ms high right after a fit at 5 ms.
INTERVAL_S = 0.01
ROUNDS = 6  # at most; a round whose median is within SETTLED_MS of the truth ends it
SETTLED_MS = 0.05
# More than this a hop means something else is wrong (a machine that cannot keep time):
# the allowance stops here and the lab says so.
MAX_LATENCY_US = 2000.0


@dataclass(frozen=True)
class Calibration:
    """The outcome: the allowance now in force, and how far the last round read off."""

    pair: tuple[str, str]
    latency_us: float
    residual_ms: float  # last round's median RTT minus the configured RTT
    rounds: int
    capped: bool
    # every round's (allowance µs, residual ms): a lab test that reads off shows them
    history: tuple[tuple[float, float], ...] = ()


Pinger = Callable[[int, float], list[float]]  # (count, interval) -> RTTs in ms


def next_latency_us(residual_ms: float, current_us: float) -> float:
    """The allowance that would have made an RTT ``residual_ms`` over the configured one
    read true (half of it a direction)."""
    return min(max(current_us + residual_ms * 1000.0 / 2.0, 0.0), MAX_LATENCY_US)


@dataclass(frozen=True)
class Fit:
    latency_us: float  # the allowance left in force
    residual_ms: float  # what the last round read off, under that allowance
    rounds: int
    history: tuple[tuple[float, float], ...] = ()


def fit(measure: Callable[[float], float | None], start_us: float) -> Fit | None:
    """Find the allowance under which a round reads true; ``measure(us)`` puts ``us`` in
    force and returns a round's median residual (ms), or None when pings were lost.

    Each round estimates the allowance (what would have made it read true). The next
    allowance is the median of every estimate so far, not the last one alone: a round
    hit by a stall (30 pings at 5 ms spanned 150 ms; one wireguard-go hiccup there moved the last
    round's median by 0.75 ms in CI) would otherwise set an allowance that no round ever
    checked, and the lab would read that far off until calibrated again. The fit ends
    when the allowance in force reads true, or after ROUNDS on the median estimate, which
    one more round then checks: the residual reported is always the allowance's own.
    """
    latency, estimates = start_us, []
    history: list[tuple[float, float]] = []
    while True:
        got = measure(latency)
        if got is None:
            return None
        history.append((round(latency, 1), round(got, 3)))
        if abs(got) <= SETTLED_MS or len(history) > ROUNDS:
            return Fit(latency, got, len(history), tuple(history))
        estimates.append(next_latency_us(got, latency))
        latency = statistics.median(estimates)


def calibrate(
    emu: EmulatorClient,
    pair: tuple[int, int],
    names: Sequence[str],
    ping: Pinger,
) -> Calibration | None:
    """Set ``pair`` (both ways) to ONE_WAY_MS, clean; adjust the allowance until pings
    through the tunnel read 2 × ONE_WAY_MS; restore the pair. None if no ping came back."""
    i, j = pair
    saved = emu.params()
    latency = float(saved["tunnel_latency_us"])
    both = [(i, j), (j, i)]
    emu.set(both, delay_ms=ONE_WAY_MS, jitter_ms=0.0, loss=0.0, rate_mbit=None, spike=0)
    try:
        if not ping(3, 0.05):  # the WireGuard handshake, off the clock
            return None

        def measure(latency_us: float) -> float | None:
            emu.tunnel_latency(latency_us)
            rtts = ping(COUNT, INTERVAL_S)
            if len(rtts) < COUNT // 2:
                return None
            return statistics.median(rtts) - 2.0 * ONE_WAY_MS

        got = fit(measure, latency)
        if got is None:
            emu.tunnel_latency(latency)
            return None
        emu.tunnel_latency(got.latency_us)
        return Calibration(
            (names[i], names[j]),
            round(got.latency_us, 1),
            round(got.residual_ms, 3),
            got.rounds,
            got.latency_us >= MAX_LATENCY_US,
            got.history,
        )
    finally:
        for a, b in both:
            rate = saved["rate_mbit"][a][b]
            emu.set(
                [(a, b)],
                delay_ms=saved["delay_ms"][a][b],
                jitter_ms=saved["jitter_ms"][a][b],
                loss=saved["loss"][a][b],
                rate_mbit=None if rate is None else float(rate),
                spike=saved["spike"][a][b],
            )


def calibrate_or_warn(
    emu: EmulatorClient,
    pair: tuple[int, int],
    names: Sequence[str],
    ping: Pinger,
) -> Calibration | None:
    """:func:`calibrate`, with a warning instead of an error: a lab that could not
    calibrate still works, its overlay RTTs read what the default allowance gives."""
    try:
        cal = calibrate(emu, pair, names, ping)
    except EmulatorError as exc:
        _log.warning("tunnel calibration failed (%s): keeping the allowance in force", exc)
        return None
    if cal is None:
        _log.warning("tunnel calibration got no replies: keeping the allowance in force")
    elif cal.capped:
        _log.warning(
            "the lab's tunnels add more than %.0f µs a hop on this machine: overlay RTTs "
            "read %.2f ms high",
            MAX_LATENCY_US,
            cal.residual_ms,
        )
    return cal
