"""WireGuard for the lab: an interface per node (or per peer) over the emulated underlay.

Keys are made fresh for every lab and kept in its state file (mode 0600 directory).
In the single layout each node's one interface has a peer per tunnel with the peer's
overlay address as AllowedIPs, and the interface address covers the whole overlay
network, so the kernel sends every mesh destination into WireGuard. In the per-peer
layout each tunnel has its own interface at each end (AllowedIPs 0.0.0.0/0), and a
route per peer chooses the interface, as operators of that layout do.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from meshopt.lab import procs
from meshopt.lab.plan import WG_MTU, WgIfPlan
from meshopt.lab.state import LabError, ProcState, WgState, lab_dir, save
from meshopt.wireguard.keys import generate_keypair
from meshopt.wireguard.model import InterfaceConfig, PeerConfig

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from meshopt.lab.lab import Lab


class WgBackend(Protocol):
    def configure(self, netns: str, ifname: str, config: InterfaceConfig) -> None: ...


def choose_wireguard(requested: str) -> str:
    """``kernel`` where the module is loaded, else ``userspace`` (wireguard-go)."""
    from meshopt.wireguard.kernel import kernel_wireguard_available

    if requested not in ("auto", "userspace", "kernel"):
        raise LabError(f"bad wireguard mode {requested!r}: use auto, userspace or kernel")
    kernel = requested != "userspace" and kernel_wireguard_available()
    if requested == "kernel" and not kernel:
        raise LabError("no WireGuard kernel module here; use --wireguard userspace")
    if kernel:
        return "kernel"
    if shutil.which("wireguard-go") is None:
        raise LabError("no WireGuard kernel module and no wireguard-go (apt install wireguard-go)")
    return "userspace"


def start_wireguard(lab: Lab, wg_ifs: Sequence[WgIfPlan]) -> WgBackend:
    """Create every WireGuard interface of the plan (keys made here, kept in the state)."""
    state = lab.state
    plan = lab.plan
    directory = lab_dir(plan.lab_id)
    for w in wg_ifs:
        node = plan.nodes[w.node]
        private, public = generate_keypair()
        state.wg.append(
            WgState(
                ifname=w.ifname,
                node=node.name,
                netns=node.netns,
                port=w.port,
                private_key=private,
                public_key=public,
                peers=[plan.nodes[j].name for j in w.peers],
                peer_ports=list(w.peer_ports),
            )
        )
    save(state)
    if state.wireguard == "kernel":
        from meshopt.wireguard.errors import WireGuardError
        from meshopt.wireguard.kernel import create_kernel_interface

        for w in wg_ifs:
            try:
                create_kernel_interface(w.ifname, netns=plan.nodes[w.node].netns, mtu=WG_MTU)
            except WireGuardError as exc:
                raise LabError(str(exc)) from None
        return _KernelLabBackend()
    from meshopt.wireguard.errors import WireGuardError
    from meshopt.wireguard.userspace import start_wireguard_go

    for w in wg_ifs:
        node = plan.nodes[w.node]
        run_dir = lab.wg_run_dir(node.name)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log = directory / f"wg-{node.name}-{w.ifname}.log"
        try:
            wg = start_wireguard_go(
                w.ifname,
                netns=node.netns,
                run_dir=str(run_dir),
                env={procs.TAG: plan.lab_id},
                log_path=str(log),
                # Handshake attempts, retries and keepalives (not per packet): a tunnel
                # that comes up late in a failed test is explained from this log.
                log_level="verbose",
            )
        except WireGuardError as exc:
            raise LabError(str(exc)) from None
        wg.log.close()  # the process keeps its own descriptor; the lab outlives us
        why = procs.favour(wg.pid, procs.WIREGUARD_NICE)
        if why is not None:
            _log.warning("lab %s: wireguard-go runs at normal priority (%s)", plan.name, why)
        state.procs.append(ProcState(f"wg:{node.name}:{w.ifname}", wg.pid, node.netns, str(log)))
        save(state)
    return _UserspaceLabBackend(lab)


class _UserspaceLabBackend:
    def __init__(self, lab: Lab) -> None:
        self.run_dirs = {n.netns: str(lab.wg_run_dir(n.name)) for n in lab.plan.nodes}

    def configure(self, netns: str, ifname: str, config: InterfaceConfig) -> None:
        from meshopt.wireguard.userspace import UserspaceBackend

        UserspaceBackend(run_dir=self.run_dirs[netns]).configure(ifname, config)


class _KernelLabBackend:
    def configure(self, netns: str, ifname: str, config: InterfaceConfig) -> None:
        from meshopt.wireguard.kernel import KernelBackend

        with KernelBackend(netns=netns) as backend:
            backend.configure(ifname, config)


def configure_mesh(lab: Lab, backend: WgBackend) -> None:
    """Keys, peers and endpoints on every interface; addresses and routes in every node."""
    plan = lab.plan
    keys = {(w.node, w.ifname): w for w in lab.state.wg}
    by_node_peer = {(w.node, p): w for w in lab.state.wg for p in w.peers}
    single = plan.layout == "single"
    for w in plan.wg_ifs:
        me = plan.nodes[w.node]
        st = keys[(me.name, w.ifname)]
        peers = []
        for j, port in zip(w.peers, w.peer_ports, strict=True):
            other = plan.nodes[j]
            their = by_node_peer[(other.name, me.name)]
            allowed = (
                (f"{other.overlay_ip}/{_host_len(other.overlay_ip)}",)
                if single
                else (
                    "0.0.0.0/0",
                    "::/0",
                )
            )
            peers.append(
                PeerConfig(
                    public_key=their.public_key,
                    allowed_ips=allowed,
                    endpoint=f"{other.underlay_ip}:{port}",
                )
            )
        backend.configure(
            me.netns,
            w.ifname,
            InterfaceConfig(private_key=st.private_key, listen_port=w.port, peers=tuple(peers)),
        )
    from meshopt.lab.lab import ip_batch

    v6 = ipaddress.ip_network(plan.overlay_net).version == 6
    for node in plan.nodes:
        cmds = []
        for w in plan.wg_ifs:
            if w.node != node.index:
                continue
            if not v6:
                # No IPv6 link-local address: its router solicitations would otherwise
                # start handshakes (per-peer AllowedIPs ::/0) towards peers not yet up,
                # and a lost first handshake is retried only after 5 s.
                cmds.append(f"link set {w.ifname} addrgenmode none")
            prefix = node.overlay_prefix if single else _host_len(node.overlay_ip)
            cmds.append(f"addr add {node.overlay_ip}/{prefix} dev {w.ifname}")
            cmds.append(f"link set {w.ifname} mtu {WG_MTU} up")
            if not single:
                other = plan.nodes[w.peers[0]]
                cmds.append(
                    f"route add {other.overlay_ip}/{_host_len(other.overlay_ip)} dev {w.ifname}"
                )
        ip_batch(cmds, netns=node.netns)


def _host_len(address: str) -> int:
    return ipaddress.ip_address(address).max_prefixlen
