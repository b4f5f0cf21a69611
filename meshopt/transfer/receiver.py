"""The receiving service: accepts offers from mesh peers and writes files into one directory.

Every failure of one transfer (bad path, peer not in the mesh, corrupted or truncated
stream, wrong hash, full disk) becomes an Error frame to the sender, a counted reason
and a log line; the service itself keeps serving.

Senders are mesh members but not trusted: each is known by its mesh identity (see
``identity``), may hold only a few of a bounded number of connection slots, must keep
data flowing (idle timeout), gets its offers checked against a quota and a free-space
reserve before anything is written, may not replace a file unless both ends agree,
and only ever sees (and reuses) chunks it sent itself. A zstd chunk may decompress to
its declared length and not a byte more.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import zstandard as zstd

from meshopt.transfer.cache import ChunkStore, ManifestCache, StoreWriter
from meshopt.transfer.chunking import (
    CHUNK_MAX,
    CHUNK_MIN,
    DIGEST_SIZE,
    Manifest,
    chunk_digest,
    whole_hash,
)
from meshopt.transfer.compress import WINDOW_LOG
from meshopt.transfer.errors import TransferError
from meshopt.transfer.identity import address_identity, normalise
from meshopt.transfer.limits import Limits, quota_refusal, reserve_bytes, space_refusal
from meshopt.transfer.partfile import PartFile, no_space, part_paths
from meshopt.transfer.protocol import (
    CHUNK_FRAME_MAX,
    RAW,
    TRANSFER_PORT,
    VERSION,
    ZSTD,
    ZSTD_NEW,
    Ack,
    Chunk,
    Done,
    Error,
    Need,
    Offer,
    encode,
    offer_frame_max,
    read_sized,
)
from meshopt.transfer.safepath import PART_SUFFIX, RESERVED_PREFIX, STATE_SUFFIX, resolve_target

log = logging.getLogger("meshopt.transfer")

DEFAULT_CACHE_MAX = 4 << 30
MAX_ROUNDS = 3  # Need rounds after Done (a cached chunk that went bad is asked for again)
# After an error: stop writing, then read (and drop) what the sender still has in flight
# for this long, so our close does not reset the connection before it reads the reason.
LINGER_S = 2.0
LINGER_BYTES = 8 << 20
# zstd writes decompressed output in pieces of this size; one piece over a chunk's
# declared length (at most CHUNK_MAX) ends the chunk, so a bomb costs at most this much.
DECODE_PIECE = 2 * CHUNK_MAX
# Errors after which the partial file stays for a resume: the sender went away or
# stalled, it did not lie.
RESUMABLE = frozenset({"closed", "truncated", "timeout", "sender"})

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Identify = Callable[[str], str | None]


@dataclass
class ServerCounters:
    connections: int = 0
    refused_peers: int = 0
    refused_busy: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    already_present: int = 0
    resumed_chunks: int = 0
    chunks_received: int = 0
    chunks_reused: int = 0
    bytes_received: int = 0
    partials_removed: int = 0  # discarded after a bad stream, or expired
    errors: Counter[str] = field(default_factory=Counter)


def parse_allow(prefixes: Sequence[str]) -> list[IPNetwork]:
    out = []
    for p in prefixes:
        try:
            out.append(ipaddress.ip_network(p, strict=False))
        except ValueError as exc:
            raise TransferError(f"bad --allow prefix {p!r}: {exc}", code="config") from exc
    return out


def validate_offer(offer: Offer) -> Manifest:
    if offer.version != VERSION:
        raise TransferError(
            f"protocol version {offer.version}, expected {VERSION}", code="bad-offer"
        )
    n = len(offer.lengths)
    if offer.size < 0 or len(offer.digests) != n * DIGEST_SIZE:
        raise TransferError("offer's chunk list does not match its size", code="bad-offer")
    if any(not 0 < x <= CHUNK_MAX for x in offer.lengths) or sum(offer.lengths) != offer.size:
        raise TransferError("offer's chunk lengths do not add up to its size", code="bad-offer")
    if any(x < CHUNK_MIN for x in offer.lengths[:-1]):
        # Content-defined chunks are never this small but at the end: a flood of tiny
        # chunks would only make the receiver's bookkeeping big.
        raise TransferError(f"offer has chunks under {CHUNK_MIN} bytes", code="bad-offer")
    if len(offer.file_hash) != DIGEST_SIZE:
        raise TransferError("offer's file hash is not a sha256", code="bad-offer")
    if whole_hash(offer.digests) != offer.file_hash:
        # Every chunk is checked against its digest on arrival, so this binds the file.
        raise TransferError("offer's file hash does not match its chunk list", code="bad-offer")
    return Manifest(offer.size, offer.file_hash, offer.digests, tuple(offer.lengths))


class _Overflow(Exception):
    """The decompressed chunk grew past its declared length."""


class _Sink:
    """Collects one chunk's decompressed bytes; refuses any byte past ``limit``."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.limit = 0

    def write(self, data: bytes) -> int:
        if len(self.buf) + len(data) > self.limit:
            raise _Overflow
        self.buf += data
        return len(data)


