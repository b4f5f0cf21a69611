"""Probing WireGuard peers: a UDP echo responder and a prober with kernel timestamps.

``packet`` is the wire format, ``timestamps`` the kernel receive stamps and the timer
error they save, ``stats`` the pure per-peer statistics, ``responder`` and ``prober``
the asyncio adapters around them.

The adapters are imported on first use: ``python -m meshopt.probe.prober`` (and
``.responder``) must not find their module already imported by this package.
"""

import importlib
from typing import TYPE_CHECKING, Any

from meshopt.probe.packet import (
    MAX_PROBE_BYTES,
    PROBE_PORT,
    Kind,
    ProbeFormatError,
    ProbePacket,
    decode,
    encode,
    probe_bytes_per_s,
    wire_bytes,
)
from meshopt.probe.stats import PeerWindow, ProbeStats
from meshopt.probe.timestamps import (
    SO_TIMESTAMPNS,
    TimerError,
    enable_rx_timestamps,
    recv_timestamped,
)

if TYPE_CHECKING:
    from meshopt.probe.prober import ProbeConfig, Prober, Target
    from meshopt.probe.responder import Responder

_LAZY = {
    "ProbeConfig": "meshopt.probe.prober",
    "Prober": "meshopt.probe.prober",
    "Target": "meshopt.probe.prober",
    "Responder": "meshopt.probe.responder",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "MAX_PROBE_BYTES",
    "PROBE_PORT",
    "SO_TIMESTAMPNS",
    "Kind",
    "PeerWindow",
    "ProbeConfig",
    "ProbeFormatError",
    "ProbePacket",
    "ProbeStats",
    "Prober",
    "Responder",
    "Target",
    "TimerError",
    "decode",
    "enable_rx_timestamps",
    "encode",
    "probe_bytes_per_s",
    "recv_timestamped",
    "wire_bytes",
]
