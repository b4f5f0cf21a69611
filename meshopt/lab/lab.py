"""A WireGuard mesh in network namespaces, built from a topology: ``Lab.up`` / ``down``.

The lab builds, in this order, and records each step in its state file before taking
it (so a failure at any point rolls back exactly what exists):

1. a namespace per node, and one for the management network;
2. the underlay: the user-space emulator (one process, a TUN per node) applying each
   pair's delay, jitter, loss and rate;
3. the management network: a bridge in the management namespace, a veth to every
   node, and mosquitto listening on it and on a unix socket in the lab's directory
   (for tools in the root namespace). By default the broker is secured exactly as
   ``meshopt broker init`` sets one up for operators: TLS on the management network,
   a certificate and password per identity (every node, controllers ctl1..ctl3, a
   ``reader`` and an ``admin``), an ACL binding each node to its own topics; the unix
   socket takes the same passwords and ACL without TLS. ``insecure_broker`` keeps the
   old anonymous, plain broker for debugging;
4. WireGuard over the underlay (wireguard-go here; the kernel module where present),
   with the topology's overlay addresses.

Python API::

    with Lab.up("topologies/lab4.yaml") as lab:
        lab.run("n1", ["ping", "-c1", lab.overlay_ip("n4")])
        lab.set("n1-n4 delay=150ms")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from meshopt.bus.client import BrokerSettings
from meshopt.errors import InputError
from meshopt.lab import procs
from meshopt.lab.calibrate import Calibration, calibrate_or_warn
from meshopt.lab.emulator import (
    EmulatorClient,
    EmulatorError,
    EmulatorSpec,
    NodeSpec,
    start_emulator,
    write_spec,
)
from meshopt.lab.netem import (
    NetemError,
    NetemNode,
    NetemSpec,
    NetemUnderlay,
    UnderlayControl,
    choose_underlay_mode,
)
from meshopt.lab.netns import list_netns, netns_argv, netns_exists
from meshopt.lab.plan import (
    MGMT_NET,
    UNDERLAY_NET,
    LabPlan,
    Layout,
    make_plan,
    memory_estimate_mb,
    new_lab_id,
)
from meshopt.lab.state import (
    LabError,
    LabState,
    ProcState,
    all_labs,
    find,
    lab_dir,
    registry_lock,
    save,
)
from meshopt.lab.wg import WgBackend, choose_wireguard, configure_mesh, start_wireguard
from meshopt.sim.events import Event, check_events, parse_event
from meshopt.topology import load_topology, save_topology
from meshopt.topology.model import Topology
from meshopt.topology.names import resolve_event_links
from meshopt.units import parse_duration_s, parse_spike
from meshopt.wireguard.userspace import private_run_dir_argv

_log = logging.getLogger(__name__)

Progress = Callable[[str], None]
# What wireguard-go adds per direction here (two process wake-ups per packet), measured
# with scripts/bench_lab.py: median overlay RTT - underlay RTT = 0.5-0.7 ms at 10-80 ms.
WG_USERSPACE_LATENCY_US = 250.0
# The secure broker's identities besides the nodes: controllers, a host-side reader, and
# an admin (all of the mesh's topics: for tests injecting what no identity may send).
LAB_CONTROLLERS = ("ctl1", "ctl2", "ctl3")
LAB_READER = "reader"
LAB_ADMIN = "admin"
PLAIN_PORT = 1883
TLS_PORT = 8883


def _quiet(_: str) -> None:
    pass


def ip_batch(commands: Sequence[str], *, netns: str | None = None) -> None:
    """Run ``ip`` commands in one process (``ip -batch``): one fork for many changes."""
    if not commands:
        return
    argv = ["ip", *(["-n", netns] if netns else []), "-batch", "-"]
    proc = subprocess.run(
        argv, input="\n".join(commands) + "\n", capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        where = f" in {netns}" if netns else ""
        raise LabError(f"ip{where}: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")


def _mem_available_mb() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def _preflight() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, TUN devices)")
    for tool in ("ip",):
        if shutil.which(tool) is None:
            raise LabError(f"the lab needs the {tool} command (iproute2)")


def _cmdline(pid: int) -> bytes:
    """``pid``'s command line (NUL-separated), empty if it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pids_in_netns(names: Sequence[str]) -> list[int]:
    """Processes living in any of the named namespaces: they belong to the lab."""
    inodes = set()
    for name in names:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/run/netns/{name}").st_ino)
    if not inodes:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
    return found


