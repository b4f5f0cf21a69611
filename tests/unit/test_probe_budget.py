"""The probe budget: classes, rates and per-class liveness, with injected time.

The budget itself is pure. The prober's schedule is driven by hand: a fake clock, its
timer work called directly, its probes sent over a real loopback socket to a socket the
test reads, and replies handed back at chosen (fake) moments. Nothing here sleeps.
"""

from __future__ import annotations

import itertools
import math
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from meshopt.errors import InputError
from meshopt.probe.budget import (
    IDLE,
    IN_USE,
    BudgetConfig,
    ProbeBudget,
    Rate,
    TrafficMeter,
    idle_interval,
    route_hops,
    route_use,
)
from meshopt.probe.packet import decode, encode, probe_bytes_per_s, reply_to
from meshopt.probe.prober import (
    COALESCE_S,
    GRID_S,
    RETRY_MIN_S,
    ProbeConfig,
    Prober,
    Target,
)
from meshopt.probe.timestamps import open_udp_socket

CFG = BudgetConfig()
FAST = CFG.fast
IDLE_2S = CFG.idle(2.0)
EXCHANGE_B = probe_bytes_per_s(1.0, 0)  # request + reply, IPv6 in IPv4, WireGuard included


# --- the budget (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class R:
    via: str
    backup: str | None = None
    dst: str = ""


def test_route_hops_are_next_hops_and_backups() -> None:
    assert route_hops([R("a"), R("b", "c"), R("a", "b")]) == {"a", "b", "c"}
    assert route_hops([]) == set()


def test_next_hops_and_traffic_are_in_use_the_rest_idle() -> None:
    budget = ProbeBudget()
    peers = ["hop", "backup", "busy", "trickle", "quiet"]
    traffic = {"busy": 50_000.0, "trickle": 700.0}  # 700 B/s: what fast probes alone move
    classes = budget.classify(peers, {"hop", "backup"}, traffic, now=100.0)
    assert classes == {
        "hop": IN_USE,
        "backup": IN_USE,
        "busy": IN_USE,
        "trickle": IDLE,
        "quiet": IDLE,
    }


# A mesh as one agent sees it: each peer's own prefix is "<peer>/32".
def own(dst: str) -> str | None:
    return dst.removesuffix("/32") if dst.endswith("/32") else None


def route(dst: str, via: str, backup: str | None = None) -> R:
    return R(via, backup, f"{dst}/32")


def test_route_use_relays_are_next_hops_to_other_destinations_and_backups_per_hop() -> None:
    use = route_use(
        [
            route("a", "a", "b"),  # direct, backup b
            route("c", "b", "c"),  # b relays to c; c's tunnel is the backup
            route("d", "d"),  # direct, no backup
            route("e", "e", "e"),  # a backup equal to the next hop is no backup
            R("f", "g", "10.0.0.0/8"),  # a destination nobody owns: counted as relayed
        ],
        own,
    )
    assert use.relays == {"b", "f"}
    assert use.backups == {"a": {"b"}, "b": {"c"}, "f": {"g"}}
    assert route_use([], own) == type(use)()


def classes_of(routes: list[R], traffic: dict[str, float], now: float = 0.0) -> dict[str, str]:
    use = route_use(routes, own)
    return ProbeBudget().classify(PEERS, use.relays, traffic, now, use.backups)


PEERS = ["a", "b", "c", "d", "e"]
# A full mesh's route set: a route to every peer, direct but for c (relayed by b,
# its tunnel the backup); every direct route backed up by the next peer.
FULL = [route("a", "a", "b"), route("b", "b", "c"), route("c", "b", "c"), route("d", "d", "e")]
FULL += [route("e", "e", "a")]


def test_direct_routes_without_traffic_are_idle_relays_and_their_backups_in_use() -> None:
    # b relays (to c), so b is in use, and so are the backups of every route through
    # b: c (backup of b's route to c, and of b's own). a, d and e are only direct next
    # hops or backups of next hops that are idle themselves.
    assert classes_of(FULL, {}) == {"a": IDLE, "b": IN_USE, "c": IN_USE, "d": IDLE, "e": IDLE}


def test_traffic_on_a_direct_next_hop_puts_it_and_its_backup_in_use() -> None:
    # Local fail-over moves d's route to e the moment d is dead: e must be known alive.
    got = classes_of(FULL, {"d": 50_000.0})
    assert got == {"a": IDLE, "b": IN_USE, "c": IN_USE, "d": IN_USE, "e": IN_USE}
    # Not further: e is only a backup (it carries nothing), so e's own backup (a) stays
    # idle, and a trickle below the threshold (what fast probes move) changes nothing.
    assert classes_of(FULL, {"a": 700.0})["a"] == IDLE


def test_a_backup_follows_its_next_hop_including_the_hold_and_no_longer() -> None:
    budget = ProbeBudget(BudgetConfig(in_use_hold_s=30.0))
    use = route_use(FULL, own)

    def at(now: float, traffic: dict[str, float]) -> tuple[str, str]:
        got = budget.classify(PEERS, use.relays, traffic, now, use.backups)
        return got["d"], got["e"]

    assert at(0.0, {"d": 1e5}) == (IN_USE, IN_USE)
    assert at(30.0, {}) == (IN_USE, IN_USE)  # d held, and e with it
    assert at(30.5, {}) == (IDLE, IDLE)  # e had no hold of its own
    # The route set changes its backup: the new one is in use at once, the old idle.
    moved = route_use([*FULL[:3], route("d", "d", "a"), FULL[4]], own)
    budget.classify(PEERS, moved.relays, {"d": 1e5}, 31.0, moved.backups)
    got = budget.classify(PEERS, moved.relays, {"d": 1e5}, 32.0, moved.backups)
    assert (got["d"], got["a"], got["e"]) == (IN_USE, IN_USE, IDLE)


