"""The agent's pure core: which route set it installs, and what it signs.

Every refused set here carries routes different from the installed ones, so "nothing
was installed" is a real check: removing any of the core's rules makes a test fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshopt.agent.core import AgentCore, RouteState
from meshopt.bus.freshness import first_seq
from meshopt.bus.messages import Route, RouteSet, decode_status, decode_telemetry
from meshopt.bus.signing import (
    generate_signing_key,
    sign_route_set,
    unsigned_payload,
    verify_status,
    verify_telemetry,
)
from meshopt.wireguard.keys import generate_keypair

MESH = "lab"
T0 = 1_800_000_000.0
PEERS = [generate_keypair()[1] for _ in range(3)]
CTL, CTL_PUB = generate_signing_key()


def route_set(version: int, term: int = int(T0), via: int = 0, **kw: Any) -> bytes:
    base: dict[str, Any] = dict(
        mesh=MESH,
        node="a",
        version=version,
        issued_at=T0,
        controller="ctl1",
        term=term,
        routes=[Route(dst="10.99.0.3/32", via=PEERS[via])],
    )
    base.update(kw)
    return sign_route_set(RouteSet(**base), CTL)


def core(state: RouteState | None = None, keys: list[str] | None = None) -> AgentCore:
    identity, _ = generate_signing_key()
    return AgentCore(
        MESH, "a", identity, [CTL_PUB] if keys is None else keys, state or RouteState(), T0
    )


def via(c: AgentCore) -> str | None:
    return c.route_set.routes[0].via if c.route_set is not None else None


V = first_seq(T0)


def refused(c: AgentCore, data: bytes, reason: str) -> None:
    before = (via(c), c.state.version, c.state.term)
    n0 = c.counters[f"routeset_{reason}"]
    assert c.on_route_set(data, T0) is None
    assert c.counters[f"routeset_{reason}"] == n0 + 1, c.counters
    assert (via(c), c.state.version, c.state.term) == before


def test_a_trusted_newer_set_is_installed_and_persisted() -> None:
    c = core()
    got = c.on_route_set(route_set(V, via=1), T0)
    assert got is not None and got.save and via(c) == PEERS[1]
    assert (c.state.version, c.state.term) == (V, int(T0))


def test_wrong_key_is_refused() -> None:
    c = core()
    c.on_route_set(route_set(V), T0)
    forger, _ = generate_signing_key()
    rs = RouteSet(
        mesh=MESH,
        node="a",
        version=V + 1,
        issued_at=T0,
        controller="evil",
        term=int(T0),
        routes=[Route(dst="10.99.0.3/32", via=PEERS[2])],
    )
    refused(c, sign_route_set(rs, forger), "unknown_key")


def test_no_controller_key_installs_nothing() -> None:
    c = core(keys=[])
    refused(c, route_set(V), "unknown_key")


def test_replays_and_duplicates_are_refused() -> None:
    c = core()
    c.on_route_set(route_set(V + 10, via=1), T0)
    refused(c, route_set(V + 5, via=2), "replay")
    refused(c, route_set(V + 10, via=2), "replay")  # the same version again
    assert c.on_route_set(route_set(V + 11, via=2), T0) is not None


def test_an_older_term_is_refused() -> None:
    c = core()
    c.on_route_set(route_set(V, term=int(T0) + 5, via=1), T0)
    refused(c, route_set(V + 1, term=int(T0) + 4, via=2), "old_term")


def test_a_set_for_another_node_is_refused() -> None:
    c = core()
    c.on_route_set(route_set(V, via=1), T0)
    refused(c, route_set(V + 1, via=2, node="b"), "wrong_node")
    refused(c, route_set(V + 1, via=2, mesh="other"), "wrong_node")


def test_terms_and_versions_the_clock_cannot_explain_are_refused() -> None:
    c = core()
    c.on_route_set(route_set(V, via=1), T0)
    refused(c, route_set(V + 1, term=2**62, via=2), "term_jump")
    refused(c, route_set(2**62, via=2), "bad_version")
    # Within the slack (a controller a little ahead of us) is fine.
    assert c.on_route_set(route_set(V + 1, term=int(T0) + 600, via=2), T0) is not None


def test_state_from_before_a_restart_still_refuses_older_sets() -> None:
    c = core(RouteState(version=V + 10, term=int(T0)))
    refused(c, route_set(V + 9, via=2), "replay")
    # The installed version itself is taken once after a restart (the retained set).
    got = c.on_route_set(route_set(V + 10, via=1), T0)
    assert got is not None and not got.save


def test_status_will_and_telemetry_carry_the_session() -> None:
    identity, public = generate_signing_key()
    c = AgentCore(MESH, "a", identity, [CTL_PUB], RouteState(), T0)
    topic, will, retain = c.new_session(T0)
    assert topic == "meshopt/lab/status/a" and retain
    w = verify_status(will, [public], mesh=MESH, node="a")
    online = verify_status(c.online(T0 + 1), [public], mesh=MESH, node="a")
    assert (w.online, online.online) == (False, True)
    assert w.seq == online.seq == c.session > first_seq(T0)
    t = verify_telemetry(
        c.telemetry(T0 + 2, public_keys=PEERS[:1], addresses=[], full=True, peers=[], counters={}),
        [public],
        mesh=MESH,
        node="a",
    )
    assert t.session == c.session and t.seq > c.session
    # A new connection starts a newer session.
    c.new_session(T0 + 3)
    assert c.session > t.seq
    # What the agent signs is readable without the key (for `meshopt routes`).
    assert decode_status(unsigned_payload(will, "status")) == w
    data = c.telemetry(T0, public_keys=PEERS[:1], addresses=[], full=False, peers=[], counters={})
    assert decode_telemetry(unsigned_payload(data, "telemetry")).full is False


@pytest.mark.parametrize("garbage", [b"", b"{}", b"\xff" * 10, b'{"v":1,"kind":"routes"}'])
def test_garbage_is_counted_not_raised(garbage: bytes) -> None:
    c = core()
    assert c.on_route_set(garbage, T0) is None
    assert c.counters.total() == 1
