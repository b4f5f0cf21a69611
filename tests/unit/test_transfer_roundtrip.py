"""Real transfers over loopback TCP: integrity, the chunk cache, compression, resume, CLI."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from meshopt.cli.main import main
from meshopt.transfer.chunking import CHUNK_MAX
from meshopt.transfer.errors import TransferError
from meshopt.transfer.limits import Limits
from meshopt.transfer.receiver import serve_in_agent
from meshopt.transfer.sender import TransferSummary, send_file

from .test_transfer_common import ServerThread, make_server, random_bytes, send, text_bytes

__all__ = ["make_server"]
MakeServer = Callable[..., ServerThread]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("size", [0, 1, 100_000, 6_000_000])
def test_round_trip(make_server: MakeServer, tmp_path: Path, size: int) -> None:
    srv = make_server()
    src = _write(tmp_path / "f.bin", random_bytes(size))
    s = send(srv, src, tmp_path)
    out = srv.root / "f.bin"
    assert out.read_bytes() == src.read_bytes()
    assert s.remote_path == "f.bin" and s.file_bytes == size
    assert s.chunks_sent == s.chunks_total and not s.already_present
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert [p.name for p in srv.root.iterdir() if p.name.startswith(".f.bin")] == []


def test_into_a_subdirectory(make_server: MakeServer, tmp_path: Path) -> None:
    srv = make_server()
    src = _write(tmp_path / "f.bin", random_bytes(1000))
    assert send(srv, src, tmp_path, dest="a/b").remote_path == "a/b/f.bin"
    assert (srv.root / "a" / "b" / "f.bin").read_bytes() == src.read_bytes()
    absolute = send(srv, src, tmp_path, dest=str(srv.root / "c"))  # absolute, but inside
    assert absolute.remote_path == "c/f.bin"


def test_second_send_costs_only_the_offer(make_server: MakeServer, tmp_path: Path) -> None:
    srv = make_server()
    src = _write(tmp_path / "big.bin", random_bytes(8_000_000))
    first = send(srv, src, tmp_path)
    again = send(srv, src, tmp_path)
    assert again.already_present and again.chunks_sent == 0
    # The offer carries 32+~3 bytes per chunk: well under 1 % of the file.
    assert again.bytes_on_wire < 40 * first.chunks_total + 500
    assert again.ratio > 100
    assert srv.counters.already_present == 1


def test_same_content_under_another_name_comes_from_the_cache(
    make_server: MakeServer, tmp_path: Path
) -> None:
    srv = make_server()
    data = random_bytes(3_000_000)
    send(srv, _write(tmp_path / "one.bin", data), tmp_path)
    s = send(srv, _write(tmp_path / "two.bin", data), tmp_path)
    assert s.chunks_sent == 0 and s.chunks_reused == s.chunks_total
    assert (srv.root / "two.bin").read_bytes() == data


def _edit_costs(
    make_server: MakeServer, tmp_path: Path, edit: Callable[[bytes], bytes], **server: int
) -> tuple[int, int]:
    srv = make_server(limits=Limits(allow_overwrite=True), **server)
    data = random_bytes(10_000_000)
    src = _write(tmp_path / "v.bin", data)
    send(srv, src, tmp_path)
    new = edit(data)
    src.write_bytes(new)
    s = send(srv, src, tmp_path, overwrite=True)
    assert (srv.root / "v.bin").read_bytes() == new
    return s.chunks_sent, s.chunk_bytes_sent


def _overwrite_1pct(data: bytes) -> bytes:
    b = bytearray(data)
    for k in range(5):  # 5 spots of 20 kB: 1 % of the file
        pos = 1_000_000 + k * 1_900_000
        b[pos : pos + 20_000] = random_bytes(20_000, seed=100 + k)
    return bytes(b)


def _insert(data: bytes) -> bytes:
    return data[:5_000_000] + b"a new line\n" * 300 + data[5_000_000:]


@pytest.mark.parametrize("cache_max_bytes", [1 << 30, 0])  # 0: chunks from the old version
def test_one_percent_overwritten_costs_only_those_chunks(
    make_server: MakeServer, tmp_path: Path, cache_max_bytes: int
) -> None:
    sent, nbytes = _edit_costs(
        make_server, tmp_path, _overwrite_1pct, cache_max_bytes=cache_max_bytes
    )
    assert 5 <= sent <= 15  # each 20 kB spot touches one to three chunks
    assert nbytes <= 15 * CHUNK_MAX and nbytes < 0.1 * 10_000_000


def test_an_insertion_costs_only_the_chunks_around_it(
    make_server: MakeServer, tmp_path: Path
) -> None:
    sent, nbytes = _edit_costs(make_server, tmp_path, _insert)
    assert 1 <= sent <= 3 and nbytes <= 3 * CHUNK_MAX


def test_text_is_compressed_and_random_is_not(make_server: MakeServer, tmp_path: Path) -> None:
    srv = make_server()
    text = send(srv, _write(tmp_path / "t.txt", text_bytes(6_000_000)), tmp_path, link_mbit=50)
    assert (srv.root / "t.txt").read_bytes() == (tmp_path / "t.txt").read_bytes()
    assert all(k.startswith("zstd-") for k in text.levels) and text.ratio > 1.5
    noise = send(srv, _write(tmp_path / "r.bin", random_bytes(6_000_000)), tmp_path, link_mbit=50)
    assert noise.levels == {"raw": noise.chunks_total}
    assert 0.99 < noise.ratio <= 1.0


def test_interrupted_send_resumes_with_only_the_missing_chunks(
    make_server: MakeServer, tmp_path: Path
) -> None:
    srv = make_server(cache_max_bytes=0)  # no chunk cache: the partial file alone resumes
    src = _write(tmp_path / "r.bin", random_bytes(20_000_000))
    calls = []

    def stop_after_two_batches(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 3:  # the first call reports reused bytes, then one per batch
            raise KeyboardInterrupt  # the user pressed Ctrl-C

    with pytest.raises(KeyboardInterrupt):
        send(srv, src, tmp_path, progress=stop_after_two_batches)
    srv.wait_for(lambda: srv.counters.transfers_failed == 1)
    got = srv.counters.chunks_received
    assert got > 0
    assert not (srv.root / "r.bin").exists()
    assert (srv.root / ".r.bin.meshopt-part").exists()
    assert (srv.root / ".r.bin.meshopt-state").exists()
    s = send(srv, src, tmp_path)
    assert s.chunks_sent == s.chunks_total - got and srv.counters.resumed_chunks == got
    assert (srv.root / "r.bin").read_bytes() == src.read_bytes()
    assert not (srv.root / ".r.bin.meshopt-part").exists()
    assert not (srv.root / ".r.bin.meshopt-state").exists()


def test_cli_send_prints_a_summary(
    make_server: MakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = make_server()
    src = _write(tmp_path / "c.txt", text_bytes(300_000))
    argv = ["transfer", "send", str(src), "127.0.0.1:inbox", "--port", str(srv.port)]
    code = main([*argv, "--no-progress", "--cache-dir", str(tmp_path / "sc")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "-> 127.0.0.1:inbox/c.txt" in out and "on the wire (ratio" in out and "goodput" in out
    assert (srv.root / "inbox" / "c.txt").read_bytes() == src.read_bytes()


def test_cli_refusal_is_one_line_and_non_zero(
    make_server: MakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = make_server()
    src = _write(tmp_path / "c.txt", b"hello")
    argv = ["transfer", "send", str(src), "127.0.0.1:../up", "--port", str(srv.port)]
    code = main([*argv, "--cache-dir", str(tmp_path / "sc")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "meshopt: error: receiver refused: '..'" in err


def test_missing_file_and_closed_port_are_errors(make_server: MakeServer, tmp_path: Path) -> None:
    srv = make_server()
    with pytest.raises(TransferError, match="cannot read"):
        send(srv, tmp_path / "nope", tmp_path)
    srv.stop()  # nothing listens there now
    with pytest.raises(TransferError, match="cannot connect"):
        send(srv, _write(tmp_path / "f", b"x"), tmp_path)


def test_agent_starts_and_stops_a_receiver_in_its_own_loop(tmp_path: Path) -> None:
    src = _write(tmp_path / "f.bin", random_bytes(1_500_000))
    root = tmp_path / "inbox"
    root.mkdir()

    async def agent() -> tuple[int, int, TransferSummary]:
        server = await serve_in_agent(root, ["127.0.0.0/8"], port=0, host="127.0.0.1")
        try:
            s = await send_file(src, "127.0.0.1", server.port, cache_dir=tmp_path / "sc")
            return server.port, server.counters.transfers_ok, s
        finally:
            await server.close()

    port, ok, s = asyncio.run(agent())
    assert ok == 1 and s.remote_path == "f.bin"
    assert (root / "f.bin").read_bytes() == src.read_bytes()
    src.write_bytes(random_bytes(1000, seed=5))
    with pytest.raises(TransferError) as info:  # closed: nothing listens any more
        asyncio.run(send_file(src, "127.0.0.1", port, cache_dir=tmp_path / "sc"))
    assert info.value.code == "connect"


def test_a_receiver_that_never_answers_is_named_as_such(tmp_path: Path) -> None:
    import socket

    src = _write(tmp_path / "f.bin", random_bytes(1000))
    with socket.socket() as listener, socket.socket() as first:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: once its queue is full, SYNs go unanswered
        port = listener.getsockname()[1]
        first.connect(("127.0.0.1", port))
        fillers = [socket.socket() for _ in range(2)]
        try:
            for s in fillers:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
            with pytest.raises(TransferError) as info:
                asyncio.run(
                    send_file(
                        src, "127.0.0.1", port, cache_dir=tmp_path / "sc", connect_timeout=0.5
                    )
                )
        finally:
            for s in fillers:
                s.close()
    assert info.value.code == "connect"
    assert str(info.value).endswith("no answer in 0.5 s"), str(info.value)
