"""Kernel backend: pyroute2 arguments and reply parsing, without the kernel module."""

from __future__ import annotations

import base64
from socket import AF_INET, AF_INET6, inet_pton
from typing import Any

import pytest

from meshopt.wireguard import WireGuardError, backend_for
from meshopt.wireguard.kernel import (
    KernelBackend,
    kernel_unavailable_reason,
    peer_args,
    set_calls,
    state_from_messages,
)
from meshopt.wireguard.keys import generate_keypair, key_from_bytes
from meshopt.wireguard.model import ZERO_KEY, DeviceUpdate, PeerConfig, PeerUpdate, plan_sync
from meshopt.wireguard.userspace import UserspaceBackend

PRIV, PUB = generate_keypair()
K1 = generate_keypair()[1]
K2 = generate_keypair()[1]
K3 = generate_keypair()[1]


def test_peer_args() -> None:
    p = PeerConfig(
        public_key=K1,
        allowed_ips=("10.0.0.1/32",),
        endpoint="[fd00::2]:51820",
        persistent_keepalive=25,
    ).to_update()
    assert peer_args(p) == {
        "public_key": K1,
        "preshared_key": ZERO_KEY,
        "endpoint_addr": "fd00::2",
        "endpoint_port": 51820,
        "persistent_keepalive": 25,
        "replace_allowed_ips": True,
        "allowed_ips": ["10.0.0.1/32"],
    }
    assert peer_args(PeerUpdate(public_key=K1, remove=True, allowed_ips=("1.0.0.0/8",))) == {
        "public_key": K1,
        "remove": True,
    }
    assert peer_args(PeerUpdate(public_key=K1, update_only=True)) == {
        "public_key": K1,
        "update_only": True,
        "allowed_ips": [],
    }


def test_set_calls_single_peer_and_device_fields() -> None:
    up = DeviceUpdate(
        private_key=PRIV, listen_port=51820, fwmark=0, peers=(PeerUpdate(public_key=K1),)
    )
    assert set_calls(up) == [
        {"private_key": PRIV, "listen_port": 51820, "fwmark": 0},
        {"peer": {"public_key": K1, "allowed_ips": []}},
    ]
    assert set_calls(DeviceUpdate()) == []


def test_set_calls_move_prefixes_without_a_gap_and_remove_last() -> None:
    # 10.0.1.0/24 moves from K1 to K2; K3 goes away.
    up = DeviceUpdate(
        peers=(
            PeerUpdate(public_key=K3, remove=True),
            PeerUpdate(public_key=K1, replace_allowed_ips=True, allowed_ips=("10.0.0.0/24",)),
            PeerUpdate(public_key=K2, replace_allowed_ips=True, allowed_ips=("10.0.1.0/24",)),
        )
    )
    calls = set_calls(up)
    peers = [c["peer"] for c in calls]
    # first every peer gains its prefixes (no replace flag: nothing is dropped yet) ...
    assert peers[0] == {"public_key": K1, "allowed_ips": ["10.0.0.0/24"]}
    assert peers[1] == {"public_key": K2, "allowed_ips": ["10.0.1.0/24"]}
    # ... then the replace trims leftovers, never creating peers ...
    assert peers[2] == {
        "public_key": K1,
        "update_only": True,
        "replace_allowed_ips": True,
        "allowed_ips": ["10.0.0.0/24"],
    }
    assert peers[3]["public_key"] == K2 and peers[3]["replace_allowed_ips"]
    # ... and removals come last.
    assert peers[4] == {"public_key": K3, "remove": True}
    assert len(calls) == 5


def test_set_calls_replace_peers_removes_the_others() -> None:
    up = DeviceUpdate(replace_peers=True, peers=(PeerUpdate(public_key=K1),))
    calls = set_calls(up, current_peers=[K1, K2, K3])
    removed = [c["peer"]["public_key"] for c in calls if c["peer"].get("remove")]
    assert sorted(removed) == sorted([K2, K3])


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _message(peers: list[list[Any]], **device: Any) -> Any:
    """Encode and decode a real pyroute2 WireGuard message, as the kernel would send it."""
    wg = pytest.importorskip("pyroute2.netlink.generic.wireguard")
    msg = wg.wgmsg()
    msg["cmd"] = wg.WG_CMD_GET_DEVICE
    msg["version"] = 1
    msg["attrs"] = [["WGDEVICE_A_IFNAME", "wg0"]]
    msg["attrs"] += [[f"WGDEVICE_A_{k.upper()}", v] for k, v in device.items()]
    msg["attrs"].append(["WGDEVICE_A_PEERS", [{"attrs": p} for p in peers]])
    msg.encode()
    out = wg.wgmsg(msg.data)
    out.decode()
    return out


