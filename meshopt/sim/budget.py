"""The agents' probe budget (:mod:`meshopt.probe.budget`) for every link at once.

The agent probes a link fast (``in_use``) while it relays for a route (and for
``in_use_hold_s`` after), while it is the backup of a next hop in use, and every link
before the first route set and for ``in_use_hold_s`` after a route set that moved the
agent's next hops or backups; every other link is ``idle``: probed every idle interval
(the budget's own :func:`~meshopt.probe.budget.idle_interval`, stretched under the
cap) and declared dead after the idle class's dead time. A link whose estimator has
outliers waiting is probed fast until they are confirmed or dismissed (the prober's
``_interval``). The simulator probes in rounds of the fast interval, so an idle link
goes out on the first round at least its interval after its last probe, less half a
round (2 s: every sixth round, 1.98 s).

Not modelled: traffic (the simulator carries none, so no link is in use for it); the
route sets' backups (the engine computes them only when fail-over reads them, which is
what makes it fast at scale, so a backup stays in its own class, and a route set that
moves only backups does not settle its row); the 0.47 s dead time of a peer promoted
while silent; the 50 ms grid of idle sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from meshopt.metric import FloatArray
from meshopt.probe.budget import BudgetConfig, idle_interval
from meshopt.routing.tables import IntArray
from meshopt.sim.estimator import BoolArray

__all__ = ["LinkBudget"]


@dataclass
class LinkBudget:
    config: BudgetConfig
    tunnel: BoolArray
    settle_until: FloatArray  # per row: every peer in use until then
    last_used: FloatArray  # when each link last relayed
    next_idle: FloatArray  # when each link is due at the idle rate
    in_use: BoolArray
    idle_s: FloatArray  # per row: the idle class's interval
    idle_dead_s: FloatArray  # per row: its dead time
    next_hop: IntArray | None = None
    relay: BoolArray | None = None
    # Each link's idle phase, a share of the interval on the wall clock (the agent's
    # meshopt.agent.peers.idle_phase: a tunnel's two ends half an interval apart), and
    # the wall clock at simulated time 0. None: the phase of the link's last probe.
    phase: FloatArray | None = None
    wall0: float = 0.0

    @classmethod
    def start(
        cls, config: BudgetConfig, tunnel: BoolArray, rng: np.random.Generator | None = None
    ) -> LinkBudget:
        """``rng``: draws the tunnels' idle phases and the wall clock's offset (as the
        agents' key hashes and the lab's start time would fall); None: no phases."""
        n = tunnel.shape[0]
        idle = config.idle(config.idle_interval_s)
        phase: FloatArray | None = None
        wall0 = 0.0
        if rng is not None:
            base = np.triu(rng.random((n, n)), 1)
            phase = (base + base.T + np.tril(np.full((n, n), 0.5), -1)) % 1.0
            wall0 = float(rng.uniform(0.0, idle.interval_s))
        return cls(
            phase=phase,
            wall0=wall0,
            config=config,
            tunnel=tunnel,
            settle_until=np.full(n, np.inf),  # before the first route set: all in use
            last_used=np.full((n, n), -np.inf),
            next_idle=np.zeros((n, n)),
            in_use=tunnel.copy(),
            idle_s=np.full(n, idle.interval_s),
            idle_dead_s=np.full(n, idle.dead_after_s),
        )

    def routes(self, next_hop: IntArray, now: float) -> None:
        """A route set reached the agents at ``now``: each row whose next hops moved (all
        of them with the first) probes every peer fast for the hold time."""
        n = next_hop.shape[0]
        if self.next_hop is None:
            moved = np.ones(n, dtype=bool)
        else:
            moved = (next_hop != self.next_hop).any(axis=1)
        self.settle_until = np.where(moved, now + self.config.in_use_hold_s, self.settle_until)
        self.next_hop = next_hop
        # A relay: the next hop of a route to somebody else's destination.
        relay = np.zeros((n, n), dtype=bool)
        rows = np.broadcast_to(np.arange(n)[:, None], (n, n))
        via = (next_hop >= 0) & (next_hop != np.arange(n)[None, :]) & (rows != np.arange(n))
        relay[rows[via], next_hop[via]] = True
        self.relay = relay & self.tunnel

    def classify(self, now: float) -> None:
        """Each link's class at ``now`` (:meth:`meshopt.probe.budget.ProbeBudget.classify`
        without traffic) and each row's idle rate (:meth:`~ProbeBudget.rates`)."""
        cfg = self.config
        if self.relay is not None:
            self.last_used[self.relay] = now
        own = (now - self.last_used <= cfg.in_use_hold_s) & self.tunnel
        in_use = (own | (self.settle_until >= now)[:, None]) & self.tunnel
        self.in_use = in_use
        fast = in_use.sum(axis=1)
        idle = self.tunnel.sum(axis=1) - fast
        pairs, index = np.unique(np.stack([fast, idle], axis=1), axis=0, return_inverse=True)
        intervals = np.array([idle_interval(cfg, int(f), int(i))[0] for f, i in pairs])
        self.idle_s = intervals[index.ravel()]
        ratio = cfg.fast_dead_after_s / cfg.fast_interval_s
        self.idle_dead_s = np.round(self.idle_s * ratio, 3)  # BudgetConfig.idle's rule

    def due(self, sent_at: float, round_s: float, confirming: BoolArray) -> BoolArray:
        """The links probed in the round at ``sent_at``."""
        idle_due = self.next_idle <= sent_at + round_s / 2
        return np.asarray(self.tunnel & (self.in_use | idle_due | confirming))

    def sent(self, probed: BoolArray, sent_at: float) -> None:
        """Probes went out: an idle link is next due one idle interval later (a demoted
        link one idle interval after its last fast probe), on its phase if it has one."""
        interval = self.idle_s[:, None]
        if self.phase is None:
            after = np.broadcast_to(sent_at + interval, probed.shape)
        else:  # the first moment on the link's phase at least half an interval on
            wall = sent_at + interval / 2 + self.wall0
            after = (np.ceil(wall / interval - self.phase) + self.phase) * interval - self.wall0
        self.next_idle = np.where(probed, after, self.next_idle)

    def dead_after(self, links: npt.NDArray[np.intp]) -> FloatArray:
        """The dead time of ``links`` (flat indices) at their class."""
        n = self.tunnel.shape[0]
        rows = links // n
        fast = self.in_use.ravel()[links]
        return np.where(fast, self.config.fast_dead_after_s, self.idle_dead_s[rows])

    def interval_of(self, links: npt.NDArray[np.intp]) -> FloatArray:
        """The probe interval of ``links`` (flat indices) at their class."""
        n = self.tunnel.shape[0]
        fast = self.in_use.ravel()[links]
        return np.where(fast, self.config.fast_interval_s, self.idle_s[links // n])
