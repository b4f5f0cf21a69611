"""The probe budget: links in use are probed fast, idle links slowly, under a total cap.

Probing every peer 3 times a second costs 3 probes/s and ~850 B/s per peer: 3,000
probes/s at 1,000 peers. Only some links need that rate: a dead next hop must be found
within a second because traffic is on it. So each peer gets a class (pure, injected
time; the agent feeds it, :class:`meshopt.probe.prober.Prober` applies the rates):

* ``in_use``: a peer that **relays** for us (the next hop of a route to a destination
  that is not the peer itself), or that **carries traffic** (its WireGuard byte
  counters moved faster than ``traffic_bytes_per_s`` in either direction since the
  last poll; probes alone move them by at most ~700 B/s), for ``in_use_hold_s`` after
  it last did either (no flapping between rates); and the **backup** of any route whose
  next hop is in use that way (local fail-over must find it alive). Probed at the
  prober's own ``interval_s`` with its ``dead_after_s``: today's rate and detection.
  A direct route to a peer that carries no traffic does not make it in use: nothing
  is lost while it is slow to be found dead, and traffic that starts promotes it (and
  its backups) at the next poll. The agent passes every peer as ``active`` before its
  first route set and for ``in_use_hold_s`` after one that moved a next hop or backup
  (the controller's candidates measured fast while it chooses).
* ``idle``: everyone else, probed every ``idle_interval_s``, stretched so that the sum
  over all peers stays within ``max_probes_per_s`` (never beyond
  ``idle_max_interval_s``). Its dead time scales with its interval (the fast class's
  ratio, 0.8 / 0.33 = 2.4 intervals), so an idle peer is judged only on the probes it
  was sent: two unanswered, the second given 0.4 of an interval to answer.

In-use links are never slowed for the cap (the 1 s detection outranks it), nor idle ones
beyond ``idle_max_interval_s`` (they must still be known alive or dead); a plan over the
cap says ``over_budget``. See docs/probe-budget.md for the figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from meshopt.errors import InputError

__all__ = [
    "IDLE",
    "IN_USE",
    "BudgetConfig",
    "BudgetPlan",
    "ProbeBudget",
    "Rate",
    "RouteUse",
    "TrafficMeter",
    "route_hops",
    "route_use",
]

IN_USE = "in_use"
IDLE = "idle"
CLASSES = (IN_USE, IDLE)
STEP_S = 0.25  # idle intervals are whole steps: small peer-count changes change nothing


@dataclass(frozen=True, slots=True)
class Rate:
    """How one peer is probed: its class, the time between probes and its dead time."""

    cls: str
    interval_s: float
    dead_after_s: float


@dataclass(frozen=True)
class BudgetConfig:
    fast_interval_s: float = 0.33
    fast_dead_after_s: float = 0.8
    idle_interval_s: float = 2.0
    idle_max_interval_s: float = 10.0
    max_probes_per_s: float = 250.0
    traffic_bytes_per_s: float = 1500.0
    in_use_hold_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "fast_interval_s",
            "fast_dead_after_s",
            "idle_interval_s",
            "idle_max_interval_s",
            "max_probes_per_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise InputError(f"probe budget: {name} must be a positive number, not {value!r}")
        for name in ("traffic_bytes_per_s", "in_use_hold_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise InputError(f"probe budget: {name} must be >= 0, not {value!r}")
        if self.fast_dead_after_s <= self.fast_interval_s:
            raise InputError("probe budget: fast_dead_after_s must exceed fast_interval_s")
        if self.idle_interval_s < self.fast_interval_s:
            raise InputError(
                f"probe budget: idle_interval_s ({self.idle_interval_s}) must be at least "
                f"the probe interval ({self.fast_interval_s})"
            )
        if self.idle_max_interval_s < self.idle_interval_s:
            raise InputError("probe budget: idle_max_interval_s must be >= idle_interval_s")

    @property
    def fast(self) -> Rate:
        return Rate(IN_USE, self.fast_interval_s, self.fast_dead_after_s)

    def idle(self, interval_s: float) -> Rate:
        """The idle class at ``interval_s``: the fast class's dead time, scaled."""
        ratio = self.fast_dead_after_s / self.fast_interval_s
        return Rate(IDLE, interval_s, round(interval_s * ratio, 3))


@dataclass(frozen=True)
class BudgetPlan:
    rates: dict[str, Rate]
    idle_interval_s: float
    probes_per_s: float  # what the plan sends, all peers together
    over_budget: bool  # probes_per_s > max_probes_per_s: in use alone, or idle at the max

    def count(self, cls: str) -> int:
        return sum(1 for r in self.rates.values() if r.cls == cls)


class _HopLike(Protocol):
    @property
    def via(self) -> str: ...
    @property
    def backup(self) -> str | None: ...


class _RouteLike(_HopLike, Protocol):
    @property
    def dst(self) -> str: ...


def route_hops(routes: Iterable[_HopLike]) -> set[str]:
    """Every peer a route set names: next hops and backups (relays included)."""
    out: set[str] = set()
    for r in routes:
        out.add(r.via)
        if r.backup is not None:
            out.add(r.backup)
    return out


@dataclass(frozen=True)
class RouteUse:
    """What a route set asks of the budget: which peers relay, and each next hop's
    backups (the peers local fail-over moves its routes to)."""

    relays: frozenset[str] = frozenset()
    backups: Mapping[str, frozenset[str]] = field(default_factory=dict)


