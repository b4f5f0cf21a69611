"""Wire format: length-prefixed msgpack frames of tagged msgspec Structs over TCP.

sender -> receiver: Offer, then Chunk* and Done; receiver -> sender: Need (the chunks
it lacks; may come again after Done if a cached chunk turned out unusable), Ack, or
Error at any point. A frame is a 4-byte big-endian length and the encoded message.

A receiver reads the offer with a limit derived from its quota and every later frame
with CHUNK_FRAME_MAX, each under a deadline (an idle timeout plus time for the frame at
MIN_FRAME_RATE), so a sender can neither make it buffer large frames nor hold a
connection open by trickling bytes.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Final

import msgspec

from meshopt.transfer.errors import TransferError

VERSION: Final = 2  # 2: the file hash is sha256 over the chunk digests
TRANSFER_PORT: Final = 51897
# Chunk sizes are part of the protocol: the receiver refuses chunks outside them.
CHUNK_MIN: Final = 16 * 1024  # every chunk but a file's last is at least this long
CHUNK_MAX: Final = 256 * 1024
MAX_FRAME: Final = 64 * 1024 * 1024  # an offer for ~100 GB of 64 KiB chunks fits
# A chunk frame: at most CHUNK_MAX bytes of data, which zstd may grow by its block
# headers (3 bytes per 128 KiB block, a frame header) when the data does not compress.
CHUNK_FRAME_MAX: Final = CHUNK_MAX + CHUNK_MAX // 64 + 4096
OFFER_BYTES_PER_CHUNK: Final = 40  # a digest (32 + 2) and a length (<= 5) in msgpack
MIN_FRAME_RATE: Final = 64_000  # bytes/s a frame must arrive at, beyond the idle timeout
_LEN = struct.Struct("!I")

RAW: Final = 0
ZSTD: Final = 1  # continues the current zstd stream
ZSTD_NEW: Final = 2  # starts a new zstd stream (level changed)


class Offer(msgspec.Struct, tag="offer", frozen=True):
    name: str
    dir: str
    size: int
    file_hash: bytes  # chunking.whole_hash(digests)
    digests: bytes  # sha256 of every chunk, concatenated
    lengths: list[int]
    version: int = VERSION
    overwrite: bool = False  # replace an existing file (the receiver must allow it too)


class Need(msgspec.Struct, tag="need", frozen=True):
    missing: list[int]  # chunk indices the receiver lacks
    complete: bool = False  # the receiver already holds exactly this file


class Chunk(msgspec.Struct, tag="chunk", frozen=True):
    index: int
    codec: int
    data: bytes


class Done(msgspec.Struct, tag="done", frozen=True):
    pass


class Ack(msgspec.Struct, tag="ack", frozen=True):
    path: str  # where the file is, relative to the receiver's directory
    file_hash: bytes


class Error(msgspec.Struct, tag="error", frozen=True):
    code: str
    reason: str


Message = Offer | Need | Chunk | Done | Ack | Error

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        msg: Message = _decoder.decode(body)
        return msg
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransferError(f"corrupted frame: {exc}", code="corrupt") from exc


async def read_message(reader: asyncio.StreamReader, *, max_frame: int = MAX_FRAME) -> Message:
    """The next message; EOF, an oversized or undecodable frame raise TransferError."""
    return (await read_sized(reader, max_frame=max_frame))[0]


def offer_frame_max(quota_bytes: int) -> int:
    """The largest offer a receiver with this quota can accept: every chunk but the last
    is at least CHUNK_MIN long, so the quota bounds the number of chunks."""
    chunks = quota_bytes // CHUNK_MIN + 2
    return min(MAX_FRAME, OFFER_BYTES_PER_CHUNK * chunks + 16 * 1024)


async def read_sized(
    reader: asyncio.StreamReader,
    *,
    max_frame: int = MAX_FRAME,
    idle_timeout: float | None = None,
) -> tuple[Message, int]:
    """The next message and its size on the wire (length prefix included).

    ``idle_timeout``: the length prefix must arrive within it, the frame within it plus
    its size at MIN_FRAME_RATE (TimeoutError otherwise); None waits for ever.
    """
    try:
        head = await asyncio.wait_for(reader.readexactly(_LEN.size), idle_timeout)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise TransferError("stream truncated mid-frame", code="truncated") from exc
        raise TransferError("connection closed by peer", code="closed") from exc
    (n,) = _LEN.unpack(head)
    if n > max_frame:
        raise TransferError(f"frame of {n} bytes is over the {max_frame} limit", code="corrupt")
    timeout = None if idle_timeout is None else idle_timeout + n / MIN_FRAME_RATE
    try:
        body = await asyncio.wait_for(reader.readexactly(n), timeout)
    except asyncio.IncompleteReadError as exc:
        raise TransferError("stream truncated mid-frame", code="truncated") from exc
    return decode(body), _LEN.size + n
