"""WireGuard peers and AllowedIPs, through the kernel or wireguard-go, one API for both.

- ``keys``: Curve25519 keys, base64 <-> hex.
- ``model``: desired config, one-shot updates, read-back state; ``plan_sync``.
- ``uapi``: wireguard-go's UAPI socket (blocking and asyncio clients).
- ``userspace``: start/stop wireguard-go (in a namespace) and ``UserspaceBackend``.
- ``kernel``: pyroute2 generic netlink, ``KernelBackend``, ``kernel_wireguard_available``.

The lab and the agent use a ``WireGuardBackend`` (or ``AsyncWireGuardBackend``):
``get``, ``apply``, ``configure``, ``add_peer``, ``remove_peer``, ``set_allowed_ips``.
``backend_for`` picks the implementation for a machine.
"""

from __future__ import annotations

from meshopt.wireguard.backend import AsyncWireGuardBackend, WireGuardBackend
from meshopt.wireguard.errors import (
    KernelWireGuardError,
    KeyFormatError,
    UapiError,
    WireGuardError,
    WireGuardGoError,
)
from meshopt.wireguard.kernel import (
    AsyncKernelBackend,
    KernelBackend,
    kernel_unavailable_reason,
    kernel_wireguard_available,
)
from meshopt.wireguard.keys import (
    generate_keypair,
    generate_preshared_key,
    generate_private_key,
    key_from_hex,
    key_to_hex,
    public_key,
)
from meshopt.wireguard.model import (
    DeviceUpdate,
    InterfaceConfig,
    InterfaceState,
    PeerConfig,
    PeerState,
    PeerUpdate,
    allowed_ips_update,
    plan_sync,
)
from meshopt.wireguard.uapi import DEFAULT_RUN_DIR, AsyncUapiClient, UapiClient
from meshopt.wireguard.userspace import (
    AsyncUserspaceBackend,
    UserspaceBackend,
    WireGuardGo,
    start_wireguard_go,
    stop_all,
    wireguard_go_path,
)


def backend_for(kind: str = "auto", *, netns: str | None = None) -> WireGuardBackend:
    """``"kernel"``, ``"userspace"`` or ``"auto"`` (kernel where the module exists).

    The userspace backend does not depend on the namespace: UAPI sockets are files.
    """
    if kind == "auto":
        kind = "kernel" if kernel_wireguard_available() else "userspace"
    if kind == "kernel":
        return KernelBackend(netns=netns)
    if kind == "userspace":
        return UserspaceBackend()
    raise WireGuardError(f"unknown WireGuard backend {kind!r}: kernel, userspace or auto")


__all__ = [
    "DEFAULT_RUN_DIR",
    "AsyncKernelBackend",
    "AsyncUapiClient",
    "AsyncUserspaceBackend",
    "AsyncWireGuardBackend",
    "DeviceUpdate",
    "InterfaceConfig",
    "InterfaceState",
    "KernelBackend",
    "KernelWireGuardError",
    "KeyFormatError",
    "PeerConfig",
    "PeerState",
    "PeerUpdate",
    "UapiClient",
    "UapiError",
    "UserspaceBackend",
    "WireGuardBackend",
    "WireGuardError",
    "WireGuardGo",
    "WireGuardGoError",
    "allowed_ips_update",
    "backend_for",
    "generate_keypair",
    "generate_preshared_key",
    "generate_private_key",
    "kernel_unavailable_reason",
    "kernel_wireguard_available",
    "key_from_hex",
    "key_to_hex",
    "plan_sync",
    "public_key",
    "start_wireguard_go",
    "stop_all",
    "wireguard_go_path",
]
