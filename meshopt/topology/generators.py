"""Synthetic topologies: seeded, deterministic, and shaped to exercise the route engine.

``geo_mesh`` imitates the Internet (paths longer than the great circle, some
badly detoured, so relaying often wins); ``ring`` is the control case where
the direct tunnel is always best; ``hub_and_spoke`` and ``two_regions`` are the
textbook shapes operators ask about.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from meshopt.errors import InputError, TopologyError
from meshopt.topology.geo import distance_matrix_km, fibre_delay_ms
from meshopt.topology.model import BoolMatrix, FloatMatrix, Node, Topology
from meshopt.units import parse_loss, parse_time_ms

MAX_NODES = 5000  # five dense n×n float matrices: 5,000 nodes is already ~1 GB

# Metro areas where mesh nodes cluster: (code, lat, lon, relative weight).
CENTRES: tuple[tuple[str, float, float, float], ...] = (
    ("fra", 50.11, 8.68, 3.0),
    ("ams", 52.37, 4.90, 2.0),
    ("lon", 51.51, -0.13, 3.0),
    ("par", 48.86, 2.35, 2.0),
    ("waw", 52.23, 21.01, 1.0),
    ("nyc", 40.71, -74.01, 3.0),
    ("ash", 39.04, -77.49, 2.0),
    ("chi", 41.88, -87.63, 1.5),
    ("dal", 32.78, -96.80, 1.0),
    ("sfo", 37.77, -122.42, 2.5),
    ("sao", -23.55, -46.63, 1.0),
    ("jnb", -26.20, 28.05, 0.5),
    ("bom", 19.08, 72.88, 1.0),
    ("sin", 1.35, 103.82, 1.5),
    ("tyo", 35.68, 139.69, 2.0),
    ("syd", -33.87, 151.21, 1.0),
)
KM_PER_DEGREE = 111.2


def geo_mesh(
    n: int,
    seed: int = 0,
    *,
    bad_fraction: float = 0.1,
    lossy_fraction: float = 0.1,
    spread_km: float = 300.0,
) -> Topology:
    """A full mesh over the globe whose direct paths are inflated like real Internet routes.

    Most pairs get 1.2-3x the great-circle fibre delay (median 1.5x); ``bad_fraction``
    of them get 2-5x (policy routing, detours through distant exchanges). That
    breaks the triangle inequality about as often as measured RTTs do: with the
    defaults a one-relay path beats about half the direct paths and beats a
    quarter of them by more than 10%, close to the RIPE Atlas country matrix.
    """
    _check(n >= 2 and n <= MAX_NODES, "geo", f"n must be 2..{MAX_NODES}, got {n}")
    _check(0 <= bad_fraction <= 1, "geo", "bad must be a fraction 0..1")
    _check(0 <= lossy_fraction <= 1, "geo", "lossy must be a fraction 0..1")
    _check(0 <= spread_km <= 5000, "geo", "spread_km must be 0..5000")
    rng = _rng("geo", seed)
    centre, lat, lon = _place(rng, n, spread_km)
    fibre = fibre_delay_ms(distance_matrix_km(lat, lon))
    normal = np.clip(1.2 + rng.lognormal(math.log(0.3), 0.4, (n, n)), 1.2, 3.0)
    bad = rng.uniform(2.0, 5.0, (n, n))
    inflation = _sym(np.where(rng.random((n, n)) < bad_fraction, bad, normal))
    access = rng.uniform(0.3, 3.0, n)  # last-mile one-way delay at each end
    asym = rng.uniform(0.97, 1.03, (n, n))  # forward and return paths differ a little
    delay = (fibre * inflation + access[:, None] + access[None, :]) * asym
    jitter = delay * _sym(rng.uniform(0.01, 0.05, (n, n)))
    lossy = _sym(rng.random((n, n))) < lossy_fraction
    loss = np.where(lossy, _sym(rng.uniform(0.001, 0.02, (n, n))), 0.0)
    nodes = _geo_nodes(centre, lat, lon)
    name = f"geo-n{n}-s{seed}"
    return _topology(name, nodes, delay, jitter=jitter, loss=loss)


def ring(
    n: int,
    delay_ms: float = 10.0,
    *,
    tunnels: str = "full",
    seed: int = 0,
    spread: float = 0.0,
) -> Topology:
    """Nodes on a ring backbone; a pair's delay is the shorter way round.

    The delays form a metric (shortest paths on the ring), so no relay ever beats
    a direct tunnel: the control case. ``tunnels="ring"`` keeps only neighbour
    tunnels, so every non-neighbour pair must relay. ``spread`` varies each ring
    segment by up to ±spread (seeded) and keeps the metric property.
    """
    _check(3 <= n <= MAX_NODES, "ring", f"n must be 3..{MAX_NODES}, got {n}")
    _check(tunnels in ("full", "ring"), "ring", "tunnels must be 'full' or 'ring'")
    _check_delays("ring", delay_ms)
    _check_spread("ring", spread)
    rng = _rng("ring", seed)
    segment = delay_ms * rng.uniform(1 - spread, 1 + spread, n)  # segment k joins k and k+1
    pos = np.concatenate(([0.0], np.cumsum(segment)))  # distance along the ring
    clockwise = np.abs(pos[:n, None] - pos[None, :n])
    delay = np.minimum(clockwise, pos[n] - clockwise)
    tun = None
    if tunnels == "ring":
        idx = np.arange(n)
        tun = np.zeros((n, n), dtype=bool)
        tun[idx, (idx + 1) % n] = tun[(idx + 1) % n, idx] = True
    nodes = [_node(f"r{k + 1}", k) for k in range(n)]
    return _topology(f"ring-n{n}", nodes, delay, tunnels=tun)


def hub_and_spoke(
    n: int,
    delay_ms: float = 20.0,
    *,
    spoke_delay_ms: float | None = None,
    seed: int = 0,
    spread: float = 0.0,
) -> Topology:
    """One hub and n-1 spokes with tunnels only to the hub: spoke traffic must relay.

    The spoke-to-spoke underlay (which carries no tunnel) defaults to the sum of
    the two spokes' hub delays.
    """
    _check(2 <= n <= MAX_NODES, "hub", f"n must be 2..{MAX_NODES}, got {n}")
    _check_delays("hub", delay_ms, 0.0 if spoke_delay_ms is None else spoke_delay_ms)
    _check_spread("hub", spread)
    rng = _rng("hub", seed)
    to_hub = np.concatenate(([0.0], delay_ms * rng.uniform(1 - spread, 1 + spread, n - 1)))
    delay = to_hub[:, None] + to_hub[None, :]
    if spoke_delay_ms is not None:
        delay[1:, 1:] = spoke_delay_ms
    tun = np.zeros((n, n), dtype=bool)
    tun[0, 1:] = tun[1:, 0] = True
    nodes = [_node("hub", 0, site="hub")] + [_node(f"s{k}", k) for k in range(1, n)]
    return _topology(f"hub-n{n}", nodes, delay, tunnels=tun)


def two_regions(
    n: int,
    intra_ms: float = 5.0,
    inter_ms: float = 80.0,
    *,
    gateways: int = 1,
    gateway_ms: float | None = None,
    seed: int = 0,
    spread: float = 0.0,
) -> Topology:
    """Two clusters joined by slow paths, except between a few well-peered gateways.

    Gateways (the first ``gateways`` nodes of each region, a1 and b1 by default)
    reach each other in ``gateway_ms`` (default inter/4); everyone else crossing
    regions takes ``inter_ms``, so x -> a1 -> b1 -> y beats the direct tunnel.
    """
    _check(4 <= n <= MAX_NODES, "two-regions", f"n must be 4..{MAX_NODES}, got {n}")
    size_a, size_b = (n + 1) // 2, n // 2
    _check(1 <= gateways <= size_b, "two-regions", f"gateways must be 1..{size_b}")
    _check_spread("two-regions", spread)
    gw_ms = inter_ms / 4 if gateway_ms is None else gateway_ms
    _check_delays("two-regions", intra_ms, inter_ms, gw_ms)
    region = np.array([0] * size_a + [1] * size_b)
    gate = np.array([k < gateways for k in range(size_a)] + [k < gateways for k in range(size_b)])
    cross = region[:, None] != region[None, :]
    both_gw = gate[:, None] & gate[None, :]
    one_gw = gate[:, None] ^ gate[None, :]
    delay = np.where(cross, inter_ms, intra_ms)
    delay = np.where(cross & one_gw, gw_ms + intra_ms, delay)
    delay = np.where(cross & both_gw, gw_ms, delay)
    rng = _rng("two-regions", seed)
    delay = delay * _sym(rng.uniform(1 - spread, 1 + spread, (n, n)))
    nodes = [
        _node(f"{'ab'[r]}{k + 1}", i, site=f"region-{'ab'[r]}")
        for i, (r, k) in enumerate(
            [(0, k) for k in range(size_a)] + [(1, k) for k in range(size_b)]
        )
    ]
    return _topology(f"two-regions-n{n}", nodes, delay)


# --- spec strings ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    kwarg: str
    parse: Callable[[str], object]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InputError(f"bad integer {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"bad number {text!r}") from None
    if not math.isfinite(value):
        raise InputError(f"bad number {text!r}")
    return value


def _ms(text: str) -> float:
    return parse_time_ms(text)


def _fraction(text: str) -> float:
    return parse_loss(text, "fraction")


def _text(text: str) -> str:
    return text


_SEED = {"seed": _Param("seed", _int), "spread": _Param("spread", _fraction)}
GENERATORS: dict[str, tuple[Callable[..., Topology], dict[str, _Param]]] = {
    "geo": (
        geo_mesh,
        {
            "n": _Param("n", _int),
            "seed": _Param("seed", _int),
            "bad": _Param("bad_fraction", _fraction),
            "lossy": _Param("lossy_fraction", _fraction),
            "spread_km": _Param("spread_km", _float),
        },
    ),
    "ring": (
        ring,
        {
            "n": _Param("n", _int),
            "delay": _Param("delay_ms", _ms),
            "tunnels": _Param("tunnels", _text),
        }
        | _SEED,
    ),
    "hub": (
        hub_and_spoke,
        {
            "n": _Param("n", _int),
            "delay": _Param("delay_ms", _ms),
            "spoke_delay": _Param("spoke_delay_ms", _ms),
        }
        | _SEED,
    ),
    "two-regions": (
        two_regions,
        {
            "n": _Param("n", _int),
            "intra": _Param("intra_ms", _ms),
            "inter": _Param("inter_ms", _ms),
            "gateways": _Param("gateways", _int),
            "gateway": _Param("gateway_ms", _ms),
        }
        | _SEED,
    ),
}


def generate(spec: str, *, seed: int | None = None) -> Topology:
    """Build from ``gen:KIND:key=value,...``; a seed in the spec wins over ``seed``."""
    body = spec.removeprefix("gen:")
    kind, _, args = body.partition(":")
    kind = kind.strip().lower().replace("_", "-")
    if kind not in GENERATORS:
        raise TopologyError(
            f"unknown generator {kind!r} (use {', '.join(GENERATORS)})", source=spec
        )
    func, params = GENERATORS[kind]
    kwargs = _parse_args(kind, args, params, spec)
    if "n" not in kwargs:
        raise TopologyError(f"generator {kind!r}: needs n=<nodes>", source=spec)
    if seed is not None:
        kwargs.setdefault("seed", seed)
    try:
        topo = func(**kwargs)
    except InputError as e:
        raise TopologyError(e.message, source=spec) from None
    topo.source = spec
    return topo


def _parse_args(kind: str, args: str, params: dict[str, _Param], spec: str) -> dict[str, object]:
    kwargs: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in args.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in params:
            what = (
                f"unknown parameter {key!r}" if eq else f"bad parameter {item!r}: write key=value"
            )
            known = ", ".join(params)
            raise TopologyError(f"generator {kind!r}: {what} (use {known})", source=spec)
        param = params[key]
        if param.kwarg in kwargs:
            raise TopologyError(f"generator {kind!r}: {key} given twice", source=spec)
        try:
            kwargs[param.kwarg] = param.parse(value.strip())
        except InputError as e:
            raise TopologyError(f"generator {kind!r}: {key}: {e.message}", source=spec) from None
    return kwargs


# --- helpers ---------------------------------------------------------------------------


def _check(ok: bool, kind: str, message: str) -> None:
    if not ok:
        raise TopologyError(f"generator {kind!r}: {message}")


def _check_spread(kind: str, spread: float) -> None:
    _check(0 <= spread < 1, kind, f"spread must be a fraction 0..1, got {spread}")


def _check_delays(kind: str, *delays_ms: float) -> None:
    for d in delays_ms:
        _check(math.isfinite(d) and d >= 0, kind, f"delays must be finite and >= 0, got {d}")


def _rng(kind: str, seed: int) -> np.random.Generator:
    _check(isinstance(seed, int) and seed >= 0, kind, f"seed must be an integer >= 0, got {seed}")
    return np.random.default_rng(seed)


def _sym(m: FloatMatrix) -> FloatMatrix:
    """The upper triangle mirrored: one random draw per unordered pair."""
    upper = np.triu(m, 1)
    return np.asarray(upper + upper.T + np.diag(np.diag(m)), dtype=np.float64)


def _place(
    rng: np.random.Generator, n: int, spread_km: float
) -> tuple[list[int], FloatMatrix, FloatMatrix]:
    weights = np.array([c[3] for c in CENTRES])
    centre = rng.choice(len(CENTRES), size=n, p=weights / weights.sum())
    base_lat = np.array([CENTRES[c][1] for c in centre])
    base_lon = np.array([CENTRES[c][2] for c in centre])
    north, east = rng.normal(0.0, spread_km, (2, n))
    lat = np.clip(base_lat + north / KM_PER_DEGREE, -89.0, 89.0)
    lon = base_lon + east / (KM_PER_DEGREE * np.cos(np.radians(lat)))
    lon = (lon + 180.0) % 360.0 - 180.0
    return centre.tolist(), np.round(lat, 4), np.round(lon, 4)


def _geo_nodes(centre: list[int], lat: FloatMatrix, lon: FloatMatrix) -> list[Node]:
    counts: dict[int, int] = {}
    nodes = []
    for i, c in enumerate(centre):
        counts[c] = counts.get(c, 0) + 1
        code = CENTRES[c][0]
        nodes.append(
            Node(
                f"{code}{counts[c]}",
                address=_address(i),
                site=code,
                lat=float(lat[i]),
                lon=float(lon[i]),
            )
        )
    return nodes


def _address(i: int) -> str | None:
    """10.99.0.1, 10.99.0.2, ...: the overlay range the example topologies use."""
    host = i + 1
    return f"10.99.{host >> 8}.{host & 255}" if host < 65535 else None


def _node(name: str, i: int, site: str | None = None) -> Node:
    return Node(name, address=_address(i), site=site)


def _topology(
    name: str,
    nodes: list[Node],
    delay: FloatMatrix,
    *,
    jitter: FloatMatrix | None = None,
    loss: FloatMatrix | None = None,
    tunnels: BoolMatrix | None = None,
) -> Topology:
    return Topology.from_matrices(
        name, nodes, delay, source=f"<generator {name}>", jitter=jitter, loss=loss, tunnels=tunnels
    )
