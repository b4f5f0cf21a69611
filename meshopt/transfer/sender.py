"""Send one file: offer its chunk list, stream only the chunks the receiver lacks.

Compression and file reads run in a worker thread one batch ahead of the socket, so
the slower of the two sets the pace; the level is re-chosen per batch from the
measured link rate and what the compressor achieved on the previous batch. The
connection and the compression calibration (on the file's head) run while the file is
hashed, so the only time before the first chunk is the hashing and the offer's round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard as zstd

from meshopt.transfer.cache import ManifestCache
from meshopt.transfer.chunking import Manifest, chunk_file
from meshopt.transfer.compress import Adaptive, LevelStats, calibrate, compressor, measure_level
from meshopt.transfer.errors import TransferError
from meshopt.transfer.protocol import (
    RAW,
    ZSTD,
    ZSTD_NEW,
    Ack,
    Chunk,
    Done,
    Error,
    Message,
    Need,
    Offer,
    encode,
    read_sized,
)
from meshopt.transfer.tcpinfo import LinkMeter, acked_and_unsent

BATCH_BYTES = 4 << 20  # raw bytes per compression decision
SAMPLE_BYTES = 1 << 20  # calibration sample
UNKNOWN_LINK_FLOOR = 24e6  # calibrate up to levels this fast while the link is unknown
REPLY_TIMEOUT_S = 120.0  # the receiver hashes the whole file before it acks

Progress = Callable[[int, int], None]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshopt" / "transfer"


@dataclass
class TransferSummary:
    path: str
    remote_path: str
    file_bytes: int
    bytes_sent: int  # frames written, length prefixes included
    bytes_received: int  # the receiver's answers
    seconds: float  # end to end: hashing, offer, chunks, the receiver's check
    hash_seconds: float
    chunks_total: int
    chunks_sent: int
    chunks_reused: int
    chunk_bytes_sent: int  # file bytes inside the chunks sent (before compression)
    already_present: bool
    levels: dict[str, int] = field(default_factory=dict)  # "raw"/"zstd-N" -> chunks
    last_level: int | None = None
    link_mbit: float | None = None  # the rate compression decisions used at the end

    @property
    def bytes_on_wire(self) -> int:
        return self.bytes_sent + self.bytes_received

    @property
    def ratio(self) -> float:
        """File bytes delivered per byte on the wire."""
        return self.file_bytes / max(1, self.bytes_on_wire)

    @property
    def goodput_bps(self) -> float:
        return self.file_bytes / max(self.seconds, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "remote_path": self.remote_path,
            "file_bytes": self.file_bytes,
            "bytes_on_wire": self.bytes_on_wire,
            "ratio": round(self.ratio, 3),
            "goodput_mbit": round(self.goodput_bps * 8 / 1e6, 3),
            "seconds": round(self.seconds, 3),
            "hash_seconds": round(self.hash_seconds, 3),
            "chunks_total": self.chunks_total,
            "chunks_sent": self.chunks_sent,
            "chunks_reused": self.chunks_reused,
            "already_present": self.already_present,
            "levels": self.levels,
            "link_mbit": None if self.link_mbit is None else round(self.link_mbit, 2),
        }


async def manifest_for(path: Path, cache: ManifestCache | None) -> tuple[Manifest, bool]:
    """The file's manifest, from the cache while the file is unchanged; (manifest, hit)."""
    if cache is not None:
        hit = await asyncio.to_thread(cache.get, path)
        if hit is not None:
            return hit, True
    before = os.stat(path)
    manifest = await asyncio.to_thread(chunk_file, path)
    after = os.stat(path)
    if (before.st_mtime_ns, before.st_size) != (after.st_mtime_ns, after.st_size):
        raise TransferError(f"{path} changed while it was being hashed", code="changed")
    if cache is not None:
        await asyncio.to_thread(cache.put, path, manifest, after)
    return manifest, False


@dataclass
class _Packed:
    frames: list[bytes]
    raw: int
    packed: int  # payload bytes after compression
    seconds: float
    level: int | None
    probe: LevelStats | None = None