def test_relays_are_held_after_the_route_set_drops_them() -> None:
    budget = ProbeBudget(BudgetConfig(in_use_hold_s=30.0))
    use = route_use(FULL, own)
    assert budget.classify(PEERS, use.relays, {}, 0.0, use.backups)["b"] == IN_USE
    direct = route_use([route(p, p) for p in PEERS], own)  # c direct now: nobody relays
    assert direct.relays == frozenset()
    got = budget.classify(PEERS, direct.relays, {}, 20.0, direct.backups)
    assert (got["b"], got["c"]) == (IN_USE, IDLE)  # b held; c was only b's backup
    assert budget.classify(PEERS, direct.relays, {}, 30.5, direct.backups)["b"] == IDLE


def test_backups_of_unknown_next_hops_and_unknown_backups_are_ignored() -> None:
    use = route_use([route("x", "x", "a"), route("y", "b", "z")], own)
    got = ProbeBudget().classify(["a", "b"], use.relays, {"x": 1e6}, 0.0, use.backups)
    assert got == {"a": IDLE, "b": IN_USE}  # x is no peer; z (b's backup) neither


def test_in_use_is_held_for_hold_s_then_idle_and_gone_peers_are_forgotten() -> None:
    budget = ProbeBudget(BudgetConfig(in_use_hold_s=30.0))
    assert budget.classify(["a", "b"], {"a"}, {"b": 1e6}, now=0.0) == {"a": IN_USE, "b": IN_USE}
    assert budget.classify(["a", "b"], set(), {}, now=30.0) == {"a": IN_USE, "b": IN_USE}
    assert budget.classify(["a", "b"], set(), {}, now=30.5) == {"a": IDLE, "b": IDLE}
    budget.classify(["a"], {"a"}, {}, now=31.0)
    assert set(budget.last_used) == {"a"}
    # A peer that comes back starts idle (nothing remembered of it).
    assert budget.classify(["a", "b"], set(), {}, now=32.0) == {"a": IN_USE, "b": IDLE}


def test_rates_fast_for_in_use_and_idle_dead_time_scaled_from_the_fast_class() -> None:
    plan = ProbeBudget().rates({"a": IN_USE, "b": IDLE})
    assert plan.rates["a"] == Rate(IN_USE, 0.33, 0.8)
    idle = plan.rates["b"]
    assert idle.cls == IDLE and idle.interval_s == 2.0
    # The fast class's 0.8 / 0.33 intervals: two unanswered probes, the second given
    # 0.42 of an interval to answer.
    assert idle.dead_after_s == pytest.approx(2.0 * 0.8 / 0.33, abs=0.001)
    assert plan.probes_per_s == pytest.approx(1 / 0.33 + 1 / 2.0)
    assert (plan.count(IN_USE), plan.count(IDLE), plan.over_budget) == (1, 1, False)


@pytest.mark.parametrize(
    ("peers", "in_use", "goal_bytes_per_s"),
    [(100, 10, None), (250, 25, 100_000), (1000, 25, 150_000), (1000, 60, 150_000)],
)
def test_the_cap_holds_and_probe_bytes_stay_within_the_goals(
    peers: int, in_use: int, goal_bytes_per_s: int | None
) -> None:
    classes = {f"p{i}": IN_USE if i < in_use else IDLE for i in range(peers)}
    plan = ProbeBudget().rates(classes)
    # Over the cap only where idle peers are at their slowest (10 s) already.
    assert plan.over_budget is (plan.probes_per_s > CFG.max_probes_per_s)
    assert not plan.over_budget or plan.idle_interval_s == CFG.idle_max_interval_s
    assert plan.over_budget is (in_use == 60)
    assert CFG.idle_interval_s <= plan.idle_interval_s <= CFG.idle_max_interval_s
    assert plan.idle_interval_s / 0.25 == pytest.approx(round(plan.idle_interval_s / 0.25))
    wire = plan.probes_per_s * EXCHANGE_B  # request + reply, WireGuard overhead included
    if goal_bytes_per_s is not None:
        assert wire <= goal_bytes_per_s
    if peers == 100:  # well under the cap: idle at its own rate
        assert plan.idle_interval_s == CFG.idle_interval_s


def test_idle_interval_stretches_to_the_cap_then_stops_at_the_max() -> None:
    assert idle_interval(CFG, 10, 90) == (2.0, False)
    interval, over = idle_interval(CFG, 20, 980)  # 60.6/s fast, 189.4/s for 980 idle
    assert interval == 5.25 and not over  # 980 / 189.4 = 5.17, up to a whole step
    assert idle_interval(CFG, 80, 920) == (10.0, False)  # 7.8/s left for 920 idle: the max
    assert idle_interval(CFG, 100, 5) == (10.0, True)  # in use alone exceed the cap
    assert idle_interval(CFG, 100, 0) == (2.0, True)


def test_in_use_links_are_never_slowed_for_the_cap() -> None:
    plan = ProbeBudget().rates({f"p{i}": IN_USE for i in range(200)})
    assert plan.over_budget
    assert {r.interval_s for r in plan.rates.values()} == {0.33}


