"""Great-circle distances against known city pairs, and the fibre delay rule of thumb."""

from __future__ import annotations

import numpy as np
import pytest

from meshopt.topology.geo import (
    distance_matrix_km,
    fibre_delay_ms,
    geo_delay_ms,
    great_circle_km,
    mean_position,
)

NEW_YORK = (40.7128, -74.0060)
LOS_ANGELES = (34.0522, -118.2437)
LONDON = (51.5074, -0.1278)
PARIS = (48.8566, 2.3522)


def test_known_distances() -> None:
    assert great_circle_km(*NEW_YORK, *LOS_ANGELES) == pytest.approx(3936, rel=0.01)
    assert great_circle_km(*LONDON, *PARIS) == pytest.approx(344, rel=0.01)
    assert great_circle_km(0, 0, 0, 180) == pytest.approx(np.pi * 6371.0, rel=0.001)
    assert great_circle_km(*PARIS, *PARIS) == 0.0


def test_fibre_rule_of_thumb() -> None:
    # two thirds of c: ~0.5 ms one way per 100 km, ~1 ms RTT per 100 km
    assert float(fibre_delay_ms(100.0)) == pytest.approx(0.5, rel=0.01)
    assert 2 * geo_delay_ms(*NEW_YORK, *LOS_ANGELES) == pytest.approx(39.4, rel=0.02)


def test_matrix_matches_scalar_and_is_symmetric() -> None:
    lat = np.array([NEW_YORK[0], LOS_ANGELES[0], LONDON[0], PARIS[0]])
    lon = np.array([NEW_YORK[1], LOS_ANGELES[1], LONDON[1], PARIS[1]])
    d = distance_matrix_km(lat, lon)
    assert np.allclose(d, d.T)
    assert np.all(np.diag(d) == 0)
    assert d[2, 3] == pytest.approx(great_circle_km(*LONDON, *PARIS))


def test_mean_position_across_the_antimeridian() -> None:
    lat, lon = mean_position(np.array([10.0, 10.0]), np.array([179.0, -179.0]))
    assert lat == pytest.approx(10.0, abs=0.01)
    assert abs(lon) == pytest.approx(180.0, abs=0.01)


def test_mean_position_of_neighbours() -> None:
    lat, lon = mean_position(np.array([50.0, 52.0]), np.array([8.0, 10.0]))
    assert lat == pytest.approx(51.0, abs=0.05)
    assert lon == pytest.approx(9.0, abs=0.05)
