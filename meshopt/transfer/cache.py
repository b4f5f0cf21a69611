"""On-disk caches: a content-addressed chunk store and stat-keyed file manifests.

The chunk store keeps chunk blobs under their sha256 with a size cap; the least
recently used blobs go first. Every read is checked against its name, so a damaged
blob is a miss, never bad data. The manifest records remember what a file hashed to
while its (device, inode, size, mtime, ctime) is unchanged, so a sender does not hash
an unchanged file again and a receiver knows which chunks its current copy holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from meshopt.transfer.chunking import DIGEST_SIZE, Manifest, chunk_digest

NS_LEN = 32  # hex characters of a namespace directory


class ChunkStore:
    """Chunk blobs in ``root/[ns/]ab/abcd...``, at most ``max_bytes`` in all (0: disabled).

    ``ns`` is a namespace (the receiver uses one per sender: a sender may only reuse,
    or learn the presence of, chunks it sent itself); "" is the plain layout. Every
    namespace shares the one size cap and least-recently-used order. ``min_free``: a
    put that would leave less free space on the filesystem is skipped.
    """

    def __init__(self, root: Path, max_bytes: int, *, min_free: int = 0) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.min_free = min_free
        self._lock = threading.Lock()
        self._sizes: dict[tuple[str, bytes], int] = {}
        self._used: dict[tuple[str, bytes], float] = {}
        self.total = 0
        self.evicted = 0
        if max_bytes > 0:
            root.mkdir(parents=True, exist_ok=True)
            self._scan()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @staticmethod
    def namespace(identity: str) -> str:
        """A directory name for ``identity`` (any string: it never reaches the path)."""
        return hashlib.sha256(identity.encode()).hexdigest()[:NS_LEN]

    def _path(self, key: tuple[str, bytes]) -> Path:
        ns, digest = key
        h = digest.hex()
        return (self.root / ns if ns else self.root) / h[:2] / h

    def _scan(self) -> None:
        for top in self.root.iterdir():
            if not top.is_dir():
                continue
            if len(top.name) == 2:
                self._scan_dir("", top)
            elif len(top.name) == NS_LEN:
                for sub in top.iterdir():
                    if sub.is_dir() and len(sub.name) == 2:
                        self._scan_dir(top.name, sub)
        self._evict(0)

    def _scan_dir(self, ns: str, sub: Path) -> None:
        for f in sub.iterdir():
            try:
                digest = bytes.fromhex(f.name)
                st = f.stat()
            except (ValueError, OSError):
                continue
            if len(digest) != DIGEST_SIZE or f.name.endswith(".tmp"):
                continue
            self._sizes[ns, digest] = st.st_size
            self._used[ns, digest] = st.st_mtime
            self.total += st.st_size

    def has(self, digest: bytes, ns: str = "") -> bool:
        with self._lock:
            return (ns, digest) in self._sizes

    def get(self, digest: bytes, ns: str = "") -> bytes | None:
        """The chunk's bytes, or None when absent or damaged (a damaged blob is removed)."""
        key = (ns, digest)
        if not self.has(digest, ns):
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(key)
            return None
        if chunk_digest(data) != digest:
            self._forget(key)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with self._lock:
            self._used[key] = _now()
        return data

    def put(self, digest: bytes, data: bytes | bytearray | memoryview, ns: str = "") -> bool:
        """Store a chunk (best effort: a full disk or a chunk over the cap skips it)."""
        key = (ns, digest)
        size = len(data)
        if not self.enabled or size > self.max_bytes or self.has(digest, ns):
            return False
        path = self._path(key)
        tmp = path.with_name(path.name + ".tmp")
        try:
            if self.min_free:
                st = os.statvfs(self.root)
                if st.f_bavail * st.f_frsize - size < self.min_free:
                    return False
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        with self._lock:
            self._sizes[key] = size
            self._used[key] = _now()
            self.total += size
        self._evict(0)
        return True

    def _forget(self, key: tuple[str, bytes]) -> None:
        with self._lock:
            size = self._sizes.pop(key, 0)
            self._used.pop(key, None)
            self.total -= size

    def _evict(self, room: int) -> None:
        """Drop least recently used blobs until ``room`` more bytes fit under the cap."""
        with self._lock:
            if self.total + room <= self.max_bytes:
                return
            order = sorted(self._used, key=self._used.__getitem__)
            victims = []
            for key in order:
                if self.total + room <= self.max_bytes:
                    break
                victims.append(key)
                self.total -= self._sizes.pop(key)
                del self._used[key]
        for key in victims:
            with contextlib.suppress(OSError):
                self._path(key).unlink()
            self.evicted += 1