def test_traffic_meter_takes_rates_over_at_least_min_span() -> None:
    meter = TrafficMeter(min_span_s=1.0)
    assert meter.update({"a": (1000, 0)}, 0.0) == {"a": 0.0}
    assert meter.update({"a": (1500, 0)}, 0.05) == {"a": 0.0}  # too short a span: kept
    assert meter.update({"a": (5000, 200)}, 2.0) == {"a": 2000.0}  # rx 4000 B over 2 s
    assert meter.update({"a": (5000, 9000)}, 4.0) == {"a": 4400.0}  # tx is larger now
    assert meter.update({"a": (10, 10)}, 6.0) == {"a": 0.0}  # counters went down: restart
    assert meter.update({}, 7.0) == {}


def test_bad_budget_settings_are_one_line_errors() -> None:
    for kwargs, words in (
        ({"idle_interval_s": 0.1}, "idle_interval_s (0.1) must be at least"),
        ({"idle_max_interval_s": 1.0}, "idle_max_interval_s must be >= idle_interval_s"),
        ({"max_probes_per_s": 0}, "max_probes_per_s must be a positive number"),
        ({"in_use_hold_s": -1}, "in_use_hold_s must be >= 0"),
        ({"traffic_bytes_per_s": math.nan}, "traffic_bytes_per_s must be >= 0"),
    ):
        with pytest.raises(InputError) as info:
            BudgetConfig(**kwargs)  # type: ignore[arg-type]
        assert words in str(info.value) and "\n" not in str(info.value)


# --- the prober's schedule, by hand ------------------------------------------------------


@dataclass
class Harness:
    """A prober on a fake clock whose probes reach a loopback socket read by the test."""

    answer: Callable[[str, float], bool] = lambda name, now: True
    rtt_ms: Callable[[str, float], float] = lambda name, now: 0.1
    now: float = 1000.0
    events: list[tuple[str, bool, float]] = field(default_factory=list)
    steps: list[tuple[str, float]] = field(default_factory=list)  # on_step calls
    sent: list[tuple[str, float]] = field(default_factory=list)
    replies: list[tuple[float, bytes, int]] = field(default_factory=list)  # (due, reply, rx_ns)
    _seen: set[int] = field(default_factory=set)  # sequence numbers read from the socket

    def __post_init__(self) -> None:
        self.rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rx.bind(("127.0.0.1", 0))
        self.rx.setblocking(False)
        self.prober = Prober(
            ProbeConfig(port=self.rx.getsockname()[1]),
            on_change=lambda n, a: self.events.append((n, a, self.now)),
            on_step=lambda n: self.steps.append((n, self.now)),
            clock=lambda: self.now,
        )
        self.prober._sock = open_udp_socket("::", 0)  # sends without an event loop
        # Each send in the tick it falls due in: these tests read the schedule itself
        # (test_close_sends_share_a_tick covers the coalescing).
        self.prober.coalesce_s = 0.0

    def close(self) -> None:
        assert self.prober._sock is not None
        self.prober._sock.close()
        self.rx.close()

    def peers(self, *names: str) -> None:
        self.prober.set_targets(Target(n, "127.0.0.1") for n in names)

    def run(self, seconds: float, step: float = 0.01, *, timer: bool = False) -> None:
        """Advance the clock; at every step the timer's work, then replies to what came.
        ``timer``: step to when the prober's timer would fire next instead."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            if timer:
                self.now = max(self.prober._next_wake(self.now), self.now + 1e-6)
            else:
                self.now = round(self.now + step, 6)
            self.prober._tick(self.now)
            for data in self._drain():
                request = decode(data)
                pending = self.prober._pending.get(request.seq)
                assert pending is not None
                name = pending.peer.target.name
                self.sent.append((name, self.now))
                if self.answer(name, self.now):
                    rtt_s = self.rtt_ms(name, self.now) / 1000.0
                    reply = encode(reply_to(request, 0))
                    # under 1 ms: answered in the tick it was sent (the prober's slack)
                    due = self.now if rtt_s <= 0.001 else self.now + rtt_s
                    self.replies.append((due, reply, request.send_ns + round(rtt_s * 1e9)))
            waiting = []
            for due, reply, rx_ns in self.replies:
                if due <= self.now + 1e-9:
                    self.prober._handle(reply, ("127.0.0.1", 0), rx_ns, self.now)
                else:
                    waiting.append((due, reply, rx_ns))
            self.replies = waiting

    def _drain(self) -> Iterator[bytes]:
        """What the prober sent, every probe of this tick included: on a busy machine the
        kernel can deliver a loopback datagram after ``sendto`` returns (softirq work
        deferred to ksoftirqd), and a probe read a tick late moved these tests' clocks."""
        want = set(self.prober._pending) - self._seen
        self.rx.settimeout(5.0)
        try:
            while want:
                data = self.rx.recv(2048)
                seq = decode(data).seq
                self._seen.add(seq)
                want.discard(seq)
                yield data
        finally:
            self.rx.setblocking(False)
        while True:
            try:
                data = self.rx.recv(2048)
            except BlockingIOError:
                return
            self._seen.add(decode(data).seq)
            yield data

    def sends(self, name: str) -> list[float]:
        return [t for n, t in self.sent if n == name]


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        h.close()


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 3) for a, b in itertools.pairwise(times)]


