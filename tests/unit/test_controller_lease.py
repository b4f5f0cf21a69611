"""Active/standby controllers through a retained lease, on an explicit fake clock.

``Bus`` stands in for the broker's retained lease topic: every lease a controller
publishes in one tick becomes the retained one and reaches every connected controller
(itself included) before the next tick, in publish order, as MQTT delivers them.
"""

from __future__ import annotations

import pytest

from meshopt.bus.messages import BusMessageError, Lease, encode
from meshopt.controller.lease import LeaseKeeper

MESH = "lab"
TICK = 0.05  # the daemon's tick
LEASE_S = 3.0
SETTLE_S = 0.5


def role(k: LeaseKeeper) -> str:
    return k.role  # read afresh: mypy would narrow k.role across calls that change it


def offer(k: LeaseKeeper, lease: Lease) -> None:
    """Deliver as the controller core does: an older lease is refused (and counted there)."""
    try:
        k.on_lease(lease)
    except BusMessageError as exc:
        assert exc.reason == "replay"


class Bus:
    def __init__(self) -> None:
        self.controllers: dict[str, LeaseKeeper] = {}
        self.retained: Lease | None = None
        self.published: list[tuple[float, Lease]] = []
        self.paused: dict[str, tuple[LeaseKeeper, list[Lease]]] = {}
        self.step = 0

    @property
    def now(self) -> float:
        return round(self.step * TICK, 6)

    def connect(self, name: str) -> LeaseKeeper:
        k = LeaseKeeper(MESH, name, lease_s=LEASE_S, settle_s=SETTLE_S)
        self.controllers[name] = k
        if self.retained is not None:
            offer(k, self.retained)  # retained messages arrive on subscribing
        return k

    def kill(self, name: str, *, will: bool) -> None:
        """The controller stops; with ``will`` the broker tells the others at once."""
        del self.controllers[name]
        if will:
            for k in self.controllers.values():
                k.on_controller_offline(name)

    def pause(self, name: str) -> None:
        """The process hangs (still connected): messages queue up for it."""
        self.paused[name] = (self.controllers.pop(name), [])

    def resume(self, name: str) -> None:
        """It wakes up, ticks first (a late renewal), then reads what queued up."""
        k, queued = self.paused.pop(name)
        lease = k.tick(self.now)
        for q in queued:
            offer(k, q)
        self.controllers[name] = k
        if lease is not None:
            self.published.append((self.now, lease))
            self.deliver(lease)

    def deliver(self, lease: Lease) -> None:
        self.retained = lease
        for k in self.controllers.values():
            offer(k, lease)
        for _, queue in self.paused.values():
            queue.append(lease)

    def tick(self) -> None:
        out = []
        for k in list(self.controllers.values()):
            lease = k.tick(self.now)
            if lease is not None:
                encode(lease)  # a lease the bus would refuse fails here
                out.append(lease)
        for lease in out:
            self.published.append((self.now, lease))
            self.deliver(lease)
        self.check()
        self.step += 1

    def check(self) -> None:
        publishing = [n for n, k in self.controllers.items() if k.may_publish(self.now)]
        assert len(publishing) <= 1, f"{publishing} publish at {self.now}"

    def run_until(self, t: float) -> None:
        while self.now < t - 1e-9:
            self.tick()

    def active(self) -> list[str]:
        return [n for n, k in self.controllers.items() if k.may_publish(self.now)]


def test_single_controller_becomes_active_after_settling() -> None:
    bus = Bus()
    ctl = bus.connect("ctl1")
    bus.run_until(0.5)
    assert role(ctl) == "starting" and not ctl.may_publish(bus.now), "waits for a retained lease"
    bus.run_until(1.0)
    assert role(ctl) == "claiming" and not ctl.may_publish(bus.now)
    bus.tick()
    assert role(ctl) == "active" and ctl.may_publish(bus.now)
    assert ctl.became_active_at == pytest.approx(2 * SETTLE_S)
    assert ctl.term == 1
    assert bus.retained is not None
    assert (bus.retained.controller, bus.retained.term) == ("ctl1", 1)
    assert bus.retained.expires_at == pytest.approx(1.0 + LEASE_S)
    # Renewed every third of the lease: it never lapses while the controller runs.
    before = len(bus.published)
    bus.run_until(31.0)
    assert len(bus.published) - before == pytest.approx(30 / (LEASE_S / 3), abs=1)
    assert ctl.may_publish(bus.now)


