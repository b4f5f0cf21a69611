"""Route engine: all-pairs next hops, symmetric mode, widest paths, backups, updates."""

from meshopt.routing.allpairs import compute_routes, reference_costs, reference_routes
from meshopt.routing.backup import add_backups, backup_next_hops
from meshopt.routing.incremental import IncrementalRoutes
from meshopt.routing.symmetric import allowed_ips_consistent, allowed_ips_violations
from meshopt.routing.tables import NO_ROUTE, RouteTables, reduce_paths, walk_costs
from meshopt.routing.widest import WidestTables, bandwidth_levels, widest_routes

__all__ = [
    "NO_ROUTE",
    "IncrementalRoutes",
    "RouteTables",
    "WidestTables",
    "add_backups",
    "allowed_ips_consistent",
    "allowed_ips_violations",
    "backup_next_hops",
    "bandwidth_levels",
    "compute_routes",
    "reduce_paths",
    "reference_costs",
    "reference_routes",
    "walk_costs",
    "widest_routes",
]
