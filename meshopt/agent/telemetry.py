"""What the agent tells the controller, and when a change is worth telling at once.

A full snapshot (retained: a controller that starts late, or missed messages, catches
up) goes out every :func:`full_interval`: ``full_interval_s`` up to ``full_peers`` peers,
then stretching in proportion to the peer count (a snapshot's size grows with it, so the
uplink it costs stays flat) up to ``max_full_interval_s``. Between snapshots a change
report carries only the peers whose values moved significantly (:func:`changed_peers`:
alive/dead flips, a new or lost RTT, an RTT or loss step over the thresholds); it goes out
at the next check, so reaction time does not depend on the snapshot interval. When
nothing changed for ``full_interval_s``, an empty change report tells the controller the
agent is alive (a few hundred bytes). A peer appearing or disappearing sends a full
snapshot at once. Telemetry carries its peers as a columnar table (see
meshopt.bus.messages.PeerTable). Pure: the daemon supplies readings and times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from meshopt.agent.config import TelemetrySettings
from meshopt.agent.peers import PeerInfo
from meshopt.bus.messages import PeerReport, Telemetry, peer_table
from meshopt.bus.signing import sign
from meshopt.estimate import WARM_SAMPLES
from meshopt.probe.budget import IDLE, IN_USE, Rate
from meshopt.probe.stats import ProbeStats

if TYPE_CHECKING:
    from meshopt.agent.core import AgentCore


@dataclass(frozen=True)
class Capacity:
    """The last active bandwidth estimate of one peer."""

    mbit: float
    confidence: float
    measured_at: float  # monotonic


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def peer_report(
    peer: PeerInfo,
    stats: ProbeStats | None,
    alive: bool | None,
    capacity: Capacity | None,
    now: float,
    pmtu: int | None = None,
    rate: Rate | None = None,
) -> PeerReport:
    """One peer's report; ``rate`` is how the prober probes it now (its budget class)."""
    return PeerReport(
        public_key=peer.public_key,
        ifname=peer.ifname,
        endpoint=peer.endpoint,
        alive=alive,
        rtt_ms=_finite(stats.srtt_ms) if stats else None,
        rtt_min_ms=_finite(stats.rtt_min_ms) if stats else None,
        rtt_median_ms=_finite(stats.rtt_median_ms) if stats else None,
        rtt_p95_ms=_finite(stats.rtt_p95_ms) if stats else None,
        jitter_ms=_finite(stats.rtt_std_ms) if stats else None,  # sigma: meshopt.estimate
        noise_ms=_finite(stats.noise_ms) if stats else None,
        loss=stats.loss if stats and stats.sent else None,
        samples=stats.samples if stats else 0,
        probes_sent=stats.sent if stats else 0,
        loss_outcomes=round(stats.loss_outcomes) if stats else 0,
        handshake_age_s=peer.handshake_age_s,
        rx_bytes=peer.rx_bytes,
        tx_bytes=peer.tx_bytes,
        rx_bps=peer.rx_bps,
        tx_bps=peer.tx_bps,
        bandwidth_mbit=capacity.mbit if capacity else None,
        bandwidth_confidence=capacity.confidence if capacity else None,
        bandwidth_age_s=max(0.0, now - capacity.measured_at) if capacity else None,
        pmtu=pmtu,
        probe_class=_probe_class(rate),
        probe_interval_s=rate.interval_s if rate else None,
        probe_dead_after_s=rate.dead_after_s if rate else None,
    )


def _probe_class(rate: Rate | None) -> Literal["in_use", "idle"] | None:
    if rate is None:
        return None
    if rate.cls == IN_USE:
        return "in_use"
    return "idle" if rate.cls == IDLE else None


def reports_moved(
    old_alive: Any,
    new_alive: Any,
    old_rtt: Any,
    new_rtt: Any,
    old_samples: Any,
    new_samples: Any,
    old_loss: Any,
    new_loss: Any,
    cfg: TelemetrySettings,
) -> Any:
    """Whether a peer's report moved enough since it was last published to tell now.

    Written with operators only, so it takes plain numbers (the agent, through
    :func:`peer_changed`) or numpy arrays of any shape (the simulator, every link at
    once) without the agent importing numpy: ``alive`` as 1/0/-1 (unknown), RTT NaN
    where not reported, loss 0 where not reported.
    """
    has_old = old_rtt == old_rtt  # not NaN
    has_new = new_rtt == new_rtt
    both = has_old & has_new
    step = abs(new_rtt - old_rtt)
    rtt_step = both & (step >= cfg.rtt_change_ms) & (step >= cfg.rtt_change_rel * old_rtt)
    # A young estimate is told again each time its samples double (up to 16), and when
    # they reach WARM_SAMPLES: the controller routes once every link has that many, and
    # the policy weighs a gain against their noise, which shrinks fast; a 5 s snapshot
    # would hold the first routes back.
    doubled = (new_samples >= 2 * old_samples) & (new_samples >= 2)
    warmed = (old_samples < WARM_SAMPLES) & (new_samples >= WARM_SAMPLES)
    young = both & (old_samples < 16) & (doubled | warmed)
    dl = abs(new_loss - old_loss)
    loss = (dl != 0) & (dl >= cfg.loss_change)
    return (old_alive != new_alive) | (has_old != has_new) | rtt_step | young | loss


