"""The link metric: what one hop over one tunnel costs, in milliseconds.

cost = rtt + jitter_weight * jitter + loss_penalty_ms * loss / (1 - loss)

* RTT is the base: interactive traffic cares about round trips.
* Jitter counts ``jitter_weight`` times (default 2): a playout buffer or a TCP
  RTO has to absorb about two deviations, so a jittery link is as slow as that.
* Loss costs ``loss_penalty_ms`` per expected retransmission (default 200 ms, the
  Linux minimum TCP RTO); ``loss / (1 - loss)`` is the expected number of
  retransmissions per delivered packet, so 1% loss adds 2 ms, 5% adds 10.5 ms,
  50% adds 200 ms and 100% loss makes the link unusable.
* Every relay hop adds ``relay_hop_ms`` to a path: what relaying measurably costs
  beyond the two tunnels' RTTs, which already carry the relay's decrypt and
  encrypt (its kernel forwarding between the tunnels and one more pass through its
  WireGuard queue). The default, ``RELAY_HOP_MS``, is measured in the lab with
  ``python -m meshopt.bench.relayhop`` (docs/estimator.md); it was a fixed 2 ms,
  which with the jitter terms kept 15 % gains out. Hysteresis against relaying on
  noise is the policy's job (its margins and noise test), not the price's. The
  route engine adds it per hop and subtracts it once, so a direct tunnel pays nothing.

Age is explicit: a sample older than ``fresh_s`` is inflated linearly up to
``1 + aging_penalty`` times at ``stale_s``; a stale or missing measurement gives
the link ``unknown_cost_ms`` (default 1 s): still usable as a last resort, never
preferred over any measured path. A link with loss 1 or an infinite RTT is down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from meshopt.errors import InputError

FloatArray = npt.NDArray[np.float64]

# A relay hop's own cost (ms) where nothing better is known: RTT(a->c via b) minus
# RTT(a->b) + RTT(b->c) over wireguard-go tunnels in the lab (meshopt.bench.relayhop)
# measured -0.11 ms (rounds -0.19 .. -0.03, a loaded 2-core VM): forwarding between two
# tunnels costs no more than answering on one. 0.1 ms, not 0, keeps an exact tie on the
# direct tunnel (one node fewer that can fail).
RELAY_HOP_MS = 0.1


@dataclass(frozen=True)
class LinkSample:
    """What an agent knows about one direction of one tunnel."""

    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    bandwidth_mbit: float | None = None
    noise_ms: float = 0.0  # standard deviation of the RTT estimate
    age_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rtt_ms", "jitter_ms", "noise_ms", "age_s"):
            v = getattr(self, name)
            if math.isnan(v) or v < 0:
                raise InputError(f"impossible {name} {v!r}")
        if math.isnan(self.loss) or not 0 <= self.loss <= 1:
            raise InputError(f"impossible loss {self.loss!r}: must be within 0..1")
        bw = self.bandwidth_mbit
        if bw is not None and (math.isnan(bw) or bw < 0):
            raise InputError(f"impossible bandwidth_mbit {bw!r}")


@dataclass(frozen=True)
class Metric:
    jitter_weight: float = 2.0
    loss_penalty_ms: float = 200.0
    relay_hop_ms: float = RELAY_HOP_MS
    fresh_s: float = 10.0
    stale_s: float = 30.0
    aging_penalty: float = 0.5
    unknown_cost_ms: float = 1000.0

    def link_cost(self, sample: LinkSample | None) -> float:
        """Cost of one link; inf when it is down."""
        if sample is None:
            return self.unknown_cost_ms
        return float(
            self.link_costs(
                np.array([sample.rtt_ms]),
                np.array([sample.jitter_ms]),
                np.array([sample.loss]),
                np.array([sample.age_s]),
            )[0]
        )

    def link_costs(
        self,
        rtt_ms: FloatArray,
        jitter_ms: FloatArray,
        loss: FloatArray,
        age_s: FloatArray | None = None,
    ) -> FloatArray:
        """Vectorised ``link_cost``: NaN RTT means missing, inf RTT or loss 1 means down."""
        with np.errstate(divide="ignore", invalid="ignore"):
            lossc = np.clip(loss, 0.0, 1.0)
            cost = (
                rtt_ms
                + self.jitter_weight * jitter_ms
                + self.loss_penalty_ms * lossc / (1.0 - lossc)
            )
            if age_s is not None:
                span = max(self.stale_s - self.fresh_s, 1e-9)
                over = np.clip((age_s - self.fresh_s) / span, 0.0, 1.0)
                cost = cost * (1.0 + self.aging_penalty * over)
                cost = np.where(age_s > self.stale_s, self.unknown_cost_ms, cost)
        cost = np.where(np.isnan(rtt_ms), self.unknown_cost_ms, cost)
        cost = np.where((lossc >= 1.0) | np.isposinf(rtt_ms), np.inf, cost)
        return np.asarray(cost, dtype=np.float64)
