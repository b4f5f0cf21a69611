"""The route installer against a real kernel, inside a fresh namespace per test.

Everything is checked through ``ip`` (what an operator sees), not only through pyroute2:
routes with proto 77 in table 7701, our rules, routes of others left alone, replaces
that never leave a gap, classifier rules that really select the bulk table, and route
attributes that a real TCP connection picks up.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from meshopt.errors import InputError
from meshopt.install import (
    BULK_TABLE,
    FAST_TABLE,
    DesiredRoute,
    DesiredRule,
    InstallError,
    ReconcileResult,
    RouteInstaller,
    bulk_rules,
    fast_rules,
)

from .conftest import new_lab_id

pytestmark = pytest.mark.lab

MakeNetns = Callable[[str, int], list[str]]


def ip(ns: str, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"ip -n {ns} {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def add_veth(ns: str, name: str, address: str, address6: str | None = None) -> None:
    """A veth pair inside ``ns`` (both ends up), ``address`` on the first end."""
    ip(ns, "link", "add", name, "type", "veth", "peer", "name", f"{name}p")
    ip(ns, "link", "set", name, "up")
    ip(ns, "link", "set", f"{name}p", "up")
    ip(ns, "addr", "add", address, "dev", name)
    if address6:
        ip(ns, "-6", "addr", "add", address6, "dev", name, "nodad")


@pytest.fixture
def ns(make_netns: MakeNetns) -> str:
    """A namespace with veths mi0 (10.250.0.1/24, fd00:250::1/64) and mj0 (10.250.1.1/24)."""
    (name,) = make_netns(new_lab_id(), 1)
    ip(name, "link", "set", "lo", "up")
    add_veth(name, "mi0", "10.250.0.1/24", "fd00:250::1/64")
    add_veth(name, "mj0", "10.250.1.1/24")
    return name


T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def reconcile(
    ns: str, routes: list[DesiredRoute], rules: list[DesiredRule] | None = None
) -> ReconcileResult:
    async with RouteInstaller(ns) as inst:
        return await inst.reconcile(routes, rules)


def table(ns: str, number: int, family: str = "-4") -> list[str]:
    return [
        line.strip()
        for line in ip(ns, family, "-d", "route", "show", "table", str(number)).splitlines()
    ]


def rules_text(ns: str, family: str = "-4") -> list[str]:
    return [line.strip() for line in ip(ns, family, "rule", "show").splitlines()]


class Monitor:
    """``ip monitor`` inside a namespace, its output in a file; knows when it is live."""

    def __init__(self, ns: str, objects: tuple[str, ...], path: Path) -> None:
        self.ns = ns
        self.path = path
        self.out = path.open("w")
        self.proc = subprocess.Popen(
            ["ip", "-n", ns, "monitor", *objects], stdout=self.out, stderr=subprocess.STDOUT
        )
        self._sentinels = 0
        self.sync()

    def sync(self) -> None:
        """Make marker changes until the monitor has printed one of them."""
        markers = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self._sentinels += 1
            marker = f"10.254.{self._sentinels // 250}.{self._sentinels % 250}"
            ip(self.ns, "route", "add", marker, "dev", "mi0", "table", "7799")
            markers.append(marker)
            text = self.path.read_text()
            if any(f"{m} dev" in text for m in markers):
                return
            time.sleep(0.02)
        raise AssertionError("ip monitor printed nothing within 10 s")

    def lines(self) -> list[str]:
        self.sync()  # everything before this point has been printed
        return [line for line in self.path.read_text().splitlines() if "table 7799" not in line]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.out.close()


@contextlib.contextmanager
def monitor(ns: str, tmp_path: Path, *objects: str) -> Iterator[Monitor]:
    m = Monitor(ns, objects or ("route",), tmp_path / "monitor.txt")
    try:
        yield m
    finally:
        m.close()


A = DesiredRoute("10.1.0.0/24", "mi0", "10.250.0.2")
B = DesiredRoute("10.2.0.0/24", "mi0", "10.250.0.3")
C = DesiredRoute("10.3.0.0/24", "mj0")
V6 = DesiredRoute("fd00:1::/64", "mi0", "fd00:250::2")


def test_reconcile_installs_owned_routes_and_rules_and_is_idempotent(
    ns: str, tmp_path: Path
) -> None:
    result = run(reconcile(ns, [A, B, C, V6]))
    assert result.errors == []
    assert (result.replaced, result.rules_added) == (4, 2)
    assert table(ns, FAST_TABLE) == [
        "unicast 10.1.0.0/24 via 10.250.0.2 dev mi0 proto 77 scope global",
        "unicast 10.2.0.0/24 via 10.250.0.3 dev mi0 proto 77 scope global",
        "unicast 10.3.0.0/24 dev mj0 proto 77 scope link",
    ]
    assert table(ns, FAST_TABLE, "-6") == [
        "unicast fd00:1::/64 via fd00:250::2 dev mi0 proto 77 scope global metric 1024 pref medium"
    ]
    assert "7701:\tfrom all lookup 7701 proto 77" in ip(ns, "-4", "rule", "show")
    assert "7701:\tfrom all lookup 7701 proto 77" in ip(ns, "-6", "rule", "show")
    assert "lookup main" in rules_text(ns)[-2]  # main still comes after ours
    # the rule really sends traffic into our table
    assert "via 10.250.0.2 dev mi0 table 7701" in ip(ns, "route", "get", "10.1.0.5")
    assert "via fd00:250::2 dev mi0 table 7701" in ip(ns, "route", "get", "fd00:1::5")

    with monitor(ns, tmp_path, "route", "rule") as mon:
        again = run(reconcile(ns, [C, B, A, V6]))
        events = mon.lines()
    assert again.errors == [] and again.changes == 0
    assert (again.unchanged, again.rules_unchanged) == (4, 2)
    assert events == [], f"an unchanged reconcile sent changes: {events}"


def test_routes_of_others_are_never_touched(ns: str) -> None:
    ip(ns, "route", "add", "10.1.0.0/24", "via", "10.250.0.9", "proto", "static")  # main
    ip(ns, "route", "add", "10.7.0.0/24", "dev", "mj0", "table", "7701", "proto", "static")
    ip(ns, "rule", "add", "pref", "7701", "fwmark", "0x99", "lookup", "100")
    main_before = ip(ns, "route", "show", "table", "main")
    clash = DesiredRoute("10.7.0.0/24", "mi0", "10.250.0.2")

    result = run(reconcile(ns, [A, B, clash]))
    assert result.replaced == 2
    assert len(result.errors) == 1 and "proto 4" in result.errors[0]
    assert "\n" not in result.errors[0]
    assert "unicast 10.7.0.0/24 dev mj0 proto static scope link" in table(ns, FAST_TABLE)

    async def withdraw() -> tuple[int, list[DesiredRoute], list[DesiredRule]]:
        async with RouteInstaller(ns) as inst:
            n = await inst.withdraw()
            return n, await inst.installed_routes(), await inst.installed_rules()

    removed, routes_left, rules_left = run(withdraw())
    assert removed == 4  # A, B and the two fast rules
    assert routes_left == [] and rules_left == []
    assert table(ns, FAST_TABLE) == ["unicast 10.7.0.0/24 dev mj0 proto static scope link"]
    assert ip(ns, "route", "show", "table", "main") == main_before
    assert "7701:\tfrom all fwmark 0x99 lookup 100" in ip(ns, "rule", "show")
    assert "proto 77" not in ip(ns, "rule", "show") + ip(ns, "-6", "rule", "show")
    # with our table gone, the destination falls back to main (the fail-static state)
    assert "via 10.250.0.9 dev mi0" in ip(ns, "route", "get", "10.1.0.5")


def test_a_new_installer_finds_its_routes_and_changes_exactly_those(ns: str) -> None:
    tuned = DesiredRoute("10.4.0.0/24", "mi0", "10.250.0.2", mtu=1380, advmss=1340)
    assert run(reconcile(ns, [A, B, C, V6, tuned])).errors == []
    ip(ns, "route", "add", "10.8.0.0/24", "dev", "mj0", "table", "7701", "proto", "static")

    async def restart() -> tuple[list[DesiredRoute], list[DesiredRule], ReconcileResult]:
        async with RouteInstaller(ns) as inst:  # a fresh process would do the same
            found = await inst.installed_routes()
            rules = await inst.installed_rules()
            moved = DesiredRoute("10.1.0.0/24", "mj0", "10.250.1.2")
            return found, rules, await inst.reconcile([moved, B, V6, tuned])

    found, rules, result = run(restart())
    assert sorted(found, key=repr) == sorted([A, B, C, V6, tuned], key=repr)
    assert sorted(rules, key=repr) == sorted(fast_rules(), key=repr)
    assert (result.replaced, result.deleted, result.unchanged) == (1, 1, 3)
    assert result.errors == []
    assert table(ns, FAST_TABLE) == [
        "unicast 10.1.0.0/24 via 10.250.1.2 dev mj0 proto 77 scope global",
        "unicast 10.2.0.0/24 via 10.250.0.3 dev mi0 proto 77 scope global",
        "unicast 10.4.0.0/24 via 10.250.0.2 dev mi0 proto 77 scope global mtu 1380 advmss 1340",
        "unicast 10.8.0.0/24 dev mj0 proto static scope link",
    ]


def test_next_hop_change_is_atomic(ns: str, tmp_path: Path) -> None:
    """200 next-hop flips: the monitor sees 200 replaces and never a deletion."""
    flips = 200
    hops = [
        DesiredRoute("10.1.0.0/24", "mi0", "10.250.0.2"),
        DesiredRoute("10.1.0.0/24", "mj0", "10.250.1.2"),
    ]

    async def flip() -> list[int]:
        async with RouteInstaller(ns) as inst:
            await inst.reconcile([hops[0]])
            counts = []
            for i in range(flips):
                r = await inst.reconcile([hops[(i + 1) % 2]])
                counts.append(r.changes)
                assert r.errors == []
            return counts

    with monitor(ns, tmp_path, "route") as mon:
        counts = run(flip())
        events = [line for line in mon.lines() if "10.1.0.0/24" in line]
    assert counts == [1] * flips
    deleted = [line for line in events if line.startswith("Deleted")]
    assert deleted == [], f"our prefix was deleted during a replace: {deleted[:3]}"
    assert len(events) == flips + 1  # the first install and every flip, as new routes
    assert sum("via 10.250.1.2" in line for line in events) == flips // 2


def test_route_attributes_are_installed(ns: str) -> None:
    tuned = DesiredRoute(
        "10.5.0.0/24",
        "mi0",
        "10.250.0.2",
        mtu=1380,
        advmss=1340,
        initcwnd=20,
        initrwnd=40,
        window=500_000,
        congctl="cubic",
    )
    assert run(reconcile(ns, [tuned])).errors == []
    (line,) = table(ns, FAST_TABLE)
    assert line.endswith(
        "mtu 1380 window 500000 advmss 1340 initcwnd 20 initrwnd 40 congctl cubic"
    ), line

    async def found() -> list[DesiredRoute]:
        async with RouteInstaller(ns) as inst:
            return await inst.installed_routes()

    assert run(found()) == [tuned]
    # dropping the attributes is a change: the replaced route has none
    assert run(reconcile(ns, [DesiredRoute("10.5.0.0/24", "mi0", "10.250.0.2")])).replaced == 1
    assert table(ns, FAST_TABLE) == [
        "unicast 10.5.0.0/24 via 10.250.0.2 dev mi0 proto 77 scope global"
    ]
    # congestion control the kernel does not offer: refused before anything changes
    with pytest.raises(InputError, match="not available"):
        run(reconcile(ns, [DesiredRoute("10.5.0.0/24", "mi0", congctl="nosuchcc")]))
    assert "via 10.250.0.2" in table(ns, FAST_TABLE)[0]


_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(); print("ready", flush=True)
c, _ = s.accept()
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG), flush=True)
while c.recv(65536): pass
"""

