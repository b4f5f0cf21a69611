"""Bulk file transfer: content-defined chunks, a chunk cache on both ends, adaptive zstd.

The sender offers a file as a list of FastCDC chunks (each with a strong hash); the
receiver answers with the chunks it lacks (its cache, a partial earlier attempt or the
previous version of the file supply the rest), the sender streams those, compressed
only while compression speeds the transfer up, and the receiver renames the file into
place after the whole-file hash matches.
"""

from __future__ import annotations

from meshopt.transfer.errors import TransferError
from meshopt.transfer.protocol import TRANSFER_PORT

__all__ = ["TRANSFER_PORT", "TransferError"]
