"""Topologies: the nodes of a mesh, its underlay between every pair, and its tunnels.

The names below load on first use (PEP 562): importing ``meshopt.topology.limits`` or
``.names`` for a light command must not pull in numpy, scipy and networkx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshopt.topology.limits import Limits
    from meshopt.topology.load import load_topology, save_topology
    from meshopt.topology.model import LinkProps, Node, Topology

__all__ = ["Limits", "LinkProps", "Node", "Topology", "load_topology", "save_topology"]

_WHERE = {
    "Limits": "meshopt.topology.limits",
    "load_topology": "meshopt.topology.load",
    "save_topology": "meshopt.topology.load",
    "LinkProps": "meshopt.topology.model",
    "Node": "meshopt.topology.model",
    "Topology": "meshopt.topology.model",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'meshopt.topology' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
