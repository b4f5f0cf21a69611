"""The urgent path's per-node route-list patch and key lookup (issue 15: a dead relay
at N = 1000 patches ~650 lists of 2000 routes): the comprehension-based ``_patched``
gives what the loop it replaced gave, and ``_Base.key_for`` keeps the last key per
peer index and no unusable (negative) index."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.bus.messages import Route
from meshopt.controller.core import _Base, _patched
from meshopt.wireguard.keys import generate_keypair

KEYS = [generate_keypair()[1] for _ in range(4)]
DSTS = [f"10.0.0.{i}/32" for i in range(6)]


def reference(
    old: list[Route], fast: dict[str, Route | None], bulk: dict[str, Route | None]
) -> list[Route]:
    """The loop ``_patched`` was before."""
    out: list[Route] = []
    seen: set[tuple[str, str]] = set()
    for r in old:
        patch = fast if r.table == "fast" else bulk
        if r.dst in patch:
            seen.add((r.table, r.dst))
            new = patch[r.dst]
            if new is not None:
                out.append(new)
        else:
            out.append(r)
    for table, patch in (("fast", fast), ("bulk", bulk)):
        for dst, new in patch.items():
            if (table, dst) not in seen and new is not None:
                out.append(new)
    return out


ROUTE = st.builds(
    Route,
    dst=st.sampled_from(DSTS),
    via=st.sampled_from(KEYS),
    table=st.sampled_from(["fast", "bulk"]),
)
PATCH = st.dictionaries(st.sampled_from(DSTS), st.none() | ROUTE, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(ROUTE, max_size=10), PATCH, PATCH)
def test_patched_is_the_loop_it_replaced(
    old: list[Route], fast: dict[str, Route | None], bulk: dict[str, Route | None]
) -> None:
    assert _patched(old, fast, bulk) == reference(old, fast, bulk)


def test_patched_replaces_drops_and_appends_in_order() -> None:
    a, b, c = (Route(dst=d, via=KEYS[0]) for d in DSTS[:3])
    ab = Route(dst=DSTS[0], via=KEYS[1], table="bulk")
    new_a = Route(dst=DSTS[0], via=KEYS[2])
    d = Route(dst=DSTS[3], via=KEYS[3])
    old = [a, ab, b, c]
    assert _patched(old, {DSTS[0]: new_a, DSTS[1]: None, DSTS[3]: d}, {}) == [new_a, ab, c, d]
    assert _patched(old, {}, {DSTS[0]: None}) == [a, b, c]
    assert _patched(old, {}, {}) == old


def test_key_for_keeps_the_last_key_per_index_and_no_negative_one() -> None:
    base = _Base(
        names=["n0", "n1"],
        index={"n0": 0, "n1": 1},
        next_hop=np.zeros((2, 2), dtype=np.int64),
        cost=np.zeros((2, 2)),
        noise=np.zeros((2, 2)),
        dead=np.zeros(2, dtype=bool),
        backup=None,
        bulk=None,
        best=None,
        dist=None,
        peers={"n0": (KEYS[:4], np.array([1, -1, 1, 5]))},
        addresses={},
    )
    assert base.key_for(0) == {1: KEYS[2], 5: KEYS[3]}
    assert base.key_for(1) == {}
