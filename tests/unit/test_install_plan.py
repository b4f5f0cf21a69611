"""The installer's pure part: route/rule normalisation, the plan, and the TCP tuning."""

from __future__ import annotations

import socket

import pytest

from meshopt.errors import InputError
from meshopt.install import (
    BULK_TABLE,
    FAST_TABLE,
    DesiredRoute,
    DesiredRule,
    bulk_rules,
    fast_rules,
    plan,
    plan_rules,
    tcp_tuning,
)
from meshopt.install.routes import check_congctl

A = DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.2")
B = DesiredRoute("10.2.0.0/24", "wg0", "10.0.0.3")
C = DesiredRoute("10.3.0.0/24", "wg0")


# --- normalisation: equal to what the kernel reports -----------------------------------


def test_route_is_normalised_to_what_the_kernel_reports() -> None:
    r = DesiredRoute("10.1.0.7/24", "wg0", "10.0.0.2")
    assert r.dst == "10.1.0.0/24" and r.family == socket.AF_INET and r.table == FAST_TABLE
    assert DesiredRoute("10.9.9.9", "wg0").dst == "10.9.9.9/32"
    v6 = DesiredRoute("FD00:0:0:1::/64", "wg0", "FD00::0002")
    assert (v6.dst, v6.gateway, v6.family) == ("fd00:0:0:1::/64", "fd00::2", socket.AF_INET6)
    assert v6.metric == 1024  # the kernel stores IPv6 metric 0 as 1024
    assert v6 == DesiredRoute("fd00:0:0:1::/64", "wg0", "fd00::2", metric=1024)
    assert v6.key == (FAST_TABLE, "fd00:0:0:1::/64", socket.AF_INET6, 1024)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dst": "10.0.0.0/33", "oif": "wg0"},
        {"dst": "nonsense", "oif": "wg0"},
        {"dst": "10.0.0.0/24", "oif": "a/b"},
        {"dst": "10.0.0.0/24", "oif": "x" * 16},
        {"dst": "10.0.0.0/24", "oif": "wg0", "gateway": "fd00::1"},
        {"dst": "10.0.0.0/24", "oif": "wg0", "table": 254},
        {"dst": "10.0.0.0/24", "oif": "wg0", "table": 0},
        {"dst": "10.0.0.0/24", "oif": "wg0", "mtu": 40},
        {"dst": "fd00::/64", "oif": "wg0", "mtu": 1200},
        {"dst": "10.0.0.0/24", "oif": "wg0", "window": True},
        {"dst": "10.0.0.0/24", "oif": "wg0", "congctl": "cubic; rm"},
    ],
)
def test_bad_route_is_an_input_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(InputError):
        DesiredRoute(**kwargs)  # type: ignore[arg-type]


def test_rule_is_normalised_and_checked() -> None:
    assert DesiredRule(7601, BULK_TABLE, fwmark=0x10).fwmask == 0xFFFFFFFF
    assert DesiredRule(7601, BULK_TABLE, tos=0).tos is None
    assert DesiredRule(7601, BULK_TABLE, fwmark=0, fwmask=0xFF).fwmark == 0
    DesiredRule(7601, BULK_TABLE, tos=0x20, family=socket.AF_INET6)  # DSCP CS1 on IPv6
    for bad in (
        {"fwmask": 0xFF},  # mask without mark
        {"fwmark": 0},  # matches everything
        {"dport": (5000, 5100)},  # no ipproto
        {"dport": (5100, 5000), "ipproto": 6},
        {"dport": (10, 65535), "ipproto": 6},  # the kernel refuses 65535
        {"tos": 0x20},  # IPv4 rules match only the legacy TOS bits 0x1e
        {"priority": 0},
    ):
        with pytest.raises(InputError):
            DesiredRule(**{"priority": 7601, "table": BULK_TABLE, **bad})  # type: ignore[arg-type]


