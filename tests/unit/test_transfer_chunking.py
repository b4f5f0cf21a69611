"""FastCDC manifests and the two caches."""

from __future__ import annotations

import os
from pathlib import Path

from meshopt.transfer.cache import ChunkStore, ManifestCache
from meshopt.transfer.chunking import (
    CHUNK_MAX,
    CHUNK_MIN,
    chunk_buffer,
    chunk_digest,
    chunk_file,
    whole_hash,
)

from .test_transfer_common import random_bytes


def _digests(data: bytes) -> list[bytes]:
    m = chunk_buffer(data)
    return [m.digest(i) for i in range(m.count)]


def test_chunks_cover_the_file_within_the_size_bounds(tmp_path: Path) -> None:
    data = random_bytes(3_000_000)
    f = tmp_path / "f"
    f.write_bytes(data)
    m = chunk_file(f)
    assert m == chunk_buffer(data)
    assert m.size == len(data) == sum(m.lengths)
    assert all(CHUNK_MIN <= n <= CHUNK_MAX for n in m.lengths[:-1])
    assert 40 * 1024 < len(data) / m.count < 100 * 1024  # about 64 KiB on average
    assert m.file_hash == whole_hash(m.digests)
    offsets = m.offsets()
    for i in (0, m.count // 2, m.count - 1):
        piece = data[offsets[i] : offsets[i] + m.lengths[i]]
        assert chunk_digest(piece) == m.digest(i)


def test_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty"
    f.write_bytes(b"")
    m = chunk_file(f)
    assert m.size == 0 and m.count == 0 and m.file_hash == whole_hash(b"")


def test_an_insertion_moves_only_nearby_boundaries() -> None:
    data = random_bytes(4_000_000)
    edited = data[:2_000_000] + b"inserted!" * 100 + data[2_000_000:]
    old, new = set(_digests(data)), _digests(edited)
    changed = [d for d in new if d not in old]
    assert 1 <= len(changed) <= 2, len(changed)  # fixed-size blocks would change ~30


def test_store_returns_what_was_put_and_evicts_least_recently_used(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s", max_bytes=250_000)
    blobs = [random_bytes(100_000, seed=i) for i in range(3)]
    digests = [chunk_digest(b) for b in blobs]
    store.put(digests[0], blobs[0])
    store.put(digests[1], blobs[1])
    assert store.get(digests[0]) == blobs[0]  # 0 is now more recent than 1
    store.put(digests[2], blobs[2])  # over the cap: 1 goes
    assert store.total <= 250_000
    assert store.has(digests[0]) and store.has(digests[2]) and not store.has(digests[1])
    assert not (tmp_path / "s" / digests[1].hex()[:2] / digests[1].hex()).exists()
    # A reopened store finds the blobs on disk.
    again = ChunkStore(tmp_path / "s", max_bytes=250_000)
    assert again.get(digests[2]) == blobs[2] and again.total == store.total


def test_damaged_blob_is_a_miss_not_bad_data(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s", max_bytes=1 << 20)
    blob = random_bytes(5000)
    d = chunk_digest(blob)
    store.put(d, blob)
    path = tmp_path / "s" / d.hex()[:2] / d.hex()
    path.write_bytes(b"x" + blob[1:])
    assert store.get(d) is None and not store.has(d) and not path.exists()


def test_disabled_store_keeps_nothing(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s", max_bytes=0)
    assert not store.put(chunk_digest(b"a"), b"a") and not (tmp_path / "s").exists()


def test_manifest_cache_is_valid_only_while_the_file_is_unchanged(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(random_bytes(100_000))
    cache = ManifestCache(tmp_path / "m")
    m = chunk_file(f)
    cache.put(f, m)
    assert cache.get(f) == m
    with open(f, "r+b") as fh:  # same size, new content
        fh.write(b"changed")
    os.utime(f, ns=(0, 12345))
    assert cache.get(f) is None
