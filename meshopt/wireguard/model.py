"""Backend-neutral WireGuard data: desired configuration, changes, and read-back state.

Keys are base64 strings everywhere here (what ``wg`` prints and operators paste); the
UAPI client converts to hex at its boundary. Allowed IPs are normalised networks
(``10.1.2.3/24`` becomes ``10.1.2.0/24``, as WireGuard itself stores them), so a
configuration compares equal to what the interface reports back.

Three kinds of value:
- ``InterfaceConfig``/``PeerConfig``: the whole desired state of an interface;
- ``DeviceUpdate``/``PeerUpdate``: one change, exactly what a UAPI ``set`` or a netlink
  ``WG_CMD_SET_DEVICE`` can express (flags included);
- ``InterfaceState``/``PeerState``: what the interface reports (handshakes, counters).

``plan_sync`` turns (state, config) into the smallest update, like ``wg syncconf``:
sessions of peers that stay are kept (no ``replace_peers``, which would drop them all).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from meshopt.wireguard.errors import WireGuardError
from meshopt.wireguard.keys import check_key, public_key

MAX_PORT = 65535
MAX_KEEPALIVE = 65535
MAX_FWMARK = 2**32 - 1


def normalize_allowed_ips(prefixes: Iterable[str]) -> tuple[str, ...]:
    """Sorted, de-duplicated, host bits cleared; WireGuardError on a malformed prefix."""
    nets: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = set()
    for p in prefixes:
        text = str(p).strip()
        if "/" not in text:
            raise WireGuardError(f"allowed IP {text!r} needs a prefix length (a.b.c.d/n)")
        try:
            nets.add(ipaddress.ip_network(text, strict=False))
        except ValueError as exc:
            raise WireGuardError(f"bad allowed IP {text!r}: {exc}") from None
    ordered = sorted(nets, key=lambda n: (n.version, n.network_address, n.prefixlen))
    return tuple(str(n) for n in ordered)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"192.0.2.1:51820"`` or ``"[2001:db8::1]:51820"`` -> (address, port).

    Only IP literals: wireguard-go's UAPI does not resolve names, and a daemon that
    silently resolved DNS at configure time would hide a dependency.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise WireGuardError(f"bad endpoint {text!r}: want ADDRESS:PORT")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise WireGuardError(f"bad endpoint {text!r}: {host!r} is not an IP address") from None
    if addr.version == 6 and not bracketed:
        raise WireGuardError(f"bad endpoint {text!r}: write IPv6 as [ADDRESS]:PORT")
    port = int(port_text)
    if not 1 <= port <= MAX_PORT:
        raise WireGuardError(f"bad endpoint {text!r}: port out of range")
    return str(addr), port


def format_endpoint(address: str, port: int) -> str:
    """(address, port) -> the ``ADDRESS:PORT`` text UAPI and ``wg`` use."""
    addr = ipaddress.ip_address(address)
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def _check_range(name: str, value: int | None, high: int, low: int = 0) -> None:
    if value is not None and not low <= value <= high:
        raise WireGuardError(f"{name} {value} out of range {low}..{high}")


def _normalize_peer(peer: PeerConfig | PeerUpdate) -> None:
    """Check keys and keepalive; store allowed IPs and endpoint as WireGuard does."""
    check_key(peer.public_key)
    if peer.preshared_key is not None:
        check_key(peer.preshared_key)
    object.__setattr__(peer, "allowed_ips", normalize_allowed_ips(peer.allowed_ips))
    if peer.endpoint is not None:
        object.__setattr__(peer, "endpoint", format_endpoint(*parse_endpoint(peer.endpoint)))
    _check_range("persistent keepalive", peer.persistent_keepalive, MAX_KEEPALIVE)


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """One peer as it should be. ``endpoint=None`` leaves a learned endpoint alone."""

    public_key: str
    allowed_ips: tuple[str, ...] = ()
    endpoint: str | None = None
    persistent_keepalive: int = 0  # seconds; 0 = off
    preshared_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _normalize_peer(self)

    def to_update(self, *, update_only: bool = False) -> PeerUpdate:
        """This peer as a create-or-update change that replaces its allowed IPs."""
        return PeerUpdate(
            public_key=self.public_key,
            update_only=update_only,
            replace_allowed_ips=True,
            allowed_ips=self.allowed_ips,
            endpoint=self.endpoint,
            persistent_keepalive=self.persistent_keepalive,
            preshared_key=self.preshared_key or ZERO_KEY,
        )


def _normalize_device(dev: InterfaceConfig | DeviceUpdate) -> None:
    """Check the private key, port and fwmark; peers as a tuple."""
    if dev.private_key is not None:
        check_key(dev.private_key)
    _check_range("listen port", dev.listen_port, MAX_PORT)
    _check_range("fwmark", dev.fwmark, MAX_FWMARK)
    object.__setattr__(dev, "peers", tuple(dev.peers))


@dataclass(frozen=True, slots=True)
class InterfaceConfig:
    """The whole desired state of one interface. ``None`` fields are left as they are."""

    private_key: str | None = field(default=None, repr=False)
    listen_port: int | None = None
    fwmark: int | None = None  # 0 clears the mark
    peers: tuple[PeerConfig, ...] = ()

    def __post_init__(self) -> None:
        _normalize_device(self)
        seen: set[str] = set()
        for p in self.peers:
            if p.public_key in seen:
                raise WireGuardError(f"peer {p.public_key} appears twice")
            seen.add(p.public_key)

    @property
    def public_key(self) -> str | None:
        return None if self.private_key is None else public_key(self.private_key)


ZERO_KEY = "A" * 43 + "="  # all-zero key: "no preshared key" / "no private key"


@dataclass(frozen=True, slots=True)
class PeerUpdate:
    """One peer's part of a set operation; the flags mean what UAPI/netlink say.

    ``remove``: delete the peer (other fields ignored). ``update_only``: change it only
    if it exists, never create it. ``replace_allowed_ips``: the list replaces the
    peer's allowed IPs instead of adding to them. ``None`` fields are left unchanged;
    ``preshared_key=ZERO_KEY`` clears the key.
    """

    public_key: str
    remove: bool = False
    update_only: bool = False
    replace_allowed_ips: bool = False
    allowed_ips: tuple[str, ...] = ()
    endpoint: str | None = None
    persistent_keepalive: int | None = None
    preshared_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _normalize_peer(self)


@dataclass(frozen=True, slots=True)
class DeviceUpdate:
    """One set operation on an interface (applied atomically by wireguard-go).

    ``replace_peers`` removes every existing peer first (their sessions too).
    """

    private_key: str | None = field(default=None, repr=False)
    listen_port: int | None = None
    fwmark: int | None = None
    replace_peers: bool = False
    peers: tuple[PeerUpdate, ...] = ()

    def __post_init__(self) -> None:
        _normalize_device(self)

    def is_empty(self) -> bool:
        """True when applying this would change nothing (so it need not be sent)."""
        return (
            self.private_key is None
            and self.listen_port is None
            and self.fwmark is None
            and not self.replace_peers
            and not self.peers
        )


@dataclass(frozen=True, slots=True)
class PeerState:
    """A peer as the interface reports it."""

    public_key: str
    allowed_ips: tuple[str, ...] = ()
    endpoint: str | None = None
    persistent_keepalive: int = 0
    preshared_key: str | None = field(default=None, repr=False)
    last_handshake_ns: int = 0  # Unix time in ns of the last handshake; 0 = never
    rx_bytes: int = 0
    tx_bytes: int = 0
    protocol_version: int = 1

    @property
    def last_handshake(self) -> float | None:
        """Unix time (seconds) of the last completed handshake, or None if never."""
        return self.last_handshake_ns / 1e9 if self.last_handshake_ns else None

    def handshake_age(self, now: float) -> float | None:
        """Seconds since the last handshake at wall-clock ``now``, or None if never."""
        t = self.last_handshake
        return None if t is None else max(0.0, now - t)

    def as_config(self) -> PeerConfig:
        return PeerConfig(
            public_key=self.public_key,
            allowed_ips=self.allowed_ips,
            endpoint=self.endpoint,
            persistent_keepalive=self.persistent_keepalive,
            preshared_key=self.preshared_key,
        )


@dataclass(frozen=True, slots=True)
class InterfaceState:
    """An interface as it reports itself (private key hidden from repr)."""

    private_key: str | None = field(default=None, repr=False)
    public_key: str | None = None
    listen_port: int = 0
    fwmark: int = 0
    peers: tuple[PeerState, ...] = ()

    def peer(self, public_key: str) -> PeerState | None:
        for p in self.peers:
            if p.public_key == public_key:
                return p
        return None

    @property
    def peer_keys(self) -> frozenset[str]:
        return frozenset(p.public_key for p in self.peers)


def state_with_public_key(state: InterfaceState) -> InterfaceState:
    """Fill ``public_key`` from ``private_key`` (UAPI reports only the private one)."""
    if state.public_key is None and state.private_key is not None:
        return replace(state, public_key=public_key(state.private_key))
    return state


def _in_sync(current: PeerState | None, want: PeerConfig) -> bool:
    """True when ``current`` already is ``want`` (a learned endpoint counts if none is set)."""
    return (
        current is not None
        and current.allowed_ips == want.allowed_ips
        and (want.endpoint is None or current.endpoint == want.endpoint)
        and current.persistent_keepalive == want.persistent_keepalive
        and current.preshared_key == want.preshared_key
    )


def plan_sync(current: InterfaceState, want: InterfaceConfig) -> DeviceUpdate:
    """The smallest update taking ``current`` to ``want`` (empty if already there).

    Peers not in ``want`` are removed; peers that stay keep their sessions; device
    fields are sent only when they differ (re-sending ``listen_port`` would rebind).
    """
    peers: list[PeerUpdate] = []
    wanted = {p.public_key for p in want.peers}
    for p in current.peers:
        if p.public_key not in wanted:
            peers.append(PeerUpdate(public_key=p.public_key, remove=True))
    peers.extend(w.to_update() for w in want.peers if not _in_sync(current.peer(w.public_key), w))
    return DeviceUpdate(
        private_key=(
            want.private_key
            if want.private_key is not None and want.private_key != current.private_key
            else None
        ),
        listen_port=(
            want.listen_port
            if want.listen_port is not None and want.listen_port != current.listen_port
            else None
        ),
        fwmark=want.fwmark if want.fwmark is not None and want.fwmark != current.fwmark else None,
        peers=tuple(peers),
    )


def allowed_ips_update(allowed: Sequence[tuple[str, Sequence[str]]]) -> DeviceUpdate:
    """Set the allowed IPs of existing peers (never creating one), in one operation.

    Used by the one-interface layout, where AllowedIPs follow the routes: putting every
    peer in one update lets wireguard-go apply them under one lock, so a prefix moving
    from one peer to another never has no peer.
    """
    return DeviceUpdate(
        peers=tuple(
            PeerUpdate(
                public_key=key, update_only=True, replace_allowed_ips=True, allowed_ips=tuple(ips)
            )
            for key, ips in allowed
        )
    )