def test_fast_and_bulk_rule_helpers() -> None:
    assert fast_rules() == [
        DesiredRule(7701, FAST_TABLE, family=socket.AF_INET),
        DesiredRule(7701, FAST_TABLE, family=socket.AF_INET6),
    ]
    rules = bulk_rules(
        dports=[(5000, 5100, "tcp")], fwmarks=[(0x10, 0xFF)], families=[socket.AF_INET]
    )
    assert rules == [
        DesiredRule(7601, BULK_TABLE, dport=(5000, 5100), ipproto=6),
        DesiredRule(7602, BULK_TABLE, fwmark=0x10, fwmask=0xFF),
    ]
    assert all(r.priority < 7701 for r in rules)  # before the fast rule
    with pytest.raises(InputError):
        bulk_rules(dports=[(1, 2, "icmp")])
    with pytest.raises(InputError):
        bulk_rules(fwmarks=[(m, None) for m in range(1, 102)])  # 101 > 100 slots


# --- route plan ----------------------------------------------------------------------


def test_plan_new_routes_are_replaced() -> None:
    p = plan([], [B, A])
    assert (p.replace, p.delete, p.unchanged) == ([A, B], [], 0)


def test_plan_unchanged_sends_nothing() -> None:
    p = plan([A, B], [DesiredRoute("10.1.0.9/24", "wg0", "10.0.0.2"), B])
    assert (p.replace, p.delete, p.unchanged) == ([], [], 2)


@pytest.mark.parametrize(
    "changed",
    [
        DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.9"),  # next hop
        DesiredRoute("10.1.0.0/24", "wg1", "10.0.0.2"),  # interface
        DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.2", mtu=1380),  # attribute set
        DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.2", congctl="cubic"),
    ],
)
def test_plan_changed_route_is_replaced_in_place_not_deleted(changed: DesiredRoute) -> None:
    p = plan([A], [changed])
    assert (p.replace, p.delete, p.unchanged) == ([changed], [], 0)


def test_plan_attribute_removed_is_a_change() -> None:
    tuned = DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.2", mtu=1420, advmss=1380)
    p = plan([tuned], [A])
    assert p.replace == [A] and p.delete == []


def test_plan_stale_routes_are_deleted() -> None:
    p = plan([A, B, C], [A])
    assert (p.replace, p.delete, p.unchanged) == ([], [B, C], 1)


def test_plan_other_table_or_metric_is_another_route() -> None:
    bulk_a = DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.3", table=BULK_TABLE)
    metric_a = DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.4", metric=10)
    p = plan([A], [A, bulk_a, metric_a])
    assert p.replace == [metric_a, bulk_a] and p.delete == [] and p.unchanged == 1
    p = plan([A, bulk_a], [bulk_a])
    assert p.replace == [] and p.delete == [A]


