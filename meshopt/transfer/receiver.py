"""The receiving service: accepts offers from mesh peers and writes files into one directory.

Every failure of one transfer (bad path, peer not in the mesh, corrupted or truncated
stream, wrong hash, full disk) becomes an Error frame to the sender, a counted reason
and a log line; the service itself keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zstandard as zstd

from meshopt.transfer.cache import ChunkStore, ManifestCache, StoreWriter
from meshopt.transfer.chunking import (
    CHUNK_MAX,
    DIGEST_SIZE,
    Manifest,
    chunk_digest,
    whole_hash,
)
from meshopt.transfer.errors import TransferError
from meshopt.transfer.partfile import PartFile, no_space
from meshopt.transfer.protocol import (
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
    read_sized,
)
from meshopt.transfer.safepath import RESERVED_PREFIX, resolve_target

log = logging.getLogger("meshopt.transfer")

DEFAULT_CACHE_MAX = 4 << 30
IDLE_TIMEOUT_S = 60.0
MAX_ROUNDS = 3  # Need rounds after Done (a cached chunk that went bad is asked for again)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class ServerCounters:
    connections: int = 0
    refused_peers: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    already_present: int = 0
    resumed_chunks: int = 0
    chunks_received: int = 0
    chunks_reused: int = 0
    bytes_received: int = 0
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
    if len(offer.file_hash) != DIGEST_SIZE:
        raise TransferError("offer's file hash is not a sha256", code="bad-offer")
    if whole_hash(offer.digests) != offer.file_hash:
        # Every chunk is checked against its digest on arrival, so this binds the file.
        raise TransferError("offer's file hash does not match its chunk list", code="bad-offer")
    return Manifest(offer.size, offer.file_hash, offer.digests, tuple(offer.lengths))


class TransferServer:
    """``await start()`` listens; ``await close()`` stops; ``counters`` says what happened."""

    def __init__(
        self,
        root: Path,
        *,
        host: str = "::",
        port: int = TRANSFER_PORT,
        allow: Sequence[str],
        cache_dir: Path | None = None,
        cache_max_bytes: int = DEFAULT_CACHE_MAX,
        max_file_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise TransferError(f"receive directory {root} does not exist", code="config")
        self.host = host
        self.port = port
        self.allow = parse_allow(allow)
        cache = Path(cache_dir) if cache_dir is not None else self.root / f"{RESERVED_PREFIX}-cache"
        self.store = ChunkStore(cache / "chunks", cache_max_bytes)
        self.store_writer = StoreWriter(self.store)
        self.records = ManifestCache(cache / "files")
        self.max_file_bytes = max_file_bytes
        self.counters = ServerCounters()
        self._server: asyncio.Server | None = None
        self._busy: set[Path] = set()

    async def start(self) -> None:
        # asyncio sets IPV6_V6ONLY on "::": "::" (or "") here means every address, both
        # families, which asyncio binds as two sockets when given no host.
        host = None if self.host in ("::", "") else self.host
        self._server = await asyncio.start_server(self._handle, host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("transfer: receiving into %s on port %d", self.root, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        await asyncio.to_thread(self.store_writer.flush)

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    def allowed(self, host: str) -> bool:
        try:
            addr = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self.allow)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        c = self.counters
        c.connections += 1
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        try:
            if not self.allowed(host):
                c.refused_peers += 1
                raise TransferError(f"peer {host} is not in the mesh", code="not-allowed")
            msg, n = await asyncio.wait_for(read_sized(reader), IDLE_TIMEOUT_S)
            c.bytes_received += n
            if not isinstance(msg, Offer):
                raise TransferError(f"expected an offer, got {type(msg).__name__}", code="protocol")
            await self._receive(msg, reader, writer)
            c.transfers_ok += 1
        except Exception as exc:
            code, reason = _describe(exc)
            c.transfers_failed += 1
            c.errors[code] += 1
            log.warning("transfer from %s failed: %s (%s)", host, reason, code)
            with contextlib.suppress(Exception):
                writer.write(encode(Error(code, reason)))
                await asyncio.wait_for(writer.drain(), 5)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 5)

    async def _receive(
        self, offer: Offer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        manifest = validate_offer(offer)
        if self.max_file_bytes is not None and offer.size > self.max_file_bytes:
            raise TransferError(
                f"{offer.name} is {offer.size} bytes, over the receiver's quota of "
                f"{self.max_file_bytes}",
                code="no-space",
            )
        target = await asyncio.to_thread(resolve_target, self.root, offer.dir, offer.name)
        if target in self._busy:
            raise TransferError(f"{offer.name} is being received already", code="busy")
        self._busy.add(target)
        try:
            await self._receive_into(target, manifest, reader, writer)
        finally:
            self._busy.discard(target)

    async def _receive_into(
        self,
        target: Path,
        manifest: Manifest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        c = self.counters
        rel = str(target.relative_to(self.root.resolve()))
        old = self.records.get(target) if target.exists() else None
        if old is not None and old.file_hash == manifest.file_hash:
            writer.write(encode(Need([], complete=True)))
            await self._expect_done(reader)
            c.already_present += 1
            writer.write(encode(Ack(rel, manifest.file_hash)))
            await writer.drain()
            return
        job = await asyncio.to_thread(PartFile.open, target, manifest)
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
                (local if d in basis or self.store.has(d) else missing).append(i)
            writer.write(encode(Need(missing)))
            fill = asyncio.create_task(
                asyncio.to_thread(job.fill, local, self.store, target if old else None, basis)
            )
            try:
                await self._take_chunks(job, reader, writer, fill)
            finally:
                if not fill.done():
                    with contextlib.suppress(Exception):
                        await fill
            c.chunks_reused += len(local)
            await asyncio.to_thread(job.finish)
            self.records.put(target, manifest)
            writer.write(encode(Ack(rel, manifest.file_hash)))
            await writer.drain()
        except OSError as exc:
            keep = not no_space(exc)  # a full disk: free what the partial file holds
            raise
        finally:
            if job.fd >= 0:
                await asyncio.to_thread(job.close if keep else job.discard)

    async def _take_chunks(
        self,
        job: PartFile,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fill: asyncio.Task[list[int]],
    ) -> None:
        """Chunk frames until Done; then ask again for whatever is still missing."""
        c = self.counters
        m = job.manifest
        dobj = None
        rounds = 0
        while True:
            msg, n = await asyncio.wait_for(read_sized(reader), IDLE_TIMEOUT_S)
            c.bytes_received += n
            if isinstance(msg, Chunk):
                if not 0 <= msg.index < m.count:
                    raise TransferError(f"chunk index {msg.index} out of range", code="corrupt")
                if msg.codec == RAW:
                    data = msg.data
                elif msg.codec == ZSTD_NEW or (msg.codec == ZSTD and dobj is not None):
                    if msg.codec == ZSTD_NEW:
                        dobj = zstd.ZstdDecompressor().decompressobj()
                    assert dobj is not None
                    try:
                        data = dobj.decompress(msg.data)
                    except zstd.ZstdError as exc:
                        raise TransferError(
                            f"chunk {msg.index}: corrupted zstd data", code="corrupt"
                        ) from exc
                else:
                    raise TransferError(f"chunk {msg.index}: bad codec {msg.codec}", code="corrupt")
                if len(data) != m.lengths[msg.index] or chunk_digest(data) != m.digest(msg.index):
                    raise TransferError(f"chunk {msg.index}: hash mismatch", code="corrupt")
                job.write(msg.index, data)
                self.store_writer.put(m.digest(msg.index), data)
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
                raise TransferError(f"sender gave up: {msg.reason}", code=msg.code)
            else:
                raise TransferError(f"unexpected {type(msg).__name__} frame", code="protocol")

    async def _expect_done(self, reader: asyncio.StreamReader) -> None:
        msg, n = await asyncio.wait_for(read_sized(reader), IDLE_TIMEOUT_S)
        self.counters.bytes_received += n
        if not isinstance(msg, Done):
            raise TransferError(f"expected done, got {type(msg).__name__}", code="protocol")


async def serve_in_agent(
    root: Path,
    allow: Sequence[str],
    *,
    port: int = TRANSFER_PORT,
    host: str = "::",
    cache_dir: Path | None = None,
    cache_max_bytes: int = DEFAULT_CACHE_MAX,
    max_file_bytes: int | None = None,
) -> TransferServer:
    """Start a receiver inside an already running event loop (the agent's); it is listening
    when this returns. The caller owns it: ``await server.close()`` on stop.

    ``allow`` is the mesh's prefixes (peers outside them are refused). The chunk cache is
    scanned in a worker thread, so a large cache does not stall the agent's loop.
    ``server.counters`` says what happened; ``server.port`` is the bound port (port 0
    picks a free one). Raises TransferError (code "config") for a missing directory or a
    bad prefix, OSError when the port is taken.
    """
    server = await asyncio.to_thread(
        TransferServer,
        root,
        host=host,
        port=port,
        allow=allow,
        cache_dir=cache_dir,
        cache_max_bytes=cache_max_bytes,
        max_file_bytes=max_file_bytes,
    )
    await server.start()
    return server


def _describe(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, TransferError):
        return exc.code, str(exc)
    if isinstance(exc, TimeoutError):
        return "timeout", f"no data for {IDLE_TIMEOUT_S:.0f} s"
    if isinstance(exc, OSError):
        if no_space(exc):
            return "no-space", f"receiver's disk is full ({os.strerror(exc.errno or 0)})"
        if isinstance(exc, ConnectionError):
            return "closed", "connection lost"
        return "io", f"receiver I/O error: {exc.strerror or exc}"
    log.exception("transfer: unexpected error")
    return "internal", f"receiver error: {type(exc).__name__}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m meshopt.transfer.receiver --dir D --allow P ...``: the CLI's ``serve``."""
    from meshopt.cli.main import main as cli_main

    return cli_main(["transfer", "serve", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
