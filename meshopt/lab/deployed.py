"""Machines "as deployed": a namespace per machine with its own /etc/meshopt, wg-quick.

The deploy rehearsal (``tests/lab/test_deploy_rehearsal.py``) follows ``docs/deploy.md``
on machines that look like an operator's, not like the lab's: each machine is a network
namespace on a bridge (its "public" address on the underlay) and a set of private
directories bind-mounted, in a mount namespace of its own, over the paths a real
machine has: ``/etc/meshopt``, ``/etc/wireguard``, ``/etc/systemd/system``,
``/var/lib/meshopt`` and ``/var/run/wireguard`` (and ``/etc/mosquitto``,
``/var/lib/mosquitto`` on the broker host), plus its own copy of ``/etc/passwd`` and
``/etc/group`` (so ``useradd`` on one machine adds a user there only). So the guide's
commands and config files run unchanged, paths included; WireGuard is brought up by
``wg-quick up wg0`` from ``/etc/wireguard/wg0.conf`` (wireguard-go where the kernel
has no WireGuard: its UAPI socket lands in the machine's own ``/var/run/wireguard``);
services run as their unit's user with ambient capabilities (setpriv), and where the
interpreter lies under a directory only root may enter (a pyenv in /root) the
machines see a view of that directory holding just the way through.

Clean-up is exact, like the lab's: namespaces are named ``ml<id>-<machine>`` and
every process started carries ``MESHOPT_LAB=<id>`` (so ``meshopt lab down --all``
also finds a crashed rehearsal's leftovers); processes are ended by PID, wireguard-go
by ``wg-quick down`` and then by its PID; a mount point this module had to create on
the host (``/etc/meshopt`` where nothing is installed) is removed again if empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshopt.errors import MeshoptError
from meshopt.lab import procs
from meshopt.lab.lab import _pids_in_netns, ip_batch
from meshopt.lab.netns import list_netns, netns_argv, netns_exists
from meshopt.lab.plan import new_lab_id

# The paths every machine has of its own; the broker host has the mosquitto ones too.
MACHINE_PATHS = (
    "/etc/meshopt",
    "/etc/wireguard",
    "/etc/systemd/system",  # the units install.sh puts there, and their drop-ins
    "/var/lib/meshopt",
    "/var/run/wireguard",
)
BROKER_PATHS = ("/etc/mosquitto", "/var/lib/mosquitto")
# Files every machine has a copy of: its users (``useradd`` on a machine adds there).
MACHINE_FILES = ("/etc/passwd", "/etc/group")
UNDERLAY_IF = "eth0"
# Every running rehearsal holds this lock shared; the last one out (the only one able to
# take it exclusively) removes the mount points rehearsals made on the host, listed in
# MADE. Never /var/run/wireguard: the lab's nodes bind-mount their own directory there,
# and removing a mount point on the host detaches it in every other mount namespace.
LOCK = Path("/run/meshopt/deployed.lock")
MADE = Path("/run/meshopt/deployed.made")
KEEP = ("/var/run/wireguard",)


class DeployError(MeshoptError):
    """The rehearsal's machines cannot be built or used; one line for the user."""


@dataclass
class Machine:
    """One "machine": a namespace, an address, and its private directories."""

    name: str
    netns: str
    address: str  # on the underlay, without prefix
    root: Path  # its directories: root/etc/meshopt is its /etc/meshopt, ...
    paths: tuple[str, ...]

    @property
    def home(self) -> Path:
        """root's home directory on this machine (``~`` in the guide's commands)."""
        return self.root / "root"

    @property
    def journal(self) -> Path:
        """Where the output of the machine's services goes (its journald)."""
        return self.root / "journal"

    def host_path(self, path: str) -> Path:
        """Where ``path`` as seen on the machine is on the host (its private dirs, ~)."""
        if path == "~" or path.startswith("~/"):
            return self.home / path[2:]
        for p in self.paths:
            if path == p or path.startswith(p + "/"):
                return self.root / p.lstrip("/") / path[len(p) :].lstrip("/")
        raise DeployError(f"{self.name}: {path} is not one of the machine's own paths")


