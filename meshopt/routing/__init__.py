"""Route engine: all-pairs next hops, symmetric mode, widest paths, backups, updates."""

from meshopt.routing.allpairs import compute_routes, reference_costs, reference_routes
from meshopt.routing.tables import NO_ROUTE, RouteTables

__all__ = ["NO_ROUTE", "RouteTables", "compute_routes", "reference_costs", "reference_routes"]
