"""The backend-neutral model: normalisation, validation and plan_sync (like wg syncconf)."""

from __future__ import annotations

import pytest

from meshopt.errors import MeshoptError
from meshopt.wireguard.keys import generate_keypair
from meshopt.wireguard.model import (
    ZERO_KEY,
    DeviceUpdate,
    InterfaceConfig,
    InterfaceState,
    PeerConfig,
    PeerState,
    PeerUpdate,
    allowed_ips_update,
    format_endpoint,
    normalize_allowed_ips,
    parse_endpoint,
    plan_sync,
)

PRIV, PUB = generate_keypair()
K1 = generate_keypair()[1]
K2 = generate_keypair()[1]
K3 = generate_keypair()[1]


def test_allowed_ips_are_normalised_sorted_and_unique() -> None:
    got = normalize_allowed_ips(["10.1.2.3/24", "fd00::1/64", "10.1.2.0/24", "0.0.0.0/0"])
    assert got == ("0.0.0.0/0", "10.1.2.0/24", "fd00::/64")


@pytest.mark.parametrize("bad", ["10.0.0.1", "10.0.0.0/33", "nonsense/8"])
def test_bad_allowed_ips_rejected(bad: str) -> None:
    with pytest.raises(MeshoptError):
        normalize_allowed_ips([bad])


def test_endpoints() -> None:
    assert parse_endpoint("192.0.2.1:51820") == ("192.0.2.1", 51820)
    assert parse_endpoint("[2001:db8::1]:7") == ("2001:db8::1", 7)
    assert format_endpoint("2001:db8::1", 7) == "[2001:db8::1]:7"
    assert PeerConfig(public_key=K1, endpoint="[2001:DB8::1]:7").endpoint == "[2001:db8::1]:7"
    for bad in ["192.0.2.1", "host.example:51820", "2001:db8::1:7", "1.2.3.4:0", "1.2.3.4:x"]:
        with pytest.raises(MeshoptError, match="endpoint"):
            parse_endpoint(bad)


def test_validation() -> None:
    with pytest.raises(MeshoptError):
        PeerConfig(public_key="nope")
    with pytest.raises(MeshoptError, match="keepalive"):
        PeerConfig(public_key=K1, persistent_keepalive=70000)
    with pytest.raises(MeshoptError, match="listen port"):
        InterfaceConfig(listen_port=70000)
    with pytest.raises(MeshoptError, match="twice"):
        InterfaceConfig(peers=(PeerConfig(public_key=K1), PeerConfig(public_key=K1)))


def test_private_keys_stay_out_of_repr() -> None:
    psk = generate_keypair()[0]
    text = repr(
        InterfaceConfig(private_key=PRIV, peers=(PeerConfig(public_key=K1, preshared_key=psk),))
    )
    assert PRIV not in text and psk not in text
    assert PRIV not in repr(InterfaceState(private_key=PRIV))
    assert InterfaceConfig(private_key=PRIV).public_key == PUB


def test_peer_state_handshake() -> None:
    never = PeerState(public_key=K1)
    assert never.last_handshake is None and never.handshake_age(100.0) is None
    seen = PeerState(public_key=K1, last_handshake_ns=1_700_000_000_500_000_000)
    assert seen.last_handshake == pytest.approx(1_700_000_000.5)
    assert seen.handshake_age(1_700_000_010.5) == pytest.approx(10.0)


def _state(*peers: PeerState, port: int = 51820) -> InterfaceState:
    return InterfaceState(private_key=PRIV, public_key=PUB, listen_port=port, peers=peers)


def test_plan_sync_from_empty_creates_everything() -> None:
    want = InterfaceConfig(
        private_key=PRIV,
        listen_port=51820,
        peers=(PeerConfig(public_key=K1, allowed_ips=("10.0.0.1/32",), endpoint="192.0.2.1:1"),),
    )
    up = plan_sync(InterfaceState(), want)
    assert up.private_key == PRIV and up.listen_port == 51820 and not up.replace_peers
    (p,) = up.peers
    assert p.public_key == K1 and p.replace_allowed_ips and p.allowed_ips == ("10.0.0.1/32",)
    assert p.preshared_key == ZERO_KEY and p.persistent_keepalive == 0


def test_plan_sync_is_empty_when_in_sync_and_keeps_learned_endpoints() -> None:
    current = _state(PeerState(public_key=K1, allowed_ips=("10.0.0.1/32",), endpoint="192.0.2.9:5"))
    want = InterfaceConfig(
        private_key=PRIV,
        listen_port=51820,
        peers=(PeerConfig(public_key=K1, allowed_ips=("10.0.0.1/32",)),),
    )
    assert plan_sync(current, want).is_empty()


def test_plan_sync_removes_changes_and_adds_peers() -> None:
    current = _state(
        PeerState(public_key=K1, allowed_ips=("10.0.0.1/32",)),
        PeerState(public_key=K2, allowed_ips=("10.0.0.2/32",)),
    )
    want = InterfaceConfig(
        listen_port=51821,
        peers=(
            PeerConfig(public_key=K2, allowed_ips=("10.0.0.2/32", "10.9.0.0/16")),
            PeerConfig(public_key=K3, allowed_ips=("10.0.0.3/32",)),
        ),
    )
    up = plan_sync(current, want)
    assert up.listen_port == 51821 and up.private_key is None
    assert [(p.public_key, p.remove) for p in up.peers] == [(K1, True), (K2, False), (K3, False)]
    assert up.peers[1].allowed_ips == ("10.0.0.2/32", "10.9.0.0/16")


def test_allowed_ips_update_never_creates_peers() -> None:
    up = allowed_ips_update([(K1, ["10.0.0.0/24"]), (K2, [])])
    assert all(p.update_only and p.replace_allowed_ips for p in up.peers)
    assert up.peers[1].allowed_ips == ()
    assert DeviceUpdate().is_empty() and not up.is_empty()
    assert not DeviceUpdate(peers=(PeerUpdate(public_key=K1, remove=True),)).is_empty()