def test_without_a_budget_every_peer_is_probed_at_the_configured_rate(harness: Harness) -> None:
    start = harness.now
    harness.peers("a", "b")
    harness.run(3.0)
    for name in ("a", "b"):
        sends = harness.sends(name)
        # every 0.33 s from a phase of its own within the first interval
        assert start <= sends[0] < start + 0.34 and len(sends) in (9, 10)
        assert all(abs(g - 0.33) <= 0.011 for g in gaps(sends)), gaps(sends)  # 0.01 s ticks
        assert harness.prober.rate(name) == Rate(IN_USE, 0.33, 0.8)
    # not together: probes sent at once queue behind each other and read high
    assert abs(harness.sends("a")[0] - harness.sends("b")[0]) > 0.01
    assert harness.prober.probes_per_s() == pytest.approx(2 / 0.33)


def test_close_sends_share_a_tick(harness: Harness) -> None:
    """Probes due within COALESCE_S of a tick go out in it (one wake-up, not one each);
    a probe is never sent late for it, and a peer never twice in one tick."""
    prober = harness.prober
    prober.coalesce_s = COALESCE_S
    prober.nonce = bytes(8)  # fixed phases: names chosen by them
    names = [f"p{i}" for i in range(400)]
    at = {n: prober._phase(n) * 0.33 for n in names}
    a, b = next(
        (x, y)
        for x, y in itertools.combinations(names, 2)
        if 0.004 < at[y] - at[x] < COALESCE_S - 0.002 and at[x] > 0.02
    )
    c = next(n for n in names if min(abs(at[n] - at[a]), abs(at[n] - at[b])) > 0.05)
    start = harness.now
    harness.peers(a, b, c)
    harness.run(3.0, timer=True)
    sa, sb, sc = harness.sends(a), harness.sends(b), harness.sends(c)
    assert len(sa) == len(sb) >= 9 and sa == sb  # b went out in a's ticks, early
    assert not set(sc) & set(sa)
    for name, sends in ((a, sa), (b, sb), (c, sc)):
        due = [start + at[name] + k * 0.33 for k in range(len(sends))]
        # never late, at most COALESCE_S early
        assert all(-COALESCE_S - 1e-6 <= t - d <= 0.0011 for t, d in zip(sends, due, strict=True))


def test_a_fast_peer_is_never_probed_twice_in_one_tick(harness: Harness) -> None:
    harness.peers("x")
    harness.prober.coalesce_s = COALESCE_S
    harness.prober.set_rates({"x": Rate(IN_USE, 0.005, 0.02)})  # 5 ms: inside COALESCE_S
    harness.run(1.0, timer=True)
    sends = harness.sends("x")
    assert len(sends) == len(set(sends)) and 190 <= len(sends) <= 201


def test_idle_peers_are_probed_at_their_interval_on_the_grid(harness: Harness) -> None:
    harness.peers("fast", "idle")
    harness.prober.set_rates({"fast": FAST, "idle": IDLE_2S})
    harness.run(10.0)
    assert len(harness.sends("fast")) in (30, 31)  # from its phase in the first 0.33 s
    idle = harness.sends("idle")
    assert len(idle) == 5 and set(gaps(idle)) == {2.0}
    assert all(abs(t / GRID_S - round(t / GRID_S)) < 1e-6 for t in idle)
    snap = harness.prober.snapshot()["peers"]["idle"]
    assert (snap["class"], snap["interval_s"]) == (IDLE, 2.0)


def test_new_idle_peers_are_spread_over_the_first_second(harness: Harness) -> None:
    names = [f"p{i}" for i in range(100)]
    harness.peers(*names)
    harness.prober.set_rates(dict.fromkeys(names, IDLE_2S))
    harness.run(1.1)
    firsts = sorted(harness.sends(n)[0] for n in names)
    assert len(firsts) == 100 and firsts[-1] - harness.now <= 0  # all probed within 1.1 s
    # On the 50 ms grid across the second: no slot holds more than a fifth of them.
    slots = [round(t / GRID_S) for t in firsts]
    assert len(set(slots)) >= 10 and max(slots.count(s) for s in set(slots)) <= 20


def test_an_idle_peer_is_judged_against_its_own_interval(harness: Harness) -> None:
    """Silent from t0: the fast peer is dead 0.8 s after its last reply; the idle one not
    for the 2 s it was not asked, only after two of its own probes went unanswered."""
    silent_from: dict[str, float] = {}
    harness.answer = lambda name, now: name not in silent_from or now < silent_from[name]
    harness.peers("fast", "idle")
    harness.prober.set_rates({"fast": FAST, "idle": IDLE_2S})
    harness.run(4.0)
    assert harness.prober.alive("fast") is harness.prober.alive("idle") is True
    t0 = harness.now
    silent_from.update(fast=t0, idle=t0)
    harness.run(12.0)
    deaths = {n: t for n, alive, t in harness.events if not alive}
    # the last answered probes: one sent in the tick at t0 was answered before the silence
    last_fast = max(t for t in harness.sends("fast") if t <= t0)
    last_idle = max(t for t in harness.sends("idle") if t <= t0)
    assert deaths["fast"] - last_fast == pytest.approx(0.8, abs=0.011)
    idle_dead = IDLE_2S.dead_after_s
    assert deaths["idle"] - last_idle == pytest.approx(idle_dead, abs=0.011)
    # Two idle probes went out unanswered before it was judged, the second 2 s after the
    # first, each sent again once RETRY_MIN_S later (lost, not slow: RTT 0.1 ms); the
    # retries move the death neither earlier nor later.
    asked = [t for t in harness.sends("idle") if last_idle < t <= deaths["idle"]]
    assert gaps(asked) == [RETRY_MIN_S, 2.0 - RETRY_MIN_S, RETRY_MIN_S]
    assert harness.prober.counters["retries"] == 2 + 2  # each peer: its two lost probes