def _allowed(family: int, addr: str, mask: int) -> dict[str, Any]:
    return {
        "attrs": [
            ["WGALLOWEDIP_A_FAMILY", family],
            ["WGALLOWEDIP_A_IPADDR", inet_pton(family, addr)],
            ["WGALLOWEDIP_A_CIDR_MASK", mask],
        ]
    }


def test_state_from_messages_merges_a_split_dump() -> None:
    first = _message(
        [
            [
                ["WGPEER_A_PUBLIC_KEY", K1],
                ["WGPEER_A_PRESHARED_KEY", ZERO_KEY],
                ["WGPEER_A_ENDPOINT", {"addr": "192.168.1.2", "port": 51820}],
                ["WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 25],
                ["WGPEER_A_LAST_HANDSHAKE_TIME", {"tv_sec": 1_700_000_000, "tv_nsec": 7}],
                ["WGPEER_A_RX_BYTES", 100],
                ["WGPEER_A_TX_BYTES", 200],
                ["WGPEER_A_ALLOWEDIPS", [_allowed(AF_INET, "10.0.0.0", 24)]],
                ["WGPEER_A_PROTOCOL_VERSION", 1],
            ]
        ],
        private_key=PRIV,
        public_key=PUB,
        listen_port=51820,
        fwmark=9,
    )
    second = _message(
        [
            [
                ["WGPEER_A_PUBLIC_KEY", K1],
                ["WGPEER_A_ALLOWEDIPS", [_allowed(AF_INET6, "fd00::", 64)]],
            ],
            [
                ["WGPEER_A_PUBLIC_KEY", K2],
                ["WGPEER_A_PRESHARED_KEY", key_from_bytes(bytes(range(32)))],
            ],
        ]
    )
    st = state_from_messages([first, second])
    assert (st.private_key, st.public_key, st.listen_port, st.fwmark) == (PRIV, PUB, 51820, 9)
    a, b = st.peers
    assert a.public_key == K1 and a.preshared_key is None
    assert a.endpoint == "192.168.1.2:51820" and a.persistent_keepalive == 25
    assert a.last_handshake_ns == 1_700_000_000_000_000_007
    assert (a.rx_bytes, a.tx_bytes) == (100, 200)
    assert a.allowed_ips == ("10.0.0.0/24", "fd00::/64")
    assert b.public_key == K2 and b.preshared_key == _b64(bytes(range(32)))
    # a state read back from the kernel can be fed straight to plan_sync
    assert plan_sync(st, st_config(st)).is_empty()


def st_config(st: Any) -> Any:
    from meshopt.wireguard.model import InterfaceConfig

    return InterfaceConfig(
        private_key=st.private_key,
        listen_port=st.listen_port,
        fwmark=st.fwmark,
        peers=tuple(p.as_config() for p in st.peers),
    )


def test_backend_for() -> None:
    assert isinstance(backend_for("userspace"), UserspaceBackend)
    assert isinstance(backend_for("kernel", netns="x"), KernelBackend)
    with pytest.raises(WireGuardError, match="unknown WireGuard backend"):
        backend_for("magic")


def test_unavailable_reason_without_probing_is_cheap() -> None:
    reason = kernel_unavailable_reason(probe=False)
    assert reason is None or "no wireguard kernel module" in reason


def test_kernel_errors_are_project_errors() -> None:
    """Module missing (here) or interface missing (elsewhere): one clear error either way."""
    import asyncio

    from meshopt.wireguard.errors import KernelWireGuardError
    from meshopt.wireguard.kernel import AsyncKernelBackend

    with KernelBackend() as kb, pytest.raises(KernelWireGuardError) as info:
        kb.get("mownoexist0")
    assert "kernel" in str(info.value) or "no such" in str(info.value)

    async def main() -> None:
        ab = AsyncKernelBackend()
        try:
            with pytest.raises(KernelWireGuardError):
                await ab.get("mownoexist0")
        finally:
            ab.close()

    asyncio.run(main())