class ChunkDecoder:
    """Turns Chunk frames back into chunk bytes; a zstd stream runs across chunks.

    zstd hands its output to a sink in pieces of DECODE_PIECE bytes; the sink refuses
    past the chunk's declared length, so decompression stops there instead of
    expanding a few kilobytes into gigabytes.
    """

    def __init__(self) -> None:
        self._sink = _Sink()
        self._stream: zstd.ZstdDecompressionWriter | None = None

    def decode(self, index: int, codec: int, data: bytes, length: int) -> bytes | bytearray:
        if codec == RAW:
            if len(data) != length:
                raise TransferError(
                    f"chunk {index}: {len(data)} bytes, the offer said {length}", code="corrupt"
                )
            return data
        if codec == ZSTD_NEW:
            dctx = zstd.ZstdDecompressor(max_window_size=1 << WINDOW_LOG)
            # zstd only calls the sink's write(): it needs no more of a file than that.
            sink = cast("IO[bytes]", self._sink)
            self._stream = dctx.stream_writer(sink, write_size=DECODE_PIECE, write_return_read=True)
        elif codec != ZSTD or self._stream is None:
            raise TransferError(f"chunk {index}: bad codec {codec}", code="corrupt")
        self._sink.buf = bytearray()  # a new buffer: the last one went to the chunk store
        self._sink.limit = length
        try:
            self._stream.write(data)
        except _Overflow:
            raise TransferError(
                f"chunk {index}: decompresses to more than its declared {length} bytes",
                code="oversize",
            ) from None
        except zstd.ZstdError as exc:
            raise TransferError(f"chunk {index}: corrupted zstd data", code="corrupt") from exc
        out = self._sink.buf
        if len(out) != length:
            raise TransferError(
                f"chunk {index}: decompresses to {len(out)} bytes, the offer said {length}",
                code="corrupt",
            )
        return out


