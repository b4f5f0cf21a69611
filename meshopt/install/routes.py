"""Install our routes and rules with pyroute2's ``AsyncIPRoute`` (the netlink adapter).

The kernel is the only state: every reconcile dumps what carries our protocol number
(``RTPROT_MESHOPT``) and plans against it, so an installer started after an agent
restart finds and adopts its routes, and nothing else is ever changed:

1. ``replace`` every new or changed route (NLM_F_REPLACE swaps a route in one step,
   so a destination never goes without one);
2. add missing rules;
3. only then delete stale routes and rules, with our protocol number in the request
   (the kernel then refuses to delete a route or rule of anyone else).

A desired route whose key (table, prefix, metric) is held by somebody else's route is
not installed (reported in ``errors``). A route the kernel refuses (its interface has
gone, ...) is reported with a one-line reason and the others still go in; the last
good version of that route, if any, stays. Enabling forwarding is the agent's job.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import os
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from meshopt.errors import InputError, MeshoptError
from meshopt.install.model import (
    RTPROT_MESHOPT,
    U32_MAX,
    DesiredRoute,
    DesiredRule,
    fast_rules,
    plan,
    plan_rules,
)

CONGESTION_CONTROL_FILE = "/proc/sys/net/ipv4/tcp_available_congestion_control"
_METRICS = {
    "RTAX_MTU": "mtu",
    "RTAX_ADVMSS": "advmss",
    "RTAX_INITCWND": "initcwnd",
    "RTAX_INITRWND": "initrwnd",
    "RTAX_WINDOW": "window",
    "RTAX_CC_ALGO": "congctl",
}
_FAMILIES = (socket.AF_INET, socket.AF_INET6)
RTN_UNICAST = 1
RT_SCOPE_LINK = 253
RT_SCOPE_NOWHERE = 255


class InstallError(MeshoptError):
    """The installer cannot work at all (no namespace, no netlink socket)."""


def _pyroute2() -> Any:
    """pyroute2, imported on demand (it ships no types and takes ~0.4 s to import)."""
    return importlib.import_module("pyroute2")


def available_congestion_control(path: str = CONGESTION_CONTROL_FILE) -> frozenset[str]:
    """The congestion control algorithms the kernel offers (``tcp_available_...``)."""
    try:
        with open(path, encoding="ascii") as f:
            return frozenset(f.read().split())
    except OSError:
        return frozenset()


def check_congctl(routes: Sequence[DesiredRoute], available: frozenset[str]) -> None:
    """Raise InputError for a route asking for congestion control the kernel lacks."""
    for route in routes:
        if route.congctl is not None and route.congctl not in available:
            offered = " ".join(sorted(available)) or "none"
            raise InputError(
                f"route {route.dst}: congestion control {route.congctl!r} is not available "
                f"here (net.ipv4.tcp_available_congestion_control: {offered})"
            )


@dataclass
class ReconcileResult:
    """What one reconcile did. ``errors``: one line per route or rule not installed."""

    replaced: int = 0
    deleted: int = 0
    unchanged: int = 0
    rules_added: int = 0
    rules_deleted: int = 0
    rules_unchanged: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def changes(self) -> int:
        """Netlink changes sent (0 for a reconcile that found everything in place)."""
        return self.replaced + self.deleted + self.rules_added + self.rules_deleted


def _reason(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    if isinstance(code, int) and code > 0:
        return os.strerror(code)
    return str(exc) or type(exc).__name__


def _attr(msg: Any, name: str, default: Any = None) -> Any:
    value = msg.get_attr(name)
    return default if value is None else value


@dataclass(frozen=True)
class _Seen:
    """One route from a dump: ours (parsed) or somebody else's (key and proto only)."""

    key: tuple[int, str, int, int]
    proto: int
    route: DesiredRoute | None