class StoreWriter:
    """Puts chunks into a ChunkStore from one background thread, off the receiving path.

    Creating a file per chunk costs more than receiving it; the store is a best-effort
    cache, so while more than ``max_backlog`` bytes wait, further chunks are not stored.
    """

    def __init__(self, store: ChunkStore, max_backlog: int = 64 << 20) -> None:
        self.store = store
        self.max_backlog = max_backlog
        self.skipped = 0
        self._backlog = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chunk-store")

    def put(self, digest: bytes, data: bytes | bytearray, ns: str = "") -> None:
        """Queue a chunk; ``data`` must not change afterwards."""
        if not self.store.enabled:
            return
        with self._lock:
            if self._backlog + len(data) > self.max_backlog:
                self.skipped += 1
                return
            self._backlog += len(data)
        self._pool.submit(self._put, digest, data, ns)

    def _put(self, digest: bytes, data: bytes | bytearray, ns: str) -> None:
        try:
            self.store.put(digest, data, ns)
        finally:
            with self._lock:
                self._backlog -= len(data)

    def flush(self) -> None:
        """Wait until every queued chunk is stored (tests; shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_clock = 0.0


def _now() -> float:
    """A strictly increasing use stamp (wall-clock ties would make eviction order vague)."""
    global _clock
    _clock = max(_clock + 1e-6, time.time())
    return _clock


HASH_SCHEME = 2  # records of another scheme (older file hashes) fail to decode: a miss


class _Record(msgspec.Struct, frozen=True):
    key: tuple[int, int, int, int, int]
    scheme: int
    size: int
    file_hash: bytes
    digests: bytes
    lengths: list[int]
    owner: str = ""  # the receiver's: who sent this file ("": unknown)


def stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ManifestCache:
    """Manifests of files by absolute path, valid while the file's stat key is unchanged."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, file: Path) -> Path:
        name = hashlib.sha256(os.fsencode(file.absolute())).hexdigest()
        return self.root / name[:2] / name

    def get(self, file: Path) -> Manifest | None:
        got = self.get_owned(file)
        return None if got is None else got[0]

    def get_owned(self, file: Path) -> tuple[Manifest, str] | None:
        """(manifest, owner) while ``file`` is unchanged since it was recorded."""
        try:
            st = file.stat()
            rec = msgspec.msgpack.decode(self._path(file).read_bytes(), type=_Record)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        if rec.key != stat_key(st) or rec.scheme != HASH_SCHEME:
            return None
        return Manifest(rec.size, rec.file_hash, rec.digests, tuple(rec.lengths)), rec.owner

    def put(
        self,
        file: Path,
        manifest: Manifest,
        st: os.stat_result | None = None,
        *,
        owner: str = "",
    ) -> None:
        """Remember ``manifest`` for ``file`` (``st``: its stat when it was hashed)."""
        try:
            st = st or file.stat()
            rec = _Record(
                stat_key(st),
                HASH_SCHEME,
                manifest.size,
                manifest.file_hash,
                manifest.digests,
                list(manifest.lengths),
                owner,
            )
            path = self._path(file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(msgspec.msgpack.encode(rec))
            os.replace(tmp, path)
        except OSError:
            pass  # a cache: losing a record costs a re-hash, nothing more

    def forget(self, file: Path) -> None:
        with contextlib.suppress(OSError):
            self._path(file).unlink()
