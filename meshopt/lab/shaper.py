"""Per-pair underlay shaping: loss, rate, delay and jitter as a pure schedule.

The emulator asks one :class:`PairShaper` per directed pair (i, j) when a packet of
``size`` bytes that arrived at ``now`` may be delivered; the answer is a release time
or ``None`` (dropped). No I/O, no clock, no global RNG: time and randomness are passed
in, so the behaviour is unit-tested without any network.

Model, in the order applied to each packet (the order of a real bottleneck link):

1. **Rate** (when finite): the pair is a FIFO link serialising at ``rate_mbit``.
   ``departure = max(now, last_departure) + size * 8 / rate``. The queue holds at most
   ``max(queue_min_bytes, queue_ms of the rate)`` (64 KB and 50 ms by default: enough
   for one TCP flow to fill the link without bufferbloat of seconds); a packet that
   would exceed it is tail-dropped (reason ``queue``). Packets already queued keep
   their times when the rate changes; new ones queue behind them.
2. **Loss**: Bernoulli with probability ``loss`` per packet (reason ``loss``). A lost
   packet has used its serialisation time, as on a real lossy link.
3. **Delay and jitter**: ``release = departure + delay + N(0, jitter)``, where
   ``jitter_ms`` is the standard deviation of a normal distribution (the simulator's
   meaning too), clipped so that a packet never leaves before its departure.
4. **No reordering**: ``release = max(release, previous release of the pair)``. Jitter
   therefore shows as delay variation, never as reordering (as on one physical path);
   with jitter comparable to the packet spacing this raises the mean delay a little.
   A change of ``delay_ms`` clears this clamp: a new delay models a new path, and
   packets sent after the change follow it at once, possibly overtaking packets still
   queued under the old delay (as after a real route change).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DEFAULT_QUEUE_MS = 50.0
DEFAULT_QUEUE_MIN_BYTES = 64 * 1024


@dataclass(frozen=True)
class PairParams:
    """Underlay properties of one direction (the emulator's view of ``LinkProps``)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0  # fraction 0..1
    rate_mbit: float = math.inf  # inf: not limited

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss must be a fraction in [0, 1], not {self.loss!r}")
        if not self.rate_mbit > 0.0:  # also rejects NaN
            raise ValueError(
                f"rate_mbit must be > 0 (inf or null: unlimited), not {self.rate_mbit!r}"
            )


class PairShaper:
    """Parameters, FIFO state and drop counters of one directed pair.

    Counters the shaper decides (``drop_loss``, ``drop_queue``) are kept here; the
    emulator adds the ones it decides (delivered packets and bytes, ``drop_down``,
    ``drop_error``) to the same object so one place holds a pair's statistics.
    """

    __slots__ = (
        "_delay_s",
        "_jitter_s",
        "_limit_bytes",
        "_loss",
        "_rate_bytes_s",
        "drop_down",
        "drop_error",
        "drop_loss",
        "drop_queue",
        "last_departure",
        "last_release",
        "params",
        "queue_min_bytes",
        "queue_ms",
        "rng",
        "sent_bytes",
        "sent_packets",
    )

    def __init__(
        self,
        params: PairParams,
        rng: random.Random,
        *,
        queue_ms: float = DEFAULT_QUEUE_MS,
        queue_min_bytes: int = DEFAULT_QUEUE_MIN_BYTES,
    ) -> None:
        self.rng = rng
        self.queue_ms = queue_ms
        self.queue_min_bytes = queue_min_bytes
        self.last_departure = -math.inf
        self.last_release = -math.inf
        self.sent_packets = 0
        self.sent_bytes = 0
        self.drop_loss = 0
        self.drop_queue = 0
        self.drop_down = 0
        self.drop_error = 0
        self.params = params
        self._delay_s = 0.0
        self._jitter_s = 0.0
        self._loss = 0.0
        self._rate_bytes_s = math.inf
        self._limit_bytes = math.inf
        self.set_params(params)

    def set_params(self, params: PairParams) -> None:
        """Apply new parameters to packets scheduled from now on (see module doc)."""
        if params.delay_ms != self.params.delay_ms:
            self.last_release = -math.inf
        self.params = params
        self._delay_s = params.delay_ms / 1000.0
        self._jitter_s = params.jitter_ms / 1000.0
        self._loss = params.loss
        self._rate_bytes_s = params.rate_mbit * 1e6 / 8.0
        if math.isinf(self._rate_bytes_s):
            self._limit_bytes = math.inf
        else:
            self._limit_bytes = max(
                float(self.queue_min_bytes), self._rate_bytes_s * self.queue_ms / 1000.0
            )

    @property
    def queue_limit_bytes(self) -> float:
        """Tail-drop limit of the rate queue (inf when the rate is unlimited)."""
        return self._limit_bytes

    def schedule(self, now: float, size: int) -> float | None:
        """Release time (seconds, same clock as ``now``) of a packet, or None if dropped."""
        t = now
        rate = self._rate_bytes_s
        if rate != math.inf:
            dep = self.last_departure
            if dep < now:
                dep = now
            if (dep - now) * rate + size > self._limit_bytes:
                self.drop_queue += 1
                return None
            dep += size / rate
            self.last_departure = dep
            t = dep
        if self._loss and self.rng.random() < self._loss:
            self.drop_loss += 1
            return None
        release = t + self._delay_s
        if self._jitter_s:
            release += self.rng.gauss(0.0, self._jitter_s)
            if release < t:
                release = t
        if release < self.last_release:
            release = self.last_release
        self.last_release = release
        return release

    def counters(self) -> dict[str, int]:
        """Delivered and dropped counts, as reported by the emulator's ``stats``."""
        return {
            "packets": self.sent_packets,
            "bytes": self.sent_bytes,
            "drop_loss": self.drop_loss,
            "drop_queue": self.drop_queue,
            "drop_down": self.drop_down,
            "drop_error": self.drop_error,
        }