def peer_changed(o: PeerReport, n: PeerReport, cfg: TelemetrySettings) -> bool:
    """True when one peer's report moved enough since it was last published to tell now."""
    return bool(
        reports_moved(
            -1 if o.alive is None else int(o.alive),
            -1 if n.alive is None else int(n.alive),
            math.nan if o.rtt_ms is None else o.rtt_ms,
            math.nan if n.rtt_ms is None else n.rtt_ms,
            o.samples,
            n.samples,
            o.loss or 0.0,
            n.loss or 0.0,
            cfg,
        )
    )


def changed_peers(
    old: Mapping[str, PeerReport], new: Mapping[str, PeerReport], cfg: TelemetrySettings
) -> list[str]:
    """Keys of the peers of ``new`` whose report moved significantly since ``old``."""
    return [k for k, n in new.items() if k not in old or peer_changed(old[k], n, cfg)]


def significant(
    old: Mapping[str, PeerReport], new: Mapping[str, PeerReport], cfg: TelemetrySettings
) -> bool:
    """True when ``new`` differs from what was last published enough to publish now."""
    if set(old) != set(new):
        return True
    return any(peer_changed(old[k], n, cfg) for k, n in new.items())


# The least time between two telemetry messages told early: when a link's estimator
# confirms a step the agent publishes at once rather than at its next check (the agent's
# telemetry loop; the simulator models the same rule).
TELL_GAP_S = 0.2


# Until its peers' estimates have reached WARM_SAMPLES, an agent checks its telemetry
# every WARM_CHECK_S, not every check_interval_s: the controller's first routes wait for
# the last link to be told warm, and a whole check of 1 s was most of that wait (the
# lab's first telemetry came 1 s after the start with one sample on its slowest link,
# WireGuard's first handshake having taken the rest). For at most WARM_WINDOW_S after
# the start: a peer that never answers does not keep it checking fast.
WARM_CHECK_S = 0.25
WARM_WINDOW_S = 10.0


def check_interval(warm: Any, since_start_s: Any, cfg: TelemetrySettings) -> Any:
    """Seconds to the agent's next telemetry check (operators only, as
    :func:`reports_moved`: plain values for the agent, arrays for the simulator)."""
    fast = min(WARM_CHECK_S, cfg.check_interval_s)
    settled = warm | (since_start_s >= WARM_WINDOW_S)
    return fast + settled * (cfg.check_interval_s - fast)


def full_due(now: Any, last_full: Any, interval: Any, cfg: TelemetrySettings) -> Any:
    """Whether a full snapshot is due at a check at ``now`` (operators only, as
    :func:`reports_moved`). Half a check early counts: checks run a whole
    ``check_interval_s`` apart, and one landing a few ms short of the interval pushed the
    snapshot a whole check later. With change reports shifting the checks, the lab's
    16 agents sent theirs every 5 or 6 s, and their phases, started within 0.5 s, spread
    over the interval; the simulator's stayed together."""
    return now - last_full >= interval - cfg.check_interval_s / 2


def full_anchor(now: float, last_full: float, interval: float, cfg: TelemetrySettings) -> float:
    """When a due full snapshot counts as sent: on schedule (within a check of when it
    was due), when it was due, so that snapshots keep their phase; else (the first, or
    after a silence) now."""
    due = last_full + interval
    return due if abs(now - due) <= cfg.check_interval_s else now


def full_interval(peers: int, cfg: TelemetrySettings) -> float:
    """Seconds between full snapshots for ``peers`` peers.

    ``full_interval_s`` up to ``full_peers`` peers, then proportional to the peer count
    (bytes per second stay what ``full_peers`` peers cost at ``full_interval_s``), at
    most ``max_full_interval_s``; never below ``full_interval_s``.
    """
    stretched = cfg.full_interval_s * peers / max(cfg.full_peers, 1)
    return max(cfg.full_interval_s, min(stretched, cfg.max_full_interval_s))


