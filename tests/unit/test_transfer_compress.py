"""The compression decision: min(compress, decompress, ratio x link) against the link."""

from __future__ import annotations

from meshopt.transfer.compress import (
    Adaptive,
    LevelStats,
    calibrate,
    choose_level,
)

from .test_transfer_common import random_bytes, text_bytes

MB = 1e6
# Shapes measured on this machine's stdlib tarball (compress MB/s, ratio).
TEXT = [
    LevelStats(1, 320 * MB, 650 * MB, 3.26),
    LevelStats(3, 185 * MB, 570 * MB, 3.61),
    LevelStats(9, 51 * MB, 760 * MB, 4.16),
    LevelStats(12, 23 * MB, 750 * MB, 4.21),
    LevelStats(19, 2 * MB, 560 * MB, 4.81),
]


def test_incompressible_data_is_sent_raw() -> None:
    stats = [LevelStats(1, 900 * MB, 3000 * MB, 1.0), LevelStats(3, 500 * MB, 3000 * MB, 1.001)]
    d = choose_level(6 * MB, stats)
    assert d.level is None and d.reason == "incompressible"


def test_link_faster_than_compressor_is_sent_raw() -> None:
    d = choose_level(1250 * MB, TEXT)  # 10 Gbit/s: even level 1 cannot keep up
    assert d.level is None and "faster than the compressor" in d.reason


def test_slow_link_and_text_compresses_hard_but_not_slower_than_the_link() -> None:
    d = choose_level(6.25 * MB, TEXT)  # 50 Mbit/s
    # Ranked with the CPU at half speed: level 9 min(25.5, 380, 4.16 x 6.25 = 26) beats
    # 3 (22.6), 12 (11.5) and 19 (1).
    assert d.level == 9
    assert abs(d.expected_bps - 4.16 * 6.25 * MB) < 1  # reported at the measured speed


def test_faster_link_picks_a_faster_level() -> None:
    d = choose_level(100 * MB, TEXT)  # 800 Mbit/s
    # level 1: min(320, 650, 326) = 320 MB/s; level 3: 185; level 9: 51.
    assert d.level == 1 and d.expected_bps == 320 * MB
    # 20 MB/s: level 3 min(185/2, 72.2) beats 1 (65.2) and 9 (51/2: ranked at half speed).
    assert choose_level(20 * MB, TEXT).level == 3


def test_rule_is_the_minimum_of_the_three_stages() -> None:
    s = LevelStats(5, 40 * MB, 30 * MB, 4.0)
    assert s.effective_bps(5 * MB) == 20 * MB  # ratio x link
    assert s.effective_bps(10 * MB) == 30 * MB  # decompressor
    assert LevelStats(5, 25 * MB, 30 * MB, 4.0).effective_bps(10 * MB) == 25 * MB


def test_unknown_link_starts_at_the_default_level() -> None:
    assert choose_level(None, TEXT).level == 3
    assert choose_level(None, [LevelStats(1, 1e9, 1e9, 1.0)]).level is None


def test_ratio_barely_above_one_does_not_pay() -> None:
    # 1.04 x link is below the 5 % margin: the CPU is not worth it.
    d = choose_level(10 * MB, [LevelStats(1, 500 * MB, 900 * MB, 1.04)])
    assert d.level is None and "ratio" in d.reason


def test_calibrate_on_real_data() -> None:
    text = [text_bytes(64 * 1024, seed=i) for i in range(4)]
    stats = calibrate(text, 6.25 * MB, levels=(1, 3))
    assert [s.level for s in stats] == [1, 3] and all(s.ratio > 1.5 for s in stats)
    noise = calibrate([random_bytes(256 * 1024)], 6.25 * MB)
    assert len(noise) == 1 and noise[0].ratio < 1.01  # stops at the first level