@dataclass
class Service:
    machine: str
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class DeployedMachines:
    """Machines in namespaces on one bridge; see the module's docstring."""

    lab_id: str
    root: Path
    machines: dict[str, Machine]
    switch_netns: str
    shim_dir: Path  # holds ``meshopt``: the checkout's meshopt, first on the PATH
    meshopt_argv: list[str]  # the same, for services (the shim is root's only)
    netns: list[str] = field(default_factory=list)  # created so far
    lock_fd: int | None = None  # LOCK, held shared while the machines exist
    services: list[Service] = field(default_factory=list)
    wg_pids: dict[str, list[int]] = field(default_factory=dict)

    # -- building -----------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        root: Path,
        addresses: Mapping[str, str],
        *,
        broker_host: str,
        meshopt_argv: Sequence[str],
    ) -> DeployedMachines:
        """Namespaces for ``addresses`` (name -> "198.51.100.1/24") on one bridge.

        ``meshopt_argv`` is how the ``meshopt`` command is run here (the checkout's
        virtualenv), put first on every machine's PATH in place of /opt/meshopt.
        On failure, whatever was built is removed again.
        """
        if os.geteuid() != 0:
            raise DeployError("the rehearsal needs root (network and mount namespaces)")
        lab_id = new_lab_id()
        while any(n.startswith(f"ml{lab_id}-") for n in list_netns()):
            lab_id = new_lab_id()
        machines: dict[str, Machine] = {}
        for name, cidr in addresses.items():
            iface = ipaddress.ip_interface(cidr)
            paths = MACHINE_PATHS + MACHINE_FILES + (BROKER_PATHS if name == broker_host else ())
            machines[name] = Machine(name, f"ml{lab_id}-{name}", str(iface.ip), root / name, paths)
        shim = root / "bin"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "meshopt").write_text(
            "#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in meshopt_argv) + ' "$@"\n'
        )
        (shim / "meshopt").chmod(0o755)
        self = cls(lab_id, root, machines, f"ml{lab_id}--sw", shim, list(meshopt_argv))
        try:
            self._build(addresses)
        except BaseException:
            self.close()
            raise
        return self

    def _build(self, addresses: Mapping[str, str]) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_SH)
        for m in self.machines.values():
            for p in MACHINE_FILES:
                (m.root / p.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, m.root / p.lstrip("/"))
            for p in m.paths:
                if p in MACHINE_FILES:
                    continue
                d = m.root / p.lstrip("/")
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o700 if p == "/etc/wireguard" else 0o755)
                if not os.path.isdir(p):  # the mount point must exist on the host
                    os.makedirs(p, mode=0o755)
                    if p not in KEEP:
                        with MADE.open("a") as f:
                            f.write(p + "\n")
            m.home.mkdir(mode=0o700, exist_ok=True)
            m.journal.mkdir(exist_ok=True)
        names = [m.netns for m in self.machines.values()] + [self.switch_netns]
        self.netns = names
        ip_batch([f"netns add {ns}" for ns in names])
        sw = self.switch_netns
        ip_batch(
            [
                f"link add name ml{self.lab_id}s{i} netns {sw} type veth "
                f"peer name {UNDERLAY_IF} netns {m.netns}"
                for i, m in enumerate(self.machines.values())
            ]
        )
        ip_batch(
            ["link set lo up", "link add name br0 type bridge", "link set br0 up"]
            + [f"link set ml{self.lab_id}s{i} master br0 up" for i in range(len(self.machines))],
            netns=sw,
        )
        for m in self.machines.values():
            ip_batch(
                [
                    "link set lo up",
                    f"addr add {addresses[m.name]} dev {UNDERLAY_IF}",
                    f"link set {UNDERLAY_IF} up",
                ],
                netns=m.netns,
            )

    # -- using --------------------------------------------------------------------------
    def machine(self, name: str) -> Machine:
        try:
            return self.machines[name]
        except KeyError:
            have = ", ".join(self.machines)
            raise DeployError(f"no machine {name!r} (there are: {have})") from None

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` on machine ``name``: its namespace, its directories mounted in place.

        ``ip netns exec`` gives the command a mount namespace of its own (slave to the
        host's), so the bind mounts are seen by it and its children alone.
        """
        m = self.machine(name)
        q = shlex.quote
        mounts = [f"mount --bind {q(str(m.root / p.lstrip('/')))} {q(p)}" for p in m.paths]
        for blocked, child, view in self._views():
            mounts.append(f"mount --bind {q(blocked + '/' + child)} {q(str(view / child))}")
            mounts.append(f"mount --rbind {q(str(view))} {q(blocked)}")
        script = f'set -e; {"; ".join(mounts)}; exec "$@"'
        return netns_argv(m.netns, ["sh", "-c", script, "sh", *argv])

    def _views(self) -> list[tuple[str, str, Path]]:
        """Directories on the way to meshopt's interpreter that only root may enter
        (a pyenv in /root): each is replaced, on the machines, by a view holding just
        the way through, so a service user reaches the interpreter as it reaches
        /opt/meshopt on a real machine. (blocked dir, its child on the way, view)"""
        out = []
        for target in (self.meshopt_argv[0], os.path.realpath(self.meshopt_argv[0])):
            parts = Path(target).parts
            for i in range(1, len(parts) - 1):
                d = Path(*parts[: i + 1])
                if d.stat().st_mode & 0o001 == 0:
                    view = self.root / "views" / str(d).strip("/").replace("/", "_")
                    (view / parts[i + 1]).mkdir(parents=True, exist_ok=True)
                    view.chmod(0o755)
                    out.append((str(d), parts[i + 1], view))
                    break
        return list(dict.fromkeys(out))

    def add_user(self, name: str, user: str, *, home: str = "/var/lib/meshopt") -> int:
        """``useradd --system --user-group`` on machine ``name``: its own passwd and
        group files; a uid and gid unused on the host. Returns the uid."""
        m = self.machine(name)
        passwd, group = m.host_path("/etc/passwd"), m.host_path("/etc/group")
        taken = {int(line.split(":")[2]) for line in passwd.read_text().splitlines() if line}
        taken |= {int(line.split(":")[2]) for line in group.read_text().splitlines() if line}
        uid = next(n for n in range(999, 100, -1) if n not in taken)
        with passwd.open("a") as f:
            f.write(f"{user}:x:{uid}:{uid}:{user} daemons:{home}:/usr/sbin/nologin\n")
        with group.open("a") as f:
            f.write(f"{user}:x:{uid}:\n")
        return uid

    def env(self, name: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A root login's environment on machine ``name``, tagged as this rehearsal's."""
        m = self.machine(name)
        path = f"{self.shim_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM")}
        return {
            **keep,
            "PATH": path,
            "HOME": str(m.home),
            "USER": "root",
            "LOGNAME": "root",
            **(extra or {}),
            procs.TAG: self.lab_id,
        }

    def sh(
        self,
        name: str,
        command: str,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run one shell command line on machine ``name`` as root, output captured."""
        return subprocess.run(
            self.argv(name, ["sh", "-c", command]),
            capture_output=True,
            text=True,
            env=self.env(name, env),
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def start(
        self,
        name: str,
        service: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        capabilities: Sequence[str] = (),
    ) -> Service:
        """Start a long-running ``argv`` on machine ``name`` (as systemd would start the
        unit ``service``): its own process group, output to ``<journal>/<service>.log``.

        With ``user``: as that user (and its group), holding only ``capabilities``
        (``CAP_NET_ADMIN``, ...) as ambient ones, with no way to gain more: the unit's
        ``User=``, ``AmbientCapabilities=``, ``CapabilityBoundingSet=`` and
        ``NoNewPrivileges=`` through setpriv.
        """
        m = self.machine(name)
        log = m.journal / f"{service}.log"
        if user is not None:
            argv = setpriv_argv(user, capabilities, argv)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.argv(name, argv),
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(name, env),
                process_group=0,  # not a session of its own: see procs.spawn
            )
        s = Service(name, service, proc, log)
        self.services.append(s)
        return s

    def service(self, name: str, service: str) -> Service | None:
        for s in self.services:
            if s.machine == name and s.name == service:
                return s
        return None

    def stop(self, s: Service, *, timeout: float = 15.0) -> int:
        """SIGTERM (a unit's clean stop), SIGKILL after ``timeout`` (the units' TimeoutStopSec);
        the exit status."""
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait(5)
        self.services.remove(s)
        return s.proc.returncode

    def wg_quick(self, name: str, action: str, interface: str = "wg0") -> str:
        """``wg-quick up|down <interface>`` on machine ``name``; its output.

        Where the kernel lacks WireGuard, wg-quick starts wireguard-go (named by
        ``WG_QUICK_USERSPACE_IMPLEMENTATION``), which daemonizes: its PID is found by
        this rehearsal's tag in the machine's namespace and kept for the clean-up.
        """
        from meshopt.wireguard.kernel import kernel_wireguard_available

        env = (
            {}
            if kernel_wireguard_available()
            else {"WG_QUICK_USERSPACE_IMPLEMENTATION": "wireguard-go"}
        )
        out = self.sh(name, f"wg-quick {action} {shlex.quote(interface)}", env=env)
        if out.returncode != 0:
            raise DeployError(
                f"{name}: wg-quick {action} {interface}: "
                + (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
            )
        if action == "up":
            m = self.machine(name)
            self.wg_pids.setdefault(name, []).extend(
                pid
                for pid in _pids_in_netns([m.netns])
                if procs.lab_of(pid) == self.lab_id
                and _comm(pid) == "wireguard-go"
                and pid not in self.wg_pids.get(name, [])
            )
        return out.stdout + out.stderr

    # -- tearing down -------------------------------------------------------------------
    def close(self) -> None:
        """Stop every service by PID, ``wg-quick down``, remove namespaces and mount
        points made on the host; never touches what this rehearsal did not start."""
        for s in list(self.services):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.stop(s)
        for name in list(self.wg_pids):
            if netns_exists(self.machine(name).netns):
                with contextlib.suppress(DeployError, subprocess.SubprocessError):
                    self.wg_quick(name, "down")
            procs.stop_pids(self.wg_pids.pop(name), self.lab_id)
        ours = [ns for ns in self.netns if netns_exists(ns)]
        left = [pid for pid in _pids_in_netns(ours) if pid != os.getpid()]
        procs.kill_pids([pid for pid in left if procs.lab_of(pid) == self.lab_id])
        if ours:
            ip_batch([f"netns delete {ns}" for ns in ours])
        self.netns = []
        if self.lock_fd is not None:
            self._remove_mount_points(self.lock_fd)
            os.close(self.lock_fd)
            self.lock_fd = None

    @staticmethod
    def _remove_mount_points(fd: int) -> None:
        """As the last rehearsal out: the mount points rehearsals made, if still empty
        (someone may have installed meshopt meanwhile)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another rehearsal still has its machines up
        with contextlib.suppress(OSError):
            for line in sorted(set(MADE.read_text().split()), reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(line)
            MADE.unlink()

    def __enter__(self) -> DeployedMachines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def setpriv_argv(user: str, capabilities: Sequence[str], argv: Sequence[str]) -> list[str]:
    """``argv`` as ``user`` (and its group) with only ``capabilities`` (``CAP_NET_ADMIN``,
    ...), ambient so they survive the exec, none to gain later: what a unit's ``User=``,
    ``AmbientCapabilities=``, ``CapabilityBoundingSet=`` and ``NoNewPrivileges=`` do."""
    caps = ",".join("+" + c.lower().removeprefix("cap_") for c in capabilities)
    more = "," + caps if caps else ""
    return [
        "setpriv",
        f"--reuid={user}",
        f"--regid={user}",
        "--init-groups",
        f"--inh-caps=-all{more}",
        *([f"--ambient-caps={caps}"] if caps else []),
        f"--bounding-set=-all{more}",
        "--no-new-privs",
        *argv,
    ]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def wait_for(check: Callable[[], bool], what: str, timeout: float, interval: float = 0.5) -> None:
    """Call ``check()`` until it returns true; DeployError naming ``what`` on timeout.

    For waiting on a state (a broker listening, routes installed), not for timing it.
    """
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise DeployError(f"{what}: not after {timeout:g} s")
        time.sleep(interval)
