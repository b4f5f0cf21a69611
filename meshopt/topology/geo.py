"""Great-circle distance and the propagation delay it implies.

Light in fibre travels at about two thirds of c, so every 100 km of path adds
roughly 0.5 ms one way (1 ms of RTT). Real paths are longer than the great
circle; callers that want realism multiply by an inflation factor.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

EARTH_RADIUS_KM = 6371.0088  # mean radius (IUGG)
SPEED_OF_LIGHT_KM_PER_MS = 299_792.458 / 1000.0
FIBRE_KM_PER_MS = SPEED_OF_LIGHT_KM_PER_MS * 2.0 / 3.0  # ~199.9 km per ms


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance in km between two points given in degrees."""
    return float(
        _haversine_km(np.array([lat1]), np.array([lon1]), np.array([lat2]), np.array([lon2]))[0]
    )


def distance_matrix_km(lat: FloatArray, lon: FloatArray) -> FloatArray:
    """All-pairs great-circle distances (km); vectorised because meshes reach 1,000s of nodes."""
    lat = np.asarray(lat, dtype=np.float64)
    lon = np.asarray(lon, dtype=np.float64)
    d = _haversine_km(lat[:, None], lon[:, None], lat[None, :], lon[None, :])
    np.fill_diagonal(d, 0.0)
    return d


def fibre_delay_ms(km: float | FloatArray) -> FloatArray:
    """One-way propagation delay over ``km`` of fibre (no routing detours, no queueing)."""
    return np.asarray(km, dtype=np.float64) / FIBRE_KM_PER_MS


def geo_delay_ms(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """One-way fibre delay along the great circle: the physical lower bound for a pair."""
    return great_circle_km(lat1, lon1, lat2, lon2) / FIBRE_KM_PER_MS


def mean_position(lats: FloatArray, lons: FloatArray) -> tuple[float, float]:
    """Centre of points on the sphere (unit-vector mean), so averaging across ±180° works."""
    phi, lam = np.radians(lats), np.radians(lons)
    x = float(np.mean(np.cos(phi) * np.cos(lam)))
    y = float(np.mean(np.cos(phi) * np.sin(lam)))
    z = float(np.mean(np.sin(phi)))
    if x * x + y * y + z * z < 1e-24:  # antipodal points: no meaningful centre
        return float(np.mean(lats)), float(np.mean(lons))
    lat = float(np.degrees(np.arctan2(z, np.hypot(x, y))))
    lon = float(np.degrees(np.arctan2(y, x)))
    return lat, lon


def _haversine_km(
    lat1: FloatArray, lon1: FloatArray, lat2: FloatArray, lon2: FloatArray
) -> FloatArray:
    phi1, phi2 = np.radians(lat1), np.radians(lat2)
    dphi = phi2 - phi1
    dlam = np.radians(lon2 - lon1)
    h = np.sin(dphi / 2) ** 2 + np.cos(phi1) * np.cos(phi2) * np.sin(dlam / 2) ** 2
    return np.asarray(2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0))))
