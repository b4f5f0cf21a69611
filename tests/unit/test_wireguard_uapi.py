"""UAPI: request serialisation, reply parsing, and both clients against a fake socket."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshopt.errors import MeshoptError
from meshopt.wireguard.errors import UapiError
from meshopt.wireguard.keys import key_from_hex, public_key
from meshopt.wireguard.model import DeviceUpdate, InterfaceConfig, PeerConfig, PeerUpdate
from meshopt.wireguard.uapi import (
    AsyncUapiClient,
    UapiClient,
    check_set_reply,
    encode_set,
    parse_get,
    socket_path,
)
from meshopt.wireguard.userspace import AsyncUserspaceBackend, UserspaceBackend

PRIV_HEX = "10" + "11" * 30 + "51"
PEER_HEX = "22" * 32
PSK_HEX = "33" * 32
PRIV = key_from_hex(PRIV_HEX)
PEER = key_from_hex(PEER_HEX)
PSK = key_from_hex(PSK_HEX)

# What wireguard-go 0.0.20220316 answered here (keys replaced by the ones above).
GET_REPLY = (
    f"private_key={PRIV_HEX}\n"
    "listen_port=51820\n"
    "fwmark=7\n"
    f"public_key={PEER_HEX}\n"
    f"preshared_key={PSK_HEX}\n"
    "protocol_version=1\n"
    "endpoint=192.168.9.1:51820\n"
    "last_handshake_time_sec=1700000000\n"
    "last_handshake_time_nsec=250000000\n"
    "tx_bytes=1234\n"
    "rx_bytes=5678\n"
    "persistent_keepalive_interval=25\n"
    "allowed_ip=10.1.2.0/24\n"
    "allowed_ip=fd00::/64\n"
    f"public_key={'44' * 32}\n"
    f"preshared_key={'00' * 32}\n"
    "protocol_version=1\n"
    "last_handshake_time_sec=0\n"
    "last_handshake_time_nsec=0\n"
    "tx_bytes=0\n"
    "rx_bytes=0\n"
    "persistent_keepalive_interval=0\n"
    "errno=0\n\n"
)


def test_socket_path() -> None:
    assert socket_path("wg0") == "/var/run/wireguard/wg0.sock"
    assert socket_path("wg0", "/run/x") == "/run/x/wg0.sock"
    with pytest.raises(MeshoptError):
        socket_path("../etc")


def test_encode_full_set() -> None:
    up = DeviceUpdate(
        private_key=PRIV,
        listen_port=51820,
        fwmark=0,
        replace_peers=True,
        peers=(
            PeerUpdate(
                public_key=PEER,
                update_only=True,
                replace_allowed_ips=True,
                allowed_ips=("10.1.2.3/24", "fd00::1/64"),
                endpoint="[fd00::9]:51820",
                persistent_keepalive=25,
                preshared_key=PSK,
            ),
            PeerUpdate(public_key=key_from_hex("44" * 32), remove=True, allowed_ips=("1.0.0.0/8",)),
        ),
    )
    assert encode_set(up).decode() == (
        "set=1\n"
        f"private_key={PRIV_HEX}\n"
        "listen_port=51820\n"
        "fwmark=0\n"
        "replace_peers=true\n"
        f"public_key={PEER_HEX}\n"
        "update_only=true\n"
        f"preshared_key={PSK_HEX}\n"
        "endpoint=[fd00::9]:51820\n"
        "persistent_keepalive_interval=25\n"
        "replace_allowed_ips=true\n"
        "allowed_ip=10.1.2.0/24\n"
        "allowed_ip=fd00::/64\n"
        f"public_key={'44' * 32}\n"
        "remove=true\n"
        "\n"
    )


def test_encode_leaves_unset_fields_out() -> None:
    assert encode_set(DeviceUpdate(peers=(PeerUpdate(public_key=PEER),))) == (
        f"set=1\npublic_key={PEER_HEX}\n\n".encode()
    )


def test_parse_get() -> None:
    st = parse_get(GET_REPLY)
    assert st.private_key == PRIV and st.public_key == public_key(PRIV)
    assert st.listen_port == 51820 and st.fwmark == 7
    a, b = st.peers
    assert a.public_key == PEER and a.preshared_key == PSK
    assert a.endpoint == "192.168.9.1:51820" and a.persistent_keepalive == 25
    assert a.last_handshake_ns == 1_700_000_000_250_000_000
    assert (a.rx_bytes, a.tx_bytes) == (5678, 1234)
    assert a.allowed_ips == ("10.1.2.0/24", "fd00::/64")
    assert b.preshared_key is None and b.last_handshake is None and b.endpoint is None
    assert st.peer(PEER) is a and st.peer_keys == {PEER, b.public_key}


def test_a_second_poll_parses_the_same_and_keeps_no_secret() -> None:
    """Public keys are remembered from one poll to the next (a bounded map), private and
    preshared keys never: nothing secret outlives the reading it came in."""
    from meshopt.wireguard import uapi

    first, again = parse_get(GET_REPLY), parse_get(GET_REPLY)
    assert first == again
    assert uapi._public_keys[PEER_HEX] == PEER
    remembered = set(uapi._public_keys) | set(uapi._public_keys.values())
    assert not remembered & {PRIV_HEX, PRIV, PSK_HEX, PSK}
    # a bad public key is still refused, remembered or not
    with pytest.raises(UapiError, match="public_key"):
        parse_get(GET_REPLY.replace(PEER_HEX, "zz" * 32))


def test_parse_empty_device_and_unknown_keys() -> None:
    st = parse_get("listen_port=4242\njc=4\nerrno=0\n\n")
    assert st.listen_port == 4242 and st.private_key is None and st.public_key is None
    assert st.peers == ()


def test_parsed_state_round_trips_into_config() -> None:
    st = parse_get(GET_REPLY)
    cfg = InterfaceConfig(
        private_key=st.private_key,
        listen_port=st.listen_port,
        fwmark=st.fwmark,
        peers=tuple(p.as_config() for p in st.peers),
    )
    from meshopt.wireguard.model import plan_sync

    assert plan_sync(st, cfg).is_empty()


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ("errno=-22\n\n", r"errno -22 \(Invalid argument\)"),
        ("errno=-98\n\n", "errno -98"),
        ("", "not terminated"),
        ("listen_port=1\nerrno=0\n", "not terminated"),
        ("listen_port=1\n\n", "no errno"),
        ("errno=zero\n\n", "bad errno"),
        ("garbage\nerrno=0\n\n", "garbage in reply line 1"),
        ("\n\n", "garbage"),
        ("listen_port=99999\nerrno=0\n\n", "listen_port"),
        ("rx_bytes=5\nerrno=0\n\n", "before any public_key"),
        ("public_key=abc\nerrno=0\n\n", "public_key"),
        (f"public_key={PEER_HEX}\nrx_bytes=-1\nerrno=0\n\n", "rx_bytes"),
        (f"public_key={PEER_HEX}\nallowed_ip=10.0.0.0/99\nerrno=0\n\n", "allowed_ip"),
        (f"public_key={PEER_HEX}\nlast_handshake_time_nsec=1000000000\nerrno=0\n\n", "nsec"),
    ],
)
def test_bad_get_replies_raise(reply: str, match: str) -> None:
    with pytest.raises(UapiError, match=match):
        parse_get(reply, path="/x.sock")


def test_errno_is_kept() -> None:
    with pytest.raises(UapiError) as info:
        check_set_reply("errno=-22\n\n", path="/run/wireguard/wg0.sock")
    assert info.value.errno == 22
    assert str(info.value).startswith("/run/wireguard/wg0.sock: ")
    assert isinstance(info.value, MeshoptError)
    check_set_reply("errno=0\n\n")
    with pytest.raises(UapiError, match="unexpected"):
        check_set_reply("listen_port=1\nerrno=0\n\n")


# --- clients against a fake wireguard-go -------------------------------------------------


class FakeUapi:
    """A unix-socket server that records requests and answers from a script."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.replies: list[bytes | None] = []  # None: close without answering
        self.requests: list[bytes] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        self._srv.listen(8)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\n\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    buf += chunk
                self.requests.append(buf)
                reply = self.replies.pop(0) if self.replies else b"errno=0\n\n"
                if reply is not None:
                    conn.sendall(reply)

    def close(self) -> None:
        self._srv.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeUapi]:
    srv = FakeUapi(tmp_path / "wgt0.sock")
    yield srv
    srv.close()