def test_second_controller_stays_standby_while_the_lease_is_renewed() -> None:
    bus = Bus()
    first = bus.connect("ctl1")
    bus.run_until(5.0)
    second = bus.connect("ctl2")
    bus.run_until(65.0)  # Bus.check: never two publishers at once
    assert first.may_publish(bus.now) and first.term == 1
    assert role(second) == "standby" and not second.may_publish(bus.now)
    assert second.became_active_at is None
    assert {lease.controller for _, lease in bus.published} == {"ctl1"}


def test_standby_takes_over_once_the_lease_expires() -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    second = bus.connect("ctl2")
    bus.run_until(10.0)
    assert bus.retained is not None
    expires = bus.retained.expires_at
    bus.kill("ctl1", will=False)  # hangs: no renewal, no will message
    bus.run_until(expires)
    assert role(second) == "standby", "the lease still runs"
    bus.run_until(expires + SETTLE_S + 2 * TICK)
    assert bus.active() == ["ctl2"]
    assert second.term > 1  # a newer term than the first holder's
    assert second.became_active_at is not None
    assert expires <= second.became_active_at <= expires + SETTLE_S + TICK + 1e-9


def test_standby_takes_over_at_once_when_the_holder_s_will_arrives() -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    second = bus.connect("ctl2")
    bus.run_until(10.0)
    assert bus.retained is not None
    died = bus.now
    bus.kill("ctl1", will=True)
    bus.run_until(died + SETTLE_S + 2 * TICK)
    assert bus.active() == ["ctl2"]
    assert second.became_active_at is not None
    assert second.became_active_at - died <= SETTLE_S + TICK + 1e-9
    assert second.became_active_at < bus.retained.expires_at - LEASE_S / 3


def test_will_of_another_controller_than_the_holder_changes_nothing() -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    second = bus.connect("ctl2")
    bus.connect("ctl3")
    bus.run_until(5.0)
    bus.kill("ctl3", will=True)
    bus.run_until(20.0)
    assert bus.active() == ["ctl1"] and role(second) == "standby"


@pytest.mark.parametrize("order", [("ctl2", "ctl3"), ("ctl3", "ctl2")])
def test_two_standbys_claiming_together_only_the_retained_claim_wins(
    order: tuple[str, str],
) -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    for name in order:  # the later one publishes its claim last: the broker keeps it
        bus.connect(name)
    bus.run_until(10.0)
    claims_from = len(bus.published)
    bus.kill("ctl1", will=True)
    bus.tick()
    claims = [lease for _, lease in bus.published[claims_from:]]
    assert [c.controller for c in claims] == list(order), "both claimed in the same tick"
    terms = {c.term for c in claims}
    assert len(terms) == 1 and min(terms) > 1  # the same next term, claimed twice
    bus.run_until(bus.now + SETTLE_S + 2 * TICK)
    winner, loser = order[1], order[0]
    assert bus.active() == [winner]
    assert bus.controllers[loser].role == "standby"
    bus.run_until(60.0)
    assert bus.active() == [winner]


def test_active_controller_seeing_a_newer_term_steps_down() -> None:
    bus = Bus()
    ctl = bus.connect("ctl1")
    bus.run_until(5.0)
    assert ctl.may_publish(bus.now)
    now = bus.now
    other = Lease(mesh=MESH, controller="ctl2", term=2, expires_at=now + 3, issued_at=now)
    bus.deliver(other)
    assert role(ctl) == "standby" and not ctl.may_publish(now), "stops at once"
    bus.run_until(now + 2.9)
    assert role(ctl) == "standby", "ctl2's lease still runs"
    # ctl2 never renews: its lease expires and ctl1 claims the next term.
    bus.run_until(now + 3.0 + SETTLE_S + 2 * TICK)
    assert role(ctl) == "active" and ctl.term > 2


def test_a_stale_lower_term_does_not_depose_the_active_controller() -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    ctl = bus.connect("ctl2")
    bus.run_until(4.0)
    bus.kill("ctl1", will=True)
    bus.run_until(6.0)
    assert bus.active() == ["ctl2"] and ctl.term > 1
    now = bus.now
    late = Lease(mesh=MESH, controller="ctl1", term=1, expires_at=now + 3, issued_at=now - 1)
    bus.deliver(late)  # e.g. a renewal of the old holder, delivered late
    assert role(ctl) == "active"
    bus.run_until(now + LEASE_S / 3 + TICK)  # its next renewal retakes the topic
    assert bus.active() == ["ctl2"]


