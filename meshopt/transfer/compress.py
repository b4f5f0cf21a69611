"""When to compress, and how hard: a pure decision plus the measurements that feed it.

Compression pays only while min(compress speed, decompress speed, ratio x link rate)
exceeds the link rate (DESIGN.md): the compressor runs in its own thread beside the
socket, so the slowest stage sets the pace. The sender re-decides per batch of chunks
from the measured link rate and the speed and ratio it observes on the data itself.
A level change starts a new zstd stream, which forgets the long-distance window, so a
settled level is kept unless another one promises clearly more (SWITCH_GAIN).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import zstandard as zstd

LEVELS = (1, 3, 6, 9, 12, 15, 19)
DEFAULT_LEVEL = 3  # zstd's own default: used until the link rate is known
MIN_RATIO = 1.03  # below this the data is treated as incompressible
CPU_HEADROOM = 0.5  # rank levels as if the CPU were half as fast (see choose_level)
MARGIN = 1.05  # compression must beat sending raw by 5 % to be worth the CPU
# Leave a settled level only for one ranked this much faster: noise in the link and speed
# estimates otherwise makes the level flap, and every switch restarts the stream (which
# costs ~50 KB of ratio here, so the bar is low; calibration on a 1 MiB sample also
# understates what slower levels gain over a long window).
SWITCH_GAIN = 1.03
# Levels ranked within this of the best count as equal and the fastest of them wins: a
# small sample barely separates slow levels' ratios, and CPU left over is safety.
TIE = 0.02
# Long-distance matching over a 128 MiB window: measured on the stdlib tarball here,
# level 3 goes from ratio 4.6 to 6.6 at about the same speed (the decompressor's default
# window limit is this size, so receivers need no setting).
WINDOW_LOG = 27


def compressor(level: int) -> zstd.ZstdCompressor:
    params = zstd.ZstdCompressionParameters.from_level(
        level, enable_ldm=True, window_log=WINDOW_LOG
    )
    return zstd.ZstdCompressor(compression_params=params)


@dataclass(frozen=True)
class LevelStats:
    """What one zstd level does to this data on this machine (bytes per second)."""

    level: int
    compress_bps: float
    decompress_bps: float
    ratio: float

    def effective_bps(self, link_bps: float, cpu: float = 1.0) -> float:
        """File bytes per second with this level: the slowest pipeline stage.

        ``cpu`` scales the compressor's and decompressor's speeds (a share of the CPU).
        """
        return min(cpu * self.compress_bps, cpu * self.decompress_bps, self.ratio * link_bps)


@dataclass(frozen=True)
class Decision:
    level: int | None  # None: send raw
    expected_bps: float  # file bytes per second the choice should give (0: unknown)
    reason: str


def choose_level(
    link_bps: float | None,
    stats: Sequence[LevelStats],
    *,
    min_ratio: float = MIN_RATIO,
    margin: float = MARGIN,
) -> Decision:
    """The level that delivers file bytes fastest, or None where raw is as fast.

    ``link_bps`` None (not yet measured) gives zstd's default level on compressible
    data, so the first batch neither wastes the link nor stalls on a slow level.
    """
    usable = [s for s in stats if s.ratio >= min_ratio]
    if not usable:
        return Decision(None, link_bps or 0.0, "incompressible")
    if link_bps is None:
        default = next((s for s in usable if s.level == DEFAULT_LEVEL), usable[0])
        return Decision(default.level, 0.0, "link rate not yet measured")
    # Rank with the CPU stages at CPU_HEADROOM of their measured speed: the estimate
    # comes from a small sample, and a busy CPU slows compression, never the link.
    top = max(s.effective_bps(link_bps, CPU_HEADROOM) for s in usable)
    near = [s for s in usable if s.effective_bps(link_bps, CPU_HEADROOM) >= (1 - TIE) * top]
    best = max(near, key=lambda s: s.compress_bps)
    rate = best.effective_bps(link_bps)
    if rate < margin * link_bps:
        fastest = max(usable, key=lambda s: s.compress_bps)
        if min(fastest.compress_bps, fastest.decompress_bps) < margin * link_bps:
            return Decision(None, link_bps, "link faster than the compressor")
        return Decision(None, link_bps, "ratio too low to pay")
    return Decision(best.level, rate, f"level {best.level}: ~{rate / 1e6:.1f} MB/s")


def measure_level(sample: Sequence[bytes], level: int) -> LevelStats:
    """Compress ``sample`` (chunks, one stream, block flush per chunk) and decompress it.

    The first chunk is not timed: it pays for setting up the stream (tables of several
    MiB for the long window), a one-off cost that dwarfs a small sample's real work.
    """
    raw = sum(len(c) for c in sample)
    timed = raw - len(sample[0]) if len(sample) > 1 else raw
    cobj = compressor(level).compressobj()
    parts = []
    t0 = time.perf_counter()
    for k, c in enumerate(sample):
        parts.append(cobj.compress(c) + cobj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
        if k == 0 and len(sample) > 1:
            t0 = time.perf_counter()
    t1 = time.perf_counter()
    dobj = zstd.ZstdDecompressor().decompressobj()
    t2 = time.perf_counter()
    for k, p in enumerate(parts):
        dobj.decompress(p)
        if k == 0 and len(parts) > 1:
            t2 = time.perf_counter()
    t3 = time.perf_counter()
    packed = max(1, sum(len(p) for p in parts))
    return LevelStats(
        level,
        timed / max(t1 - t0, 1e-6),
        timed / max(t3 - t2, 1e-6),
        raw / packed,
    )


def calibrate(
    sample: Sequence[bytes], link_bps: float | None, levels: Sequence[int] = LEVELS
) -> list[LevelStats]:
    """Measure levels from fastest to slowest (best of two runs); stop once one is slower
    than the link.

    Higher levels only get slower, so measuring past that point wastes time.
    """
    out: list[LevelStats] = []
    for level in levels:
        s = measure_level(sample, level)
        if s.ratio >= MIN_RATIO and (link_bps is None or s.compress_bps >= link_bps):
            # The faster of two runs: a busy machine only ever makes a run slower.
            b = measure_level(sample, level)
            s = replace(
                s,
                compress_bps=max(s.compress_bps, b.compress_bps),
                decompress_bps=max(s.decompress_bps, b.decompress_bps),
            )
        out.append(s)
        if s.ratio < MIN_RATIO:
            break  # incompressible: slower levels will not find more
        if link_bps is not None and s.compress_bps < link_bps:
            break
    return out


class Adaptive:
    """Level choice during a transfer: calibration scaled by what batches really did."""

    def __init__(self, stats: Sequence[LevelStats], link_bps: float | None) -> None:
        self.base = {s.level: s for s in stats}  # the calibration
        self.ratio_f = 1.0  # this data against the calibration sample
        self.speed_f = 1.0  # this data and CPU against the calibration
        self.stats = dict(self.base)  # the calibration scaled by both
        self.link_bps = link_bps
        self.fixed_link = link_bps is not None
        self.history: list[Decision] = []
        self._settled: int | None = None  # the level last chosen with a known link rate
        self.starved = False  # the last batch left the link waiting for the compressor

    def decide(self) -> Decision:
        d = self._keep(choose_level(self.link_bps, list(self.stats.values())))
        self._settled = d.level if self.link_bps is not None else None
        self.history.append(d)
        return d

    def _keep(self, d: Decision) -> Decision:
        """The settled level instead of ``d`` unless ``d`` ranks SWITCH_GAIN faster.

        Slower levels are climbed one at a time and never while the link waits for the
        compressor (a receiver or CPU that holds the link back looks like a slow link,
        and chasing it with ever slower levels would spiral). Going raw is never held
        back, nor is a level picked before the link rate was known.
        """
        cur = self.stats.get(self._settled) if self._settled is not None else None
        if cur is None or d.level is None or d.level == cur.level or self.link_bps is None:
            return d
        link = self.link_bps
        new = self.stats[d.level]
        if new.level > cur.level:
            up = min(lv for lv in self.stats if lv > cur.level)
            new = self.stats[up] if not self.starved else cur
        if new.level != cur.level and new.effective_bps(
            link, CPU_HEADROOM
        ) >= SWITCH_GAIN * cur.effective_bps(link, CPU_HEADROOM):
            rate = new.effective_bps(link)
            return Decision(new.level, rate, f"level {new.level}: ~{rate / 1e6:.1f} MB/s")
        rate = cur.effective_bps(link)
        return Decision(cur.level, rate, f"level {cur.level} kept: ~{rate / 1e6:.1f} MB/s")

    def observe_link(self, bps: float) -> None:
        """A measured link rate (smoothed); ignored when the caller fixed the rate."""
        if self.fixed_link or bps <= 0:
            return
        self.link_bps = bps if self.link_bps is None else 0.5 * self.link_bps + 0.5 * bps

    def observe_batch(
        self, level: int, raw: int, packed: int, seconds: float, starved: bool = True
    ) -> None:
        """Scale every level's ratio and speed by how this level did against calibration.

        ``starved``: the socket ran out of data while this batch was being compressed.
        Otherwise the compressor kept up, and a slow-looking batch (a thread that waited
        for the CPU or the GIL while it had time to spare) does not lower the speeds.
        """
        cal = self.base.get(level)
        if cal is None or raw == 0 or packed == 0:
            return
        self.starved = starved
        ratio = raw / packed
        r_obs = ratio / cal.ratio
        s_obs = raw / max(seconds, 1e-6) / cal.compress_bps
        if not starved:
            s_obs = max(1.0, s_obs)  # against the calibration: no ratchet upwards
        # Smooth: one odd batch moves the estimates half way; incompressible data is
        # believed at once (the next batch goes raw).
        self.ratio_f = 0.5 * self.ratio_f + 0.5 * r_obs if ratio >= MIN_RATIO else r_obs
        self.speed_f = 0.5 * self.speed_f + 0.5 * s_obs
        self._rescale()

    def _rescale(self) -> None:
        self.stats = {
            lv: replace(s, ratio=s.ratio * self.ratio_f, compress_bps=s.compress_bps * self.speed_f)
            for lv, s in self.base.items()
        }

    def observe_probe(self, probe: LevelStats) -> None:
        """A level-1 probe while sending raw: compressible again re-opens calibration."""
        cal = self.base.get(probe.level)
        if cal is None:
            self.base[probe.level] = replace(probe, ratio=probe.ratio / self.ratio_f)
        else:
            self.ratio_f = probe.ratio / cal.ratio if cal.ratio > 0 else 1.0
        self._rescale()