def test_sync_client_get_and_set(fake: FakeUapi) -> None:
    fake.replies = [GET_REPLY.encode(), b"errno=0\n\n"]
    client = UapiClient(fake.path, timeout=2)
    assert client.get().peers[0].rx_bytes == 5678
    client.set(DeviceUpdate(listen_port=1))
    client.set(DeviceUpdate())  # empty: nothing sent
    assert fake.requests == [b"get=1\n\n", b"set=1\nlisten_port=1\n\n"]


def test_sync_client_errors(fake: FakeUapi, tmp_path: Path) -> None:
    client = UapiClient(fake.path, timeout=2)
    fake.replies = [b"errno=-22\n\n", None, b"listen_port=1\n", b"\xff\xfe=1\nerrno=0\n\n"]
    with pytest.raises(UapiError, match="errno -22"):
        client.set(DeviceUpdate(listen_port=1))
    with pytest.raises(UapiError, match="no reply"):
        client.get()
    with pytest.raises(UapiError, match="incomplete reply"):
        client.get()
    with pytest.raises(UapiError, match="not ASCII"):
        client.get()
    with pytest.raises(UapiError, match="wireguard-go running"):
        UapiClient(tmp_path / "missing.sock").get()


def test_stale_socket_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens
    with pytest.raises(UapiError, match="stale"):
        UapiClient(path).get()


