"""Probing WireGuard peers: a UDP echo responder and a prober with kernel timestamps.

``packet`` is the wire format, ``timestamps`` the kernel receive stamps and the timer
error they save, ``stats`` the pure per-peer statistics, ``responder`` and ``prober``
the asyncio adapters around them. ``train`` estimates a tunnel's capacity from short
packet trains; ``icmp`` pings a peer that runs no agent and ``pmtu`` finds the path MTU
through a tunnel (both build their echo requests by hand: no scapy on the nodes).

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
    from meshopt.probe.icmp import IcmpError, IcmpResult, icmp_ping
    from meshopt.probe.pmtu import PmtuError, discover_pmtu
    from meshopt.probe.prober import ProbeConfig, Prober, Target
    from meshopt.probe.responder import Responder
    from meshopt.probe.train import (
        TRAIN_PORT,
        BandwidthEstimate,
        TrainError,
        TrainResponder,
        TrainUnansweredError,
        estimate_capacity,
    )

_LAZY = {
    "ProbeConfig": "meshopt.probe.prober",
    "Prober": "meshopt.probe.prober",
    "Target": "meshopt.probe.prober",
    "Responder": "meshopt.probe.responder",
    "TRAIN_PORT": "meshopt.probe.train",
    "BandwidthEstimate": "meshopt.probe.train",
    "TrainError": "meshopt.probe.train",
    "TrainResponder": "meshopt.probe.train",
    "TrainUnansweredError": "meshopt.probe.train",
    "estimate_capacity": "meshopt.probe.train",
    "IcmpError": "meshopt.probe.icmp",
    "IcmpResult": "meshopt.probe.icmp",
    "icmp_ping": "meshopt.probe.icmp",
    "PmtuError": "meshopt.probe.pmtu",
    "discover_pmtu": "meshopt.probe.pmtu",
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
    "TRAIN_PORT",
    "BandwidthEstimate",
    "IcmpError",
    "IcmpResult",
    "Kind",
    "PeerWindow",
    "PmtuError",
    "ProbeConfig",
    "ProbeFormatError",
    "ProbePacket",
    "ProbeStats",
    "Prober",
    "Responder",
    "Target",
    "TimerError",
    "TrainError",
    "TrainResponder",
    "TrainUnansweredError",
    "decode",
    "discover_pmtu",
    "enable_rx_timestamps",
    "encode",
    "estimate_capacity",
    "icmp_ping",
    "probe_bytes_per_s",
    "recv_timestamped",
    "wire_bytes",
]
