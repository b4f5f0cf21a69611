"""Kernel WireGuard through pyroute2's generic-netlink ``WireGuard`` socket.

For operators' machines, which usually have the module (these development machines do
not: here the module is absent, so only the argument building is exercised by unit
tests and the lab test skips).

pyroute2 0.9's ``WireGuard.set`` takes at most one peer per call and does not expose
``WGDEVICE_F_REPLACE_PEERS``, so an update becomes several calls (``set_calls``):
1. device fields; 2. every peer with its allowed IPs *added* (a prefix moving from one
peer to another is taken over at once); 3. peers whose allowed IPs are replaced, with
the replace flag (the leftovers go); 4. removals, last. No prefix is ever without a
peer on the way, but unlike wireguard-go the whole is not one atomic operation.
``replace_peers`` removes the peers not in the update (instead of all of them).
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
from collections.abc import Iterable
from typing import Any

from meshopt.wireguard.backend import AsyncBackendBase, BackendBase
from meshopt.wireguard.errors import KernelWireGuardError
from meshopt.wireguard.keys import key_to_bytes
from meshopt.wireguard.model import (
    ZERO_KEY,
    DeviceUpdate,
    InterfaceState,
    PeerState,
    PeerUpdate,
    format_endpoint,
    normalize_allowed_ips,
    parse_endpoint,
)

SYS_MODULE = "/sys/module/wireguard"


def _pyroute2() -> Any:
    """pyroute2, imported on demand (it ships no types and takes ~0.4 s to import)."""
    return importlib.import_module("pyroute2")


# --- detection --------------------------------------------------------------------------


@functools.cache
def kernel_unavailable_reason(*, probe: bool = True) -> str | None:
    """Why kernel WireGuard cannot be used here, or None if it can.

    The module may be installed but not loaded: with ``probe`` (and root) a wireguard
    link is created in a throw-away namespace, which loads it on demand, then deleted.
    """
    if os.path.isdir(SYS_MODULE):
        return None
    if not probe:
        return "no wireguard kernel module (not loaded)"
    if os.geteuid() != 0:
        return "no wireguard kernel module loaded (probing needs root)"
    from meshopt.lab.netns import temporary_netns

    try:
        with temporary_netns(prefix="mowgprobe") as ns:
            proc = subprocess.run(
                ["ip", "-n", ns, "link", "add", "wgprobe", "type", "wireguard"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
    except Exception as exc:
        return f"no wireguard kernel module (probe failed: {exc})"
    if proc.returncode != 0:
        return f"no wireguard kernel module ({proc.stderr.strip() or 'ip link add failed'})"
    return None


def kernel_wireguard_available(*, probe: bool = True) -> bool:
    """True where ``ip link add ... type wireguard`` works (the kernel module exists)."""
    return kernel_unavailable_reason(probe=probe) is None


# --- requests (pure) --------------------------------------------------------------------


def peer_args(
    p: PeerUpdate, *, allowed: bool = True, replace: bool | None = None
) -> dict[str, Any]:
    """The ``peer`` dict pyroute2's ``WireGuard.set`` wants for ``p``.

    ``allowed=False`` leaves allowed IPs out; ``replace`` overrides the replace flag.
    """
    if p.remove:
        return {"public_key": p.public_key, "remove": True}
    args: dict[str, Any] = {"public_key": p.public_key}
    if p.update_only:
        args["update_only"] = True
    if p.preshared_key is not None:
        args["preshared_key"] = p.preshared_key
    if p.endpoint is not None:
        addr, port = parse_endpoint(p.endpoint)
        args["endpoint_addr"] = addr
        args["endpoint_port"] = port
    if p.persistent_keepalive is not None:
        args["persistent_keepalive"] = p.persistent_keepalive
    if allowed:
        if p.replace_allowed_ips if replace is None else replace:
            args["replace_allowed_ips"] = True
        args["allowed_ips"] = list(p.allowed_ips)
    return args


def set_calls(update: DeviceUpdate, current_peers: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Keyword arguments for successive ``WireGuard.set(ifname, **kw)`` calls (see module).

    ``current_peers`` (public keys on the interface now) is needed only for
    ``replace_peers``.
    """
    calls: list[dict[str, Any]] = []
    device: dict[str, Any] = {}
    if update.private_key is not None:
        device["private_key"] = update.private_key
    if update.listen_port is not None:
        device["listen_port"] = update.listen_port
    if update.fwmark is not None:
        device["fwmark"] = update.fwmark
    if device:
        calls.append(device)
    keep = [p for p in update.peers if not p.remove]
    replacing = [p for p in keep if p.replace_allowed_ips]
    if len(keep) == 1:
        calls.append({"peer": peer_args(keep[0])})
    else:
        for p in keep:  # add (and take over) first ...
            calls.append({"peer": peer_args(p, replace=False)})
        for p in replacing:  # ... then drop what is no longer wanted
            trim = PeerUpdate(
                public_key=p.public_key,
                update_only=True,
                replace_allowed_ips=True,
                allowed_ips=p.allowed_ips,
            )
            calls.append({"peer": peer_args(trim)})
    removed = {p.public_key for p in update.peers if p.remove}
    if update.replace_peers:
        wanted = {p.public_key for p in keep}
        removed |= {k for k in current_peers if k not in wanted}
    calls.extend({"peer": {"public_key": k, "remove": True}} for k in sorted(removed))
    return calls


