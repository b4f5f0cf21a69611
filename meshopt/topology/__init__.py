"""Topologies: the nodes of a mesh, its underlay between every pair, and its tunnels."""

from meshopt.topology.limits import Limits
from meshopt.topology.load import load_topology, save_topology
from meshopt.topology.model import LinkProps, Node, Topology

__all__ = ["Limits", "LinkProps", "Node", "Topology", "load_topology", "save_topology"]
