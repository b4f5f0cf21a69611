"""A client for wireguard-go's UAPI socket (the cross-platform configuration protocol).

pyroute2 speaks only the kernel's generic netlink, so userspace WireGuard needs this.
The protocol: a request is ``get=1\\n\\n`` or ``set=1\\n`` followed by ``key=value``
lines and an empty line; every reply ends with ``errno=N\\n\\n`` (0 on success, a
negative errno otherwise) and a ``get`` reply carries ``key=value`` lines before it.
Keys are lowercase hex. Measured with wireguard-go 0.0.20220316: an unknown operation
makes it close the connection without a reply; a failed ``set`` leaves the rest of the
request unread, so every request here uses its own connection.

Two clients with the same behaviour: ``UapiClient`` (blocking; for the lab and tools)
and ``AsyncUapiClient`` (asyncio; for the agent). Every failure raises ``UapiError``
with the socket path in its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
from pathlib import Path
from typing import Self

from meshopt.wireguard.errors import KeyFormatError, UapiError, WireGuardError
from meshopt.wireguard.keys import key_from_hex, key_to_hex
from meshopt.wireguard.model import (
    ZERO_KEY,
    DeviceUpdate,
    InterfaceState,
    PeerState,
    state_with_public_key,
)

DEFAULT_RUN_DIR = "/var/run/wireguard"
GET_REQUEST = b"get=1\n\n"
MAX_REPLY = 16 * 1024 * 1024  # ~40k peers' worth; a reply beyond this is not WireGuard's
DEFAULT_TIMEOUT = 5.0


def socket_path(ifname: str, run_dir: str | os.PathLike[str] = DEFAULT_RUN_DIR) -> str:
    """Where wireguard-go listens for ``ifname``: ``<run_dir>/<ifname>.sock``."""
    if not ifname or "/" in ifname or ifname in (".", ".."):
        raise WireGuardError(f"bad interface name {ifname!r}")
    return str(Path(run_dir) / f"{ifname}.sock")


# --- requests ---------------------------------------------------------------------------


def encode_set(update: DeviceUpdate) -> bytes:
    """The UAPI ``set`` request for ``update`` (keys in hex, ends with an empty line).

    Order matters to wireguard-go: device keys before the first ``public_key``; after
    it, ``remove``/``update_only`` first (they decide whether the peer is touched),
    ``replace_allowed_ips`` before the ``allowed_ip`` lines it should not erase.
    """
    lines = ["set=1"]
    if update.private_key is not None:
        lines.append(f"private_key={key_to_hex(update.private_key)}")
    if update.listen_port is not None:
        lines.append(f"listen_port={update.listen_port}")
    if update.fwmark is not None:
        lines.append(f"fwmark={update.fwmark}")
    if update.replace_peers:
        lines.append("replace_peers=true")
    for p in update.peers:
        lines.append(f"public_key={key_to_hex(p.public_key)}")
        if p.remove:
            lines.append("remove=true")
            continue
        if p.update_only:
            lines.append("update_only=true")
        if p.preshared_key is not None:
            lines.append(f"preshared_key={key_to_hex(p.preshared_key)}")
        if p.endpoint is not None:
            lines.append(f"endpoint={p.endpoint}")
        if p.persistent_keepalive is not None:
            lines.append(f"persistent_keepalive_interval={p.persistent_keepalive}")
        if p.replace_allowed_ips:
            lines.append("replace_allowed_ips=true")
        lines.extend(f"allowed_ip={ip}" for ip in p.allowed_ips)
    return ("\n".join(lines) + "\n\n").encode("ascii")


# --- replies ----------------------------------------------------------------------------


def _split_reply(reply: str, path: str | None) -> list[tuple[str, str]]:
    """``key=value`` pairs before the final errno; raises on errno != 0 or garbage."""
    if not reply.endswith("\n\n"):
        raise UapiError("reply is not terminated by an empty line", path=path)
    lines = reply[:-2].split("\n")
    pairs: list[tuple[str, str]] = []
    for n, line in enumerate(lines, 1):
        key, sep, value = line.partition("=")
        if not sep or not key:
            raise UapiError(f"garbage in reply line {n}: {line[:60]!r}", path=path)
        pairs.append((key, value))
    last_key, last_value = pairs[-1]
    if last_key != "errno":
        raise UapiError("reply has no errno line", path=path)
    try:
        code = int(last_value)
    except ValueError:
        raise UapiError(f"reply has a bad errno {last_value[:20]!r}", path=path) from None
    if code != 0:
        num = abs(code)
        raise UapiError(
            f"wireguard-go refused the request: errno {code} ({os.strerror(num)}); "
            "its log says why",
            path=path,
            errno=num,
        )
    return pairs[:-1]


def check_set_reply(reply: str, *, path: str | None = None) -> None:
    """Raise UapiError unless ``reply`` is a bare success (``errno=0``)."""
    extra = _split_reply(reply, path)
    if extra:
        raise UapiError(f"unexpected lines in a set reply: {extra[0][0]!r}...", path=path)


def _int(key: str, value: str, path: str | None, high: int = 2**64 - 1) -> int:
    if value.isdigit():  # ASCII only: the reply was decoded as ASCII
        n = int(value)
        if n <= high:
            return n
    raise UapiError(f"bad value for {key}: {value[:30]!r}", path=path)


_ZERO_HEX = "0" * 64


def _key(key: str, value: str, path: str | None) -> str:
    try:
        return key_from_hex(value)
    except KeyFormatError:
        raise UapiError(f"bad {key} in reply (not 64 hex digits)", path=path) from None


# The same peers come back at every poll: their public keys' base64 form is remembered
# (bounded like the AllowedIPs below; a 100-peer reply spent a fifth of its parsing on
# keys). Public keys only: no secret is kept beyond the reading it came in.
_public_keys: dict[str, str] = {}


def _public_key(value: str, path: str | None) -> str:
    try:
        return _public_keys[value]
    except KeyError:
        pass
    out = _key("public_key", value, path)
    if len(_public_keys) >= MAX_REMEMBERED:
        _public_keys.clear()
    _public_keys[value] = out
    return out


class _PeerBuilder:
    """Accumulates one peer's lines of a ``get`` reply."""

    def __init__(self, public_key: str) -> None:
        self.public_key = public_key
        self.allowed_ips: list[str] = []
        self.endpoint: str | None = None
        self.keepalive = 0
        self.psk: str | None = None
        self.sec = 0
        self.nsec = 0
        self.rx = 0
        self.tx = 0
        self.version = 1

    def build(self) -> PeerState:
        return PeerState(
            public_key=self.public_key,
            allowed_ips=tuple(self.allowed_ips),
            endpoint=self.endpoint,
            persistent_keepalive=self.keepalive,
            preshared_key=self.psk,
            last_handshake_ns=self.sec * 1_000_000_000 + self.nsec,
            rx_bytes=self.rx,
            tx_bytes=self.tx,
            protocol_version=self.version,
        )


