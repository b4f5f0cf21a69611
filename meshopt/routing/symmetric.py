"""Checks that next-hop tables can be installed behind WireGuard's AllowedIPs.

WireGuard accepts a packet from peer p only if p's AllowedIPs cover the
packet's source address, and a node's AllowedIPs for source a are exactly
"the peer I route a via". So a packet from a relayed along a→…→p→x→…→d is
dropped at x unless ``next_hop[x, a] == p``. Symmetric mode
(``compute_routes(..., symmetric=True)``) guarantees this; tables assembled
any other way (anti-flap policy, hand edits, directed mode) may not.
"""

from __future__ import annotations

import numpy as np

from meshopt.routing.tables import NO_ROUTE, IntArray, RouteTables


def _next_hops(tables: RouteTables | IntArray) -> IntArray:
    return tables.next_hop if isinstance(tables, RouteTables) else tables


def allowed_ips_violations(
    tables: RouteTables | IntArray, accept: RouteTables | IntArray | None = None
) -> IntArray:
    """(source, destination) pairs whose path a relay would drop, as a k×2 array.

    A pair is listed when some hop p→x on its path has ``accept[x, a] != p``,
    or when the path breaks (``NO_ROUTE`` on the way) or loops. Unreachable
    pairs (``next_hop[a, d] == NO_ROUTE``) have no path and are not listed.

    ``accept`` is the table the AllowedIPs are derived from; it defaults to
    ``tables`` itself. Pass the main tables when ``tables`` is a second routing
    class (e.g. bulk traffic on widest paths): WireGuard has one AllowedIPs set
    per peer, so every class's relayed packets are checked against it.

    Vectorised over all pairs at once, one gather per hop: O(n² · longest path).
    """
    nh = _next_hops(tables)
    back_nh = nh if accept is None else _next_hops(accept)
    n = nh.shape[0]
    if back_nh.shape != nh.shape:
        raise ValueError("tables and accept differ in size")
    a, d = np.nonzero((nh != NO_ROUTE) & ~np.eye(n, dtype=bool))
    a = a.astype(np.int64)
    d = d.astype(np.int64)
    cur = a.copy()
    found: list[IntArray] = []
    for _ in range(n):
        if a.size == 0:
            break
        nxt = nh[cur, d]
        broken = nxt == NO_ROUTE
        back = back_nh[np.where(broken, cur, nxt), a]
        bad = broken | (back != cur)
        if bad.any():
            found.append(np.stack([a[bad], d[bad]], axis=1))
        keep = ~bad & (nxt != d)
        a, d, cur = a[keep], d[keep], nxt[keep]
    if a.size:  # still walking after n hops: a loop
        found.append(np.stack([a, d], axis=1))
    if not found:
        return np.zeros((0, 2), dtype=np.int64)
    out = np.concatenate(found)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def allowed_ips_consistent(
    tables: RouteTables | IntArray, accept: RouteTables | IntArray | None = None
) -> bool:
    """True if every relayed packet would pass every relay's AllowedIPs check."""
    return bool(allowed_ips_violations(tables, accept).shape[0] == 0)
