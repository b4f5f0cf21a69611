"""Who may publish route sets: a lease on the broker, held by one controller at a time.

The lease is a retained message ``{controller, term, expires_at}``. The active
controller renews it every third of ``lease_s``. A standby claims it (``term + 1``) when
it has expired, or at once when the holder's will message says it is gone; it then
waits ``settle_s`` and becomes active only if the retained lease it reads back is still
its own claim (two standbys claiming together: the broker keeps the last, and the other
backs off). A controller that sees a newer term than its own stops publishing at once.
After connecting, a controller waits ``settle_s`` for the retained lease before it
decides anything, so a restarted controller never overrides a live one.

So two controllers never publish at the same time as long as clocks agree to within
``lease_s - settle_s`` (NTP); route-set versions (time based, strictly increasing) and
the agents' refusal of older versions cover the rest. Pure: times are passed in.

Leases are signed by a controller key (meshopt.controller.core checks that) and bounded
here (:func:`check_lease`): issued no later than the clock skew allows, living at most
``MAX_LEASE_FACTOR`` x ``lease_s`` (a lease "for 30 years" would freeze routing), with a
term the clock can explain (a term of 2^62 would be persisted by agents and refuse every
later controller). A lease older than the one held (lower term, or the same holder's
earlier renewal) is a replay and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshopt.bus.freshness import MAX_SKEW_S, check_time, term_ceiling
from meshopt.bus.messages import BusMessageError, Lease

MAX_LEASE_FACTOR = 3.0


def check_lease(
    lease: Lease, wall: float, *, lease_s: float, max_skew_s: float = MAX_SKEW_S
) -> None:
    """BusMessageError unless ``lease`` is possible for controllers configured with ``lease_s``."""
    check_time(lease.issued_at, wall, max_skew_s=max_skew_s, max_age_s=None)
    if lease.expires_at - lease.issued_at > MAX_LEASE_FACTOR * lease_s:
        raise BusMessageError(
            "lease_too_long",
            f"{lease.expires_at - lease.issued_at:.0f} s (at most {MAX_LEASE_FACTOR * lease_s:g})",
        )
    if lease.term > term_ceiling(wall, max_skew_s):
        raise BusMessageError("term_jump", f"term {lease.term} runs ahead of the clock")


Role = Literal["starting", "standby", "claiming", "active"]


@dataclass
class LeaseKeeper:
    mesh: str
    me: str
    lease_s: float = 3.0
    settle_s: float = 0.5
    role: Role = "starting"
    current: Lease | None = None
    holder_gone: bool = False
    term: int = 0
    started_at: float | None = None
    claimed_at: float = 0.0
    renewed_at: float = 0.0
    became_active_at: float | None = None

    def on_lease(self, lease: Lease) -> None:
        """Take a (checked, signed) lease; BusMessageError "replay" for an older one."""
        cur = self.current
        if cur is not None and (
            lease.term < cur.term
            or (
                lease.term == cur.term
                and lease.controller == cur.controller
                and lease.issued_at < cur.issued_at
            )
        ):
            raise BusMessageError("replay", f"term {lease.term} from {lease.controller}")
        self.current = lease
        self.holder_gone = False
        if self.role == "active" and lease.controller != self.me and lease.term >= self.term:
            self.role = "standby"  # someone else holds a newer (or equal) term
        elif self.role in ("active", "claiming") and lease.controller == self.me:
            # A newer claim of our own, echoed after an older one made us active (echoes
            # slower than settle_s: claims go out every settle_s until one comes back).
            # Without this the newer term stood as current, every renewal in the older
            # term was a replay, and the controller stayed active publishing nothing.
            self.term = max(self.term, lease.term)

    def own_published(self, lease: Lease) -> None:
        """Our renewal, which the broker took (PUBACK): held from now on, as its echo
        would make it. Only while active in that term, and never over a newer lease."""
        cur = self.current
        if self.role != "active" or lease.controller != self.me or lease.term != self.term:
            return
        if cur is not None and (
            cur.term > lease.term
            or (cur.term == lease.term and cur.controller != self.me)
            or (cur.controller == self.me and cur.issued_at >= lease.issued_at)
        ):
            return
        self.current = lease

    def on_controller_offline(self, controller: str) -> None:
        if self.current is not None and self.current.controller == controller != self.me:
            self.holder_gone = True

    def _lease(self, now: float) -> Lease:
        return Lease(
            mesh=self.mesh,
            controller=self.me,
            term=self.term,
            expires_at=now + self.lease_s,
            issued_at=now,
        )

    def tick(self, now: float) -> Lease | None:
        """Advance; return a lease to publish (retained), if any."""
        if self.started_at is None:
            self.started_at = now
        cur = self.current
        if self.role == "starting":
            if now - self.started_at < self.settle_s:
                return None
            self.role = "standby"
        if self.role == "standby":
            free = cur is None or cur.expires_at <= now or self.holder_gone
            if cur is not None and cur.controller == self.me and cur.expires_at > now:
                # Our own lease from before a restart: take it back at once.
                self.term = cur.term
                return self._activate(now)
            if free:
                # Terms grow with the clock as well: a broker that lost its retained lease
                # must not restart terms at 1 below what agents have already installed.
                self.term = max((cur.term if cur is not None else 0) + 1, int(now))
                self.role = "claiming"
                self.claimed_at = now
                return self._lease(now)
            return None
        if self.role == "claiming":
            if now - self.claimed_at < self.settle_s:
                return None
            if cur is not None and cur.controller == self.me and cur.term == self.term:
                return self._activate(now)
            self.role = "standby"
            return None
        # active
        if now - self.renewed_at >= self.lease_s / 3:
            self.renewed_at = now
            return self._lease(now)
        return None

    def _activate(self, now: float) -> Lease:
        self.role = "active"
        self.became_active_at = now
        self.renewed_at = now
        return self._lease(now)

    def may_publish(self, now: float) -> bool:
        cur = self.current
        return (
            self.role == "active"
            and cur is not None
            and cur.controller == self.me
            and cur.term == self.term
            and now < cur.expires_at
        )