def test_adaptive_turns_off_when_the_data_stops_compressing() -> None:
    a = Adaptive(TEXT, 6.25 * MB)
    assert a.decide().level == 9
    a.observe_batch(9, raw=4_000_000, packed=4_000_100, seconds=0.05)  # a random stretch
    assert a.decide().level is None
    # A level-1 probe on text again brings compression back.
    a.observe_probe(LevelStats(1, 300 * MB, 600 * MB, 3.3))
    assert a.decide().level is not None


def test_measured_link_rate_moves_the_level() -> None:
    a = Adaptive(TEXT, None)
    assert a.decide().level == 3
    for _ in range(8):
        a.observe_link(2000 * MB)
    assert a.decide().level is None  # the compressor would slow a 16 Gbit/s link
    fixed = Adaptive(TEXT, 6.25 * MB)
    fixed.observe_link(2000 * MB)  # a rate the caller fixed is kept
    assert fixed.decide().level == 9


def test_a_settled_level_is_kept_against_a_small_gain() -> None:
    # At 50 Mbit/s level 9 ranks min(25.5, 26) = 25.5 MB/s; level 3 ranks 22.6.
    a = Adaptive(TEXT, 6.25 * MB)
    assert a.decide().level == 9
    # Level 9 turns out slower (speeds x 0.875 after smoothing): ranked 22.3; level 3
    # (22.6) is better, but by less than 3 %: stay (a switch restarts the stream).
    a.observe_batch(9, raw=4_000_000, packed=961_538, seconds=4_000_000 / (0.75 * 51 * MB))
    assert choose_level(a.link_bps, list(a.stats.values())).level == 3
    assert a.decide().level == 9 and "kept" in a.history[-1].reason
    # Much slower (the CPU is busy): level 3 now promises clearly more.
    for _ in range(4):
        a.observe_batch(9, raw=4_000_000, packed=961_538, seconds=4_000_000 / (0.2 * 51 * MB))
    assert a.decide().level == 3


def test_slow_batches_that_kept_the_link_busy_do_not_lower_the_level() -> None:
    a = Adaptive(TEXT, 6.25 * MB)
    assert a.decide().level == 9
    for _ in range(4):
        a.observe_batch(9, 4_000_000, 961_538, 4_000_000 / (0.2 * 51 * MB), starved=False)
    assert a.decide().level == 9


def test_slower_levels_are_climbed_one_at_a_time_and_not_while_starved() -> None:
    a = Adaptive(TEXT, 100 * MB)  # 800 Mbit/s: level 1
    assert a.decide().level == 1
    a.link_bps = 6.25 * MB  # the link turns out slow: level 9 would be best
    a.starved = True
    assert a.decide().level == 1  # the link waited for the compressor: no climbing
    a.starved = False
    assert a.decide().level == 3
    assert a.decide().level == 9


def test_first_measured_link_rate_is_not_held_back() -> None:
    a = Adaptive(TEXT, None)
    assert a.decide().level == 3  # provisional: no link rate yet
    a.observe_link(6.25 * MB)
    assert a.decide().level == 9  # 13 % more than level 3 would not pass the gain; it is free


def test_levels_within_two_percent_count_as_equal_and_the_fastest_wins() -> None:
    # Both keep up with a 50 Mbit/s link at half CPU; 9 packs 0.7 % tighter, 6 is faster.
    stats = [LevelStats(6, 145 * MB, 1300 * MB, 7.17), LevelStats(9, 100 * MB, 1300 * MB, 7.22)]
    assert choose_level(6.25 * MB, stats).level == 6


def test_fast_stretches_do_not_ratchet_the_speed_estimates_up() -> None:
    a = Adaptive(TEXT, 6.25 * MB)
    a.observe_batch(9, 4_000_000, 961_538, 4_000_000 / (3 * 51 * MB), starved=False)
    assert a.speed_f == 2.0  # really faster: believed (half way)
    for _ in range(8):  # slower than calibrated, but the link never waited
        a.observe_batch(9, 4_000_000, 961_538, 4_000_000 / (0.5 * 51 * MB), starved=False)
    assert abs(a.speed_f - 1.0) < 0.01  # back to the calibration, not below, not stuck high