def test_plan_duplicate_installed_routes_of_one_key_collapse() -> None:
    twin = DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.8")
    assert plan([A, twin], [A]).delete == [twin]
    p = plan([A, twin], [DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.9")])
    assert len(p.replace) == 1 and p.delete == [twin]


def test_plan_refuses_two_desired_routes_for_one_key() -> None:
    with pytest.raises(InputError, match="two different routes"):
        plan([], [A, DesiredRoute("10.1.0.0/24", "wg0", "10.0.0.9")])
    assert plan([], [A, A]).replace == [A]  # the same route twice is fine


# --- rule plan -----------------------------------------------------------------------


def test_rule_plan() -> None:
    fast4, fast6 = fast_rules()
    mark = DesiredRule(7601, BULK_TABLE, fwmark=0x10, fwmask=0xFF)
    ports = DesiredRule(7602, BULK_TABLE, dport=(5000, 5100), ipproto=6)
    p = plan_rules([], [fast4, mark])
    assert (p.add, p.delete, p.unchanged) == ([mark, fast4], [], 0)
    p = plan_rules([fast4, mark], [fast4, mark])
    assert (p.add, p.delete, p.unchanged) == ([], [], 2)
    p = plan_rules([fast4, mark, fast6], [fast4, ports])
    assert (p.add, p.delete, p.unchanged) == ([ports], [mark, fast6], 1)
    p = plan_rules([fast4, fast4], [fast4])  # a duplicate of ours goes
    assert (p.add, p.delete, p.unchanged) == ([], [fast4], 1)


# --- congestion control ----------------------------------------------------------------


def test_congctl_must_be_available() -> None:
    cubic = DesiredRoute("10.1.0.0/24", "wg0", congctl="cubic")
    check_congctl([A, cubic], frozenset({"cubic", "reno"}))
    with pytest.raises(InputError, match="'bbr2' is not available"):
        check_congctl([DesiredRoute("10.1.0.0/24", "wg0", congctl="bbr2")], frozenset({"cubic"}))


# --- TCP tuning, values checked by hand ------------------------------------------------


def test_tuning_direct_default_underlay() -> None:
    # 1500 - 80 (IPv6 outer, the default assumption) = 1420 = the wg interface MTU
    t = tcp_tuning(None, socket.AF_INET, None, None, relay_hops=0)
    assert t == {"mtu": 1420, "advmss": 1380, "window": None, "initcwnd": None, "initrwnd": None}
    t6 = tcp_tuning(None, socket.AF_INET6, None, None, relay_hops=0)
    assert (t6["mtu"], t6["advmss"]) == (1420, 1360)


def test_tuning_relayed_path_takes_the_narrowest_hop() -> None:
    # hops 1500, 1400, 1500 over IPv4 underlay: min(1440, 1340, 1440) = 1340
    t = tcp_tuning(
        [1500, 1400, 1500], socket.AF_INET, None, None, relay_hops=2, underlay_family=socket.AF_INET
    )
    assert (t["mtu"], t["advmss"]) == (1340, 1300)
    # an IPv4 underlay of 1500 would allow 1440, but the interface MTU caps it at 1420
    t = tcp_tuning([1500], socket.AF_INET, None, None, relay_hops=0, underlay_family=2)
    assert t["mtu"] == 1420


def test_tuning_windows_from_the_bandwidth_delay_product() -> None:
    # 50 Mbit/s x 40 ms = 250 000 B; window 2 x BDP = 500 000
    # segments 250000 / 1380 = 181.2; initcwnd ceil(181.2 / 8) = 23; initrwnd 46
    t = tcp_tuning(None, socket.AF_INET, 50.0, 40.0, relay_hops=1)
    assert t == {"mtu": 1420, "advmss": 1380, "window": 500_000, "initcwnd": 23, "initrwnd": 46}
    # LAN: 100 Mbit/s x 1 ms = 12 500 B -> window floor 65 536, initcwnd floor 10
    t = tcp_tuning(None, socket.AF_INET, 100.0, 1.0, relay_hops=0)
    assert (t["window"], t["initcwnd"], t["initrwnd"]) == (65_536, 10, 20)
    # 10 Gbit/s x 200 ms = 250 MB -> window ceiling 32 MiB, initcwnd 32, initrwnd 64
    t = tcp_tuning(None, socket.AF_INET, 10_000.0, 200.0, relay_hops=0)
    assert (t["window"], t["initcwnd"], t["initrwnd"]) == (32 * 1024 * 1024, 32, 64)


def test_tuning_result_builds_a_route() -> None:
    t = tcp_tuning(None, socket.AF_INET, 50.0, 40.0, relay_hops=0)
    route = DesiredRoute("10.1.0.0/24", "wg0", table=BULK_TABLE, congctl="cubic", **t)
    assert (route.mtu, route.window) == (1420, 500_000)


@pytest.mark.parametrize(
    ("hops", "family", "bw", "rtt", "relays"),
    [
        ([1500], socket.AF_INET, None, None, 1),  # 1 MTU for 2 hops
        ([1300], socket.AF_INET6, None, None, 0),  # 1300 - 80 < 1280
        (None, socket.AF_INET, -5.0, 10.0, 0),
        (None, socket.AF_INET, 5.0, float("nan"), 0),
        (None, 99, None, None, 0),
        (None, socket.AF_INET, None, None, -1),
    ],
)
def test_tuning_bad_input(
    hops: list[int] | None, family: int, bw: float | None, rtt: float | None, relays: int
) -> None:
    with pytest.raises(InputError):
        tcp_tuning(hops, family, bw, rtt, relay_hops=relays)
