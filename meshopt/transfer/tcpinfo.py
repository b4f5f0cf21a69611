"""Bytes the peer acknowledged and bytes not yet sent, from Linux's TCP_INFO.

The link rate is what the peer acknowledges per second while the socket has data
waiting; that is measured, not assumed, and it ignores the first megabytes that only
fill the kernel's send buffer.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_BYTES_ACKED = 120  # struct tcp_info: __u64 tcpi_bytes_acked (Linux >= 4.1)
_NOTSENT = 144  # __u32 tcpi_notsent_bytes (Linux >= 4.6)


def acked_and_unsent(sock: Any) -> tuple[int, int] | None:
    """(bytes acked, bytes not yet sent) for a connected TCP socket, or None if unknown."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except OSError:
        return None
    if len(raw) < _NOTSENT + 4:
        return None
    (acked,) = struct.unpack_from("=Q", raw, _BYTES_ACKED)
    (unsent,) = struct.unpack_from("=I", raw, _NOTSENT)
    return int(acked), int(unsent)
