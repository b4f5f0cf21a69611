"""Real WireGuard tunnels between network namespaces, configured through meshopt.wireguard.

wireguard-go here (no kernel module); the kernel backend's test runs where the module
exists. Every namespace, process and socket is made by these tests, named with a
fresh id, and removed (processes by PID) even when a test fails.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshopt.lab.netns import create_netns, delete_netns, netns_exists, netns_run, unique_name
from meshopt.wireguard import (
    AsyncUserspaceBackend,
    InterfaceConfig,
    KernelBackend,
    PeerConfig,
    UapiError,
    UserspaceBackend,
    WireGuardBackend,
    WireGuardGo,
    generate_keypair,
    kernel_unavailable_reason,
    start_wireguard_go,
    stop_all,
)
from meshopt.wireguard.kernel import create_kernel_interface
from meshopt.wireguard.uapi import DEFAULT_RUN_DIR, check_set_reply

from .tools import need_tools

pytestmark = pytest.mark.lab


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, text=True)


def ping(ns: str, dst: str, count: int = 3, wait: float = 2.0) -> subprocess.CompletedProcess[str]:
    argv = ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-W", str(wait), dst]
    return netns_run(ns, argv, check=False)


def unreachable(ns: str, dst: str) -> bool:
    """No reply to two echoes within half a second each."""
    return ping(ns, dst, count=2, wait=0.5).returncode != 0


@dataclass
class Net:
    """Namespaces joined by veth pairs (addresses 192.168.77.x/30 inside them only)."""

    tag: str
    netns: list[str] = field(default_factory=list)
    procs: list[WireGuardGo] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def ns(self, i: int) -> str:
        return self.netns[i]

    def ifname(self, label: str) -> str:
        return f"wg{self.tag}{label}"  # unique across the shared /var/run/wireguard

    def link(self, a: int, b: int, subnet: int) -> tuple[str, str]:
        """veth between nodes a and b on 192.168.77.<4*subnet>/30; returns both addresses."""
        va, vb = f"ve{subnet}a", f"ve{subnet}b"
        ip(self.ns(a), "link", "add", va, "type", "veth", "peer", "name", vb, "netns", self.ns(b))
        addr_a, addr_b = f"192.168.77.{4 * subnet + 1}", f"192.168.77.{4 * subnet + 2}"
        for ns, dev, addr in ((self.ns(a), va, addr_a), (self.ns(b), vb, addr_b)):
            ip(ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip(ns, "link", "set", dev, "up")
        return addr_a, addr_b

    def wireguard_go(self, node: int, label: str, **kwargs: str) -> WireGuardGo:
        wg = start_wireguard_go(
            self.ifname(label), netns=self.ns(node), env={"MESHOPT_LAB": self.tag}, **kwargs
        )
        self.procs.append(wg)
        return wg

    def up(self, node: int, ifname: str, address: str) -> None:
        ip(self.ns(node), "addr", "add", address, "dev", ifname)
        ip(self.ns(node), "link", "set", ifname, "up")


@pytest.fixture
def make_net(lab_ok: None) -> Iterator[Callable[[int], Net]]:
    """``make_net(n)``: n fresh namespaces (lo up); processes stopped, namespaces deleted."""
    need_tools("wireguard-go")
    made: list[Net] = []

    def make(n: int) -> Net:
        tag = unique_name("")
        net = Net(tag=tag)
        made.append(net)
        for i in range(n):
            name = f"mowgt{tag}n{i}"
            create_netns(name)
            net.netns.append(name)
            ip(name, "link", "set", "lo", "up")
        return net

    yield make
    for net in made:
        try:
            stop_all(net.procs)
        finally:
            for name in net.netns:
                if netns_exists(name):
                    delete_netns(name)
        for wg in net.procs:
            assert not os.path.exists(wg.socket_path), f"socket left behind: {wg.socket_path}"


def _pair_config(
    private: str, port: int, peer_public: str, allowed: tuple[str, ...], endpoint: str
) -> InterfaceConfig:
    return InterfaceConfig(
        private_key=private,
        listen_port=port,
        peers=(PeerConfig(public_key=peer_public, allowed_ips=allowed, endpoint=endpoint),),
    )


def _bring_up_pair(
    net: Net, backend_a: WireGuardBackend, backend_b: WireGuardBackend, if_a: str, if_b: str
) -> tuple[str, str]:
    """Configure a WireGuard pair over veth 0; return both public keys."""
    under_a, under_b = net.link(0, 1, 0)
    priv_a, pub_a = generate_keypair()
    priv_b, pub_b = generate_keypair()
    t0 = time.monotonic()
    backend_a.configure(
        if_a, _pair_config(priv_a, 51820, pub_b, ("10.200.0.2/32",), f"{under_b}:51821")
    )
    backend_b.configure(
        if_b, _pair_config(priv_b, 51821, pub_a, ("10.200.0.1/32",), f"{under_a}:51820")
    )
    net.timings["configure_both_s"] = time.monotonic() - t0
    net.up(0, if_a, "10.200.0.1/24")
    net.up(1, if_b, "10.200.0.2/24")
    return pub_a, pub_b


def test_wireguard_go_tunnel_carries_packets_and_reports_state(
    make_net: Callable[[int], Net],
) -> None:
    net = make_net(2)
    wa, wb = net.wireguard_go(0, "a"), net.wireguard_go(1, "b")
    net.timings["start_s"] = max(wa.start_seconds, wb.start_seconds)
    # the TUN device is in the process's namespace, not ours
    assert wa.ifname in netns_run(net.ns(0), ["ip", "-o", "link"]).stdout
    assert (
        wa.ifname not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    )
    # the lab's tag is in the daemon's own environment (what clean-up searches for)
    assert f"MESHOPT_LAB={net.tag}".encode() in Path(f"/proc/{wa.pid}/environ").read_bytes()

    backend = UserspaceBackend()
    pub_a, pub_b = _bring_up_pair(net, backend, backend, wa.ifname, wb.ifname)
    # configuring again changes nothing (no request beyond the get)
    assert backend.configure(wa.ifname, _config_of(backend, wa.ifname)).is_empty()

    t0 = time.monotonic()
    first = ping(net.ns(0), "10.200.0.2", count=1)  # handshake, then the echo
    net.timings["handshake_and_first_echo_s"] = time.monotonic() - t0
    assert first.returncode == 0, first.stdout + first.stderr
    result = ping(net.ns(0), "10.200.0.2")
    assert result.returncode == 0, result.stdout + result.stderr

    now = time.time()
    sa, sb = backend.get(wa.ifname), backend.get(wb.ifname)
    assert sa.public_key == pub_a and sb.public_key == pub_b
    assert sa.listen_port == 51820
    peer = sa.peer(pub_b)
    assert peer is not None
    assert peer.last_handshake is not None and 0 <= now - peer.last_handshake < 30
    assert peer.rx_bytes > 0 and peer.tx_bytes > 0
    assert peer.allowed_ips == ("10.200.0.2/32",)
    back = sb.peer(pub_a)
    assert back is not None and back.endpoint == "192.168.77.1:51820"  # learned from A
    assert back.rx_bytes > 0 and back.tx_bytes > 0

    # the asyncio backend (the agent's) reads the same state
    async_state = asyncio.run(AsyncUserspaceBackend().get(wa.ifname))
    async_peer = async_state.peer(pub_b)
    assert async_peer is not None and async_peer.rx_bytes >= peer.rx_bytes

    # AllowedIPs decide: without B's address no packet goes; restored, they flow again
    backend.set_allowed_ips(wa.ifname, pub_b, [])
    assert unreachable(net.ns(0), "10.200.0.2")
    backend.set_allowed_ips(wa.ifname, pub_b, ["10.200.0.2/32"])
    assert ping(net.ns(0), "10.200.0.2", count=2).returncode == 0

    # a removed peer is gone from the state and no longer reachable
    backend.remove_peer(wa.ifname, pub_b)
    assert backend.get(wa.ifname).peers == ()
    assert unreachable(net.ns(0), "10.200.0.2")

    # a request wireguard-go refuses raises the project error with its errno ...
    with pytest.raises(UapiError, match="errno -22") as info:
        check_set_reply(wa.client().request(b"set=1\nlisten_port=notanumber\n\n"))
    assert info.value.errno == 22
    # ... and an unknown operation makes it hang up without a reply
    with pytest.raises(UapiError, match="no reply"):
        wa.client().request(b"bogus=1\n\n")
    assert "failed to parse listen_port" in wa.log_text()

    t0 = time.monotonic()
    stop_all([wa, wb])
    net.timings["stop_both_s"] = time.monotonic() - t0
    assert wa.proc.returncode == 0 and wb.proc.returncode == 0
    assert not os.path.exists(wa.socket_path)
    assert wa.ifname not in netns_run(net.ns(0), ["ip", "-o", "link"]).stdout  # TUN gone
    print(f"\nwireguard-go timings: {net.timings}")


def _config_of(backend: WireGuardBackend, ifname: str) -> InterfaceConfig:
    st = backend.get(ifname)
    return InterfaceConfig(
        private_key=st.private_key,
        listen_port=st.listen_port,
        peers=tuple(p.as_config() for p in st.peers),
    )


def test_private_run_dir_keeps_the_socket_out_of_var_run(
    make_net: Callable[[int], Net], tmp_path: Path
) -> None:
    net = make_net(1)
    run_dir = tmp_path / "wg"
    run_dir.mkdir()
    wg = net.wireguard_go(0, "p", run_dir=str(run_dir))
    assert wg.socket_path == str(run_dir / f"{wg.ifname}.sock")
    assert os.listdir(run_dir) == [f"{wg.ifname}.sock"]
    assert not os.path.exists(os.path.join(DEFAULT_RUN_DIR, f"{wg.ifname}.sock"))
    backend = UserspaceBackend(run_dir=str(run_dir))
    assert backend.interfaces() == [wg.ifname]
    private, public = generate_keypair()
    backend.configure(wg.ifname, InterfaceConfig(private_key=private, listen_port=51830))
    assert backend.get(wg.ifname).public_key == public
    # the bind mount lives only in the daemon's mount namespace
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(run_dir) not in mounts
    wg.stop()
    assert os.listdir(run_dir) == []


def test_one_interface_per_peer_with_routes_choosing_a_relay(
    make_net: Callable[[int], Net],
) -> None:
    """A has one interface per peer (AllowedIPs 0.0.0.0/0); B reaches C through A."""
    net = make_net(3)
    ab, ba = net.link(0, 1, 0)
    ac, ca = net.link(0, 2, 1)
    keys = [generate_keypair() for _ in range(3)]
    wgs = {
        "ab": net.wireguard_go(0, "ab"),
        "ac": net.wireguard_go(0, "ac"),
        "ba": net.wireguard_go(1, "ba"),
        "ca": net.wireguard_go(2, "ca"),
    }
    backend = UserspaceBackend()
    everything = ("0.0.0.0/0",)
    plan = {  # interface: (node, own key, listen port, peer key, peer endpoint)
        "ab": (0, 0, 51820, 1, f"{ba}:51820"),
        "ac": (0, 0, 51821, 2, f"{ca}:51820"),
        "ba": (1, 1, 51820, 0, f"{ab}:51820"),
        "ca": (2, 2, 51820, 0, f"{ac}:51821"),
    }
    overlay = ["10.201.0.1", "10.201.0.2", "10.201.0.3"]
    for label, (node, me, port, peer, endpoint) in plan.items():
        ifname = wgs[label].ifname
        backend.configure(
            ifname, _pair_config(keys[me][0], port, keys[peer][1], everything, endpoint)
        )
        net.up(node, ifname, f"{overlay[node]}/32")
    # routes choose the interface: A to each neighbour directly; B and C via A
    ip(net.ns(0), "route", "add", "10.201.0.2/32", "dev", wgs["ab"].ifname)
    ip(net.ns(0), "route", "add", "10.201.0.3/32", "dev", wgs["ac"].ifname)
    ip(net.ns(1), "route", "add", "10.201.0.0/24", "dev", wgs["ba"].ifname)
    ip(net.ns(2), "route", "add", "10.201.0.0/24", "dev", wgs["ca"].ifname)
    netns_run(net.ns(0), ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])

    assert ping(net.ns(0), "10.201.0.2").returncode == 0
    assert ping(net.ns(0), "10.201.0.3").returncode == 0
    before = backend.get(wgs["ac"].ifname).peers[0].tx_bytes
    result = ping(net.ns(1), "10.201.0.3", count=5)
    assert result.returncode == 0, result.stdout + result.stderr
    relayed = backend.get(wgs["ac"].ifname).peers[0].tx_bytes - before
    # five echo requests crossed A's interface towards C (each >= 84 bytes + overhead)
    assert relayed >= 5 * 84
    stop_all(list(wgs.values()))


def test_kernel_wireguard_tunnel(make_net: Callable[[int], Net]) -> None:
    reason = kernel_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)  # "no wireguard kernel module (...)"
    net = make_net(2)
    if_a, if_b = net.ifname("ka"), net.ifname("kb")
    create_kernel_interface(if_a, netns=net.ns(0))
    create_kernel_interface(if_b, netns=net.ns(1))
    with KernelBackend(netns=net.ns(0)) as ka, KernelBackend(netns=net.ns(1)) as kb:
        _, pub_b = _bring_up_pair(net, ka, kb, if_a, if_b)
        assert ping(net.ns(0), "10.200.0.2").returncode == 0
        peer = ka.get(if_a).peer(pub_b)
        assert peer is not None and peer.last_handshake is not None
        assert peer.rx_bytes > 0 and peer.tx_bytes > 0
        assert ka.configure(if_a, _config_of(ka, if_a)).is_empty()
