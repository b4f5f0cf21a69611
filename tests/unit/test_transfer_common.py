"""Helpers the transfer tests share: a receiver on loopback in its own thread, data, raw frames.

The receiver runs its own event loop in a thread, so tests (and the CLI, which calls
``asyncio.run`` itself) talk to it over real TCP exactly as a remote sender would.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshopt.transfer.chunking import Manifest, chunk_buffer
from meshopt.transfer.protocol import Message, decode, encode
from meshopt.transfer.receiver import TransferServer
from meshopt.transfer.sender import TransferSummary, send_file


class ServerThread:
    def __init__(self, root: Path, **kwargs: Any) -> None:
        kwargs.setdefault("allow", ["127.0.0.0/8"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = TransferServer(root, host="127.0.0.1", port=0, **kwargs)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.port = self.server.port
        self.root = root

    @property
    def counters(self) -> Any:
        return self.server.counters

    def wait_for(self, check: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, "receiver did not get there in time"
            time.sleep(0.01)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    made: list[ServerThread] = []

    def make(**kwargs: Any) -> ServerThread:
        root = tmp_path / f"recv{len(made)}"
        root.mkdir()
        kwargs.setdefault("cache_dir", tmp_path / f"rcache{len(made)}")
        srv = ServerThread(root, **kwargs)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


def send(srv: ServerThread, path: Path, tmp_path: Path, **kwargs: Any) -> TransferSummary:
    kwargs.setdefault("cache_dir", tmp_path / "scache")
    return asyncio.run(send_file(path, "127.0.0.1", srv.port, **kwargs))


def random_bytes(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


def text_bytes(n: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    words = [rng.randbytes(rng.randint(2, 9)).hex() for _ in range(400)]
    out = bytearray()
    while len(out) < n:
        out += (" ".join(rng.choices(words, k=12)) + "\n").encode()
    return bytes(out[:n])


def visible(directory: Path) -> list[str]:
    """Names in ``directory`` other than hidden ones (partial files, state, the cache)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


class RawClient:
    """A blocking socket speaking frames by hand: for streams the real sender never sends."""

    def __init__(self, port: int, source: str | None = None) -> None:
        """``source``: another loopback address (127.0.0.2) is another sender."""
        local = None if source is None else (source, 0)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=local)

    def send(self, msg: Message) -> None:
        self.sock.sendall(encode(msg))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> Message:
        head = self._exact(4)
        (n,) = struct.unpack("!I", head)
        return decode(self._exact(n))

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise EOFError("receiver closed the connection")
            buf += part
        return buf

    def close(self) -> None:
        self.sock.close()


def manifest_of(data: bytes) -> Manifest:
    return chunk_buffer(data)


def test_helpers_make_distinct_data() -> None:
    assert random_bytes(100, 1) != random_bytes(100, 2)
    assert len(text_bytes(1000)) == 1000
