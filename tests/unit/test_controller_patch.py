"""The urgent path's per-node route-list patch and key lookup (issue 15: a dead relay
at N = 1000 patches ~650 lists of 2000 routes): the comprehension-based ``_patched``
gives what the loop it replaced gave, and ``_Base.key_for`` keeps the last key per
peer index and no unusable (negative) index."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshopt.bus.messages import Route
from meshopt.controller.core import _Base, _patched, _patched_at
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


@st.composite
def laid_out(draw: st.DrawFn) -> tuple[list[Route], np.ndarray]:
    """A route list as the engine lays it out: by destination, each destination's fast
    routes then its bulk routes (one per prefix and table), some destinations empty."""
    routes: list[Route] = []
    off = [0]
    prefixes = {0: DSTS[0:2], 1: DSTS[2:3], 2: DSTS[3:4], 3: DSTS[4:6]}
    for d in range(4):
        if draw(st.booleans()):
            for dst in prefixes[d]:
                routes.append(Route(dst=dst, via=draw(st.sampled_from(KEYS))))
            if draw(st.booleans()):
                for dst in prefixes[d]:
                    routes.append(Route(dst=dst, via=draw(st.sampled_from(KEYS)), table="bulk"))
        off.append(len(routes))
    return routes, np.array(off, dtype=np.int32)


@settings(max_examples=400, deadline=None)
@given(laid_out(), PATCH, PATCH, st.sets(st.integers(0, 3)))
def test_patched_at_is_patched_where_it_answers(
    lay: tuple[list[Route], np.ndarray],
    fast: dict[str, Route | None],
    bulk: dict[str, Route | None],
    dests: set[int],
) -> None:
    """Reading only the moved destinations' routes gives what ``_patched`` gives, or
    None (then ``_patched`` runs): never a different list."""
    old, off = lay
    owner = {dst: d for d, ps in enumerate([DSTS[0:2], DSTS[2:3], DSTS[3:4], DSTS[4:6]])
             for dst in ps}  # fmt: skip
    dests = dests | {owner[p] for p in [*fast, *bulk]}  # the plan names every one it moves
    got = _patched_at(old, off, dests, fast, bulk)
    if got is not None:
        assert got == _patched(old, fast, bulk)
    elif all(
        any(r.dst == p and r.table == t for r in old)
        for t, patch in (("fast", fast), ("bulk", bulk))
        for p in patch
    ):
        raise AssertionError("every patched route was there: it should have answered")