@dataclass(frozen=True)
class Plan:
    """One telemetry message to send: a full snapshot or a change report of ``peers``."""

    full: bool
    peers: list[PeerReport]
    interval_s: float  # the full-snapshot interval, announced in the message
    # A full snapshot sent on schedule counts from when it was due, not from when the
    # check that sent it happened to run (:func:`full_anchor`); None: from now.
    due_at: float | None = None


@dataclass
class Cadence:
    """When to send a full snapshot, a change report or a heartbeat (pure; times injected).

    The caller asks :meth:`plan` at every check, publishes what it returns, and calls
    :meth:`sent` once the broker took it (a failed publish is retried at the next check).
    """

    last_published: dict[str, PeerReport] = field(default_factory=dict)
    last_full: float = -math.inf
    last_sent: float = -math.inf

    def reset(self) -> None:
        """Send a full snapshot at the next check (e.g. a new broker session)."""
        self.last_full = -math.inf

    def plan(
        self, reports: Mapping[str, PeerReport], now: float, cfg: TelemetrySettings
    ) -> Plan | None:
        interval = full_interval(len(reports), cfg)
        if full_due(now, self.last_full, interval, cfg):
            due = full_anchor(now, self.last_full, interval, cfg)
            return Plan(True, list(reports.values()), interval, due)
        if set(reports) != set(self.last_published):
            return Plan(True, list(reports.values()), interval)
        keys = changed_peers(self.last_published, reports, cfg)
        if keys and not self.warm():
            # Until warm, every message is a full (retained) snapshot: the first one goes
            # out before any sample, and a late reader (``meshopt routes``, a standby
            # controller) would otherwise see that one for a whole full interval.
            return Plan(True, list(reports.values()), interval)
        # The heartbeat: due half a check early, so a check landing just short of the
        # interval does not push it a whole check later.
        if keys or full_due(now, self.last_sent, cfg.full_interval_s, cfg):
            return Plan(False, [reports[k] for k in keys], interval)
        return None

    def next_due(self, peers: int, cfg: TelemetrySettings) -> float:
        """When the next snapshot or heartbeat falls due if no value changes (a caller
        whose values move only when it is told, like the scale benchmark's agents, may
        sleep until then instead of checking every ``check_interval_s``)."""
        beat = self.last_sent + cfg.full_interval_s - cfg.check_interval_s / 2
        return min(beat, self.last_full + full_interval(peers, cfg) - cfg.check_interval_s / 2)

    def warm(self) -> bool:
        """Every peer that answered was told with WARM_SAMPLES samples (a peer told dead
        counts too; one that never answered does not: it may still)."""
        told = self.last_published.values()
        return bool(told) and all(p.alive is False or p.samples >= WARM_SAMPLES for p in told)

    def sent(self, plan: Plan, now: float) -> None:
        if plan.full:
            self.last_published = {p.public_key: p for p in plan.peers}
            self.last_full = now if plan.due_at is None else plan.due_at
        else:
            self.last_published.update((p.public_key, p) for p in plan.peers)
        self.last_sent = now


def telemetry(
    *,
    mesh: str,
    node: str,
    public_keys: Sequence[str],
    addresses: Sequence[str],
    seq: int,
    sent_at: float,
    full: bool,
    peers: Sequence[PeerReport],
    counters: Mapping[str, int],
    session: int = 0,
    full_interval_s: float = 0.0,
) -> Telemetry:
    """The message; its peers travel as a columnar table (meshopt.bus.messages.PeerTable)."""
    return Telemetry(
        mesh=mesh,
        node=node,
        public_key=public_keys[0] if public_keys else "",
        public_keys=list(public_keys),
        addresses=list(addresses),
        seq=seq,
        session=session,
        sent_at=sent_at,
        full=full,
        table=peer_table(peers),
        counters=dict(counters),
        full_interval_s=full_interval_s,
    )


def signed_telemetry(
    core: AgentCore,
    wall: float,
    *,
    public_keys: Sequence[str],
    addresses: Sequence[str],
    plan: Plan,
    counters: Mapping[str, int],
) -> bytes:
    """The signed message for ``plan``, with the agent's seq, session and identity (as
    :meth:`AgentCore.telemetry` signs it, plus the announced full interval)."""
    t = telemetry(
        mesh=core.mesh,
        node=core.node,
        public_keys=public_keys,
        addresses=addresses,
        seq=core.next_seq(),
        session=core.session,
        sent_at=wall,
        full=plan.full,
        peers=plan.peers,
        counters=counters,
        full_interval_s=plan.interval_s,
    )
    return sign("telemetry", t, core.identity, core.key_id)