def test_an_idle_peer_becoming_in_use_is_probed_fast_at_once(harness: Harness) -> None:
    harness.peers("p")
    harness.prober.set_rates({"p": IDLE_2S})
    harness.run(3.0)
    before = len(harness.sends("p"))
    promoted_at = harness.now
    harness.prober.set_rates({"p": FAST})
    harness.run(0.01)
    assert harness.sends("p")[-1] == pytest.approx(promoted_at + 0.01)  # the next tick
    harness.run(2.0)
    after = [t for t in harness.sends("p") if t > promoted_at]
    assert len(harness.sends("p")) == before + len(after)
    # The schedule restarts at the promotion: every 0.33 s from then.
    assert after[1] == pytest.approx(promoted_at + 0.33) and set(gaps(after[1:])) == {0.33}
    # And back to idle: one idle interval after its last fast probe, then every 2 s.
    demoted_at = harness.now
    harness.prober.set_rates({"p": IDLE_2S})
    harness.run(6.0)
    later = [t for t in harness.sends("p") if t > demoted_at]
    assert later[0] - after[-1] == pytest.approx(2.0, abs=GRID_S)
    assert set(gaps(later)) == {2.0}


def test_a_promoted_peer_is_not_judged_on_the_slow_probe_it_missed(harness: Harness) -> None:
    """Its last idle probe went unanswered; promoted, one fast probe out: not dead yet.
    Really dead, it is declared dead within dead_after_s of the promotion."""
    dead = {"now": False}
    harness.answer = lambda name, now: not dead["now"]
    harness.peers("p")
    harness.prober.set_rates({"p": IDLE_2S})
    harness.run(2.5)
    dead["now"] = True
    harness.run(2.0)  # one idle probe unanswered
    assert harness.prober.alive("p") is True
    promoted_at = harness.now
    harness.prober.set_rates({"p": FAST})
    harness.run(0.3)  # the first fast probe is out, unanswered for 0.3 s
    assert harness.prober.alive("p") is True and harness.events == []
    harness.run(1.0)
    (name, alive, at), *_ = harness.events
    assert (name, alive) == ("p", False)
    # Two fast probes unanswered, the first dead_after - interval before: 0.47 s.
    assert at - promoted_at == pytest.approx(0.8 - 0.33 + 0.01, abs=0.011)


def test_an_idle_link_that_steps_is_probed_fast_until_the_step_is_confirmed(
    harness: Harness,
) -> None:
    """10 ms -> 20 ms on an idle link: the first idle probe that sees it is an outlier,
    the next ones go every 0.33 s, the estimate moves ~1 s later (not 3 idle intervals),
    then the link is probed every 2 s again. (20 ms: answered before the probe is
    retried, 30 ms after it was sent; a larger step is retried too, as the spike below.)"""
    step_at = 1030.0
    harness.rtt_ms = lambda name, now: 20.0 if now >= step_at else 10.0
    harness.peers("p")
    harness.prober.set_rates({"p": IDLE_2S})
    harness.run(30.0)  # past the estimator's warm-up
    estimator = harness.prober._peers["p"].window.estimator
    assert estimator.srtt_ms == pytest.approx(10.0)
    harness.run(4.0)
    after = [t for t in harness.sends("p") if t >= step_at]
    assert gaps(after[:4]) == [0.33, 0.33, 0.33]
    assert estimator.srtt_ms == pytest.approx(20.0) and not estimator.confirming
    assert after[2] - step_at <= 2.0 + 0.67 + 1e-6  # confirmed on the third sample
    # ... and the agent is told when its reply came (to publish at once)
    assert harness.steps == [("p", pytest.approx(after[2] + 0.02, abs=0.011))]
    assert harness.prober.counters["retries"] == 0
    harness.run(6.0)
    # one more fast probe was already due when the third reply confirmed it; then 2 s
    later = [t for t in harness.sends("p") if t > after[3]]
    assert len(later) >= 3 and all(g == pytest.approx(2.0, abs=GRID_S) for g in gaps(later))


def test_an_idle_link_with_one_spike_is_probed_fast_once(harness: Harness) -> None:
    spike_at: list[float] = []

    def rtt(name: str, now: float) -> float:
        if now >= 1030.0 and not spike_at:
            spike_at.append(now)
            return 250.0
        return 10.0

    harness.rtt_ms = rtt
    harness.peers("p")
    harness.prober.set_rates({"p": IDLE_2S})
    harness.run(40.0)
    estimator = harness.prober._peers["p"].window.estimator
    assert estimator.srtt_ms == pytest.approx(10.0) and estimator.outliers == 1
    assert harness.steps == []  # a spike is no step
    after = [t for t in harness.sends("p") if t >= spike_at[0]]
    # Unanswered RETRY_MIN_S after it went (a 10 ms link), the spiked probe was sent
    # again once; then the fast probe that dismissed it and the one already due when it
    # did, 0.33 s apart from the retry; then 2 s
    assert gaps(after[:4]) == [RETRY_MIN_S, 0.33, 0.33]
    assert harness.prober.counters["retries"] == 1
    assert len(after) >= 7 and all(g == pytest.approx(2.0, abs=GRID_S) for g in gaps(after[3:]))


