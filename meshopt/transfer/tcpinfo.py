"""Bytes the peer acknowledged and bytes not yet sent, from Linux's TCP_INFO.

The link rate is what the peer acknowledges per second while the socket has data
waiting; that is measured, not assumed, and it ignores the first megabytes that only
fill the kernel's send buffer.
"""

from __future__ import annotations

import socket
import struct
import time
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


WARMUP_S = 0.5  # slow start: the first half second says little about the link
WINDOW_S = 0.5  # shorter windows see bursts of acks, not the link


class LinkMeter:
    """The link rate: bytes acked per second over windows of at least WINDOW_S.

    ``sample()`` after each batch returns (rate, busy) once a window is complete; busy
    means the socket had unsent data at every sample in the window, so the rate is the
    link's; otherwise it is only a lower bound.
    """

    def __init__(self, sock: Any, warmup_s: float = WARMUP_S, window_s: float = WINDOW_S) -> None:
        self.sock = sock
        self.start = time.perf_counter()
        self.warmup_s = warmup_s
        self.window_s = window_s
        self._anchor: tuple[float, int] | None = None
        self._busy = True

    def sample(self) -> tuple[float, bool] | None:
        cur = acked_and_unsent(self.sock)
        now = time.perf_counter()
        if cur is None or now - self.start < self.warmup_s:
            return None
        acked, unsent = cur
        if self._anchor is None:
            self._anchor, self._busy = (now, acked), unsent > 0
            return None
        self._busy = self._busy and unsent > 0
        t0, acked0 = self._anchor
        if now - t0 < self.window_s:
            return None
        out = ((acked - acked0) / (now - t0), self._busy)
        self._anchor, self._busy = (now, acked), unsent > 0
        return out