_CLIENT = """
import socket, struct, sys
c = socket.create_connection(("10.251.0.2", 5001), timeout=5)
info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
snd_mss, rcv_mss = struct.unpack_from("II", info, 16)
snd_cwnd = struct.unpack_from("I", info, 80)[0]
ca = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode()
print(snd_mss, snd_cwnd, ca, flush=True)
c.sendall(b"x" * 200000); c.close()
"""


def test_a_tcp_connection_uses_the_route_attributes(make_netns: MakeNetns) -> None:
    """A connection through the tuned route takes its MSS, initial cwnd and cc from it."""
    a, b = make_netns(new_lab_id(), 2)
    ip(a, "link", "add", "ta0", "type", "veth", "peer", "name", "tb0", "netns", b)
    ip(a, "addr", "add", "10.251.0.1/24", "dev", "ta0")
    ip(b, "addr", "add", "10.251.0.2/24", "dev", "tb0")
    for n, dev in ((a, "ta0"), (b, "tb0")):
        ip(n, "link", "set", dev, "up")
        ip(n, "link", "set", "lo", "up")
    tuned = DesiredRoute(
        "10.251.0.2/32", "ta0", mtu=1200, advmss=1100, initcwnd=23, congctl="cubic"
    )
    assert run(reconcile(a, [tuned])).errors == []
    server = subprocess.Popen(
        ["ip", "netns", "exec", b, sys.executable, "-c", _SERVER],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(
            ["ip", "netns", "exec", a, sys.executable, "-c", _CLIENT],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        server_mss = int(server.stdout.readline())
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    snd_mss, cwnd, ca = client.stdout.split()
    # without the route: MSS 1460 - 12 (timestamps) both ways, initial cwnd 10
    assert int(snd_mss) == 1200 - 40 - 12  # the client's MSS follows the route MTU
    assert server_mss == 1100 - 12  # the MSS it advertised is the route's advmss
    assert int(cwnd) == 23
    assert ca == "cubic"


def test_bulk_rules_select_the_bulk_table(ns: str) -> None:
    rules = fast_rules() + bulk_rules(
        dports=[(5000, 5100, "tcp")], fwmarks=[(0x10, 0xFF)], families=[socket.AF_INET]
    )
    routes = [
        DesiredRoute("10.5.0.0/24", "mi0", "10.250.0.2"),  # low latency
        DesiredRoute("10.5.0.0/24", "mj0", "10.250.1.2", table=BULK_TABLE),  # bulk
    ]
    result = run(reconcile(ns, routes, rules))
    assert result.errors == [] and result.rules_added == 4
    shown = rules_text(ns)
    assert "7601:\tfrom all ipproto tcp dport 5000-5100 lookup 7702 proto 77" in shown
    assert "7602:\tfrom all fwmark 0x10/0xff lookup 7702 proto 77" in shown
    assert shown.index("7701:\tfrom all lookup 7701 proto 77") > shown.index(
        "7602:\tfrom all fwmark 0x10/0xff lookup 7702 proto 77"
    )

    def get(*selector: str) -> str:
        return ip(ns, "route", "get", "10.5.0.9", *selector)

    assert "via 10.250.1.2 dev mj0 table 7702" in get("ipproto", "tcp", "dport", "5001")
    assert "via 10.250.1.2 dev mj0 table 7702" in get("ipproto", "tcp", "dport", "5100")
    assert "via 10.250.0.2 dev mi0 table 7701" in get("ipproto", "tcp", "dport", "5101")
    assert "via 10.250.0.2 dev mi0 table 7701" in get("ipproto", "udp", "dport", "5001")
    assert "via 10.250.1.2 dev mj0 table 7702" in get("mark", "0x110")  # mask 0xff
    assert "via 10.250.0.2 dev mi0 table 7701" in get("mark", "0x11")
    # a destination without a bulk route falls through to the fast table, then main
    ip(ns, "route", "add", "10.6.0.0/24", "via", "10.250.0.9", "proto", "static")
    assert "via 10.250.0.9 dev mi0" in ip(ns, "route", "get", "10.6.0.1", "mark", "0x10")

    # dropping the port classifier removes exactly that rule
    result = run(reconcile(ns, routes, fast_rules() + [r for r in rules if r.fwmark]))
    assert (result.rules_deleted, result.rules_unchanged) == (1, 3)
    assert "dport" not in ip(ns, "rule", "show")


def test_a_vanished_interface_is_an_error_entry_not_an_exception(ns: str) -> None:
    add_veth(ns, "mk0", "10.250.2.1/24")
    gone = DesiredRoute("10.9.0.0/24", "mk0", "10.250.2.2")
    assert run(reconcile(ns, [A, gone])).errors == []
    ip(ns, "link", "del", "mk0")  # the kernel drops its routes with it
    unreachable = DesiredRoute("10.10.0.0/24", "mi0", "192.0.2.1")  # gateway not on-link

    result = run(reconcile(ns, [A, gone, unreachable, B]))
    errors = sorted(result.errors, reverse=True)  # 10.9... then 10.10...
    assert len(errors) == 2, errors
    assert errors[0] == "10.9.0.0/24 via 10.250.2.2 dev mk0 table 7701 metric 0: no interface mk0"
    assert errors[1] == (
        "10.10.0.0/24 via 192.0.2.1 dev mi0 table 7701 metric 0: Network is unreachable"
    )
    assert (result.replaced, result.unchanged) == (1, 1)
    assert [line.split()[1] for line in table(ns, FAST_TABLE)] == ["10.1.0.0/24", "10.2.0.0/24"]


def test_missing_namespace_is_an_install_error(lab_ok: None) -> None:
    async def open_missing() -> None:
        async with RouteInstaller("mo-no-such-namespace"):
            pass

    with pytest.raises(InstallError, match="mo-no-such-namespace"):
        run(open_missing())
    assert not Path("/var/run/netns/mo-no-such-namespace").exists()  # not created
