"""The deploy rehearsal: docs/deploy.md followed on three namespaces "as deployed".

fra, ams and par are machines with their own /etc/meshopt, /etc/wireguard,
/etc/systemd/system, /var/lib/meshopt, /var/run/wireguard and users
(meshopt/lab/deployed.py), WireGuard brought up by ``wg-quick up wg0`` from the guide's
wg0.conf blocks. The test writes every config block of the guide (placeholders filled
in with the keys the guide's own commands printed) and runs every command of its shell
blocks on the machines they name. What a namespace cannot do is stood in for, and only
that: install.sh and apt-get (the checkout's virtualenv is the install), scp (a copy
between the machines' directories), systemctl (the installed unit and its drop-ins:
ExecStartPre and ExecStart as its User= with its AmbientCapabilities=, through setpriv;
for Type=notify a $NOTIFY_SOCKET, and the start returns at READY=1 like ``systemctl
start``) and journalctl (the service's log). Then it checks what an operator would:
every node installed the route set (proto 77 routes in table 7701 to both other
nodes), pings cross the mesh between every pair, ``meshopt routes`` as the read-only
viewer shows all three nodes with verified route sets, the daemons run as the meshopt
user with their units' capabilities only, and a clean stop leaves each node as found:
table 7701 empty, AllowedIPs as in wg0.conf, IP forwarding as before.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshopt.lab.deployed import (
    BROKER_PATHS,
    MACHINE_PATHS,
    DeployedMachines,
    DeployError,
    setpriv_argv,
    wait_for,
)
from meshopt.lab.netns import netns_run

from .deployguide import Command, ConfigBlock, GuideError, fill, read_guide
from .tools import need_tools

REPO = Path(__file__).resolve().parents[2]
# The guide's machines (its table): name -> public address.
MACHINES = {"fra": "198.51.100.1/24", "ams": "198.51.100.2/24", "par": "198.51.100.3/24"}
OVERLAY = {"fra": "10.99.0.1", "ams": "10.99.0.2", "par": "10.99.0.3"}
BROKER_HOST = "fra"
USER = "meshopt"  # the daemons' user (install.sh)
# What the agent may hold: CAP_NET_ADMIN (12), CAP_NET_RAW (13), and CAP_DAC_OVERRIDE (1)
# from the guide's wireguard-go drop-in.
CAPS_ALLOWED = (1 << 12) | (1 << 13) | (1 << 1)
FAST_TABLE = 7701
CONVERGE_S = 60.0  # first routes: 8 samples per link or 10 s, then a route set


@dataclass
class Unit:
    """What the rehearsal takes from a systemd unit: its commands, user, capabilities."""

    pre: list[list[str]]
    start: list[str]
    user: str | None
    capabilities: list[str]
    shipped: bool  # False: not in packaging/systemd yet, the guide's documented command
    type: str = "simple"
    watchdog_s: float | None = None


def read_unit(unit: Path, meshopt_argv: list[str]) -> Unit:
    """``unit`` and its drop-ins (``unit.d/*.conf``), as systemd merges them: a list
    setting adds to what came before, an empty one clears it. The installed command
    (/opt/meshopt/bin/meshopt) is the checkout's here."""
    out = Unit([], [], None, [], True)
    files = [unit, *sorted(unit.parent.glob(f"{unit.name}.d/*.conf"))]
    for line in (line for f in files for line in f.read_text().splitlines()):
        key, _, value = (x.strip() for x in line.partition("="))
        if key in ("ExecStartPre", "ExecStart"):
            # Prefixes: "-" ignore failure, "+" "!" full privileges, "@" "|" "::" rare.
            privileged = "+" in value[:3] or "!" in value[:3]
            argv = shlex.split(value.lstrip("-+!@:|"))
            if Path(argv[0]).name == "meshopt":
                argv[:1] = meshopt_argv
            if key == "ExecStart":
                out.start = argv
            elif not privileged:
                out.pre.append(argv)
        elif key == "User":
            out.user = value
        elif key == "AmbientCapabilities":
            out.capabilities = [*out.capabilities, *value.split()] if value else []
        elif key == "Type":
            out.type = value
        elif key == "WatchdogSec":
            out.watchdog_s = float(value.removesuffix("s")) if value else None
    assert out.start, f"{unit}: no ExecStart"
    return out


def documented_unit(unit: str, meshopt_argv: list[str]) -> Unit:
    """Where packaging/systemd has no such unit yet: the guide's command, as root."""
    role = unit.removeprefix("meshopt-")
    argv = [*meshopt_argv, role, "--config", f"/etc/meshopt/{role}.toml"]
    return Unit([], argv, None, [], False)


def bind_datagram(path: Path) -> socket.socket:
    """A non-blocking datagram socket at ``path`` that any user may send to, bound
    through /proc/self/fd so the long temporary path fits in sun_path (108 bytes)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)
    path.chmod(0o666)
    return sock


def fast_routes(dm: DeployedMachines, name: str) -> dict[str, str]:
    """proto 77 routes in the machine's table 7701: destination -> device."""
    out = netns_run(
        dm.machine(name).netns,
        ["ip", "-j", "route", "show", "table", str(FAST_TABLE)],
        check=False,
    )
    try:
        routes = json.loads(out.stdout or "[]")
    except json.JSONDecodeError:
        return {}
    return {
        r["dst"]: r.get("dev", "") for r in routes if str(r.get("protocol")) in ("77", "meshopt")
    }


def allowed_ips(dm: DeployedMachines, name: str) -> dict[str, str]:
    """wg0's peers on machine ``name``: public key -> AllowedIPs (as ``wg`` shows them)."""
    out = dm.sh(name, "wg show wg0 allowed-ips")
    assert out.returncode == 0, out.stderr
    return dict(line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)


def forwarding(dm: DeployedMachines, name: str) -> str:
    out = dm.sh(name, "sysctl -n net.ipv4.ip_forward")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def converged(dm: DeployedMachines) -> bool:
    for name in MACHINES:
        want = {f"{OVERLAY[o]}" for o in MACHINES if o != name}
        have = {d.split("/")[0] for d in fast_routes(dm, name)}
        if not want <= have:
            return False
    return True


class Rehearsal:
    """Follows the guide; the stand-ins for what a namespace cannot do live here."""

    def __init__(self, dm: DeployedMachines) -> None:
        self.dm = dm
        self.values: dict[str, str] = {}
        self.ran: list[str] = []  # "machine: command", for the report on failure
        self.missing: list[str] = []  # guide commands this checkout does not have yet
        self.uids: dict[str, int] = {}  # the meshopt user's uid on each machine
        self.meshopt_argv = [sys.executable, "-m", "meshopt.cli.main"]
        self.sockets: list[socket.socket] = []  # the notify sockets, closed by close()
        self.ready: list[tuple[str, str]] = []  # (machine, unit) that sent READY=1

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()

    def existing_wireguard_keys(self) -> None:
        """What the operator starts from: each machine's WireGuard key pair."""
        for name in MACHINES:
            private = subprocess.run(
                ["wg", "genkey"], capture_output=True, text=True, check=True
            ).stdout.strip()
            public = subprocess.run(
                ["wg", "pubkey"], input=private, capture_output=True, text=True, check=True
            ).stdout.strip()
            self.values[f"<{name}-wireguard-private-key>"] = private
            self.values[f"<{name}-wireguard-public-key>"] = public

    def write(self, block: ConfigBlock) -> None:
        for name in block.machines:
            target = self.dm.machine(name).host_path(block.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(fill(block.text, self.values, node=name))
            if block.path.startswith("/etc/wireguard/"):
                target.chmod(0o600)

    def run(self, name: str, command: Command) -> None:
        line = fill(command.line, self.values, node=name)
        self.ran.append(f"{name}: {line}")
        words = shlex.split(line)
        if words[0] == "systemctl":
            self.systemctl(name, words[1:])
            return
        if words[0] == "scp":
            self.scp(name, words[1:])
            return
        if words[0] == "journalctl":
            unit = words[words.index("-u") + 1]
            s = self.dm.service(name, unit)
            assert s is not None, f"{name}: journalctl -u {unit}: not started"
            assert s.log.read_text().strip(), f"{name}: {unit} logged nothing"
            return
        if words[0] == "packaging/install.sh":
            self.install(name, controller="--controller" in words)
            return
        if words[:2] == ["apt-get", "install"]:
            assert words[2:] == ["mosquitto"], line
            m = self.dm.machine(name)
            shutil.chown(m.host_path("/var/lib/mosquitto"), "mosquitto")
            return
        if words[:2] == ["meshopt", "status"] and not self.has_command("status"):
            self.missing.append(line)
            return
        out = self.dm.sh(name, line)
        assert out.returncode == 0, f"{name}: {line}\n{out.stdout}\n{out.stderr}"
        if command.prints:
            key = command.prints.replace("NODE", name)
            value = out.stdout.strip()
            assert value and "\n" not in value, f"{name}: {line}: printed {out.stdout!r}"
            if key in self.values:  # already known (the WireGuard keys): must agree
                assert self.values[key] == value, f"{name}: {line}: {value} != {key}"
            self.values[key] = value

    def install(self, name: str, *, controller: bool) -> None:
        """install.sh's layout (docs/install.md): the user and group ``meshopt``,
        /etc/meshopt root:meshopt 0750, /var/lib/meshopt meshopt 0750, the units in
        /etc/systemd/system. The checkout's virtualenv stands in for /opt/meshopt."""
        m = self.dm.machine(name)
        units = ["meshopt-agent"] + (["meshopt-controller"] if controller else [])
        for unit in units:
            shipped = REPO / "packaging" / "systemd" / f"{unit}.service"
            if shipped.exists():
                shutil.copyfile(shipped, m.host_path(f"/etc/systemd/system/{unit}.service"))
        uid = self.dm.add_user(name, USER)
        os.chown(m.host_path("/etc/meshopt"), 0, uid)
        m.host_path("/etc/meshopt").chmod(0o750)
        os.chown(m.host_path("/var/lib/meshopt"), uid, uid)
        m.host_path("/var/lib/meshopt").chmod(0o750)
        self.uids[name] = uid

    def has_command(self, cmd: str) -> bool:
        out = subprocess.run(
            [sys.executable, "-m", "meshopt.cli.main", cmd, "--help"],
            capture_output=True,
            check=False,
        )
        return out.returncode == 0

    def systemctl(self, name: str, args: list[str]) -> None:
        verb, units = args[0], [a for a in args[1:] if not a.startswith("-")]
        assert verb in ("enable", "restart", "daemon-reload"), args
        for unit in units:
            if unit == "wg-quick@wg0":
                self.dm.wg_quick(name, "up", "wg0")
            elif unit == "mosquitto":
                self.start_broker(name)
            else:
                path = self.dm.machine(name).host_path(f"/etc/systemd/system/{unit}.service")
                if path.exists():
                    u = read_unit(path, self.meshopt_argv)
                else:
                    u = documented_unit(unit, self.meshopt_argv)
                    self.missing.append(f"packaging/systemd/{unit}.service")
                for argv in u.pre:
                    if u.user is not None:
                        argv = setpriv_argv(u.user, u.capabilities, argv)
                    out = self.dm.sh(name, shlex.join(argv))
                    assert out.returncode == 0, f"{name}: {unit} ExecStartPre: {out.stderr}"
                self.start_unit(name, unit, u)

    def start_unit(self, name: str, unit: str, u: Unit) -> None:
        """ExecStart as the unit's user; for ``Type=notify``, like ``systemctl start``,
        return only once the daemon said READY=1 on ``$NOTIFY_SOCKET`` (and with the
        unit's ``WatchdogSec`` as ``$WATCHDOG_USEC``)."""
        env: dict[str, str] = {}
        notify: socket.socket | None = None
        if u.type == "notify":
            # In the state directory: the one place of the machine the user may enter.
            where = "/var/lib/meshopt/.notify-" + unit.removeprefix("meshopt-")
            notify = bind_datagram(self.dm.machine(name).host_path(where))
            self.sockets.append(notify)
            env["NOTIFY_SOCKET"] = where
            if u.watchdog_s:
                env["WATCHDOG_USEC"] = str(int(u.watchdog_s * 1e6))
        s = self.dm.start(name, unit, u.start, env=env, user=u.user, capabilities=u.capabilities)
        if notify is None:
            return
        said: list[bytes] = []

        def ready() -> bool:
            assert s.proc.poll() is None, f"{name}: {unit} exited: {s.log.read_text()[-2000:]}"
            while True:
                try:
                    said.extend(notify.recv(4096).split(b"\n"))
                except BlockingIOError:
                    return b"READY=1" in said

        wait_for(ready, f"{name}: {unit} READY=1", CONVERGE_S, 0.1)
        self.ready.append((name, unit))

    def start_broker(self, name: str) -> None:
        """Debian's mosquitto.service ExecStart (its ExecStartPre make host dirs the
        conf from ``broker init`` does not use), then wait until it listens."""
        s = self.dm.service(name, "mosquitto")
        if s is not None:
            self.dm.stop(s)
        s = self.dm.start(name, "mosquitto", ["mosquitto", "-c", "/etc/mosquitto/mosquitto.conf"])
        netns = self.dm.machine(name).netns
        address = self.dm.machine(name).address
        probe = f"import socket; socket.create_connection(('{address}', 8883), 1).close()"

        def listening() -> bool:
            assert s.proc.poll() is None, f"mosquitto exited: {s.log.read_text()}"
            return netns_run(netns, [sys.executable, "-c", probe], check=False).returncode == 0

        wait_for(listening, "mosquitto on 8883", 15.0, 0.1)

    def scp(self, name: str, args: list[str]) -> None:
        """``scp -r SRC root@ADDRESS:DST``: a copy between two machines' directories."""
        assert args[0] == "-r" and len(args) == 3, args
        src = self.dm.machine(name).host_path(args[1])
        user_host, _, dst = args[2].partition(":")
        address = user_host.partition("@")[2]
        target = next(m for m in self.dm.machines.values() if m.address == address)
        shutil.copytree(src, target.host_path(dst))


@pytest.fixture
def machines(lab_ok: None, tmp_path: Path) -> Iterator[DeployedMachines]:
    need_tools("wg-quick", "wg", "mosquitto", "ping", "mount", "setpriv", "sysctl")
    from meshopt.wireguard.kernel import kernel_wireguard_available

    if not kernel_wireguard_available():
        need_tools("wireguard-go")
    dm = DeployedMachines.build(
        tmp_path,
        MACHINES,
        broker_host=BROKER_HOST,
        meshopt_argv=[sys.executable, "-m", "meshopt.cli.main"],
    )
    try:
        yield dm
    finally:
        dm.close()


@pytest.fixture
def rehearsal(machines: DeployedMachines) -> Iterator[Rehearsal]:
    r = Rehearsal(machines)
    try:
        yield r
    finally:
        r.close()


def test_the_deploy_guide_works_on_three_wg_quick_machines(rehearsal: Rehearsal) -> None:
    dm = rehearsal.dm
    forwarding_before = {name: forwarding(dm, name) for name in MACHINES}
    rehearsal.existing_wireguard_keys()
    blocks = read_guide(tuple(MACHINES))
    files = {(m, b.path) for b in blocks if isinstance(b, ConfigBlock) for m in b.machines}
    for name in MACHINES:
        assert {(name, "/etc/wireguard/wg0.conf"), (name, "/etc/meshopt/agent.toml")} <= files
    assert (BROKER_HOST, "/etc/meshopt/controller.toml") in files
    try:
        for block in blocks:
            if isinstance(block, ConfigBlock):
                rehearsal.write(block)
                continue
            for name in block.machines:
                for command in block.commands:
                    rehearsal.run(name, command)
            if any("enable --now meshopt-agent" in c.line for c in block.commands):
                # An operator waits for the first route set before checking it.
                wait_for(lambda: converged(dm), "every node's route set", CONVERGE_S)
    except (AssertionError, DeployError, GuideError) as exc:
        logs = "\n".join(
            f"--- {s.machine} {s.name}\n{s.log.read_text()[-2500:]}" for s in dm.services
        )
        ran = "\n".join(rehearsal.ran[-5:])
        raise AssertionError(f"{exc}\n--- last commands:\n{ran}\n{logs}") from None

    # Every node installed routes to both other nodes, over wg0, with protocol 77.
    for name in MACHINES:
        routes = fast_routes(dm, name)
        for other in MACHINES:
            if other != name:
                assert routes.get(f"{OVERLAY[other]}") == "wg0", (name, routes)

    # Traffic crosses the mesh between every pair (the guide pinged from fra).
    for name in MACHINES:
        for other in MACHINES:
            if other != name:
                out = dm.sh(name, f"ping -n -c 2 -i 0.2 -W 2 {OVERLAY[other]}")
                assert out.returncode == 0, (name, other, out.stdout)

    # The guide's `meshopt routes` (viewer, verified against the controller key) as JSON.
    routes_line = next(line for line in rehearsal.ran if " routes --broker " in line)
    out = dm.sh(BROKER_HOST, routes_line.partition(": ")[2] + " --json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)  # docs/cli.md: "meshopt.routes/1"
    assert (shown["schema"], shown["source"], shown["mesh"]) == ("meshopt.routes/1", "live", "prod")
    assert set(shown["nodes"]) == set(MACHINES) and shown["unreachable"] == [], shown
    for name, entry in shown["nodes"].items():
        assert entry["online"] is True and entry["verified"] is True, entry
        fast = {r["prefix"] for r in entry["routes"] if r["table"] == "fast"}
        assert fast == {f"{OVERLAY[o]}/32" for o in MACHINES if o != name}, entry

    # The daemons run from the files the guide wrote, as their units say: the meshopt
    # user; the agents with the unit's capabilities and no others, the controller none.
    daemons = [(name, "meshopt-agent") for name in MACHINES]
    for name, unit in [*daemons, (BROKER_HOST, "meshopt-controller")]:
        s = dm.service(name, unit)
        assert s is not None and s.proc.poll() is None, (name, unit)
        cmdline = Path(f"/proc/{s.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert f"/etc/meshopt/{unit.removeprefix('meshopt-')}.toml".encode() in cmdline
        if f"packaging/systemd/{unit}.service" in rehearsal.missing:
            continue
        status = dict(
            line.split(":\t", 1)
            for line in Path(f"/proc/{s.proc.pid}/status").read_text().splitlines()
            if ":\t" in line
        )
        assert status["Uid"].split()[:2] == [str(rehearsal.uids[name])] * 2, status["Uid"]
        caps = int(status["CapEff"], 16)
        if unit == "meshopt-controller":
            assert caps == 0, f"controller capabilities {caps:#x}"
            continue
        assert caps == int(status["CapAmb"], 16) and caps != 0, status
        assert caps & ~CAPS_ALLOWED == 0, f"{name}: capabilities {caps:#x}"

    # A clean stop (systemctl stop: SIGTERM) leaves the node as wg-quick made it.
    for name in MACHINES:
        s = dm.service(name, "meshopt-agent")
        assert s is not None
        assert dm.stop(s) == 0, s.log.read_text()[-2000:]
        assert fast_routes(dm, name) == {}, name
        assert allowed_ips(dm, name) == {
            rehearsal.values[f"<{o}-wireguard-public-key>"]: f"{OVERLAY[o]}/32"
            for o in MACHINES
            if o != name
        }
        assert forwarding(dm, name) == forwarding_before[name], name
    if rehearsal.missing:
        warnings.warn(f"guide commands not in this checkout yet: {rehearsal.missing}", stacklevel=1)


def test_the_guide_defines_every_placeholder_before_its_use() -> None:
    """Without root too: each <placeholder> of the guide is printed by an earlier
    command (or is one of the WireGuard keys the operator starts with), every block
    names known machines, and every config file is where the rehearsal's machines have
    their own directories."""
    values = {
        f"<{name}-wireguard-{kind}-key>": "x" for name in MACHINES for kind in ("private", "public")
    }
    own = MACHINE_PATHS + BROKER_PATHS
    for block in read_guide(tuple(MACHINES)):
        for name in block.machines:
            if isinstance(block, ConfigBlock):
                assert any(block.path.startswith(p + "/") for p in own), block.path
                fill(block.text, values, node=name)
                continue
            for command in block.commands:
                fill(command.line, values, node=name)
                if command.prints:
                    values[command.prints.replace("NODE", name)] = "x"
