"""What the installer wants in the kernel, and the plan that gets it there (pure, no I/O).

A ``DesiredRoute`` or ``DesiredRule`` is normalised on construction to exactly what the
kernel reports back when it is dumped (canonical prefix, IPv6 metric 0 read back as 1024,
a fwmark without mask read back with mask 0xffffffff ...), so "installed == desired"
is plain equality and a reconcile of an unchanged set sends nothing.

Ownership: every route and rule we install carries ``RTPROT_MESHOPT`` (77; not listed
in /etc/iproute2/rt_protos, so ``ip`` prints "proto 77"; nothing is installed in /etc).
Routes live in our own tables (``FAST_TABLE`` for the low-latency class, ``BULK_TABLE``
for bulk traffic), reached through our own policy rules placed before ``main``:

    7601..7700  bulk classifier rules (fwmark, ipproto + dport range, tos) -> BULK_TABLE
    7701        from all lookup FAST_TABLE
    32766       from all lookup main   (the operator's and WireGuard's own routes)

A destination without a route in our table falls through to ``main``: withdrawing a
route (or all of them) leaves the plain WireGuard routes, which is the fail-static state.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meshopt.errors import InputError

RTPROT_MESHOPT = 77
FAST_TABLE = 7701
BULK_TABLE = 7702
FAST_RULE_PRIORITY = 7701
BULK_RULE_PRIORITY = 7601  # first classifier rule; the next ones count up, below 7701
IP6_RT_PRIO_USER = 1024  # the kernel stores an IPv6 route's metric 0 as this
U32_MAX = 0xFFFFFFFF
IPPROTO_NAMES = {"tcp": 6, "udp": 17, "dccp": 33, "sctp": 132}
PORT_PROTOCOLS = frozenset(IPPROTO_NAMES.values())
IPV4_TOS_MASK = 0x1E  # IPv4 rules match only the legacy TOS bits (kernel: "Invalid tos")
_IFNAME = re.compile(r"[^\s/:]{1,15}")
_FAMILIES: dict[int, str] = {socket.AF_INET: "inet", socket.AF_INET6: "inet6"}


def _family_name(family: int) -> str:
    return _FAMILIES.get(family, str(family))


def _check_family(family: int) -> None:
    if family not in _FAMILIES:
        raise InputError(f"address family must be AF_INET or AF_INET6, not {family}")


def _check_int(name: str, value: int | None, low: int, high: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InputError(f"{name} must be an integer in {low}..{high}, not {value!r}")


def _check_table(table: int) -> None:
    _check_int("table", table, 1, U32_MAX)
    if table in (253, 254, 255):
        raise InputError(f"table {table} is a system table (default/main/local); use our own")


@dataclass(frozen=True)
class DesiredRoute:
    """One unicast route we own: ``dst`` via ``gateway`` (or on-link) out of ``oif``.

    The TCP attributes are route metrics (RTAX_*); ``None`` leaves the kernel default
    and is compared as "not set". ``family`` is derived from ``dst``.
    """

    dst: str
    oif: str
    gateway: str | None = None
    table: int = FAST_TABLE
    mtu: int | None = None
    advmss: int | None = None
    initcwnd: int | None = None
    initrwnd: int | None = None
    window: int | None = None
    congctl: str | None = None
    metric: int = 0
    family: int = field(init=False)

    def __post_init__(self) -> None:
        try:
            net = ipaddress.ip_network(self.dst, strict=False)
        except ValueError as exc:
            raise InputError(f"route destination {self.dst!r} is not a prefix: {exc}") from None
        family = socket.AF_INET if net.version == 4 else socket.AF_INET6
        object.__setattr__(self, "dst", str(net))
        object.__setattr__(self, "family", family)
        if not isinstance(self.oif, str) or not _IFNAME.fullmatch(self.oif):
            raise InputError(f"route {self.dst}: bad interface name {self.oif!r}")
        if self.gateway is not None:
            try:
                gw = ipaddress.ip_address(self.gateway)
            except ValueError:
                raise InputError(
                    f"route {self.dst}: gateway {self.gateway!r} is not an address"
                ) from None
            if gw.version != net.version:
                raise InputError(f"route {self.dst}: gateway {gw} is of the other family")
            object.__setattr__(self, "gateway", str(gw))
        _check_table(self.table)
        _check_int("metric", self.metric, 0, U32_MAX)
        if family == socket.AF_INET6 and self.metric == 0:
            object.__setattr__(self, "metric", IP6_RT_PRIO_USER)
        low_mtu = 68 if family == socket.AF_INET else 1280
        _check_int(f"route {self.dst}: mtu", self.mtu, low_mtu, 65535)
        _check_int(f"route {self.dst}: advmss", self.advmss, 1, 65535)
        _check_int(f"route {self.dst}: initcwnd", self.initcwnd, 1, 1024)
        _check_int(f"route {self.dst}: initrwnd", self.initrwnd, 1, 1024)
        _check_int(f"route {self.dst}: window", self.window, 1, U32_MAX)
        if self.congctl is not None and not re.fullmatch(r"[a-z0-9_]{1,15}", self.congctl):
            raise InputError(f"route {self.dst}: bad congestion control name {self.congctl!r}")

    @property
    def key(self) -> tuple[int, str, int, int]:
        """What the kernel replaces on NLM_F_REPLACE: (table, dst, family, metric)."""
        return (self.table, self.dst, self.family, self.metric)

    def describe(self) -> str:
        via = f" via {self.gateway}" if self.gateway else ""
        return f"{self.dst}{via} dev {self.oif} table {self.table} metric {self.metric}"


@dataclass(frozen=True)
class DesiredRule:
    """One policy rule we own: traffic matching every set selector looks up ``table``.

    Selectors: ``fwmark``/``fwmask``; ``ipproto`` with an optional destination port
    range ``dport`` (inclusive); ``tos``. For IPv4 the kernel matches only the legacy
    TOS bits (mask 0x1e) in ``tos``; a DSCP class needs FRA_DSCP (kernel >= 6.13, not
    spoken by pyroute2 0.9), so mark such traffic (nftables) and classify by fwmark.
    For IPv6 ``tos`` is the traffic class byte (DSCP << 2). No selector: all traffic.
    """

    priority: int
    table: int
    fwmark: int | None = None
    fwmask: int | None = None
    dport: tuple[int, int] | None = None
    ipproto: int | None = None
    tos: int | None = None
    family: int = socket.AF_INET

    def __post_init__(self) -> None:
        _check_family(self.family)
        _check_int("rule priority", self.priority, 1, 32765)
        _check_table(self.table)
        _check_int("fwmark", self.fwmark, 0, U32_MAX)
        _check_int("fwmask", self.fwmask, 0, U32_MAX)
        if self.fwmask is not None and self.fwmark is None:
            raise InputError(f"rule {self.priority}: fwmask without fwmark")
        if self.fwmark == 0 and not self.fwmask:
            raise InputError(f"rule {self.priority}: fwmark 0 matches only with a fwmask")
        if self.fwmark and self.fwmask is None:
            object.__setattr__(self, "fwmask", U32_MAX)  # the kernel's default mask
        _check_int("ipproto", self.ipproto, 1, 255)
        if self.dport is not None:
            if len(self.dport) != 2:
                raise InputError(f"rule {self.priority}: dport must be (first, last)")
            lo, hi = self.dport
            _check_int("dport", lo, 1, 65534)
            _check_int("dport", hi, 1, 65534)
            if lo > hi:
                raise InputError(f"rule {self.priority}: dport range {lo}-{hi} is empty")
            if self.ipproto not in PORT_PROTOCOLS:
                raise InputError(
                    f"rule {self.priority}: a dport range needs ipproto tcp, udp, dccp or sctp"
                )
            object.__setattr__(self, "dport", (lo, hi))
        _check_int("tos", self.tos, 0, 255)
        if self.tos == 0:
            object.__setattr__(self, "tos", None)  # 0 matches everything: not a selector
        elif self.tos is not None:
            bad = ~IPV4_TOS_MASK & 0xFF if self.family == socket.AF_INET else 0x03
            if self.tos & bad:
                raise InputError(
                    f"rule {self.priority}: tos {self.tos:#04x} is not valid for "
                    f"{_family_name(self.family)} (allowed bits {~bad & 0xFF:#04x})"
                )

    def describe(self) -> str:
        parts = [f"{self.priority}: from all"]
        if self.fwmark is not None:
            parts.append(f"fwmark {self.fwmark:#x}/{self.fwmask or 0:#x}")
        if self.ipproto is not None:
            parts.append(f"ipproto {self.ipproto}")
        if self.dport is not None:
            parts.append(f"dport {self.dport[0]}-{self.dport[1]}")
        if self.tos is not None:
            parts.append(f"tos {self.tos:#04x}")
        parts.append(f"lookup {self.table} ({_family_name(self.family)})")
        return " ".join(parts)


def fast_rules(
    families: Iterable[int] = (socket.AF_INET, socket.AF_INET6),
    *,
    table: int = FAST_TABLE,
    priority: int = FAST_RULE_PRIORITY,
) -> list[DesiredRule]:
    """``from all lookup FAST_TABLE`` for each family: the low-latency class."""
    return [DesiredRule(priority=priority, table=table, family=f) for f in families]


def bulk_rules(
    *,
    dports: Sequence[tuple[int, int, int | str]] = (),
    fwmarks: Sequence[tuple[int, int | None]] = (),
    tos: Sequence[int] = (),
    families: Iterable[int] = (socket.AF_INET, socket.AF_INET6),
    table: int = BULK_TABLE,
    first_priority: int = BULK_RULE_PRIORITY,
    last_priority: int = FAST_RULE_PRIORITY - 1,
) -> list[DesiredRule]:
    """Classifier rules into the bulk table, numbered from ``first_priority`` per family.

    ``dports``: (first, last, ipproto) with ipproto a number or tcp/udp/dccp/sctp;
    ``fwmarks``: (mark, mask or None); ``tos``: tos bytes. Raises InputError if the
    rules would not all fit below the fast rule.
    """
    selectors: list[DesiredRule] = []  # priority and family filled in below
    for lo, hi, proto in dports:
        number = IPPROTO_NAMES.get(proto, -1) if isinstance(proto, str) else proto
        if number == -1:
            raise InputError(f"unknown ipproto {proto!r}: use tcp, udp, dccp or sctp")
        selectors.append(DesiredRule(first_priority, table, dport=(lo, hi), ipproto=number))
    selectors += [DesiredRule(first_priority, table, fwmark=m, fwmask=k) for m, k in fwmarks]
    selectors += [DesiredRule(first_priority, table, tos=value) for value in tos]
    if first_priority + len(selectors) - 1 > last_priority:
        raise InputError(
            f"too many bulk classifier rules: {len(selectors)} do not fit in priorities "
            f"{first_priority}..{last_priority}"
        )
    return [
        dataclasses.replace(rule, priority=first_priority + i, family=family)
        for family in families
        for i, rule in enumerate(selectors)
    ]


@dataclass(frozen=True)
class Plan:
    """Routes to replace (new or changed), routes to delete (stale), count unchanged."""

    replace: list[DesiredRoute]
    delete: list[DesiredRoute]
    unchanged: int


@dataclass(frozen=True)
class RulePlan:
    """Rules to add (missing), rules to delete (stale), count unchanged."""

    add: list[DesiredRule]
    delete: list[DesiredRule]
    unchanged: int


def _route_order(route: DesiredRoute) -> tuple[object, ...]:
    return (route.key, route.gateway or "", route.oif)


def plan(installed: Sequence[DesiredRoute], desired: Sequence[DesiredRoute]) -> Plan:
    """What to send so that our routes become ``desired``.

    Keyed by (table, dst, family, metric): one route per key, which NLM_F_REPLACE swaps
    in one step. A desired route equal to an installed one is left alone; an installed
    route whose key is not desired is deleted, as is any second installed route of one
    key (``ip route append`` could make one; the installer never does). Raises
    InputError when ``desired`` holds two different routes for one key.
    """
    wanted: dict[tuple[int, str, int, int], DesiredRoute] = {}
    for route in desired:
        other = wanted.setdefault(route.key, route)
        if other != route:
            raise InputError(
                f"two different routes for one key: {other.describe()} / {route.describe()}"
            )
    have: dict[tuple[int, str, int, int], list[DesiredRoute]] = {}
    for route in installed:
        have.setdefault(route.key, []).append(route)
    replace: list[DesiredRoute] = []
    delete: list[DesiredRoute] = []
    unchanged = 0
    for key, route in wanted.items():
        group = have.get(key, [])
        if route in group:
            unchanged += 1
            rest = list(group)
            rest.remove(route)
            delete += rest
        else:
            replace.append(route)
            delete += group[1:]  # the replace takes the place of one of them
    for key, group in have.items():
        if key not in wanted:
            delete += group
    return Plan(
        replace=sorted(replace, key=_route_order),
        delete=sorted(delete, key=_route_order),
        unchanged=unchanged,
    )


def _rule_order(rule: DesiredRule) -> tuple[object, ...]:
    return (rule.family, rule.priority, rule.table, repr(rule))


def plan_rules(installed: Sequence[DesiredRule], desired: Sequence[DesiredRule]) -> RulePlan:
    """What to send so that our rules become ``desired`` (a rule is its whole content)."""
    wanted = set(desired)
    have: dict[DesiredRule, int] = {}
    for rule in installed:
        have[rule] = have.get(rule, 0) + 1
    add = [rule for rule in wanted if rule not in have]
    delete: list[DesiredRule] = []
    for rule, count in have.items():
        delete += [rule] * (count if rule not in wanted else count - 1)
    return RulePlan(
        add=sorted(add, key=_rule_order),
        delete=sorted(delete, key=_rule_order),
        unchanged=len(wanted) - len(add),
    )