class Lab:
    """A running lab: its state, plan and topology, and the operations on it."""

    def __init__(self, state: LabState, topo: Topology, plan: LabPlan) -> None:
        self.state = state
        self.topo = topo
        self.plan = plan
        self._client: UnderlayControl | None = None

    # -- building ----------------------------------------------------------------
    @classmethod
    def up(
        cls,
        topology: str | Topology,
        *,
        name: str | None = None,
        layout: Layout = "single",
        underlay: str = "auto",
        wireguard: str = "auto",
        broker: bool = True,
        insecure_broker: bool = False,
        seed: int = 1,
        progress: Progress = _quiet,
    ) -> Lab:
        """Build the lab; on any failure (Ctrl-C included) remove what was built.

        The broker is secured (TLS, passwords, ACL) unless ``insecure_broker``.
        ``seed``: the emulator's random draws (jitter, loss, spikes); the same seed draws
        the same sequence per link, so repeated runs meant as samples need their own.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"lab seed must be an integer >= 0, got {seed!r}")
        _preflight()
        topo = load_topology(topology) if isinstance(topology, str) else topology
        source = topology if isinstance(topology, str) else topo.source
        underlay_mode = choose_underlay_mode(underlay)
        wg_mode = choose_wireguard(wireguard)
        started = time.monotonic()
        with registry_lock():
            lab_id = new_lab_id()
            while lab_dir(lab_id).exists() or any(
                n.startswith(f"ml{lab_id}-") for n in list_netns()
            ):
                lab_id = new_lab_id()
            lab_name = name or topo.name
            plan = make_plan(topo, lab_id, lab_name, layout=layout)
            for other in all_labs():
                if other.name == lab_name:
                    raise LabError(
                        f"a lab named {lab_name!r} is already up (id {other.id}); "
                        "pick another --name or take it down first"
                    )
            need = memory_estimate_mb(plan)
            have = _mem_available_mb()
            if need > 0.8 * have:
                raise LabError(
                    f"lab {lab_name}: {len(plan.nodes)} nodes need ~{need:.0f} MB, only "
                    f"{have:.0f} MB available"
                )
            directory = lab_dir(lab_id)
            directory.mkdir(mode=0o700)
            save_topology(topo, directory / "topology.yaml")
            state = LabState(
                id=lab_id,
                name=lab_name,
                topology=str(directory / "topology.yaml"),
                source=source,
                layout=layout,
                underlay=underlay_mode,
                wireguard=wg_mode,
                created=time.time(),
                broker_mode="none" if not broker else "insecure" if insecure_broker else "secure",
                seed=seed,
            )
            save(state)
        lab = cls(state, topo, plan)
        try:
            lab._build(broker=broker, progress=progress)
        except BaseException:
            progress("failed: removing what was built")
            lab.down()
            raise
        state.phase = "up"
        state.build_s = time.monotonic() - started
        save(state)
        return lab

    def _build(self, *, broker: bool, progress: Progress) -> None:
        state, plan = self.state, self.plan
        t0 = time.monotonic()
        netns = list(plan.netns)
        if state.underlay == "netem":
            netns.append(self.switch_netns)
        progress(f"namespaces: {len(netns)}")
        state.netns = netns
        save(state)
        ip_batch([f"netns add {ns}" for ns in netns])
        progress(f"underlay: {state.underlay}")
        if state.underlay == "netem":
            self._build_netem()
        else:
            self._start_emulator()
        progress("management network" + (" and broker" if broker else ""))
        self._build_mgmt()
        if broker:
            self._start_broker()
        progress(f"wireguard ({state.wireguard}, {state.layout}): {len(plan.wg_ifs)} interfaces")
        backend: WgBackend = start_wireguard(self, plan.wg_ifs)
        configure_mesh(self, backend)
        self.calibrate_tunnels(progress)
        progress(f"up in {time.monotonic() - t0:.1f} s")

    def calibrate_tunnels(self, progress: Progress = _quiet) -> Calibration | None:
        """Fit the emulator's tunnel allowance to this machine (:mod:`meshopt.lab.calibrate`);
        ``up`` does it once. None where there is nothing to fit or it failed (warned)."""
        client = self.emulator
        wg = next((w for w in self.plan.wg_ifs if w.peers), None)
        if not isinstance(client, EmulatorClient) or wg is None:
            return None  # netem underlay: nothing to take off; one node: no tunnel
        a, b = wg.node, wg.peers[0]
        names = [n.name for n in self.plan.nodes]

        def ping(count: int, interval: float) -> list[float]:
            return self.ping(names[a], names[b], count=count, interval=interval)

        cal = calibrate_or_warn(client, (a, b), names, ping)
        if cal is not None:
            self.state.tunnel_latency_us = cal.latency_us
            save(self.state)
            progress(
                f"tunnels calibrated on {cal.pair[0]}-{cal.pair[1]}: {cal.latency_us:.0f} µs "
                f"a hop taken off (last round {cal.residual_ms:+.2f} ms)"
            )
        return cal

    def _tunnel_allowance_us(self) -> float:
        return WG_USERSPACE_LATENCY_US if self.state.wireguard == "userspace" else 0.0

    @property
    def tunnel_allowance_us(self) -> float:
        """µs the emulator takes off each tunnel hop now: calibrated, else the default."""
        cal = self.state.tunnel_latency_us
        return self._tunnel_allowance_us() if cal is None else cal

    def ping(
        self, src: str, dst: str, *, count: int = 10, interval: float = 0.05, timeout: float = 2.0
    ) -> list[float]:
        """RTTs (ms) of ``count`` pings from ``src`` to ``dst``'s overlay address that came
        back; lost pings are simply missing."""
        argv = ["ping", "-n", "-c", str(count), "-i", str(interval), "-W", str(timeout)]
        proc = self.run(src, [*argv, self.overlay_ip(dst)], timeout=count * interval + timeout + 10)
        return [float(x) for x in re.findall(r"time=([\d.]+) ms", proc.stdout)]

    def _track(self, role: str, pid: int, netns: str | None, log: Path | None) -> None:
        self.state.procs.append(ProcState(role, pid, netns, str(log) if log else None))
        save(self.state)

    def _start_emulator(self) -> None:
        plan = self.plan
        directory = lab_dir(plan.lab_id)
        latency = self._tunnel_allowance_us()
        spec = EmulatorSpec(
            lab=plan.lab_id,
            control=str(directory / "emu.sock"),
            nodes=[
                NodeSpec(
                    name=n.name,
                    netns=n.netns,
                    ifname=n.underlay_if,
                    address=f"{n.underlay_ip}/{UNDERLAY_NET.prefixlen}",
                )
                for n in plan.nodes
            ],
            tunnel_ports=sorted({w.port for w in plan.wg_ifs}),
            tunnel_latency_us=latency,
            spike=None if self.topo.spike is None else self.topo.spike.astype(int).tolist(),
            seed=self.state.seed,
            **self._matrices(),
        )
        spec_path = directory / "emu.json"
        write_spec(spec, spec_path)
        try:
            proc = start_emulator(spec_path, die_with_parent=False, detach=True)
        except EmulatorError as exc:
            raise LabError(str(exc)) from None
        self._track("emulator", proc.pid, None, directory / "emu.log")
        why = procs.realtime(proc.pid, procs.EMULATOR_RT_PRIORITY)
        if why is not None:
            _log.warning(
                "lab %s: the emulator runs without real-time priority (%s)", plan.name, why
            )
        if proc.stdout is not None:
            proc.stdout.close()

    @property
    def switch_netns(self) -> str:
        """The netem underlay's switch (a bridge with a shaped veth per node)."""
        return f"ml{self.plan.lab_id}--sw"

    def _matrices(self) -> dict[str, Any]:
        topo = self.topo
        return {
            "delay_ms": [[float(x) for x in row] for row in topo.delay_ms],
            "jitter_ms": [[float(x) for x in row] for row in topo.jitter_ms],
            "loss": [[float(x) for x in row] for row in topo.loss],
            "rate_mbit": [
                [None if i == j or math.isinf(r) else float(r) for j, r in enumerate(row)]
                for i, row in enumerate(topo.rate_mbit)
            ],
        }

    def _build_netem(self) -> None:
        plan = self.plan
        if self.topo.spike is not None:
            raise LabError(f"{self.topo.source}: spike needs the emulator (--underlay emulator)")
        spec = NetemSpec(
            switch_netns=self.switch_netns,
            nodes=[
                NetemNode(
                    n.name, n.netns, n.underlay_if, f"{n.underlay_ip}/{UNDERLAY_NET.prefixlen}"
                )
                for n in plan.nodes
            ],
            leaf="netem",
            **self._matrices(),
        )
        NetemUnderlay(spec, lab_dir(plan.lab_id) / "netem.json").build()

    def _build_mgmt(self) -> None:
        plan = self.plan
        m = plan.mgmt_netns
        ip_batch(
            [
                f"link add name {n.mgmt_if} netns {n.netns} type veth "
                f"peer name ml{plan.lab_id}m{n.index} netns {m}"
                for n in plan.nodes
            ]
        )
        ip_batch(
            [
                "link set lo up",
                f"link add name {plan.mgmt_bridge} type bridge",
                f"addr add {plan.broker_ip}/{MGMT_NET.prefixlen} dev {plan.mgmt_bridge}",
                f"link set {plan.mgmt_bridge} up",
            ]
            + [
                f"link set ml{plan.lab_id}m{n.index} master {plan.mgmt_bridge} up"
                for n in plan.nodes
            ],
            netns=m,
        )
        for n in plan.nodes:
            ip_batch(
                [
                    f"addr add {n.mgmt_ip}/{MGMT_NET.prefixlen} dev {n.mgmt_if}",
                    f"link set {n.mgmt_if} up",
                ],
                netns=n.netns,
            )

    @property
    def broker_socket(self) -> Path:
        """The broker's unix socket, for tools in the root namespace."""
        return lab_dir(self.plan.lab_id) / "mqtt.sock"

    @property
    def broker_host(self) -> str:
        """The broker's address on the management network, for the nodes."""
        return self.plan.broker_ip

    @property
    def secure_broker(self) -> bool:
        """True when the broker runs with TLS, passwords and the ACL (the default)."""
        return self.state.broker_mode == "secure"

    @property
    def broker_port(self) -> int:
        """The broker's port on the management network (TLS in secure mode)."""
        return TLS_PORT if self.secure_broker else PLAIN_PORT

    @property
    def broker_pki(self) -> Path:
        """``meshopt broker init``'s directory for this lab (secure mode)."""
        return lab_dir(self.plan.lab_id) / "mqtt"

    def _identity_dir(self, identity: str) -> Path:
        d = self.broker_pki / "clients" / identity
        if not d.is_dir():
            have = sorted(p.name for p in (self.broker_pki / "clients").glob("*"))
            raise LabError(
                f"lab {self.plan.name}: no broker identity {identity!r} "
                f"(there are: {', '.join(have) or 'none'})"
            )
        return d

    def broker_password(self, identity: str) -> str:
        return (self._identity_dir(identity) / "password").read_text().splitlines()[0]

    def broker_settings(self, identity: str) -> BrokerSettings:
        """How a daemon of ``identity`` inside the lab (a node, or a controller in the
        management namespace) reaches the broker: mqtts:// with its own files."""
        if not self.secure_broker:
            return BrokerSettings(url=f"mqtt://{self.plan.broker_ip}:{PLAIN_PORT}")
        d = self._identity_dir(identity)
        return BrokerSettings(
            url=f"mqtts://{self.plan.broker_ip}:{TLS_PORT}",
            ca_file=str(d / "ca.crt"),
            cert_file=str(d / "client.crt"),
            key_file=str(d / "client.key"),
            username=identity,
            password_file=str(d / "password"),
        )

    def host_broker_settings(self, identity: str = LAB_READER) -> BrokerSettings:
        """The host side's door: the unix socket, with ``identity``'s password."""
        url = f"unix://{self.broker_socket}"
        if not self.secure_broker:
            return BrokerSettings(url=url)
        d = self._identity_dir(identity)
        return BrokerSettings(url=url, username=identity, password_file=str(d / "password"))

    def mosquitto_cli_args(self, identity: str = LAB_READER, *, network: bool = False) -> list[str]:
        """Connection options for mosquitto_pub/mosquitto_sub as ``identity``: the unix
        socket (host side), or with ``network`` the management network (inside a node)."""
        if network:
            where = ["-h", self.plan.broker_ip, "-p", str(self.broker_port)]
        else:
            where = ["--unix", str(self.broker_socket)]
        if not self.secure_broker:
            return where
        d = self._identity_dir(identity)
        tls = ["--cafile", str(d / "ca.crt"), "--cert", str(d / "client.crt")]
        tls += ["--key", str(d / "client.key")]
        login = ["-u", identity, "-P", self.broker_password(identity)]
        return where + (tls if network else []) + login

    def _broker_conf(self) -> Path:
        """Write the broker's config (and, in secure mode, the PKI and credentials)."""
        directory = lab_dir(self.plan.lab_id)
        if self.secure_broker:
            from meshopt.broker.mosquitto import BrokerRequest, make_identities, write_broker_dir

            nodes = [n.name for n in self.plan.nodes]
            request = BrokerRequest(
                mesh=self.plan.name,
                identities=tuple(
                    make_identities(nodes, LAB_CONTROLLERS, [LAB_READER], [LAB_ADMIN])
                ),
                hosts=(self.plan.broker_ip,),
                port=TLS_PORT,
                install_dir="",  # the conf names the files where they are
                client_dir="",  # broker.toml names the files where they are
                bind_address=self.plan.broker_ip,
                unix_socket=str(self.broker_socket),
                persistence_dir="",
                run_as="root",
                log_dest="stderr",
            )
            files = write_broker_dir(request, self.broker_pki)
            return files.broker_dir / "mosquitto.conf"
        conf = directory / "mosquitto.conf"
        conf.write_text(
            "# meshopt lab broker (--insecure-broker): anonymous, plain MQTT\n"
            "user root\npersistence false\nallow_anonymous true\n"
            "log_dest stderr\nlog_type error\nlog_type warning\n"
            f"listener {PLAIN_PORT} {self.plan.broker_ip}\n"
            f"listener 0 {self.broker_socket}\n"
        )
        return conf

    def _start_broker(self, timeout: float = 10.0) -> None:
        if shutil.which("mosquitto") is None:
            raise LabError("the lab's broker needs mosquitto (apt install mosquitto)")
        directory = lab_dir(self.plan.lab_id)
        conf = self._broker_conf()
        log = directory / "mosquitto.log"
        proc = procs.spawn(
            ["mosquitto", "-c", str(conf)], self.plan.lab_id, log, netns=self.plan.mgmt_netns
        )
        self._track("broker", proc.pid, self.plan.mgmt_netns, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LabError(f"mosquitto exited: {log.read_text(errors='replace').strip()}")
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(self.broker_socket))
                    return
                except OSError:
                    time.sleep(0.02)
        raise LabError(f"mosquitto not listening after {timeout:g} s")

    # -- attaching and tearing down -------------------------------------------------
    @classmethod
    def attach(cls, name: str) -> Lab:
        """The running lab called ``name`` (or with that id)."""
        state = find(name)
        return cls.from_state(state)

    @classmethod
    def from_state(cls, state: LabState) -> Lab:
        topo = load_topology(state.topology)
        plan = make_plan(topo, state.id, state.name, layout=state.layout)  # type: ignore[arg-type]
        return cls(state, topo, plan)

    def down(self) -> None:
        """Remove everything this lab created, and nothing else."""
        teardown(self.state)
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- using -----------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return self.plan.node(node).netns

    def overlay_ip(self, node: str) -> str:
        return self.plan.node(node).overlay_ip

    def underlay_ip(self, node: str) -> str:
        return self.plan.node(node).underlay_ip

    def mgmt_ip(self, node: str) -> str:
        return self.plan.node(node).mgmt_ip

    def wg_ifnames(self, node: str) -> list[str]:
        i = self.plan.node(node).index
        return [w.ifname for w in self.plan.wg_ifs if w.node == i]

    def env(self, node: str) -> dict[str, str]:
        """Environment for a process in ``node``: tagged, and told where things are."""
        p = self.plan.node(node)
        return {
            procs.TAG: self.plan.lab_id,
            "MESHOPT_LAB_NAME": self.plan.name,
            "MESHOPT_NODE": p.name,
            **self._broker_env(p.name),
        }

    def _broker_env(self, node: str) -> dict[str, str]:
        """MESHOPT_BROKER and, in secure mode, the node's own credentials (for the live
        commands run in a node; with them a node reads only its own route set)."""
        plain = {"MESHOPT_BROKER": f"{self.plan.broker_ip}:{PLAIN_PORT}"}
        if self.state.broker_mode != "secure":
            return plain
        try:
            s = self.broker_settings(node)
        except LabError:  # the broker is not set up yet (or was not started)
            return {"MESHOPT_BROKER": f"mqtts://{self.plan.broker_ip}:{TLS_PORT}"}
        return {
            "MESHOPT_BROKER": s.url,
            "MESHOPT_BROKER_CA_FILE": s.ca_file,
            "MESHOPT_BROKER_CERT_FILE": s.cert_file,
            "MESHOPT_BROKER_KEY_FILE": s.key_file,
            "MESHOPT_BROKER_USERNAME": s.username,
            "MESHOPT_BROKER_PASSWORD_FILE": s.password_file,
        }

    def wg_run_dir(self, node: str) -> Path:
        """The node's private ``/var/run/wireguard`` (wireguard-go's UAPI sockets)."""
        return lab_dir(self.plan.lab_id) / "wg" / self.plan.node(node).name

    def argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` in the node's namespace, seeing the node's own WireGuard sockets.

        ``ip netns exec`` gives the command its own mount namespace, so the bind mount
        of the node's directory over ``/var/run/wireguard`` is seen by it alone: ``wg
        show`` there lists the node's interfaces and no other node's.
        """
        run_dir = self.wg_run_dir(node)
        if self.state.wireguard != "userspace" or not run_dir.is_dir():
            return netns_argv(self.netns(node), argv)
        return netns_argv(self.netns(node), private_run_dir_argv(str(run_dir), argv))

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``node``; ``lab down`` ends it (it lives in the lab's netns)."""
        env = {**os.environ, **kwargs.pop("env", {}), **self.env(node)}
        return subprocess.Popen(self.argv(node, argv), env=env, **kwargs)

    def run(
        self, node: str, argv: Sequence[str], *, timeout: float | None = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``node`` to completion, output captured as text."""
        env = {**os.environ, **self.env(node)}
        return subprocess.run(
            self.argv(node, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env=env,
        )

    @property
    def emulator(self) -> UnderlayControl:
        """The underlay's run-time control: the emulator's socket or the netem state."""
        if self._client is None:
            directory = lab_dir(self.plan.lab_id)
            if self.state.underlay == "netem":
                self._client = NetemUnderlay.load(directory / "netem.json")
            else:
                self._client = EmulatorClient(directory / "emu.sock")
        return self._client

    def set(self, text: str) -> Event:
        """Change the underlay now: ``a-b delay=150ms loss=2%``, ``a->b rate=5Mbit``,
        ``a-b down``, ``node=c down``; lab faults: ``a-b spike=20`` (one packet in 20
        held 100-300 ms longer; ``spike=off``), ``node=c stall=2s`` (the node's processes
        stopped for 2 s, see :meth:`stall`). Returns the parsed change."""
        words = text.split()
        if not words:
            raise InputError("nothing to set: give a-b key=value ... or node=NAME down|up")
        head = words[0]
        if "=" not in head:
            words[0] = f"link={head}"
        # Faults of the lab only (the simulator has no such events): spike=N, stall=S.
        faults = {w.partition("=")[0]: w.partition("=")[2] for w in words if "=" in w}
        words = [w for w in words if w.partition("=")[0] not in ("spike", "stall")]
        if "stall" in faults:
            return self._set_stall(text, words, faults["stall"])
        spike: int | None = None
        if "spike" in faults:
            try:
                spike = parse_spike(faults["spike"])
            except InputError as exc:
                raise InputError(f"lab {self.plan.name}: {exc.message}") from None
            if not words[0].startswith("link="):
                raise InputError(f"lab {self.plan.name}: spike= is for a link: a-b spike=20")
        only_spike = spike is not None and len(words) == 1
        if only_spike:
            words.append("delay=0")  # a placeholder change, dropped below
        line = "at=0 " + " ".join(words)
        try:
            (event,) = resolve_event_links([parse_event(line)], self.topo.names)
            check_events([event], self.topo)
        except InputError as exc:
            # The event parser's words, in the terms of this command.
            msg = exc.message.replace(f"event {line!r}", repr(text)).replace("bad event", "bad")
            raise InputError(f"lab {self.plan.name}: {msg}") from None
        if spike is not None:
            changes = {} if only_spike else dict(event.changes)
            event = dataclasses.replace(event, text=text, changes={**changes, "spike": spike})
        self.apply(event)
        return event

    def _set_stall(self, text: str, words: list[str], value: str) -> Event:
        """``node=c stall=2s``: stop the node's processes for that long (:meth:`stall`)."""
        node = words[0].partition("=")[2] if words[0].startswith("node=") else ""
        if len(words) != 1 or node not in self.topo.names:
            raise InputError(f"lab {self.plan.name}: {text!r}: stall is node=NAME stall=2s")
        try:
            seconds = parse_duration_s(value, "stall")
        except InputError as exc:
            raise InputError(f"lab {self.plan.name}: {exc.message}") from None
        self.stall(node, seconds)
        return Event(0.0, text, node=node)

    def stall(
        self,
        node: str,
        seconds: float,
        *,
        agent_only: bool = False,
        pids: Sequence[int] | None = None,
    ) -> list[int]:
        """SIGSTOP ``node``'s processes for ``seconds``, then SIGCONT: a VM that loses the
        CPU. Every process this lab runs in the node's namespace (its agent and its
        wireguard-go: packets through it are held, then delivered at once), or only its
        agent, or ``pids``; only processes tagged with this lab are ever touched. Returns
        the PIDs that were stalled."""
        if not 0 < seconds <= 600:
            raise InputError(f"lab {self.plan.name}: stall of {seconds:g} s: give 0 < S <= 600")
        with self.paused(node, agent_only=agent_only, pids=pids) as stopped:
            time.sleep(seconds)
        return stopped

    @contextlib.contextmanager
    def paused(
        self, node: str, *, agent_only: bool = False, pids: Sequence[int] | None = None
    ) -> Iterator[list[int]]:
        """:meth:`stall` for as long as the ``with`` block runs (a change made behind a
        paused agent's back is there to be read before the agent can see it)."""
        lab_id = self.plan.lab_id
        if pids is None:
            pids = [
                pid
                for pid in _pids_in_netns([self.netns(node)])
                if not agent_only or (b"agent" in _cmdline(pid) and b"meshopt" in _cmdline(pid))
            ]
        ours = [pid for pid in pids if procs.lab_of(pid) == lab_id]
        if not ours:
            raise InputError(f"lab {self.plan.name}: node {node} runs no process of this lab")
        stopped: list[int] = []
        try:
            for pid in ours:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            yield stopped
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def apply(self, ev: Event) -> None:
        client = self.emulator
        if ev.node is not None:
            client.node_state(ev.node, ev.state == "up")
            return
        assert ev.link is not None
        a, b = ev.link
        pairs = [(a, b), (b, a)] if ev.both_ways else [(a, b)]
        if ev.state == "down":
            current = client.params()
            names: list[str] = current["names"]
            for x, y in pairs:
                key = f"{x}->{y}"
                if key not in self.state.saved_loss:
                    self.state.saved_loss[key] = current["loss"][names.index(x)][names.index(y)]
            save(self.state)
            client.set(pairs, loss=1.0)
        elif ev.state == "up":
            for x, y in pairs:
                loss = self.state.saved_loss.pop(f"{x}->{y}", None)
                if loss is not None:
                    client.set([(x, y)], loss=loss)
            save(self.state)
        ch = dict(ev.changes)
        if "spike" in ch:
            if not isinstance(client, EmulatorClient):
                raise InputError(f"lab {self.plan.name}: spike= needs the emulator underlay")
            client.set(pairs, spike=int(ch.pop("spike")))
        if ch:
            kwargs: dict[str, Any] = {
                "delay_ms": ch.get("delay_ms"),
                "jitter_ms": ch.get("jitter_ms"),
                "loss": ch.get("loss"),
            }
            if "rate_mbit" in ch:
                kwargs["rate_mbit"] = ch["rate_mbit"]
            client.set(pairs, **kwargs)

    def status(self, *, stats: bool = False) -> dict[str, Any]:
        """What the lab is and whether its parts are alive (``lab status``)."""
        return lab_status(self, stats=stats)


def lab_status(lab: Lab, *, stats: bool = False) -> dict[str, Any]:
    st = lab.state
    procs_out = []
    rss_kb = 0
    for p in st.procs:
        ok = procs.alive(p.pid) and procs.lab_of(p.pid) == st.id
        if ok:
            rss_kb += _rss_kb(p.pid)
        procs_out.append({"role": p.role, "pid": p.pid, "alive": ok})
    nodes = []
    for n in lab.plan.nodes:
        nodes.append(
            {
                "name": n.name,
                "netns": n.netns,
                "underlay": n.underlay_ip,
                "overlay": n.overlay_ip,
                "mgmt": n.mgmt_ip,
                "wireguard": lab.wg_ifnames(n.name),
                "exists": netns_exists(n.netns),
            }
        )
    out: dict[str, Any] = {
        "name": st.name,
        "id": st.id,
        "phase": st.phase,
        "topology": st.source,
        "underlay": st.underlay,
        "seed": st.seed,
        "wireguard": st.wireguard,
        "layout": st.layout,
        "overlay_net": lab.plan.overlay_net,
        "broker": {
            "address": f"{lab.broker_host}:{lab.broker_port}",
            "socket": str(lab.broker_socket),
            "mode": st.broker_mode,
        },
        "build_s": st.build_s,
        "tunnel_latency_us": st.tunnel_latency_us,
        "processes": procs_out,
        "rss_mb": round(rss_kb / 1024, 1),
        "nodes": nodes,
        "healthy": all(p["alive"] for p in procs_out) and all(n["exists"] for n in nodes),
    }
    if stats:
        try:
            out["underlay_stats"] = lab.emulator.stats()
        except (EmulatorError, NetemError) as exc:
            out["underlay_stats"] = {"error": str(exc)}
    return out


def _rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def teardown(state: LabState) -> None:
    """Stop the lab's processes by PID, delete its namespaces and its directory.

    Also ends any other process living in the lab's namespaces (a command a user
    started with ``lab exec``), since it would otherwise keep a namespace alive.
    """
    state.phase = "tearing-down"
    with contextlib.suppress(OSError):
        save(state)
    pids = [p.pid for p in state.procs]
    procs.stop_pids(pids, state.id)
    ours = [ns for ns in state.netns if netns_exists(ns)]
    procs.kill_pids([pid for pid in _pids_in_netns(ours) if pid != os.getpid()])
    if ours:
        ip_batch([f"netns delete {ns}" for ns in ours])
    shutil.rmtree(lab_dir(state.id), ignore_errors=True)


def down_all() -> list[str]:
    """Tear down every lab, and the leftovers of crashed ones; the names removed."""
    removed = []
    for st in all_labs():
        teardown(st)
        removed.append(st.name)
    # Leftovers without a state file (a crash before the first save, a deleted /run dir).
    orphans: dict[str, list[int]] = {}
    for pid, tag in procs.tagged_pids().items():
        if tag.startswith("l") and len(tag) == 5:
            orphans.setdefault(tag, []).append(pid)
    for ns in list_netns():
        if ns.startswith("ml") and len(ns) > 8 and ns[7] == "-":
            orphans.setdefault(ns[2:7], [])
    for lab_id, pids in orphans.items():
        netns = [ns for ns in list_netns() if ns.startswith(f"ml{lab_id}-")]
        teardown(
            LabState(
                id=lab_id,
                name=f"(orphan {lab_id})",
                topology="",
                source="",
                layout="single",
                underlay="",
                wireguard="",
                created=0.0,
                netns=netns,
                procs=[ProcState("orphan", pid) for pid in pids],
            )
        )
        removed.append(f"(orphan {lab_id})")
    return removed
