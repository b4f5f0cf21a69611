"""Route sets to routes and AllowedIPs: relays, fail-over, refused routes, gap-free moves."""

from __future__ import annotations

from meshopt.agent.peers import PeerInfo
from meshopt.agent.plan import allowed_ips_updates, own_prefixes_from, plan_node, prefix_owner
from meshopt.agent.probeaddr import probe_prefix
from meshopt.bus.messages import Route
from meshopt.wireguard.keys import generate_keypair

B, C, D = (generate_keypair()[1] for _ in range(3))
ME = generate_keypair()[1]
ADDR = {B: "10.9.0.2/32", C: "10.9.0.3/32", D: "10.9.0.4/32"}


def _peers(layout: str = "single") -> dict[str, PeerInfo]:
    out = {}
    for k, a in ADDR.items():
        ifname = "wg0" if layout == "single" else f"wg-{a.split('.')[3][0]}"
        allowed = (a,) if layout == "single" else ("0.0.0.0/0", "::/0")
        out[k] = PeerInfo(
            public_key=k,
            ifname=ifname,
            own_key=ME,
            layout=layout,
            allowed_ips=allowed,
            endpoint=None,
            handshake_age_s=None,
            rx_bytes=0,
            tx_bytes=0,
        )
    return out


def _plan(routes: list[Route], layout: str = "single", dead: frozenset[str] = frozenset()):  # type: ignore[no-untyped-def]
    peers = _peers(layout)
    return plan_node(
        routes,
        peers,
        lambda k: k not in dead,
        mesh_prefixes=["10.9.0.0/16"],
        own_prefixes=["10.9.0.1/32"],
        baseline={k: p.allowed_ips for k, p in peers.items()},
        fast_table=7701,
        bulk_table=7702,
    )


def test_relay_moves_allowed_ips_in_single_layout() -> None:
    plan = _plan([Route(dst="10.9.0.2/32", via=C), Route(dst="10.9.0.3/32", via=C)])
    assert [(r.dst, r.oif, r.table) for r in plan.routes] == [
        ("10.9.0.2/32", "wg0", 7701),
        ("10.9.0.3/32", "wg0", 7701),
    ]
    wg0 = plan.allowed_ips["wg0"]
    assert "10.9.0.2/32" not in wg0[B] and probe_prefix(B) in wg0[B]
    assert set(wg0[C]) == {"10.9.0.2/32", "10.9.0.3/32", probe_prefix(C)}
    assert set(wg0[D]) == {"10.9.0.4/32", probe_prefix(D)}  # not routed: baseline kept
    assert not plan.rejected and not plan.failovers


def test_per_peer_layout_routes_choose_the_interface() -> None:
    plan = _plan([Route(dst="10.9.0.2/32", via=C, table="fast")], layout="per-peer")
    assert [(r.dst, r.oif) for r in plan.routes] == [("10.9.0.2/32", "wg-3")]
    assert plan.allowed_ips["wg-2"][B] == ("0.0.0.0/0", "::/0")  # already covers probes


def test_dead_next_hop_fails_over_to_backup_or_direct() -> None:
    routes = [Route(dst="10.9.0.2/32", via=C, backup=D), Route(dst="10.9.0.4/32", via=C)]
    plan = _plan(routes, dead=frozenset({C}))
    assert [(r.dst, f.now_via) for r, f in zip(routes, plan.failovers, strict=True)] == [
        ("10.9.0.2/32", D),
        ("10.9.0.4/32", None),
    ]
    wg0 = plan.allowed_ips["wg0"]
    assert "10.9.0.2/32" in wg0[D]
    assert [r.dst for r in plan.routes] == ["10.9.0.2/32"]  # 10.9.0.4 falls back to main
    assert "10.9.0.4/32" in wg0[D]  # its baseline owner, i.e. the direct tunnel
    # Backup dead too: the route is withdrawn, never sent into a dead relay.
    plan = _plan(routes[:1], dead=frozenset({C, D}))
    assert not plan.routes and plan.failovers[0].now_via is None
    assert "10.9.0.2/32" in plan.allowed_ips["wg0"][B]


def test_bad_routes_are_refused_with_reasons_and_never_installed() -> None:
    stranger = generate_keypair()[1]
    routes = [
        Route(dst="10.8.0.2/32", via=C),  # outside the mesh
        Route(dst="10.9.0.5/32", via=stranger),  # unknown peer
        Route(dst="10.9.0.1/32", via=C),  # our own address
        Route(dst="10.9.0.2/32", via=C),
        Route(dst="10.9.0.2/32", via=D),  # duplicate
        Route(dst="10.9.0.3/32", via=B, table="bulk"),  # bulk differs from fast on one iface
    ]
    plan = _plan(routes)
    assert [r.reason for r in plan.rejected] == [
        "outside_mesh",
        "unknown_peer",
        "own_prefix",
        "duplicate",
        "bulk_needs_per_peer_layout",
    ]
    assert [r.dst for r in plan.routes] == ["10.9.0.2/32"]


def test_allowed_ips_move_without_a_gap() -> None:
    peers = _peers()
    plan = _plan([Route(dst="10.9.0.2/32", via=C)])
    updates = allowed_ips_updates(peers, plan.allowed_ips)
    steps = updates["wg0"].peers
    # The gaining peer comes first (adding to C takes the prefix from B atomically)...
    first_gain = next(i for i, u in enumerate(steps) if "10.9.0.2/32" in u.allowed_ips)
    assert steps[first_gain].public_key == C and not steps[first_gain].replace_allowed_ips
    # ...and every step only updates existing peers, never creates one.
    assert all(u.update_only for u in steps)
    # Applying the plan's own result again needs nothing.
    after = {
        k: PeerInfo(**{**p.__dict__, "allowed_ips": plan.allowed_ips["wg0"][k]})
        for k, p in peers.items()
    }
    assert allowed_ips_updates(after, plan.allowed_ips) == {}