def test_restarted_controller_resumes_its_own_unexpired_lease() -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    second = bus.connect("ctl2")
    bus.run_until(10.0)
    assert bus.retained is not None
    bus.kill("ctl1", will=False)  # a quick restart: the old connection ends cleanly
    bus.run_until(10.5)
    restarted = bus.connect("ctl1")  # gets the retained lease, still valid until ~12-13
    assert restarted.current == bus.retained
    bus.run_until(10.5 + SETTLE_S + TICK)
    assert role(restarted) == "active" and restarted.term == 1
    assert restarted.became_active_at == pytest.approx(10.5 + SETTLE_S)
    assert bus.active() == ["ctl1"]
    bus.run_until(40.0)
    assert bus.active() == ["ctl1"] and role(second) == "standby"
    assert second.became_active_at is None


def test_restarted_controller_whose_lease_expired_claims_like_anyone() -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(5.0)
    bus.kill("ctl1", will=False)
    bus.run_until(20.0)  # long gone: its lease expired
    restarted = bus.connect("ctl1")
    bus.run_until(20.0 + 2 * SETTLE_S + TICK)
    assert role(restarted) == "active" and restarted.term > 1


def test_controllers_started_together_elect_one() -> None:
    bus = Bus()
    for name in ("ctl1", "ctl2", "ctl3"):
        bus.connect(name)
    bus.run_until(30.0)
    assert bus.active() == ["ctl3"]  # the last claim published is the retained one
    assert sorted(k.role for k in bus.controllers.values()) == ["active", "standby", "standby"]


@pytest.mark.parametrize("wakes_at", [13.2, 14.5], ids=["standby-claiming", "standby-active"])
def test_holder_that_overslept_its_lease_never_publishes_alongside_the_new_one(
    wakes_at: float,
) -> None:
    bus = Bus()
    bus.connect("ctl1")
    bus.run_until(2.0)
    bus.connect("ctl2")
    bus.run_until(10.0)
    bus.pause("ctl1")  # e.g. a long GC pause or a suspended VM: no renewal, no will
    bus.run_until(wakes_at)
    bus.resume("ctl1")  # its renewal (old term) goes out before it reads ctl2's claim
    bus.check()
    bus.run_until(wakes_at + LEASE_S + SETTLE_S)  # Bus.check: never two at once
    assert len(bus.active()) == 1
    bus.run_until(wakes_at + 30.0)
    assert len(bus.active()) == 1


def test_terms_grow_with_the_clock_so_a_lost_lease_never_restarts_them() -> None:
    """A broker that lost its retained lease: the next claim must still be newer than the
    terms agents have installed (they refuse route sets from older terms)."""
    keeper = LeaseKeeper("lab", "ctl1", lease_s=3.0, settle_s=0.5)
    now = 1_795_000_000.0
    assert keeper.tick(now) is None  # waits settle_s for a retained lease
    claim = keeper.tick(now + 0.6)
    assert claim is not None and claim.term >= int(now)


def test_echoes_slower_than_the_settle_time_leave_the_controller_publishing() -> None:
    """Claims go out every settle_s until one comes back. With a broker answering in 0.6 s
    and settle_s 0.2 s, an older claim's echo made the keeper active in that term and a
    newer claim's echo then stood as current: every renewal was a replay and the
    controller stayed active publishing nothing (found with a slow broker, issue 15)."""
    k = LeaseKeeper("lab", "ctl1", lease_s=3.0, settle_s=0.2)
    t = 1_795_826_498.55
    assert k.tick(t) is None
    a = k.tick(t + 0.2)  # first claim
    assert a is not None and k.role == "claiming"
    assert k.tick(t + 0.4) is None and k.role == "standby"  # no echo within settle_s
    b = k.tick(t + 0.45)  # claims again, in the next second's term
    assert b is not None and b.term >= a.term
    k.on_lease(a)  # the first claim's echo, 0.6 s late
    assert k.tick(t + 0.65) is None and k.role == "standby"  # a is not the claim in hand
    renewal = k.tick(t + 0.7)  # our own unexpired lease: taken back, in a's term
    assert renewal is not None and k.role == "active"
    k.on_lease(b)  # the newer claim's echo
    assert k.term == b.term
    nxt = k.tick(t + 0.7 + 1.0)  # the next renewal is in the newest term
    assert nxt is not None and nxt.term == b.term
    k.on_lease(nxt)
    assert k.may_publish(t + 1.8)
