"""A file being received: a hidden partial file plus a state file of the chunks it holds.

The final name only ever appears through one rename, after every chunk was written and
the partial file was fsynced. Each chunk is checked against its digest just before it is
written, and the digests are bound to the offer's file hash, so the whole file is never
read back; chunks an earlier run claims to have written are read back and checked when
the partial file is resumed (its state file may have outlived the data). An interrupted
transfer leaves the partial and its state so the next offer from the same sender asks
only for what is missing; another sender starts afresh. Nothing is reserved up front:
the partial file holds only the chunks that arrived (a sender that lies about the size
costs the receiver nothing it did not send).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from meshopt.transfer.cache import ChunkStore
from meshopt.transfer.chunking import Manifest, chunk_digest
from meshopt.transfer.errors import TransferError
from meshopt.transfer.safepath import PART_SUFFIX, STATE_SUFFIX

STATE_EVERY_S = 1.0  # how often the state file catches up with the chunks written
# Write back in the background every this many bytes, so the fsync before the rename
# finds little left to write instead of the whole file.
FLUSH_BYTES = 32 << 20


class _State(msgspec.Struct):
    file_hash: bytes
    size: int
    count: int
    done: bytes  # one byte per chunk: 1 = written to the partial file
    owner: str = ""  # the sender's identity: only it may resume


def part_paths(target: Path) -> tuple[Path, Path]:
    return (
        target.with_name(f".{target.name}{PART_SUFFIX}"),
        target.with_name(f".{target.name}{STATE_SUFFIX}"),
    )


def no_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class PartFile:
    """The partial file of one transfer; not shared between concurrent transfers."""

    def __init__(
        self, target: Path, manifest: Manifest, fd: int, done: bytearray, owner: str = ""
    ) -> None:
        self.target = target
        self.manifest = manifest
        self.owner = owner
        self.part, self.state = part_paths(target)
        self.fd = fd
        self.done = done
        self.offsets = manifest.offsets()
        self.resumed = sum(done)
        self.written = sum(n for n, d in zip(manifest.lengths, done, strict=True) if d)
        self._saved_at = time.monotonic()
        self._state_lock = threading.Lock()  # the cache fill runs in a thread
        self._unflushed = 0
        self._flusher: threading.Thread | None = None

    @classmethod
    def open(cls, target: Path, manifest: Manifest, owner: str = "") -> PartFile:
        """Resume ``owner``'s matching partial file, or start an empty one."""
        part, state_path = part_paths(target)
        st = _load_state(state_path)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        if (
            st is not None
            and st.owner == owner
            and st.file_hash == manifest.file_hash
            and st.size == manifest.size
            and st.count == manifest.count
            and len(st.done) == manifest.count
        ):
            try:
                fd = os.open(part, flags)
                if os.fstat(fd).st_size <= manifest.size:
                    job = cls(target, manifest, fd, bytearray(st.done), owner)
                    job.recheck()
                    return job
                os.close(fd)
            except FileNotFoundError:
                pass
        with contextlib.suppress(FileNotFoundError):
            state_path.unlink()
        fd = os.open(part, flags | os.O_CREAT | os.O_TRUNC, 0o600)
        return cls(target, manifest, fd, bytearray(manifest.count), owner)

    def missing(self) -> list[int]:
        return [i for i, d in enumerate(self.done) if not d]

    def recheck(self) -> None:
        """Read back the chunks an earlier run wrote; the damaged ones count as missing."""
        m = self.manifest
        for i, d in enumerate(self.done):
            if d and chunk_digest(os.pread(self.fd, m.lengths[i], self.offsets[i])) != m.digest(i):
                self.done[i] = 0
        self.resumed = sum(self.done)
        self.written = sum(n for n, d in zip(m.lengths, self.done, strict=True) if d)

    def write(self, i: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != self.manifest.lengths[i]:  # callers check; a wrong size never lands
            raise TransferError(f"chunk {i}: wrong length", code="corrupt")
        os.pwrite(self.fd, data, self.offsets[i])
        with self._state_lock:
            if not self.done[i]:
                self.written += len(data)
            self.done[i] = 1
        self._unflushed += len(data)
        if self._unflushed >= FLUSH_BYTES:
            self._flush_behind()
        if time.monotonic() - self._saved_at >= STATE_EVERY_S:
            self.save_state()

    def _flush_behind(self) -> None:
        """Start an fdatasync in a thread unless one is running (writes go on meanwhile)."""
        with self._state_lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._unflushed = 0
            self._flusher = threading.Thread(target=self._datasync, daemon=True)
            self._flusher.start()

    def _datasync(self) -> None:
        with contextlib.suppress(OSError):  # the fsync in finish() reports real errors
            os.fdatasync(self.fd)

    def _join_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.join()
            self._flusher = None

    def fill(
        self,
        indices: Iterable[int],
        store: ChunkStore,
        basis: Path | None,
        basis_offsets: dict[bytes, int],
        ns: str = "",
    ) -> list[int]:
        """Copy chunks from the cache (namespace ``ns``) or the previous version; the
        indices that failed."""
        failed: list[int] = []
        bfd = None
        if basis is not None:
            with contextlib.suppress(OSError):
                bfd = os.open(basis, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for i in indices:
                digest = self.manifest.digest(i)
                data = store.get(digest, ns)
                if data is None and bfd is not None and digest in basis_offsets:
                    data = os.pread(bfd, self.manifest.lengths[i], basis_offsets[digest])
                    if chunk_digest(data) != digest:
                        data = None
                if data is None:
                    failed.append(i)
                else:
                    self.write(i, data)
        finally:
            if bfd is not None:
                os.close(bfd)
        return failed

    def save_state(self) -> None:
        with self._state_lock:
            self._save_state()

    def _save_state(self) -> None:
        st = _State(
            self.manifest.file_hash,
            self.manifest.size,
            self.manifest.count,
            bytes(self.done),
            self.owner,
        )
        tmp = self.state.with_name(self.state.name + ".tmp")
        try:
            tmp.write_bytes(msgspec.msgpack.encode(st))
            os.replace(tmp, self.state)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._saved_at = time.monotonic()

    def finish(self) -> None:
        """Fsync and rename into place once every (checked) chunk is written."""
        if not all(self.done):
            raise TransferError(
                f"{self.target.name}: {self.done.count(0)} chunks were never written",
                code="incomplete",
            )
        self._join_flusher()
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.part, self.target)
        dfd = os.open(self.target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        with contextlib.suppress(FileNotFoundError):
            self.state.unlink()

    def close(self) -> None:
        """Stop here, keeping the partial file and its state for a resume."""
        if self.fd >= 0:
            self._join_flusher()
            self.save_state()
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        if self.fd >= 0:
            self._join_flusher()
            os.close(self.fd)
            self.fd = -1
        for p in (self.part, self.state):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _load_state(path: Path) -> _State | None:
    try:
        return msgspec.msgpack.decode(path.read_bytes(), type=_State)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