def test_a_slower_rate_of_the_same_class_keeps_phases(harness: Harness) -> None:
    names = [f"p{i}" for i in range(20)]
    harness.peers(*names)
    harness.prober.set_rates(dict.fromkeys(names, IDLE_2S))
    harness.run(3.0)
    changed_at = harness.now
    harness.prober.set_rates(dict.fromkeys(names, CFG.idle(2.25)))
    harness.run(0.05)
    assert [t for _, t in harness.sent if t > changed_at] == []  # no burst of everyone
    harness.run(5.0)
    for n in names:
        later = [t for t in harness.sends(n) if t > changed_at]
        assert len(later) == 2 and gaps(later)[0] == pytest.approx(2.25, abs=GRID_S)


def test_reconfigure_moves_peers_without_a_rate_of_their_own(harness: Harness) -> None:
    harness.peers("default", "budgeted")
    harness.prober.set_rates({"budgeted": IDLE_2S})
    harness.prober.reconfigure(ProbeConfig(port=harness.prober.config.port, interval_s=0.5))
    assert harness.prober.rate("default") == Rate(IN_USE, 0.5, 0.8)
    assert harness.prober.rate("budgeted") == IDLE_2S
    harness.prober.set_targets([Target("default", "127.0.0.1")])
    assert harness.prober.rate("budgeted") is None  # dropped with its target
    harness.prober.set_rates({"gone": FAST})  # unknown names are ignored


def test_a_dropped_peer_leaves_nothing_scheduled(harness: Harness) -> None:
    harness.peers("a", "b")
    harness.prober.set_rates({"a": IDLE_2S, "b": IDLE_2S})
    harness.run(1.0)
    harness.peers("a")
    harness.run(5.0)
    assert [t for n, t in harness.sent if n == "b" and t > 1001.0] == []
    assert len(harness.sends("a")) == 3


def test_the_budget_plan_drives_the_prober(harness: Harness) -> None:
    """The agent's loop in small: route next hops fast, the rest idle, promotion on a
    route set change, demotion after the hold."""
    names = [f"p{i}" for i in range(10)]
    harness.peers(*names)
    budget = ProbeBudget(BudgetConfig(in_use_hold_s=5.0))
    harness.prober.set_rates(budget.plan(names, {"p0"}, {}, harness.now).rates)
    harness.run(4.0)
    assert len(harness.sends("p0")) >= 12 and len(harness.sends("p5")) == 2
    assert harness.prober.probes_per_s() == pytest.approx(1 / 0.33 + 9 / 2.0)
    changed = harness.now
    harness.prober.set_rates(budget.plan(names, {"p5"}, {}, harness.now).rates)
    harness.run(0.01)
    assert harness.sends("p5")[-1] > changed
    assert harness.prober.rate("p0") == FAST  # held for in_use_hold_s
    harness.run(6.0)
    harness.prober.set_rates(budget.plan(names, {"p5"}, {}, harness.now).rates)
    assert harness.prober.rate("p0") == IDLE_2S and harness.prober.rate("p5") == FAST


# --- the agent's settings ---------------------------------------------------------------


def test_agent_settings_build_the_budget_and_bad_ones_name_the_key() -> None:
    from meshopt.agent.config import parse_config, probe_budget_config

    cfg = parse_config({"agent": {"mesh": "m", "node": "n1"}})
    assert probe_budget_config(cfg.probe) == BudgetConfig()
    off = parse_config({"agent": {"mesh": "m", "node": "n1"}, "probe": {"budget": False}})
    assert probe_budget_config(off.probe) is None
    tuned = parse_config(
        {"agent": {"mesh": "m", "node": "n1"}, "probe": {"interval_s": 0.2, "dead_after_s": 0.5}}
    )
    budget = probe_budget_config(tuned.probe)
    assert budget is not None and budget.fast == Rate(IN_USE, 0.2, 0.5)
    with pytest.raises(InputError) as info:
        parse_config({"agent": {"mesh": "m", "node": "n1"}, "probe": {"idle_interval_s": 0.1}})
    assert "probe.idle_interval_s (0.1) must be at least the probe interval (0.33)" in str(
        info.value
    )
    with pytest.raises(InputError) as info:
        parse_config({"agent": {"mesh": "m", "node": "n1"}, "probe": {"max_probes_per_s": 0}})
    assert "probe.max_probes_per_s must be a positive number" in str(info.value)


def test_transient_peers_are_in_use_now_and_not_held() -> None:
    budget = ProbeBudget(BudgetConfig(in_use_hold_s=30.0))
    assert budget.classify(["a", "b"], set(), {}, 0.0, transient=["a", "b"]) == {
        "a": IN_USE,
        "b": IN_USE,
    }
    assert budget.classify(["a", "b"], set(), {}, 1.0) == {"a": IDLE, "b": IDLE}
    assert budget.last_used == {}