class _Packer:
    """Reads chunks and turns them into frames; runs in a worker thread, one at a time."""

    def __init__(self, fd: int, manifest: Manifest) -> None:
        self.fd = fd
        self.m = manifest
        self.offsets = manifest.offsets()
        self.cobj: Any = None
        self.level: int | None = None

    def read(self, i: int) -> bytes:
        data = os.pread(self.fd, self.m.lengths[i], self.offsets[i])
        if len(data) != self.m.lengths[i]:
            raise TransferError("file shrank while being sent", code="changed")
        return data

    def sample(self, indices: Sequence[int]) -> list[bytes]:
        out, total = [], 0
        for i in indices:
            out.append(self.read(i))
            total += len(out[-1])
            if total >= SAMPLE_BYTES:
                break
        return out

    def pack(self, indices: Sequence[int], level: int | None, probe: bool) -> _Packed:
        t0 = time.perf_counter()
        frames: list[bytes] = []
        raw = packed = 0
        first_data = None
        for i in indices:
            data = self.read(i)
            if first_data is None:
                first_data = data
            raw += len(data)
            if level is None:
                payload, codec = data, RAW
            else:
                codec = ZSTD
                if self.cobj is None or self.level != level:
                    self.cobj = compressor(level).compressobj()
                    self.level = level
                    codec = ZSTD_NEW
                payload = self.cobj.compress(data) + self.cobj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK)
            packed += len(payload)
            frames.append(encode(Chunk(i, codec, payload)))
        seconds = time.perf_counter() - t0
        sample = measure_level([first_data], 1) if probe and first_data else None
        return _Packed(frames, raw, packed, seconds, level, sample)