# --- replies (pure) ---------------------------------------------------------------------


def _key_attr(value: Any) -> str | None:
    if value is None:
        return None
    text = value.decode("ascii") if isinstance(value, bytes) else str(value)
    key_to_bytes(text)
    return text


def state_from_messages(messages: Iterable[Any]) -> InterfaceState:
    """pyroute2 ``WG_CMD_GET_DEVICE`` replies -> InterfaceState.

    A large device is dumped over several messages and one peer's allowed IPs may
    continue in the next message, so peers are merged by public key.
    """
    private_key: str | None = None
    public: str | None = None
    listen_port = 0
    fwmark = 0
    order: list[str] = []
    fields: dict[str, dict[str, Any]] = {}
    ips: dict[str, list[str]] = {}
    for msg in messages:
        private_key = _key_attr(msg.get_attr("WGDEVICE_A_PRIVATE_KEY")) or private_key
        public = _key_attr(msg.get_attr("WGDEVICE_A_PUBLIC_KEY")) or public
        listen_port = msg.get_attr("WGDEVICE_A_LISTEN_PORT") or listen_port
        fwmark = msg.get_attr("WGDEVICE_A_FWMARK") or fwmark
        for peer in msg.get_attr("WGDEVICE_A_PEERS") or ():
            key = _key_attr(peer.get_attr("WGPEER_A_PUBLIC_KEY"))
            if key is None:
                continue
            if key not in fields:
                order.append(key)
                fields[key] = {}
                ips[key] = []
            f = fields[key]
            psk = _key_attr(peer.get_attr("WGPEER_A_PRESHARED_KEY"))
            if psk is not None:
                f["preshared_key"] = None if psk == ZERO_KEY else psk
            ep = peer.get_attr("WGPEER_A_ENDPOINT")
            if ep is not None and ep.get("addr") and ep.get("port"):
                f["endpoint"] = format_endpoint(ep["addr"], ep["port"])
            ka = peer.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL")
            if ka is not None:
                f["persistent_keepalive"] = int(ka)
            hs = peer.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
            if hs is not None:
                f["last_handshake_ns"] = int(hs["tv_sec"]) * 1_000_000_000 + int(hs["tv_nsec"])
            for name, attr in (
                ("rx_bytes", "WGPEER_A_RX_BYTES"),
                ("tx_bytes", "WGPEER_A_TX_BYTES"),
            ):
                v = peer.get_attr(attr)
                if v is not None:
                    f[name] = int(v)
            pv = peer.get_attr("WGPEER_A_PROTOCOL_VERSION")
            if pv is not None:
                f["protocol_version"] = int(pv)
            for ip in peer.get_attr("WGPEER_A_ALLOWEDIPS") or ():
                if ip.get("addr"):
                    ips[key].append(ip["addr"])
    peers = tuple(
        PeerState(public_key=k, allowed_ips=normalize_allowed_ips(ips[k]), **fields[k])
        for k in order
    )
    return InterfaceState(
        private_key=private_key,
        public_key=public,
        listen_port=int(listen_port),
        fwmark=int(fwmark),
        peers=peers,
    )