def test_first_after_s_holds_only_the_first_probe_and_keeps_the_peer(harness: Harness) -> None:
    """The end with the larger key waits before its first probe of a tunnel that never
    handshook (meshopt.agent.peers.first_probe_delay); a budget that re-plans the peer
    in the meantime does not send it early, and the same target without the delay (the
    handshake since done) is the same peer, not a new one."""
    start = harness.now
    harness.prober.set_targets(
        [Target("a", "127.0.0.1"), Target("b", "127.0.0.1", first_after_s=0.5)]
    )
    harness.prober.set_rates({"b": Rate(IN_USE, 0.33, 0.8)})  # as the agent's first plan
    harness.prober.set_rates({"b": Rate(IDLE, 2.0, 4.84)})
    harness.prober.set_rates({"b": Rate(IN_USE, 0.33, 0.8)})
    harness.run(2.0)
    assert start <= harness.sends("a")[0] < start + 0.34
    b = harness.sends("b")
    assert start + 0.5 <= b[0] < start + 0.5 + 0.34, b[0] - start
    assert all(abs(g - 0.33) <= 0.011 for g in gaps(b)), gaps(b)
    peer = harness.prober._peers["b"]
    harness.prober.set_targets([Target("a", "127.0.0.1"), Target("b", "127.0.0.1")])
    assert harness.prober._peers["b"] is peer
    with pytest.raises(InputError, match="first_after_s"):
        Target("c", "127.0.0.1", first_after_s=-1.0)


def test_a_held_first_probe_goes_as_soon_as_the_peer_is_heard(harness: Harness) -> None:
    """``release``: the other end's probe reached us, its tunnel has a session, so the
    first probe held for the handshake goes at once; only a held probe is released."""
    start = harness.now
    harness.prober.set_targets(
        [Target("a", "127.0.0.1"), Target("b", "127.0.0.1", first_after_s=2.0)]
    )
    harness.run(0.4)
    assert harness.sends("b") == []
    assert harness.prober.release("a") is False  # not held
    assert harness.prober.release("nobody") is False
    assert harness.prober.release("b") is True
    harness.run(1.0)
    b = harness.sends("b")
    assert b and start + 0.4 <= b[0] <= start + 0.4 + 0.011, b[0] - start
    assert all(abs(g - 0.33) <= 0.011 for g in gaps(b)), gaps(b)
    assert harness.prober.release("b") is False  # probed already


def test_a_probe_sent_after_the_peer_was_heard_is_an_rtt_sample(harness: Harness) -> None:
    """A peer's probe came through the tunnel, so it has a session and ours wait for no
    handshake: the released first probe's reply is a sample, not an ``early_reply``
    (the warm-up's three samples came a probe interval sooner on such links)."""
    harness.prober.set_targets(
        [Target("a", "127.0.0.1"), Target("b", "127.0.0.1", first_after_s=2.0)]
    )
    harness.run(0.4)
    assert harness.prober.counters["early_reply"] == 1  # a's first: it may have waited
    assert harness.prober.release("b") is True
    harness.run(0.05)
    b = harness.prober.stats("b")
    assert b is not None and b.samples == 1
    assert harness.prober.counters["early_reply"] == 1


def test_two_lost_probes_in_a_row_are_sent_again_and_kill_no_peer(harness: Harness) -> None:
    """Without retries two probes lost in a row (0.04 % of probes at 1 % loss each way)
    left no reply within dead_after_s, and a healthy peer was declared dead: a fail-over
    and a route change. Each unanswered probe is now sent again once RETRY_MIN_S later,
    and only a peer that answers neither is dead (as before, 0.8 s after its last reply)."""
    lost: list[float] = []

    def answer(name: str, now: float) -> bool:
        # Two regular probes in a row lost; every other probe (the retries) answered.
        if now >= 1002.0 and len(lost) < 2 and (not lost or now - lost[-1] > 0.2):
            lost.append(now)
            return False
        return True

    harness.answer = answer
    harness.peers("p")
    harness.prober.set_rates({"p": FAST})
    harness.run(4.0)
    assert len(lost) == 2 and lost[1] - lost[0] == pytest.approx(0.33, abs=0.011)
    assert harness.events == [] and harness.prober.alive("p") is True
    assert harness.prober.counters["retries"] == 2
    retried = [t for t in harness.sends("p") if any(abs(t - x - RETRY_MIN_S) < 1e-6 for x in lost)]
    assert len(retried) == 2


def test_a_peer_back_from_an_outage_has_neither_its_losses_nor_its_queued_replies(
    harness: Harness,
) -> None:
    """Cut off for 15 s (a node down in the lab), the peer is declared dead; probes sent
    meanwhile are the outage, not the path. Before, its window read 60 % loss when it
    came back (400 ms of loss penalty for ~20 s), and a probe sent into the outage and
    answered late was an RTT sample. Its estimate is kept through the outage: started
    afresh it had no RTT until the next reply, and the controller priced it unknown."""
    harness.answer = lambda name, now: not 1002.0 <= now < 1017.0
    # The last probe sent into the outage is answered when it ends, 0.5 s late.
    harness.rtt_ms = lambda name, now: 500.0 if 1016.5 <= now < 1017.0 else 10.0
    harness.peers("p")
    harness.prober.set_rates({"p": FAST})
    harness.run(2.0)
    before = harness.prober.stats("p")
    assert before is not None and before.loss == 0.0
    harness.run(14.6)  # to 1016.6: dead since ~1002.8
    assert [a for _, a, _ in harness.events] == [False]
    harness.run(0.9)  # the late reply brings it back
    assert [a for _, a, _ in harness.events] == [False, True]
    assert harness.events[1][2] == pytest.approx(1017.0, abs=0.35)
    after = harness.prober.stats("p")
    assert after is not None
    assert after.loss == 0.0  # nor the onset's losses, nor the outage's
    # Its estimate is the one it had (the 500 ms reply is no sample), not none at all.
    assert after.srtt_ms == pytest.approx(10.0) and after.samples > 0
    assert harness.prober.counters["early_reply"] >= 1
    harness.run(5.0)
    later = harness.prober.stats("p")
    assert later is not None and later.loss == 0.0 and later.srtt_ms == pytest.approx(10.0)


