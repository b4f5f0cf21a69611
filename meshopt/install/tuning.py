"""Per-route TCP settings for a (possibly relayed) WireGuard path (pure).

Choices, and why:

* **MTU.** Every hop of a relayed path is its own WireGuard tunnel: the relay decrypts
  and re-encrypts, so overheads do not add up across hops, but the path can carry only
  what its narrowest tunnel carries: ``min(hop underlay MTU - overhead)``. The overhead
  is 80 bytes per hop (IPv6 outer header) unless the underlay is known to be IPv4 (60):
  an endpoint can roam between families, and 1500 - 80 = 1420 is the WireGuard
  interface MTU used everywhere here (wg-quick makes the same choice). The result is
  also capped at the interface MTU: a route MTU above the device's is never usable.
* **advmss** = MTU - 40 (IPv4 + TCP headers) or - 60 (IPv6 + TCP): 1420 -> 1380.
* **window** (RTAX_WINDOW, the clamp on the receive window a host advertises) = twice
  the bandwidth-delay product, bounded to 64 KiB .. 32 MiB: room for the window to
  grow past the BDP (queueing, rate changes) without autotuning building a
  bufferbloat-sized window. It acts on the receiving side, so both ends of a bulk path
  should install it (the agents do, each on its route to the other).
* **initcwnd** = one eighth of the BDP in segments, bounded to 10 (the kernel's
  default, RFC 6928) .. 32: a first flight that fills at most an eighth of the path.
  **initrwnd** = 2 x initcwnd (at most 64), so the peer's first flight is never held
  back by our initial receive window.
* Without both a bandwidth and an RTT the window and initial windows are left unset
  (kernel defaults); the MTU and MSS are always set.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Sequence
from typing import TypedDict

from meshopt.errors import InputError

WG_OVERHEAD: dict[int, int] = {
    socket.AF_INET: 60,
    socket.AF_INET6: 80,
}  # outer IP + UDP 8 + WireGuard 32
TCPIP_HEADERS: dict[int, int] = {socket.AF_INET: 40, socket.AF_INET6: 60}
DEFAULT_UNDERLAY_MTU = 1500
WG_INTERFACE_MTU = 1420
MIN_WINDOW = 64 * 1024
MAX_WINDOW = 32 * 1024 * 1024
INITCWND_MIN, INITCWND_MAX = 10, 32
INITRWND_MAX = 64
MIN_MTU: dict[int, int] = {socket.AF_INET: 576, socket.AF_INET6: 1280}


class TcpTuning(TypedDict):
    """Keyword arguments for ``DesiredRoute`` (``DesiredRoute(..., **tcp_tuning(...))``)."""

    mtu: int
    advmss: int
    window: int | None
    initcwnd: int | None
    initrwnd: int | None


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a positive number, not {value!r}")
    return float(value)


def tcp_tuning(
    path_mtu_hops: Sequence[int] | None,
    family: int,
    bandwidth_mbit: float | None,
    rtt_ms: float | None,
    *,
    relay_hops: int,
    underlay_family: int | None = None,
    if_mtu: int = WG_INTERFACE_MTU,
) -> TcpTuning:
    """Route attributes for a path of ``relay_hops + 1`` tunnels.

    ``path_mtu_hops``: the underlay MTU of each hop (None: 1500 each); ``family``: the
    route's (inner) family, which sets the MSS; ``underlay_family``: the outer family
    if known (None: assume IPv6, the larger overhead); ``bandwidth_mbit``/``rtt_ms``:
    the measured path, for the window and initial windows.
    """
    if family not in TCPIP_HEADERS:
        raise InputError(f"family must be AF_INET or AF_INET6, not {family}")
    if isinstance(relay_hops, bool) or not isinstance(relay_hops, int) or relay_hops < 0:
        raise InputError(f"relay_hops must be a non-negative integer, not {relay_hops!r}")
    hops = (
        [DEFAULT_UNDERLAY_MTU] * (relay_hops + 1) if path_mtu_hops is None else list(path_mtu_hops)
    )
    if len(hops) != relay_hops + 1:
        raise InputError(
            f"{len(hops)} hop MTUs given for a path of {relay_hops + 1} hops ({relay_hops} relays)"
        )
    if any(isinstance(h, bool) or not isinstance(h, int) or h <= 0 for h in hops):
        raise InputError(f"hop MTUs must be positive integers: {hops}")
    overhead = WG_OVERHEAD.get(socket.AF_INET6 if underlay_family is None else underlay_family, -1)
    if overhead < 0:
        raise InputError(f"underlay family must be AF_INET or AF_INET6, not {underlay_family}")
    mtu = min(if_mtu, *(h - overhead for h in hops))
    if mtu < MIN_MTU[family]:
        raise InputError(
            f"path MTU {mtu} (hops {hops} minus {overhead} bytes of WireGuard) is below "
            f"the minimum {MIN_MTU[family]} for this family"
        )
    advmss = mtu - TCPIP_HEADERS[family]
    rate = _positive("bandwidth_mbit", bandwidth_mbit)
    rtt = _positive("rtt_ms", rtt_ms)
    if rate is None or rtt is None:
        return TcpTuning(mtu=mtu, advmss=advmss, window=None, initcwnd=None, initrwnd=None)
    bdp = rate * 1e6 / 8 * rtt / 1000  # bytes in flight at full rate
    window = int(min(MAX_WINDOW, max(MIN_WINDOW, 2 * bdp)))
    segments = bdp / advmss
    initcwnd = min(INITCWND_MAX, max(INITCWND_MIN, math.ceil(segments / 8)))
    initrwnd = min(INITRWND_MAX, 2 * initcwnd)
    return TcpTuning(mtu=mtu, advmss=advmss, window=window, initcwnd=initcwnd, initrwnd=initrwnd)