def test_sync_client_timeout(tmp_path: Path) -> None:
    path = tmp_path / "mute.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)  # accepts (in the backlog) but never answers
    try:
        with pytest.raises(UapiError, match="no reply within"):
            UapiClient(path, timeout=0.2).get()
        with pytest.raises(UapiError, match="no reply within"):
            asyncio.run(AsyncUapiClient(path, timeout=0.2).get())
    finally:
        srv.close()


def test_async_client(fake: FakeUapi, tmp_path: Path) -> None:
    async def main() -> None:
        client = AsyncUapiClient(fake.path, timeout=2)
        fake.replies = [GET_REPLY.encode(), b"errno=0\n\n", b"errno=-98\n\n", None]
        st = await client.get()
        assert st.peers[0].last_handshake_ns == 1_700_000_000_250_000_000
        await client.set(DeviceUpdate(fwmark=3))
        with pytest.raises(UapiError, match="errno -98"):
            await client.set(DeviceUpdate(listen_port=1))
        with pytest.raises(UapiError, match="no reply"):
            await client.get()
        with pytest.raises(UapiError, match="wireguard-go running"):
            await AsyncUapiClient(tmp_path / "missing.sock").get()

    asyncio.run(main())
    assert fake.requests[1] == b"set=1\nfwmark=3\n\n"


def test_backends_build_the_right_requests(fake: FakeUapi, tmp_path: Path) -> None:
    backend = UserspaceBackend(run_dir=str(tmp_path))
    assert backend.interfaces() == ["wgt0"]
    fake.replies = [b"errno=0\n\n"] * 3 + [f"public_key={PEER_HEX}\nerrno=0\n\n".encode()]
    backend.add_peer("wgt0", PeerConfig(public_key=PEER, allowed_ips=("10.0.0.1/32",)))
    backend.set_allowed_ips("wgt0", PEER, ["10.0.0.0/24"])
    backend.remove_peer("wgt0", PEER)
    applied = backend.configure("wgt0", InterfaceConfig())  # removes the one peer
    assert applied.peers == (PeerUpdate(public_key=PEER, remove=True),)
    reqs = [r.decode() for r in fake.requests]
    assert "replace_allowed_ips=true\nallowed_ip=10.0.0.1/32\n" in reqs[0]
    assert "update_only=true" not in reqs[0]
    assert "update_only=true\nreplace_allowed_ips=true\nallowed_ip=10.0.0.0/24\n" in reqs[1]
    assert reqs[2].endswith("remove=true\n\n")
    assert reqs[3] == "get=1\n\n" and reqs[4].endswith("remove=true\n\n")

    async def main() -> None:
        ab = AsyncUserspaceBackend(run_dir=str(tmp_path))
        fake.replies = [f"public_key={PEER_HEX}\nerrno=0\n\n".encode()]
        st = await ab.get("wgt0")
        assert st.peer_keys == {PEER}
        await ab.add_peer("wgt0", PeerConfig(public_key=PEER))

    asyncio.run(main())
    assert fake.requests[-1].decode().startswith(f"set=1\npublic_key={PEER_HEX}\n")