@pytest.mark.parametrize("nonce", range(16))
def test_a_node_back_from_an_outage_is_found_on_all_its_links_at_once(
    harness: Harness, nonce: int
) -> None:
    """This node was cut off (a node down in the lab): every peer was declared dead.
    When the first one answers again, the others are probed at once rather than at their
    next probe, up to an idle interval (2 s) away: found one by one, the node's routes
    moved once per link as they came back (demo's relay return: 24 changes in the lab
    against 8 in the simulator). Each nonce puts the peers at other phases; with a
    random one the test failed for one phase in 16 (nonce 3 here), when the fast link's last probe
    left just before the outage ended and held it back from the sweep."""
    harness.prober.nonce = bytes([nonce]) * 8
    harness.answer = lambda name, now: not 1003.0 <= now < 1010.0
    harness.peers("fast", "idle1", "idle2")
    harness.prober.set_rates({"fast": FAST, "idle1": IDLE_2S, "idle2": IDLE_2S})
    harness.run(9.0)  # to 1009: all three dead
    assert {n for n, a, _ in harness.events if not a} == {"fast", "idle1", "idle2"}
    harness.run(3.0)
    back = {n: t for n, a, t in harness.events if a}
    assert set(back) == {"fast", "idle1", "idle2"}
    first = min(back.values())
    assert first < 1010.0 + 0.34  # the fast link's next probe
    # The idle links were probed in the tick the fast one answered, not 0-2 s later.
    assert max(back.values()) - first <= 0.011, back
    # (the harness handles replies after its tick; the timer reads them before it)
    assert min(t for t in harness.sends("idle1") if t >= 1010.0) - first <= 0.011


def test_a_dead_peer_heard_from_is_probed_at_once_and_not_flooded(harness: Harness) -> None:
    """A dead peer's probe reached our responder (``release``): its path is back, so it
    is probed now instead of at its next idle probe; a peer heard from again and again
    is probed early at most once per REVIVE_GAP_S, and a live one is left alone."""
    back = [math.inf]  # the path's return: set once the peer is dead
    harness.answer = lambda name, now: not 1003.0 <= now < back[0]
    harness.peers("idle")
    harness.prober.set_rates({"idle": IDLE_2S})
    harness.run(1.5)
    assert harness.prober.release("idle") is False  # alive: its schedule stands
    harness.run(8.0)
    assert harness.prober.alive("idle") is False
    sent = len(harness.sends("idle"))
    while len(harness.sends("idle")) == sent:
        harness.run(0.01)
    harness.run(0.03)  # just probed (still cut off): not again so soon
    assert harness.prober.release("idle") is False
    harness.run(0.06)
    assert harness.prober.release("idle") is True
    harness.run(0.02)
    assert len(harness.sends("idle")) == sent + 2 and harness.prober.alive("idle") is False
    back[0] = harness.now  # the path is back; the next scheduled probe is ~1.9 s away
    harness.run(0.1)
    assert len(harness.sends("idle")) == sent + 2 and harness.prober.alive("idle") is False
    heard_at = harness.now
    assert harness.prober.release("idle") is True
    assert harness.prober.release("idle") is False  # brought forward already
    harness.run(0.02)
    assert harness.prober.alive("idle") is True
    assert 0 < harness.sends("idle")[-1] - heard_at <= 0.011


def test_an_idle_peer_with_a_phase_is_probed_on_it_and_the_two_ends_apart(
    harness: Harness,
) -> None:
    """``Target.idle_phase``: idle probes at that share of each interval on the wall
    clock. The two ends of a tunnel (phases half apart, here two targets of one prober)
    probe it a second apart, so one of them sees a change within 1 s, not 2 s. Demoted
    from the fast class, the first idle probe is at least half an interval after the
    last fast one; a target without a phase keeps the phase its fast probes had."""
    harness.prober.set_targets(
        [
            Target("a", "127.0.0.1", idle_phase=0.1),
            Target("b", "127.0.0.1", idle_phase=0.6),
            Target("c", "127.0.0.1"),
        ]
    )
    harness.prober.set_rates({n: FAST for n in "abc"})
    harness.run(1.0)
    demoted = harness.now
    last_fast = {n: harness.sends(n)[-1] for n in "abc"}
    harness.prober.set_rates({n: IDLE_2S for n in "abc"})
    harness.run(12.0)
    offset = harness.prober._wall_offset
    for name, phase in (("a", 0.1), ("b", 0.6)):
        idle = [t for t in harness.sends(name) if t > demoted]
        assert 1.0 - 0.011 <= idle[0] - last_fast[name] < 3.0 + GRID_S + 0.011
        for t in idle:  # on the phase, up to the 50 ms grid and a harness step
            assert -0.011 <= ((t + offset) / 2.0 - phase) % 1.0 * 2.0 <= GRID_S + 0.011
        assert all(abs(g - 2.0) <= GRID_S + 0.011 for g in gaps(idle)), gaps(idle)
    a = [t for t in harness.sends("a") if t > demoted]
    b = [t for t in harness.sends("b") if t > demoted]
    assert min(abs(x - y) for x in a for y in b) >= 1.0 - GRID_S - 0.011
    c = [t for t in harness.sends("c") if t > demoted]
    assert c[0] - last_fast["c"] == pytest.approx(2.0, abs=GRID_S + 0.011)
    with pytest.raises(InputError, match="idle_phase"):
        Target("d", "127.0.0.1", idle_phase=1.0)
