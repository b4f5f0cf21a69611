"""The tunnel calibration's arithmetic (the lab test drives it through real tunnels)."""

from __future__ import annotations

import pytest

from meshopt.lab.calibrate import MAX_LATENCY_US, next_latency_us


def test_a_path_reading_high_gets_more_taken_off() -> None:
    # 10.6 ms at 5 ms one way: 0.3 ms a direction more than the 250 µs allowance
    assert next_latency_us(0.6, 250.0) == pytest.approx(550.0)


def test_a_path_reading_low_gets_less_taken_off() -> None:
    assert next_latency_us(-0.2, 250.0) == pytest.approx(150.0)
    assert next_latency_us(0.0, 250.0) == pytest.approx(250.0)


def test_the_allowance_stays_within_its_bounds() -> None:
    assert next_latency_us(-1.0, 250.0) == 0.0
    assert next_latency_us(20.0, 250.0) == MAX_LATENCY_US
