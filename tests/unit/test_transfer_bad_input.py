"""Bad input on loopback: a clear error on both ends, nothing under the final name, and the
receiver serves the next request."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from meshopt.transfer.errors import TransferError
from meshopt.transfer.limits import Limits
from meshopt.transfer.protocol import Ack, Chunk, Error, Need, Offer, encode
from meshopt.transfer.sender import send_file

from .test_transfer_common import (
    RawClient,
    ServerThread,
    make_server,
    manifest_of,
    random_bytes,
    send,
    visible,
)

__all__ = ["make_server"]
MakeServer = Callable[..., ServerThread]


@pytest.fixture
def srv(make_server: MakeServer) -> ServerThread:
    return make_server()


def _still_serves(srv: ServerThread, tmp_path: Path) -> None:
    ok = tmp_path / "ok.bin"
    ok.write_bytes(random_bytes(200_000, seed=9))
    send(srv, ok, tmp_path)
    assert (srv.root / "ok.bin").read_bytes() == ok.read_bytes()


def _refused(srv: ServerThread, tmp_path: Path, code: str, match: str, **kwargs: str) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(random_bytes(100_000))
    with pytest.raises(TransferError, match=match) as info:
        send(srv, src, tmp_path, **kwargs)
    assert info.value.code == code
    assert srv.counters.errors[code] >= 1


@pytest.mark.parametrize(
    ("dest", "match"),
    [
        ("../out", "'..' is not allowed"),
        ("a/../../out", "'..' is not allowed"),
        ("/etc", "outside the receive directory"),
        (".meshopt-cache", "receiver's own files"),
    ],
)
def test_paths_outside_the_directory_are_refused(
    srv: ServerThread, tmp_path: Path, dest: str, match: str
) -> None:
    _refused(srv, tmp_path, "bad-path", match, dest=dest)
    assert not (tmp_path / "out").exists() and not Path("/etc/f.bin").exists()
    assert visible(srv.root) == []
    _still_serves(srv, tmp_path)


def test_symlink_out_of_the_directory_is_refused(srv: ServerThread, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (srv.root / "escape").symlink_to(outside)
    _refused(srv, tmp_path, "bad-path", "through a symlink", dest="escape")
    _refused(srv, tmp_path, "bad-path", "through a symlink", dest="escape/deeper")
    (outside / "victim").write_bytes(b"keep me")
    (srv.root / "f.bin").symlink_to(outside / "victim")  # the final name is a link
    _refused(srv, tmp_path, "bad-path", "is a symlink")
    assert list(outside.iterdir()) == [outside / "victim"]
    assert (outside / "victim").read_bytes() == b"keep me"
    _still_serves(srv, tmp_path)


def test_peer_outside_the_mesh_is_refused(make_server: MakeServer, tmp_path: Path) -> None:
    srv = make_server(allow=["10.0.0.0/8", "fd00::/8"])
    _refused(srv, tmp_path, "not-allowed", "127.0.0.1 is not in the mesh")
    assert srv.counters.refused_peers == 1 and visible(srv.root) == []


def test_over_quota_is_refused_before_any_data(make_server: MakeServer, tmp_path: Path) -> None:
    srv = make_server(limits=Limits(quota_bytes=50_000))
    _refused(srv, tmp_path, "quota", "would exceed the receiver's quota")
    assert list(srv.root.iterdir()) == []  # not even a partial file
    _still_serves(make_server(), tmp_path)


def _offer(data: bytes, **change: object) -> tuple[Offer, list[int]]:
    m = manifest_of(data)
    fields: dict[str, object] = {
        "name": "x.bin",
        "dir": "",
        "size": m.size,
        "file_hash": m.file_hash,
        "digests": m.digests,
        "lengths": list(m.lengths),
    }
    fields.update(change)
    return Offer(**fields), m.offsets()  # type: ignore[arg-type]


def _expect_error(client: RawClient, code: str) -> Error:
    msg = client.recv()
    while isinstance(msg, Need):
        msg = client.recv()
    assert isinstance(msg, Error) and msg.code == code, msg
    return msg


def test_corrupted_chunk_is_refused(srv: ServerThread, tmp_path: Path) -> None:
    data = random_bytes(300_000)
    offer, _ = _offer(data)
    c = RawClient(srv.port)
    c.send(offer)
    assert isinstance(c.recv(), Need)
    bad = bytearray(data[: offer.lengths[0]])
    bad[100] ^= 0xFF
    c.send(Chunk(0, 0, bytes(bad)))
    assert "chunk 0: hash mismatch" in _expect_error(c, "corrupt").reason
    c.close()
    assert not (srv.root / "x.bin").exists()
    assert not (srv.root / ".x.bin.meshopt-part").exists()  # a lying sender gets no resume
    assert srv.counters.partials_removed == 1
    _still_serves(srv, tmp_path)


def test_garbage_and_bad_zstd_are_refused(srv: ServerThread, tmp_path: Path) -> None:
    c = RawClient(srv.port)
    c.send_raw(b"\x00\x00\x00\x05hello")  # a frame that is not a message
    assert "corrupted frame" in _expect_error(c, "corrupt").reason
    c.close()
    c = RawClient(srv.port)
    c.send_raw(b"\xff\xff\xff\xff")  # a 4 GB frame
    assert "over the" in _expect_error(c, "corrupt").reason
    c.close()
    offer, _ = _offer(random_bytes(100_000))
    c = RawClient(srv.port)
    c.send(offer)
    assert isinstance(c.recv(), Need)
    c.send(Chunk(0, 2, b"definitely not zstd"))
    assert "corrupted zstd" in _expect_error(c, "corrupt").reason
    c.close()
    assert visible(srv.root) == []
    _still_serves(srv, tmp_path)


def test_inconsistent_offer_is_refused(srv: ServerThread) -> None:
    offer, _ = _offer(random_bytes(100_000), size=5)
    c = RawClient(srv.port)
    c.send(offer)
    assert "do not add up" in _expect_error(c, "bad-offer").reason
    c.close()


def test_wrong_whole_file_hash_is_refused_before_any_data(
    srv: ServerThread, tmp_path: Path
) -> None:
    offer, _ = _offer(random_bytes(200_000), file_hash=b"\x01" * 32)
    c = RawClient(srv.port)
    c.send(offer)
    assert "does not match its chunk list" in _expect_error(c, "bad-offer").reason
    c.close()
    assert sorted(p.name for p in srv.root.iterdir() if "x.bin" in p.name) == []
    _still_serves(srv, tmp_path)


def test_damaged_partial_file_is_checked_on_resume(make_server: MakeServer) -> None:
    """A state file that outlived its data (a crash before write-back) costs a resend."""
    srv = make_server(cache_max_bytes=0)  # no chunk cache: the partial file alone resumes
    data = random_bytes(600_000)
    offer, offsets = _offer(data)
    c = RawClient(srv.port)
    c.send(offer)
    need = c.recv()
    assert isinstance(need, Need) and len(need.missing) >= 3
    for i in need.missing[:3]:
        c.send(Chunk(i, 0, data[offsets[i] : offsets[i] + offer.lengths[i]]))
    c.close()  # interrupted: the partial file and its state stay for a resume
    srv.wait_for(lambda: srv.counters.transfers_failed == 1)
    part = srv.root / ".x.bin.meshopt-part"
    with open(part, "r+b") as f:  # chunk 1 "lost" on disk
        f.seek(offsets[1] + 10)
        f.write(b"\xff" * 100)
    c = RawClient(srv.port)
    c.send(offer)
    need = c.recv()
    assert isinstance(need, Need)
    assert 0 not in need.missing and 2 not in need.missing and 1 in need.missing
    assert srv.counters.resumed_chunks == 2
    c.close()
    srv.wait_for(lambda: srv.counters.transfers_failed == 2)


def test_truncated_stream_leaves_only_the_partial_file(srv: ServerThread, tmp_path: Path) -> None:
    data = random_bytes(300_000)
    offer, _ = _offer(data)
    c = RawClient(srv.port)
    c.send(offer)
    assert isinstance(c.recv(), Need)
    frame = encode(Chunk(0, 0, data[: offer.lengths[0]]))
    c.send_raw(frame[: len(frame) // 2])  # cut mid-frame
    c.sock.shutdown(socket.SHUT_WR)
    srv.wait_for(lambda: srv.counters.errors["truncated"] == 1)
    c.close()
    assert not (srv.root / "x.bin").exists()
    assert (srv.root / ".x.bin.meshopt-part").exists()  # kept for a resume
    _still_serves(srv, tmp_path)


def test_receiver_that_hangs_up_is_an_error_on_the_sender(tmp_path: Path) -> None:
    """The other end of a truncated stream: the receiver vanishes mid-transfer."""
    src = tmp_path / "f.bin"
    src.write_bytes(random_bytes(3_000_000))

    async def run() -> None:
        async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readexactly(4)
            w.transport.abort()  # reset, no answer

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await send_file(src, "127.0.0.1", port, cache_dir=tmp_path / "sc")
        finally:
            server.close()

    with pytest.raises(TransferError) as info:
        asyncio.run(run())
    assert info.value.code == "closed"


def test_ack_for_another_file_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(b"hello")

    async def run() -> None:
        async def liar(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read(1 << 16)
            w.write(encode(Need([], complete=True)) + encode(Ack("f.bin", b"\0" * 32)))
            await w.drain()
            await r.read(1 << 16)
            w.close()

        server = await asyncio.start_server(liar, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await send_file(src, "127.0.0.1", port, cache_dir=tmp_path / "sc")
        finally:
            server.close()

    with pytest.raises(TransferError, match="does not match"):
        asyncio.run(run())