class RouteInstaller:
    """Owned routes and rules in one network namespace (None: the current one).

    ``async with RouteInstaller(ns) as inst: await inst.reconcile(routes)``, or
    ``await open()`` / ``await close()``. Calls are serialised by a lock.
    """

    def __init__(self, netns: str | None = None, *, proto: int = RTPROT_MESHOPT) -> None:
        if not 1 <= proto <= 255 or proto in (1, 2, 3, 4):
            raise InputError(f"route protocol must be 5..255 (not a kernel one), not {proto}")
        self.netns = netns
        self.proto = proto
        self._ipr: Any = None
        self._lock = asyncio.Lock()
        self._available_cc: frozenset[str] | None = None

    # --- lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        """Open the netlink socket (in ``netns``; a missing namespace is an error)."""
        if self._ipr is not None:
            return
        kwargs: dict[str, Any] = {}
        if self.netns is not None:
            kwargs = {"netns": self.netns, "flags": 0}  # flags 0: never create the netns
        ipr = _pyroute2().AsyncIPRoute(**kwargs)
        try:
            await ipr.setup_endpoint()
        except Exception as exc:
            ipr.close()
            where = f"namespace {self.netns}" if self.netns else "this namespace"
            raise InstallError(f"cannot open rtnetlink in {where}: {_reason(exc)}") from exc
        self._ipr = ipr

    async def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None

    async def __aenter__(self) -> RouteInstaller:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def _socket(self) -> Any:
        if self._ipr is None:
            raise InstallError("RouteInstaller is not open (use 'async with' or open())")
        return self._ipr

    # --- reading ----------------------------------------------------------------------

    async def _links(self) -> dict[int, str]:
        links: dict[int, str] = {}
        async for msg in await self._socket.link("dump"):
            links[msg["index"]] = msg.get_attr("IFLA_IFNAME")
        return links

    async def _dump_routes(self, links: dict[int, str]) -> AsyncIterator[_Seen]:
        for family in _FAMILIES:
            async for msg in await self._socket.route("dump", family=family):
                if msg["type"] != RTN_UNICAST:
                    continue  # local, broadcast, multicast ...: never ours
                table = _attr(msg, "RTA_TABLE", msg["table"])
                dst = f"{_attr(msg, 'RTA_DST', '::' if family == socket.AF_INET6 else '0.0.0.0')}"
                prefix = f"{dst}/{msg['dst_len']}"
                metric = _attr(msg, "RTA_PRIORITY", 0)
                key = (table, prefix, family, metric)
                if msg["proto"] != self.proto:
                    yield _Seen(key, msg["proto"], None)
                    continue
                yield _Seen(key, msg["proto"], self._parse_route(msg, links, prefix, metric))

    def _parse_route(
        self, msg: Any, links: dict[int, str], prefix: str, metric: int
    ) -> DesiredRoute:
        oif = _attr(msg, "RTA_OIF", 0)
        metrics: dict[str, Any] = {}
        nla = msg.get_attr("RTA_METRICS")
        if nla is not None:
            for name, value in nla["attrs"]:
                if name in _METRICS:
                    metrics[_METRICS[name]] = value
        return DesiredRoute(
            dst=prefix,
            oif=links.get(oif, f"if{oif}"),  # a multipath route or a vanished link
            gateway=msg.get_attr("RTA_GATEWAY"),
            table=_attr(msg, "RTA_TABLE", msg["table"]),
            metric=metric,
            **metrics,
        )

    async def installed_routes(self) -> list[DesiredRoute]:
        """Our routes (our protocol number), in every table."""
        async with self._lock:
            return await self._installed_routes()

    async def _installed_routes(self) -> list[DesiredRoute]:
        links = await self._links()
        return [seen.route async for seen in self._dump_routes(links) if seen.route]

    async def installed_rules(self) -> list[DesiredRule]:
        """Our policy rules (FRA_PROTOCOL == our protocol number), both families."""
        async with self._lock:
            return await self._installed_rules()

    async def _installed_rules(self) -> list[DesiredRule]:
        rules: list[DesiredRule] = []
        async for msg in await self._socket.rule("dump"):
            if msg.get_attr("FRA_PROTOCOL") != self.proto:
                continue
            ports = msg.get_attr("FRA_DPORT_RANGE")  # "first:last"
            first, _, last = ports.partition(":") if ports else ("", "", "")
            mark = msg.get_attr("FRA_FWMARK")
            mask = msg.get_attr("FRA_FWMASK")
            rules.append(
                DesiredRule(
                    priority=_attr(msg, "FRA_PRIORITY", 0),
                    table=_attr(msg, "FRA_TABLE", msg["table"]),
                    fwmark=mark if (mark or mask) else None,
                    fwmask=mask if (mark or mask) else None,
                    dport=(int(first), int(last)) if ports else None,
                    ipproto=msg.get_attr("FRA_IP_PROTO"),
                    tos=msg["tos"] or None,
                    family=msg["family"],
                )
            )
        return rules

    # --- writing ----------------------------------------------------------------------

    def _route_args(self, route: DesiredRoute, oif: int) -> dict[str, Any]:
        args: dict[str, Any] = {
            "dst": route.dst,
            "family": route.family,
            "table": route.table,
            "proto": self.proto,
            "priority": route.metric,
            "oif": oif,
        }
        if route.gateway is not None:
            args["gateway"] = route.gateway
        else:  # on-link, as `ip route add PREFIX dev IF`: it can then validate a gateway
            args["scope"] = RT_SCOPE_LINK
        metrics = {
            "mtu": route.mtu,
            "advmss": route.advmss,
            "initcwnd": route.initcwnd,
            "initrwnd": route.initrwnd,
            "window": route.window,
            "cc_algo": route.congctl,
        }
        metrics = {k: v for k, v in metrics.items() if v is not None}
        if metrics:
            args["metrics"] = metrics
        return args

    def _rule_args(self, rule: DesiredRule) -> dict[str, Any]:
        args: dict[str, Any] = {
            "family": rule.family,
            "priority": rule.priority,
            "table": rule.table,
            "protocol": self.proto,
        }
        if rule.fwmark is not None:
            args["fwmark"] = rule.fwmark
            args["fwmask"] = U32_MAX if rule.fwmask is None else rule.fwmask
        if rule.ipproto is not None:
            args["ip_proto"] = rule.ipproto
        if rule.dport is not None:
            args["dport_range"] = f"{rule.dport[0]}:{rule.dport[1]}"
        if rule.tos is not None:
            args["tos"] = rule.tos
        return args

    async def _delete_route(self, route: DesiredRoute, links: dict[int, str]) -> bool:
        """Delete one of our routes; False if it was already gone."""
        args: dict[str, Any] = {
            "dst": route.dst,
            "family": route.family,
            "table": route.table,
            "proto": self.proto,  # the kernel then deletes only a route of ours
            "priority": route.metric,
            "scope": RT_SCOPE_NOWHERE,  # "any scope", as `ip route del` sends
        }
        if route.gateway is not None:
            args["gateway"] = route.gateway
        index = {name: i for i, name in links.items()}.get(route.oif)
        if index is not None:
            args["oif"] = index
        try:
            await self._socket.route("del", **args)
        except Exception as exc:
            if getattr(exc, "code", None) == errno.ESRCH:
                return False
            raise
        return True

    async def _delete_rule(self, rule: DesiredRule) -> bool:
        try:
            await self._socket.rule("del", **self._rule_args(rule))
        except Exception as exc:
            if getattr(exc, "code", None) == errno.ENOENT:
                return False
            raise
        return True

    async def reconcile(
        self,
        routes: Sequence[DesiredRoute],
        rules: Sequence[DesiredRule] | None = None,
    ) -> ReconcileResult:
        """Make our routes and rules exactly ``routes`` and ``rules``.

        ``rules=None`` means the fast rule for both families (``fast_rules()``); pass
        ``[]`` for no rules. Raises InputError (before changing anything) for a set that
        cannot be right: two routes for one key, unavailable congestion control.
        """
        wanted_rules = fast_rules() if rules is None else list(rules)
        if self._available_cc is None:
            self._available_cc = available_congestion_control()
        check_congctl(routes, self._available_cc)
        async with self._lock:
            result = ReconcileResult()
            links = await self._links()
            index = {name: i for i, name in links.items()}
            ours: list[DesiredRoute] = []
            foreign: dict[tuple[int, str, int, int], int] = {}
            async for seen in self._dump_routes(links):
                if seen.route is not None:
                    ours.append(seen.route)
                else:
                    foreign.setdefault(seen.key, seen.proto)
            route_plan = plan(ours, routes)
            rule_plan = plan_rules(await self._installed_rules(), wanted_rules)
            result.unchanged = route_plan.unchanged
            result.rules_unchanged = rule_plan.unchanged

            for route in route_plan.replace:  # 1. new and changed routes, in place
                if route.key in foreign:
                    result.errors.append(
                        f"{route.describe()}: the prefix is held there by a route of "
                        f"proto {foreign[route.key]}; left alone"
                    )
                    continue
                if route.oif not in index:
                    result.errors.append(f"{route.describe()}: no interface {route.oif}")
                    continue
                try:
                    await self._socket.route("replace", **self._route_args(route, index[route.oif]))
                except Exception as exc:
                    result.errors.append(f"{route.describe()}: {_reason(exc)}")
                    continue
                result.replaced += 1

            for rule in rule_plan.add:  # 2. missing rules
                try:
                    await self._socket.rule("add", **self._rule_args(rule))
                except Exception as exc:
                    result.errors.append(f"rule {rule.describe()}: {_reason(exc)}")
                    continue
                result.rules_added += 1

            for route in route_plan.delete:  # 3. stale routes and rules, last
                try:
                    result.deleted += await self._delete_route(route, links)
                except Exception as exc:
                    result.errors.append(f"delete {route.describe()}: {_reason(exc)}")
            for rule in rule_plan.delete:
                try:
                    result.rules_deleted += await self._delete_rule(rule)
                except Exception as exc:
                    result.errors.append(f"delete rule {rule.describe()}: {_reason(exc)}")
            return result

    async def withdraw(self) -> int:
        """Remove all our rules (traffic falls back to main at once), then our routes.

        Returns how many routes and rules were removed. Never touches anything else.
        """
        async with self._lock:
            removed = 0
            for rule in await self._installed_rules():
                removed += await self._delete_rule(rule)
            links = await self._links()
            for route in await self._installed_routes():
                removed += await self._delete_route(route, links)
            return removed