class TransferServer:
    """``await start()`` listens; ``await close()`` stops; ``counters`` says what happened.

    ``host``: one address or several to listen on ("::" or "": every address).
    ``identify``: source address -> the sender's mesh identity, None to refuse it
    (default: the address itself). ``limits``: quota, reserve, timeouts, slots.
    """

    def __init__(
        self,
        root: Path,
        *,
        host: str | Sequence[str] = "::",
        port: int = TRANSFER_PORT,
        allow: Sequence[str],
        identify: Identify | None = None,
        cache_dir: Path | None = None,
        cache_max_bytes: int = DEFAULT_CACHE_MAX,
        limits: Limits | None = None,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise TransferError(f"receive directory {root} does not exist", code="config")
        self.limits = limits or Limits()
        self.limits.check()
        self.hosts = [host] if isinstance(host, str) else list(host)
        if not self.hosts:
            raise TransferError("no address to listen on", code="config")
        self.port = port
        self.allow = parse_allow(allow)
        self.identify: Identify = identify or address_identity
        cache = Path(cache_dir) if cache_dir is not None else self.root / f"{RESERVED_PREFIX}-cache"
        self.store = ChunkStore(cache / "chunks", cache_max_bytes)
        if self.store.enabled:
            st = os.statvfs(self.store.root)
            self.store.min_free = reserve_bytes(st.f_blocks * st.f_frsize, self.limits)
        self.store_writer = StoreWriter(self.store)
        self.records = ManifestCache(cache / "files")
        self.counters = ServerCounters()
        self._offer_max = offer_frame_max(self.limits.quota_bytes)
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._busy: set[Path] = set()
        self._slots: Counter[str] = Counter()  # open transfers per sender
        self._reserved: dict[Path, int] = {}  # running transfers: target -> declared size
        self._jobs: dict[Path, PartFile] = {}  # running transfers' partial files
        self._parked: dict[Path, int] = {}  # partial files left this run: bytes written
        self._completed = 0  # bytes of files completed this run
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._expire()
        port = self.port
        for h in self.hosts:
            # asyncio sets IPV6_V6ONLY on "::": "::" (or "") here means every address,
            # both families, which asyncio binds as two sockets when given no host.
            host = None if h in ("::", "") else h
            server = await asyncio.start_server(self._handle, host, port)
            self._servers.append(server)
            port = port or server.sockets[0].getsockname()[1]  # one port for every address
        self.port = port
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="transfer-sweep")
        log.info(
            "transfer: receiving into %s on %s port %d",
            self.root,
            ", ".join(self.hosts),
            self.port,
        )

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for server in self._servers:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers = []
        # Connections still open end now (a partial file stays for a resume).
        handlers = list(self._handlers)
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await asyncio.to_thread(self.store_writer.flush)

    async def serve_forever(self) -> None:
        if not self._servers:
            await self.start()
        await asyncio.gather(*(s.serve_forever() for s in self._servers))

    def allowed(self, host: str) -> bool:
        addr = normalise(host)
        return addr is not None and any(addr in net for net in self.allow)

    # --- admission -------------------------------------------------------------------

    def _admit(self, host: str) -> str:
        """The sender's identity, holding one of its slots; refusals raise TransferError."""
        c = self.counters
        if not self.allowed(host):
            c.refused_peers += 1
            raise TransferError(f"peer {host} is not in the mesh", code="not-allowed")
        sender = self.identify(host)
        if sender is None:
            c.refused_peers += 1
            raise TransferError(f"{host} is not a WireGuard peer of this node", code="not-a-peer")
        lim = self.limits
        running = sum(self._slots.values())
        if running >= lim.max_transfers:
            c.refused_busy += 1
            raise TransferError(
                f"receiver is busy ({running} transfers running); try again later", code="busy"
            )
        if self._slots[sender] >= lim.max_per_sender:
            c.refused_busy += 1
            raise TransferError(
                f"{lim.max_per_sender} transfers from {host} are running already; "
                "try again when one has finished",
                code="busy",
            )
        self._slots[sender] += 1
        return sender

    def _release(self, sender: str) -> None:
        self._slots[sender] -= 1
        if self._slots[sender] <= 0:
            del self._slots[sender]

    def _check_room(self, target: Path, name: str, size: int) -> None:
        """Refuse an offer the quota or the free-space reserve cannot take; before writing."""
        used = (
            self._completed
            + sum(self._reserved.values())
            + sum(n for t, n in self._parked.items() if t != target)
        )
        refusal = quota_refusal(name, size, used, self.limits)
        if refusal is None:
            st = os.statvfs(_existing_parent(target))
            pending = sum(
                n - (self._jobs[t].written if t in self._jobs else 0)
                for t, n in self._reserved.items()
            )
            part = part_paths(target)[0]
            with contextlib.suppress(OSError):
                size -= min(size, os.stat(part).st_blocks * 512)  # a resume needs less
            refusal = space_refusal(
                name,
                size,
                free=st.f_bavail * st.f_frsize,
                total=st.f_blocks * st.f_frsize,
                pending=pending,
                limits=self.limits,
            )
        if refusal is not None:
            raise refusal

    # --- one connection --------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        c = self.counters
        c.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        failed = False
        try:
            sender = self._admit(host)
            try:
                msg, n = await read_sized(
                    reader, max_frame=self._offer_max, idle_timeout=self.limits.idle_timeout_s
                )
                c.bytes_received += n
                if not isinstance(msg, Offer):
                    raise TransferError(
                        f"expected an offer, got {type(msg).__name__}", code="protocol"
                    )
                await self._receive(msg, sender, reader, writer)
                c.transfers_ok += 1
            finally:
                self._release(sender)
        except Exception as exc:
            failed = True
            code, reason = self._describe(exc)
            c.transfers_failed += 1
            c.errors[code] += 1
            log.warning("transfer from %s failed: %s (%s)", host, reason, code)
            with contextlib.suppress(Exception):
                writer.write(encode(Error(code, reason)))
                await asyncio.wait_for(writer.drain(), 5)
        finally:
            await _hang_up(reader, writer, linger=failed)

    async def _receive(
        self,
        offer: Offer,
        sender: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        manifest = validate_offer(offer)
        target = await asyncio.to_thread(
            resolve_target, self.root, offer.dir, offer.name, create=False
        )
        if target in self._busy:
            raise TransferError(f"{offer.name} is being received already", code="busy")
        self._busy.add(target)
        try:
            await self._receive_into(target, offer, manifest, sender, reader, writer)
        finally:
            self._busy.discard(target)

    async def _receive_into(
        self,
        target: Path,
        offer: Offer,
        manifest: Manifest,
        sender: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        c = self.counters
        rel = str(target.relative_to(self.root.resolve()))
        old: Manifest | None = None
        if target.exists():
            rec = self.records.get_owned(target)
            mine = rec is not None and rec[1] == sender
            if rec is not None and mine and rec[0].file_hash == manifest.file_hash:
                writer.write(encode(Need([], complete=True)))
                await self._expect_done(reader)
                c.already_present += 1
                writer.write(encode(Ack(rel, manifest.file_hash)))
                await writer.drain()
                return
            if not offer.overwrite:
                raise TransferError(
                    f"{rel} exists on the receiver; send with --overwrite to replace it",
                    code="exists",
                )
            if not self.limits.allow_overwrite:
                raise TransferError(
                    f"{rel} exists and this receiver does not allow overwriting", code="exists"
                )
            # Chunks of the old version are reused only for the sender that wrote it.
            old = rec[0] if rec is not None and mine else None
        self._check_room(target, offer.name, manifest.size)
        self._reserved[target] = manifest.size
        try:
            await self._write_file(target, offer, manifest, old, sender, reader, writer)
        finally:
            del self._reserved[target]

    async def _write_file(
        self,
        target: Path,
        offer: Offer,
        manifest: Manifest,
        old: Manifest | None,
        sender: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        c = self.counters
        made = await asyncio.to_thread(resolve_target, self.root, offer.dir, offer.name)
        if made != target:  # the directory changed under us (a link swapped in)
            raise TransferError(f"{offer.name}: destination changed meanwhile", code="bad-path")
        rel = str(target.relative_to(self.root.resolve()))
        ns = self.store.namespace(sender)
        job = await asyncio.to_thread(PartFile.open, target, manifest, sender)
        self._parked.pop(target, None)
        self._jobs[target] = job
        keep = True
        try:
            c.resumed_chunks += job.resumed
            basis: dict[bytes, int] = {}
            if old is not None:
                basis = {old.digest(i): off for i, off in enumerate(old.offsets())}
            local: list[int] = []
            missing: list[int] = []
            # Chunks an earlier transfer queued for the store count as cached.
            await asyncio.to_thread(self.store_writer.flush)
            for i in job.missing():
                d = manifest.digest(i)
                (local if d in basis or self.store.has(d, ns) else missing).append(i)
            writer.write(encode(Need(missing)))
            fill = asyncio.create_task(
                asyncio.to_thread(job.fill, local, self.store, target if old else None, basis, ns)
            )
            try:
                await self._take_chunks(job, ns, reader, writer, fill)
            finally:
                if not fill.done():
                    with contextlib.suppress(Exception):
                        await fill
            c.chunks_reused += len(local)
            await asyncio.to_thread(job.finish)
            self._completed += manifest.size
            self.records.put(target, manifest, owner=sender)
            writer.write(encode(Ack(rel, manifest.file_hash)))
            await writer.drain()
        except BaseException as exc:
            keep = _resumable(exc)
            raise
        finally:
            del self._jobs[target]
            if job.fd >= 0:
                await asyncio.to_thread(job.close if keep else job.discard)
                if keep:
                    self._parked[target] = job.written
                else:
                    c.partials_removed += 1

    async def _take_chunks(
        self,
        job: PartFile,
        ns: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fill: asyncio.Task[list[int]],
    ) -> None:
        """Chunk frames until Done; then ask again for whatever is still missing."""
        c = self.counters
        m = job.manifest
        decoder = ChunkDecoder()
        rounds = 0
        while True:
            msg, n = await read_sized(
                reader, max_frame=CHUNK_FRAME_MAX, idle_timeout=self.limits.idle_timeout_s
            )
            c.bytes_received += n
            if isinstance(msg, Chunk):
                if not 0 <= msg.index < m.count:
                    raise TransferError(f"chunk index {msg.index} out of range", code="corrupt")
                data = decoder.decode(msg.index, msg.codec, msg.data, m.lengths[msg.index])
                digest = m.digest(msg.index)
                if chunk_digest(data) != digest:
                    raise TransferError(f"chunk {msg.index}: hash mismatch", code="corrupt")
                job.write(msg.index, data)
                self.store_writer.put(digest, data, ns)
                c.chunks_received += 1
            elif isinstance(msg, Done):
                failed = await fill if not fill.done() else fill.result()
                del failed  # job.missing() below covers them
                still = job.missing()
                if not still:
                    return
                rounds += 1
                if rounds > MAX_ROUNDS:
                    raise TransferError(f"{len(still)} chunks still missing", code="incomplete")
                writer.write(encode(Need(still)))
            elif isinstance(msg, Error):
                raise TransferError(f"sender gave up: {_printable(msg.reason)}", code="sender")
            else:
                raise TransferError(f"unexpected {type(msg).__name__} frame", code="protocol")

    async def _expect_done(self, reader: asyncio.StreamReader) -> None:
        msg, n = await read_sized(
            reader, max_frame=CHUNK_FRAME_MAX, idle_timeout=self.limits.idle_timeout_s
        )
        self.counters.bytes_received += n
        if not isinstance(msg, Done):
            raise TransferError(f"expected done, got {type(msg).__name__}", code="protocol")

    # --- partial files ---------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                await self._expire()
            except OSError as exc:
                log.warning("transfer: cannot check partial files: %s", exc)

    async def _expire(self, now: float | None = None) -> int:
        """Remove partial files untouched for ``partial_max_age_s``; how many went."""
        old = await asyncio.to_thread(stale_partials, self.root, self.limits.partial_max_age_s, now)
        gone = 0
        for target in old:
            if target in self._busy:  # resumed since the scan
                continue
            part, state = part_paths(target)
            for p in (part, state, state.with_name(state.name + ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            self._parked.pop(target, None)
            gone += 1
        if gone:
            self.counters.partials_removed += gone
            log.info(
                "transfer: removed %d partial files older than %.0f s",
                gone,
                self.limits.partial_max_age_s,
            )
        return gone

    async def expire_partials(self, now: float | None = None) -> int:
        """Expire partial files now (``now``: a wall-clock time to judge their age by)."""
        return await self._expire(now)

    def _describe(self, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, TransferError):
            return exc.code, str(exc)
        if isinstance(exc, TimeoutError):
            return "timeout", f"no data for {self.limits.idle_timeout_s:g} s"
        if isinstance(exc, OSError):
            if no_space(exc):
                return "no-space", f"receiver's disk is full ({os.strerror(exc.errno or 0)})"
            if isinstance(exc, ConnectionError):
                return "closed", "connection lost"
            return "io", f"receiver I/O error: {exc.strerror or exc}"
        log.exception("transfer: unexpected error")
        return "internal", f"receiver error: {type(exc).__name__}"


def stale_partials(root: Path, max_age_s: float, now: float | None = None) -> list[Path]:
    """Final paths whose partial (or state) files were last touched over ``max_age_s`` ago.

    The receiver's own directories (the cache) are not searched.
    """
    now = time.time() if now is None else now
    ages: dict[Path, float] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
        for f in filenames:
            for suffix in (PART_SUFFIX, STATE_SUFFIX, STATE_SUFFIX + ".tmp"):
                if f.startswith(".") and f.endswith(suffix) and len(f) > len(suffix) + 1:
                    target = Path(dirpath) / f[1 : -len(suffix)]
                    with contextlib.suppress(OSError):
                        mtime = os.lstat(Path(dirpath) / f).st_mtime
                        ages[target] = max(ages.get(target, 0.0), mtime)
                    break
    return sorted(t for t, mtime in ages.items() if now - mtime > max_age_s)


def _existing_parent(path: Path) -> Path:
    p = path.parent
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _resumable(exc: BaseException) -> bool:
    """Keep the partial file after this error? Only when the sender merely went away."""
    if isinstance(exc, TransferError):
        return exc.code in RESUMABLE
    return isinstance(exc, TimeoutError | ConnectionError | asyncio.CancelledError)


def _printable(text: str, limit: int = 200) -> str:
    """A sender's words made safe for our log and counters: escaped, short."""
    out = text if text.isprintable() else repr(text)[1:-1]
    return out if len(out) <= limit else out[:limit] + "..."


async def _hang_up(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, linger: bool
) -> None:
    if linger:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                left = LINGER_BYTES
                while left > 0:
                    data = await reader.read(min(left, 1 << 16))
                    if not data:
                        break
                    left -= len(data)
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 5)


async def serve_in_agent(
    root: Path,
    allow: Sequence[str],
    *,
    port: int = TRANSFER_PORT,
    host: str | Sequence[str] = "::",
    identify: Identify | None = None,
    cache_dir: Path | None = None,
    cache_max_bytes: int = DEFAULT_CACHE_MAX,
    limits: Limits | None = None,
) -> TransferServer:
    """Start a receiver inside an already running event loop (the agent's); it is listening
    when this returns. The caller owns it: ``await server.close()`` on stop.

    ``allow`` is the mesh's prefixes (peers outside them are refused); ``host`` the
    overlay addresses to listen on; ``identify`` maps a source address to the sending
    peer (None: not a peer). The chunk cache is scanned in a worker thread, so a large
    cache does not stall the agent's loop. ``server.counters`` says what happened;
    ``server.port`` is the bound port (port 0 picks a free one). Raises TransferError
    (code "config") for a missing directory, a bad prefix or bad limits, OSError when
    the port is taken or an address is not local.
    """
    server = await asyncio.to_thread(
        TransferServer,
        root,
        host=host,
        port=port,
        allow=allow,
        identify=identify,
        cache_dir=cache_dir,
        cache_max_bytes=cache_max_bytes,
        limits=limits,
    )
    await server.start()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m meshopt.transfer.receiver --dir D --allow P ...``: the CLI's ``serve``."""
    from meshopt.cli.main import main as cli_main

    return cli_main(["transfer", "serve", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