def test_own_prefixes_skip_link_local() -> None:
    assert own_prefixes_from(["10.9.0.1/16", "fe80::1/64", "10.9.0.1/16"]) == ["10.9.0.1/32"]


def test_without_a_route_set_allowed_ips_are_kept() -> None:
    """Fail-static after a restart: what the last run set up stays until a route set comes."""
    peers = _peers()
    moved = {
        k: PeerInfo(**{**p.__dict__, "allowed_ips": a})
        for (k, p), a in zip(
            peers.items(), [(), ("10.9.0.2/32", "10.9.0.3/32"), ("10.9.0.4/32",)], strict=True
        )
    }
    plan = plan_node(
        [],
        moved,
        lambda _k: True,
        mesh_prefixes=["10.9.0.0/16"],
        own_prefixes=["10.9.0.1/32"],
        baseline={k: p.allowed_ips for k, p in peers.items()},
        fast_table=7701,
        bulk_table=7702,
        keep_current=True,
    )
    assert set(plan.allowed_ips["wg0"][C]) == {"10.9.0.2/32", "10.9.0.3/32", probe_prefix(C)}
    assert plan.allowed_ips["wg0"][B] == (probe_prefix(B),)


def test_prefix_owner_is_the_most_specific_baseline_and_nobody_when_unclear() -> None:
    probe = probe_prefix(generate_keypair()[1])
    owner = prefix_owner(
        {
            "hub": ["10.0.0.0/24", "fd00::/64", probe],
            "spoke": ["10.0.0.7/32", "0.0.0.0/0"],
            "other": ["10.0.1.5/32", "::/0"],
            "twin1": ["10.0.2.0/24"],
            "twin2": ["10.0.2.0/24"],
            "bad": ["not a prefix"],
        }
    )
    assert owner("10.0.0.7/32") == "spoke"  # its own /32 beats the hub's /24
    assert owner("10.0.0.9/32") == "hub"
    assert owner("10.0.0.0/25") == "hub"
    assert owner("fd00::5/128") == "hub"
    assert owner("10.0.1.5/32") == "other"
    assert owner("10.0.2.1/32") is None  # two peers hold it alike
    assert owner("192.168.1.1/32") is None  # only default routes hold it: nobody's
    assert owner("10.0.0.0/16") is None  # wider than any baseline prefix
    assert owner(probe) is None  # link-local: probe addresses name nobody
    assert owner("garbage") is None
    assert prefix_owner({})("10.0.0.1/32") is None


def test_only_the_larger_key_defers_its_first_probe_and_only_before_a_handshake() -> None:
    """Both ends of a tunnel initiating WireGuard's first handshake at once lose it for
    5 s; one end per tunnel (the larger key) holds its first probe so the other's
    initiation goes alone. Once the tunnel has handshaked nobody waits."""
    from meshopt.agent.peers import HANDSHAKE_DEFER_S, first_probe_delay

    p = _peers()[B]
    small, large = sorted([p.public_key, ME])
    mine = PeerInfo(**{**p.__dict__, "own_key": large, "public_key": small})
    theirs = PeerInfo(**{**p.__dict__, "own_key": small, "public_key": large})
    assert first_probe_delay(mine) == HANDSHAKE_DEFER_S > 0
    assert first_probe_delay(theirs) == 0.0  # exactly one end of the tunnel waits
    done = PeerInfo(**{**mine.__dict__, "handshake_age_s": 3.0})
    assert first_probe_delay(done) == 0.0


def test_the_two_ends_of_a_tunnel_probe_it_idle_half_an_interval_apart() -> None:
    """Each end computes its idle phase from the two keys alone: they agree on the
    tunnel's phase and sit half an interval apart; other tunnels get other phases."""
    from meshopt.agent.peers import idle_phase

    p = _peers()[B]
    one = PeerInfo(**{**p.__dict__, "own_key": ME, "public_key": p.public_key})
    other = PeerInfo(**{**p.__dict__, "own_key": p.public_key, "public_key": ME})
    a, b = idle_phase(one), idle_phase(other)
    assert 0.0 <= a < 1.0 and 0.0 <= b < 1.0
    assert abs(abs(a - b) - 0.5) < 1e-9
    phases = {
        idle_phase(PeerInfo(**{**p.__dict__, "own_key": ME, "public_key": f"{k:043d}="}))
        for k in range(20)
    }
    assert len(phases) == 20 and max(phases) - min(phases) > 0.5  # spread over the mesh


def test_a_probe_names_its_sender_by_probe_address_whatever_its_scope() -> None:
    """The responder reports who it heard by source address (link-local, with the
    interface as scope); the agent releases that peer's held first probe."""
    import ipaddress

    from meshopt.agent.peers import heard_from, peers_by_probe_address

    peers = _peers()
    by = peers_by_probe_address(peers.values())
    p = peers[B]
    scoped = ipaddress.IPv6Address(f"{p.probe_address}%{p.ifname}")
    assert heard_from(by, scoped) == B
    assert heard_from(by, ipaddress.ip_address(p.probe_address)) == B
    assert heard_from(by, ipaddress.IPv6Address("fe80::1%wg0")) is None
    assert heard_from(by, ipaddress.IPv4Address("10.0.0.1")) is None