def _batches(indices: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in indices:
        cur.append(i)
        size += lengths[i]
        if size >= BATCH_BYTES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


class _Session:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        summary: TransferSummary,
        progress: Progress | None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.s = summary
        self.progress = progress
        self.done_bytes = 0

    def send(self, msg: Message) -> None:
        data = encode(msg)
        self.s.bytes_sent += len(data)
        self.writer.write(data)

    async def recv(self, timeout: float | None = REPLY_TIMEOUT_S) -> Message:
        msg, n = await asyncio.wait_for(read_sized(self.reader), timeout)
        self.s.bytes_received += n
        if isinstance(msg, Error):
            # The reason is printed on the user's terminal: no escape sequences through it.
            reason = msg.reason if msg.reason.isprintable() else repr(msg.reason)[1:-1]
            raise TransferError(f"receiver refused: {reason[:500]}", code=msg.code[:40])
        return msg

    def tick(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if self.progress is not None:
            self.progress(self.done_bytes, self.s.file_bytes)


async def send_file(
    path: str | os.PathLike[str],
    host: str,
    port: int,
    *,
    dest: str = "",
    link_mbit: float | None = None,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    connect_timeout: float = 10.0,
    overwrite: bool = False,
    source: str | None = None,
) -> TransferSummary:
    """Send ``path`` to the receiver at ``host:port`` into its directory ``dest``.

    ``link_mbit`` fixes the link rate compression decisions use; None measures it.
    ``cache_dir`` None uses ``~/.cache/meshopt/transfer``; pass a path to move it.
    ``overwrite``: replace a file of that name (the receiver must allow it as well).
    ``source``: the local address to connect from (the receiver knows senders by it).
    Raises TransferError with the receiver's reason when it refuses or fails.
    """
    p = Path(path)
    t0 = time.perf_counter()
    try:
        st = p.stat()
    except OSError as exc:
        raise TransferError(f"cannot read {p}: {exc.strerror}", code="input") from exc
    if not p.is_file():
        raise TransferError(f"{p} is not a regular file", code="input")
    cache = ManifestCache((cache_dir or default_cache_dir()) / "manifests")
    link_bps = None if link_mbit is None else link_mbit * 1e6 / 8
    connecting = asyncio.ensure_future(_connect(host, port, connect_timeout, source))
    cached = await asyncio.to_thread(cache.get, p)
    # A file hashed before was probably sent before: calibrate only for a new one.
    calibrating: asyncio.Future[list[LevelStats]] = (
        asyncio.ensure_future(asyncio.to_thread(_calibrate_head, p, link_bps))
        if cached is None
        else _resolved([])
    )
    hashing = asyncio.ensure_future(
        _resolved((cached, True)) if cached is not None else manifest_for(p, cache)
    )
    try:
        manifest, _ = await hashing
        if manifest.size != st.st_size:
            cache.forget(p)
            raise TransferError(f"{p} changed while it was being hashed", code="changed")
        hashed = time.perf_counter()
        reader, writer = await connecting
    except BaseException:
        await _abandon(hashing, connecting, calibrating)
        raise
    s = TransferSummary(
        path=str(p),
        remote_path="",
        file_bytes=manifest.size,
        bytes_sent=0,
        bytes_received=0,
        seconds=0.0,
        hash_seconds=hashed - t0,
        chunks_total=manifest.count,
        chunks_sent=0,
        chunks_reused=0,
        chunk_bytes_sent=0,
        already_present=False,
    )
    sess = _Session(reader, writer, s, progress)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sess.send(
            Offer(
                p.name,
                dest,
                manifest.size,
                manifest.file_hash,
                manifest.digests,
                list(manifest.lengths),
                overwrite=overwrite,
            )
        )
        await writer.drain()
        reply = await sess.recv()
        if not isinstance(reply, Need):
            raise TransferError(f"receiver answered {type(reply).__name__}", code="protocol")
        if reply.complete:
            s.already_present = True
            s.chunks_reused = manifest.count
            sess.tick(manifest.size)
            sess.send(Done())
            await writer.drain()
            ack = await sess.recv()
        else:
            missing = set(reply.missing)
            if any(not 0 <= i < manifest.count for i in missing):
                raise TransferError("receiver asked for chunks that do not exist", code="protocol")
            s.chunks_reused = manifest.count - len(missing)
            sess.tick(sum(n for i, n in enumerate(manifest.lengths) if i not in missing))
            head = calibrating if len(missing) == manifest.count else None
            ack = await _stream(sess, _Packer(fd, manifest), sorted(missing), link_bps, head)
        if not isinstance(ack, Ack) or ack.file_hash != manifest.file_hash:
            raise TransferError(
                "receiver's acknowledgement does not match the file", code="protocol"
            )
        s.remote_path = ack.path
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        raise TransferError(f"connection to {host} lost: {exc}", code="closed") from exc
    except TimeoutError as exc:
        raise TransferError(f"no answer from {host} in time", code="timeout") from exc
    finally:
        await _abandon(calibrating)
        os.close(fd)
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 5)
    s.seconds = time.perf_counter() - t0
    return s


async def _connect(
    host: str, port: int, timeout: float, source: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    local = None if source is None else (source, 0)
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(host, port, local_addr=local), timeout
        )
    except TimeoutError as exc:
        raise TransferError(
            f"cannot connect to {host} port {port}: no answer in {timeout:g} s", code="connect"
        ) from exc
    except OSError as exc:
        raise TransferError(f"cannot connect to {host} port {port}: {exc}", code="connect") from exc


async def _abandon(*tasks: asyncio.Future[Any]) -> None:
    """Cancel and reap helper tasks; a connection one of them made is closed."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            result = await t
            if isinstance(result, tuple) and len(result) == 2:
                writer = result[1]
                if isinstance(writer, asyncio.StreamWriter):
                    writer.close()


def _resolved(value: Any) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def _calibrate_head(path: Path, link_bps: float | None) -> list[LevelStats]:
    """Calibrate on the file's first SAMPLE_BYTES (a whole-file send's first chunks)."""
    with open(path, "rb") as f:
        head = f.read(SAMPLE_BYTES)
    sample = [head[i : i + 64 * 1024] for i in range(0, len(head), 64 * 1024)]
    return calibrate(sample, link_bps or UNKNOWN_LINK_FLOOR) if sample else []


async def _stream(
    sess: _Session,
    packer: _Packer,
    missing: list[int],
    link_bps: float | None,
    head: asyncio.Future[list[LevelStats]] | None,
) -> Message:
    """Send the missing chunks, then Done; repeat for later Need rounds; the final reply.

    ``head``: a calibration on the file's head, used when every chunk is missing.
    """
    s = sess.s
    stats = await head if head is not None else []
    if not stats:
        sample = await asyncio.to_thread(packer.sample, missing)
        stats = await asyncio.to_thread(calibrate, sample, link_bps or UNKNOWN_LINK_FLOOR)
    policy = Adaptive(stats, link_bps)
    sock = sess.writer.get_extra_info("socket")
    while True:
        # The reply is read while we send: an Error (full disk, bad chunk) stops us early.
        reply_task = asyncio.create_task(sess.recv(timeout=None))
        try:
            await _send_batches(sess, packer, policy, missing, sock, reply_task)
            sess.send(Done())
            reply = await asyncio.wait_for(asyncio.shield(reply_task), REPLY_TIMEOUT_S)
        finally:
            if not reply_task.done():
                reply_task.cancel()
                with contextlib.suppress(BaseException):
                    await reply_task
        s.last_level = policy.history[-1].level if policy.history else None
        s.link_mbit = None if policy.link_bps is None else policy.link_bps * 8 / 1e6
        if not isinstance(reply, Need):
            return reply
        missing = sorted(set(reply.missing))  # chunks the receiver's cache failed to give


async def _send_batches(
    sess: _Session,
    packer: _Packer,
    policy: Adaptive,
    missing: list[int],
    sock: Any,
    early: asyncio.Task[Message],
) -> None:
    s = sess.s
    batches = _batches(missing, packer.m.lengths)
    if not batches:
        return
    try:
        decision = policy.decide()
        nxt = asyncio.create_task(
            asyncio.to_thread(packer.pack, batches[0], decision.level, decision.level is None)
        )
        meter = LinkMeter(sock)
        for k in range(len(batches)):
            waited = not nxt.done()
            packed = await nxt
            if packed.level is not None:
                # We waited for the batch and the kernel ran out of unsent bytes: the link
                # waited for the compressor (the first batch always finds it empty).
                left = acked_and_unsent(sock)
                starved = waited and k > 0 and left is not None and left[1] == 0
                policy.observe_batch(
                    packed.level, packed.raw, packed.packed, packed.seconds, starved
                )
            if packed.probe is not None:
                policy.observe_probe(packed.probe)
            if k + 1 < len(batches):
                decision = policy.decide()
                nxt = asyncio.create_task(
                    asyncio.to_thread(
                        packer.pack, batches[k + 1], decision.level, decision.level is None
                    )
                )
            for f in packed.frames:
                sess.writer.write(f)
                s.bytes_sent += len(f)
                if sess.writer.transport.get_write_buffer_size() > 1 << 20:
                    await _drain(sess, early)
            await _drain(sess, early)
            key = "raw" if packed.level is None else f"zstd-{packed.level}"
            s.levels[key] = s.levels.get(key, 0) + len(packed.frames)
            s.chunks_sent += len(packed.frames)
            s.chunk_bytes_sent += packed.raw
            sess.tick(packed.raw)
            measured = meter.sample()
            if measured is not None:
                rate, busy = measured
                if busy:
                    policy.observe_link(rate)  # the socket stayed busy: this is the link
                elif policy.link_bps is None or rate > policy.link_bps:
                    policy.observe_link(rate)  # the link is at least this fast
    finally:
        if early.done():
            early.result()  # raises the receiver's error, if it sent one


async def _drain(sess: _Session, early: asyncio.Task[Message]) -> None:
    """Wait for the socket, unless the receiver already answered (then raise its error)."""
    drain = asyncio.ensure_future(sess.writer.drain())
    await asyncio.wait({drain, early}, return_when=asyncio.FIRST_COMPLETED)
    if early.done() and not drain.done():
        drain.cancel()
        early.result()
        raise TransferError("receiver answered before the transfer was complete", code="protocol")
    await drain