def _netlink_error(exc: Exception, ifname: str | None, netns: str | None) -> KernelWireGuardError:
    code = getattr(exc, "code", None)
    where = (ifname or "kernel WireGuard") + (f" in namespace {netns}" if netns else "")
    if code == 19:  # ENODEV
        return KernelWireGuardError(f"{where}: no such WireGuard interface")
    if code == 2:  # ENOENT: the generic netlink family is not registered
        return KernelWireGuardError(f"{where}: no wireguard kernel module")
    return KernelWireGuardError(f"{where}: kernel WireGuard refused: {exc}")


def _current_keys(update: DeviceUpdate, state: InterfaceState | None) -> list[str]:
    return sorted(state.peer_keys) if state is not None and update.replace_peers else []


# --- backends ---------------------------------------------------------------------------


class KernelBackend(BackendBase):
    """WireGuardBackend over kernel generic netlink, in ``netns`` (None: our own)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._wg: Any = None

    def _sock(self) -> Any:
        if self._wg is None:
            kw = {"netns": self.netns} if self.netns else {}
            try:
                self._wg = _pyroute2().WireGuard(**kw)
            except Exception as exc:
                raise _netlink_error(exc, None, self.netns) from None
        return self._wg

    def close(self) -> None:
        if self._wg is not None:
            self._wg.close()
            self._wg = None

    def __enter__(self) -> KernelBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, ifname: str) -> InterfaceState:
        try:
            return state_from_messages(self._sock().info(ifname))
        except KernelWireGuardError:
            raise
        except Exception as exc:
            raise _netlink_error(exc, ifname, self.netns) from None

    def apply(self, ifname: str, update: DeviceUpdate) -> None:
        state = self.get(ifname) if update.replace_peers else None
        for kw in set_calls(update, _current_keys(update, state)):
            try:
                self._sock().set(ifname, **kw)
            except Exception as exc:
                raise _netlink_error(exc, ifname, self.netns) from None


class AsyncKernelBackend(AsyncBackendBase):
    """AsyncWireGuardBackend over pyroute2's ``AsyncWireGuard`` (for the agent)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._wg: Any = None

    async def _sock(self) -> Any:
        if self._wg is None:
            mod = importlib.import_module("pyroute2.netlink.generic.wireguard")
            kw = {"netns": self.netns} if self.netns else {}
            try:
                wg = mod.AsyncWireGuard(**kw)
                await wg.setup_endpoint()
            except Exception as exc:
                raise _netlink_error(exc, None, self.netns) from None
            self._wg = wg
        return self._wg

    def close(self) -> None:
        if self._wg is not None:
            self._wg.close()
            self._wg = None

    async def get(self, ifname: str) -> InterfaceState:
        try:
            sock = await self._sock()
            return state_from_messages([m async for m in await sock.info(ifname)])
        except KernelWireGuardError:
            raise
        except Exception as exc:
            raise _netlink_error(exc, ifname, self.netns) from None

    async def apply(self, ifname: str, update: DeviceUpdate) -> None:
        state = await self.get(ifname) if update.replace_peers else None
        sock = await self._sock()
        for kw in set_calls(update, _current_keys(update, state)):
            try:
                await sock.set(ifname, **kw)
            except Exception as exc:
                raise _netlink_error(exc, ifname, self.netns) from None


def create_kernel_interface(ifname: str, *, netns: str | None = None, mtu: int = 1420) -> None:
    """Create a kernel WireGuard link (down, no address) in ``netns``."""
    kw = {"netns": netns} if netns else {}
    try:
        with _pyroute2().IPRoute(**kw) as ipr:
            ipr.link("add", ifname=ifname, kind="wireguard")
            idx = ipr.link_lookup(ifname=ifname)[0]
            ipr.link("set", index=idx, mtu=mtu)
    except Exception as exc:
        raise _netlink_error(exc, ifname, netns) from None


def delete_kernel_interface(ifname: str, *, netns: str | None = None) -> None:
    """Delete a kernel WireGuard link; a missing one is not an error."""
    kw = {"netns": netns} if netns else {}
    with _pyroute2().IPRoute(**kw) as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if found:
            ipr.link("del", index=found[0])