def parse_get(reply: str, *, path: str | None = None) -> InterfaceState:
    """A ``get`` reply -> InterfaceState (hex keys to base64, handshake sec+nsec to ns).

    Unknown keys are skipped (forks such as AmneziaWG add their own); malformed lines,
    values or a missing/nonzero errno raise UapiError.
    """
    private_key: str | None = None
    listen_port = 0
    fwmark = 0
    peers: list[PeerState] = []
    peer: _PeerBuilder | None = None
    for key, value in _split_reply(reply, path):
        if key == "public_key":
            if peer is not None:
                peers.append(peer.build())
            peer = _PeerBuilder(_public_key(value, path))
        elif peer is None:
            if key == "private_key":
                private_key = _key(key, value, path)
            elif key == "listen_port":
                listen_port = _int(key, value, path, 65535)
            elif key == "fwmark":
                fwmark = _int(key, value, path, 2**32 - 1)
            elif key in _PEER_KEYS:
                raise UapiError(f"peer field {key!r} before any public_key", path=path)
        elif key == "allowed_ip":
            peer.allowed_ips.append(_allowed_ip(value, path))
        elif key == "endpoint":
            peer.endpoint = value
        elif key == "persistent_keepalive_interval":
            peer.keepalive = _int(key, value, path, 65535)
        elif key == "preshared_key":
            # None for the all-zero key (no PSK, the usual case), checked before decoding
            psk = None if value == _ZERO_HEX else _key(key, value, path)
            peer.psk = None if psk == ZERO_KEY else psk
        elif key == "last_handshake_time_sec":
            peer.sec = _int(key, value, path)
        elif key == "last_handshake_time_nsec":
            peer.nsec = _int(key, value, path, 999_999_999)
        elif key == "rx_bytes":
            peer.rx = _int(key, value, path)
        elif key == "tx_bytes":
            peer.tx = _int(key, value, path)
        elif key == "protocol_version":
            peer.version = _int(key, value, path)
    if peer is not None:
        peers.append(peer.build())
    return state_with_public_key(
        InterfaceState(
            private_key=private_key,
            listen_port=listen_port,
            fwmark=fwmark,
            peers=tuple(peers),
        )
    )


_PEER_KEYS = frozenset(
    {
        "allowed_ip",
        "endpoint",
        "persistent_keepalive_interval",
        "preshared_key",
        "last_handshake_time_sec",
        "last_handshake_time_nsec",
        "rx_bytes",
        "tx_bytes",
        "protocol_version",
    }
)


