"""Wire format: length-prefixed msgpack frames of tagged msgspec Structs over TCP.

sender -> receiver: Offer, then Chunk* and Done; receiver -> sender: Need (the chunks
it lacks; may come again after Done if a cached chunk turned out unusable), Ack, or
Error at any point. A frame is a 4-byte big-endian length and the encoded message.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Final

import msgspec

from meshopt.transfer.errors import TransferError

VERSION: Final = 2  # 2: the file hash is sha256 over the chunk digests
TRANSFER_PORT: Final = 51897
MAX_FRAME: Final = 64 * 1024 * 1024  # an offer for ~100 GB of 64 KiB chunks fits
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


async def read_sized(
    reader: asyncio.StreamReader, *, max_frame: int = MAX_FRAME
) -> tuple[Message, int]:
    """The next message and its size on the wire (length prefix included)."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        raise TransferError("connection closed by peer", code="closed") from exc
    (n,) = _LEN.unpack(head)
    if n > max_frame:
        raise TransferError(f"frame of {n} bytes is over the {max_frame} limit", code="corrupt")
    try:
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise TransferError("stream truncated mid-frame", code="truncated") from exc
    return decode(body), _LEN.size + n