def route_use(routes: Iterable[_RouteLike], owner: Callable[[str], str | None]) -> RouteUse:
    """Relays and backups of ``routes``. ``owner(dst)``: the peer a destination prefix
    belongs to (None: unknown). A route whose destination is not its next hop's own, or
    is nobody's we know, relays: unknown counts as in use, never as idle."""
    relays: set[str] = set()
    backups: dict[str, set[str]] = {}
    for r in routes:
        if owner(r.dst) != r.via:
            relays.add(r.via)
        if r.backup is not None and r.backup != r.via:
            backups.setdefault(r.via, set()).add(r.backup)
    return RouteUse(frozenset(relays), {k: frozenset(v) for k, v in backups.items()})


def idle_interval(config: BudgetConfig, in_use: int, idle: int) -> tuple[float, bool]:
    """(the idle class's interval, whether the in-use links alone are over the cap)."""
    fast_rate = in_use / config.fast_interval_s
    spare = config.max_probes_per_s - fast_rate
    over = spare < 0
    if idle == 0:
        return config.idle_interval_s, over
    if spare <= idle / config.idle_max_interval_s:
        return config.idle_max_interval_s, over
    wanted = max(config.idle_interval_s, idle / spare)
    # Up to whole steps (rounding up keeps the sum under the cap), capped at the max.
    stepped = math.ceil(round(wanted / STEP_S, 9)) * STEP_S
    return min(config.idle_max_interval_s, max(config.idle_interval_s, stepped)), over


@dataclass
class TrafficMeter:
    """Bytes/s per peer (the larger of rx and tx) from WireGuard's byte counters.

    A rate is taken over at least ``min_span_s``: the agent re-reads the counters right
    after an apply, and one probe over 50 ms would look like 2 kB/s of traffic.
    """

    min_span_s: float = 1.0
    rates: dict[str, float] = field(default_factory=dict)
    _last: dict[str, tuple[float, int, int]] = field(default_factory=dict)

    def update(self, counters: Mapping[str, tuple[int, int]], now: float) -> dict[str, float]:
        """Take ``peer -> (rx_bytes, tx_bytes)`` read at ``now``; the current rates."""
        for name, (rx, tx) in counters.items():
            last = self._last.get(name)
            if last is None or rx < last[1] or tx < last[2]:  # new, or re-created: restart
                self._last[name] = (now, rx, tx)
                self.rates[name] = 0.0
                continue
            span = now - last[0]
            if span >= self.min_span_s:
                self.rates[name] = max(rx - last[1], tx - last[2]) / span
                self._last[name] = (now, rx, tx)
        for name in [n for n in self._last if n not in counters]:
            del self._last[name]
            self.rates.pop(name, None)
        return dict(self.rates)


@dataclass
class ProbeBudget:
    """Classes with hold-down: remembers when each peer was last in use on its own."""

    config: BudgetConfig = field(default_factory=BudgetConfig)
    last_used: dict[str, float] = field(default_factory=dict)  # relayed or carried traffic

    def classify(
        self,
        peers: Iterable[str],
        active: Collection[str],
        traffic: Mapping[str, float],
        now: float,
        backups: Mapping[str, Collection[str]] | None = None,
        *,
        transient: Collection[str] = (),
    ) -> dict[str, str]:
        """Each peer's class at ``now``.

        ``active``: peers in use on their own account now (relays; before the first
        route set, every peer); ``traffic``: bytes/s (the larger direction), above the
        threshold also in use; either is held for ``in_use_hold_s``. ``backups``: next
        hop -> the backups of its routes, in use while that next hop is (no hold of
        their own: they follow it). ``transient``: in use now, without a hold (the
        agent's peers while its routes settle: the settling has its own clock).
        """
        cfg = self.config
        limit = cfg.traffic_bytes_per_s
        hold = cfg.in_use_hold_s
        last_used = self.last_used
        names = peers if isinstance(peers, Collection) else list(peers)
        classes: dict[str, str] = {}
        for name in names:
            if name in active or traffic.get(name, 0.0) > limit:
                last_used[name] = now
            last = last_used.get(name)
            classes[name] = IN_USE if last is not None and now - last <= hold else IDLE
        if backups:
            # Backups of the next hops in use on their own account, not of backups.
            covered = {
                b
                for hop, alternates in backups.items()
                if classes.get(hop) == IN_USE
                for b in alternates
                if b in classes
            }
            for b in covered:
                classes[b] = IN_USE
        for name in transient:
            if name in classes:
                classes[name] = IN_USE
        for name in [n for n in last_used if n not in classes]:
            del last_used[name]  # peers gone: forgotten
        return classes

    def rates(self, classes: Mapping[str, str]) -> BudgetPlan:
        cfg = self.config
        n_fast = sum(1 for c in classes.values() if c == IN_USE)
        n_idle = len(classes) - n_fast
        interval, over = idle_interval(cfg, n_fast, n_idle)
        fast, idle = cfg.fast, cfg.idle(interval)
        rates = {name: fast if c == IN_USE else idle for name, c in classes.items()}
        per_s = n_fast / fast.interval_s + n_idle / idle.interval_s
        return BudgetPlan(rates, interval, per_s, over or per_s > cfg.max_probes_per_s + 1e-9)

    def plan(
        self,
        peers: Iterable[str],
        active: Collection[str],
        traffic: Mapping[str, float],
        now: float,
        backups: Mapping[str, Collection[str]] | None = None,
        *,
        transient: Collection[str] = (),
    ) -> BudgetPlan:
        return self.rates(self.classify(peers, active, traffic, now, backups, transient=transient))