# An agent reads every peer's AllowedIPs every couple of seconds, the same strings each
# time: normalising them with ipaddress was half of parsing a 100-peer reply. Good ones
# are remembered (a bounded map, emptied when full: a peer list that churns costs a
# re-parse, never memory).
MAX_REMEMBERED = 65536
_normalized: dict[str, str] = {}


def _allowed_ip(value: str, path: str | None) -> str:
    try:
        return _normalized[value]
    except KeyError:
        pass
    try:
        out = str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise UapiError(f"bad allowed_ip in reply: {value[:50]!r}", path=path) from None
    if len(_normalized) >= MAX_REMEMBERED:
        _normalized.clear()
    _normalized[value] = out
    return out


def _decode(data: bytes, path: str) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise UapiError("reply is not ASCII text", path=path) from None


def _connect_error(exc: OSError, path: str) -> UapiError:
    if isinstance(exc, FileNotFoundError):
        msg = "no UAPI socket here: is wireguard-go running for this interface?"
    elif isinstance(exc, ConnectionRefusedError):
        msg = "UAPI socket refuses connections: stale socket, wireguard-go is gone"
    elif isinstance(exc, PermissionError):
        msg = "permission denied on the UAPI socket (it is root-only)"
    else:
        msg = f"cannot connect to the UAPI socket: {exc}"
    return UapiError(msg, path=path)


# --- clients ----------------------------------------------------------------------------


class _ClientBase:
    """Where a client connects and how long it waits; shared by both clients."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT):
        self.path = str(path)
        self.timeout = timeout

    @classmethod
    def for_interface(
        cls,
        ifname: str,
        run_dir: str | os.PathLike[str] = DEFAULT_RUN_DIR,
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Self:
        return cls(socket_path(ifname, run_dir), timeout=timeout)


class UapiClient(_ClientBase):
    """Blocking UAPI client; one connection per request."""

    def request(self, data: bytes) -> str:
        """Send one raw request and return the raw reply (through ``errno=N\\n\\n``)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                raise _connect_error(exc, self.path) from None
            try:
                sock.sendall(data)
                buf = bytearray()
                while b"\n\n" not in buf:
                    chunk = sock.recv(65536)
                    if not chunk:
                        what = "an incomplete reply" if buf else "no reply"
                        raise UapiError(
                            f"wireguard-go closed the connection with {what} (unknown operation?)",
                            path=self.path,
                        )
                    buf += chunk
                    if len(buf) > MAX_REPLY:
                        raise UapiError(f"reply larger than {MAX_REPLY} bytes", path=self.path)
            except TimeoutError:
                raise UapiError(f"no reply within {self.timeout:g} s", path=self.path) from None
            except OSError as exc:
                raise UapiError(f"socket error: {exc}", path=self.path) from None
        finally:
            sock.close()
        end = buf.index(b"\n\n") + 2
        return _decode(bytes(buf[:end]), self.path)

    def get(self) -> InterfaceState:
        return parse_get(self.request(GET_REQUEST), path=self.path)

    def set(self, update: DeviceUpdate) -> None:
        if update.is_empty():
            return
        check_set_reply(self.request(encode_set(update)), path=self.path)


# --- asyncio client ---------------------------------------------------------------------


class AsyncUapiClient(_ClientBase):
    """asyncio UAPI client for the agent; same behaviour and errors as UapiClient."""

    async def request(self, data: bytes) -> str:
        try:
            async with asyncio.timeout(self.timeout):
                return await self._exchange(data)
        except TimeoutError:
            raise UapiError(f"no reply within {self.timeout:g} s", path=self.path) from None

    async def _exchange(self, data: bytes) -> str:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path, limit=MAX_REPLY)
        except OSError as exc:
            raise _connect_error(exc, self.path) from None
        try:
            writer.write(data)
            await writer.drain()
            raw = await reader.readuntil(b"\n\n")
        except asyncio.IncompleteReadError as exc:
            what = "an incomplete reply" if exc.partial else "no reply"
            raise UapiError(
                f"wireguard-go closed the connection with {what} (unknown operation?)",
                path=self.path,
            ) from None
        except asyncio.LimitOverrunError:
            raise UapiError(f"reply larger than {MAX_REPLY} bytes", path=self.path) from None
        except OSError as exc:
            raise UapiError(f"socket error: {exc}", path=self.path) from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return _decode(raw, self.path)

    async def get(self) -> InterfaceState:
        return parse_get(await self.request(GET_REQUEST), path=self.path)

    async def set(self, update: DeviceUpdate) -> None:
        if update.is_empty():
            return
        check_set_reply(await self.request(encode_set(update)), path=self.path)
