"""meshopt: route and protocol optimizer for WireGuard mesh VPNs."""

__version__ = "0.1.0"
