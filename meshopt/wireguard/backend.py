"""The backend-neutral interface the lab and the agent program against.

A backend only has to read an interface (``get``) and apply one change (``apply``);
``configure``, ``add_peer``, ``remove_peer`` and ``set_allowed_ips`` are built on those
two here, once, so the userspace (UAPI) and kernel (netlink) backends cannot drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from meshopt.wireguard.model import (
    DeviceUpdate,
    InterfaceConfig,
    InterfaceState,
    PeerConfig,
    PeerUpdate,
    allowed_ips_update,
    plan_sync,
)


@runtime_checkable
class WireGuardBackend(Protocol):
    """Blocking WireGuard control (lab, CLI)."""

    def get(self, ifname: str) -> InterfaceState: ...

    def apply(self, ifname: str, update: DeviceUpdate) -> None: ...

    def configure(self, ifname: str, config: InterfaceConfig) -> DeviceUpdate: ...

    def add_peer(self, ifname: str, peer: PeerConfig) -> None: ...

    def remove_peer(self, ifname: str, public_key: str) -> None: ...

    def set_allowed_ips(self, ifname: str, public_key: str, allowed_ips: Sequence[str]) -> None: ...


@runtime_checkable
class AsyncWireGuardBackend(Protocol):
    """asyncio WireGuard control (agent)."""

    async def get(self, ifname: str) -> InterfaceState: ...

    async def apply(self, ifname: str, update: DeviceUpdate) -> None: ...

    async def configure(self, ifname: str, config: InterfaceConfig) -> DeviceUpdate: ...

    async def add_peer(self, ifname: str, peer: PeerConfig) -> None: ...

    async def remove_peer(self, ifname: str, public_key: str) -> None: ...

    async def set_allowed_ips(
        self, ifname: str, public_key: str, allowed_ips: Sequence[str]
    ) -> None: ...


class BackendBase:
    """``configure`` and the peer helpers, for a subclass that has ``get``/``apply``."""

    def get(self, ifname: str) -> InterfaceState:
        raise NotImplementedError

    def apply(self, ifname: str, update: DeviceUpdate) -> None:
        raise NotImplementedError

    def configure(self, ifname: str, config: InterfaceConfig) -> DeviceUpdate:
        """Make ``ifname`` match ``config`` like ``wg syncconf``; return what was applied.

        Idempotent: a second call finds nothing to change and sends nothing. Peers that
        stay keep their sessions; peers not in ``config`` are removed.
        """
        update = plan_sync(self.get(ifname), config)
        if not update.is_empty():
            self.apply(ifname, update)
        return update

    def add_peer(self, ifname: str, peer: PeerConfig) -> None:
        """Create ``peer`` or bring an existing one to this config (allowed IPs replaced)."""
        self.apply(ifname, DeviceUpdate(peers=(peer.to_update(),)))

    def remove_peer(self, ifname: str, public_key: str) -> None:
        """Remove a peer; removing one that is not there is not an error."""
        self.apply(ifname, DeviceUpdate(peers=(PeerUpdate(public_key=public_key, remove=True),)))

    def set_allowed_ips(self, ifname: str, public_key: str, allowed_ips: Sequence[str]) -> None:
        """Replace an existing peer's allowed IPs; an unknown peer is left uncreated."""
        self.apply(ifname, allowed_ips_update([(public_key, allowed_ips)]))


class AsyncBackendBase:
    """The asyncio twin of BackendBase."""

    async def get(self, ifname: str) -> InterfaceState:
        raise NotImplementedError

    async def apply(self, ifname: str, update: DeviceUpdate) -> None:
        raise NotImplementedError

    async def configure(self, ifname: str, config: InterfaceConfig) -> DeviceUpdate:
        update = plan_sync(await self.get(ifname), config)
        if not update.is_empty():
            await self.apply(ifname, update)
        return update

    async def add_peer(self, ifname: str, peer: PeerConfig) -> None:
        await self.apply(ifname, DeviceUpdate(peers=(peer.to_update(),)))

    async def remove_peer(self, ifname: str, public_key: str) -> None:
        await self.apply(
            ifname, DeviceUpdate(peers=(PeerUpdate(public_key=public_key, remove=True),))
        )

    async def set_allowed_ips(
        self, ifname: str, public_key: str, allowed_ips: Sequence[str]
    ) -> None:
        await self.apply(ifname, allowed_ips_update([(public_key, allowed_ips)]))
