"""Paths through a snapshot of a lab's next hops (meshopt.lab.mesh.LiveMesh)."""

from __future__ import annotations

from meshopt.lab.mesh import LiveMesh

# a <-> b through c; the rest direct.
HOPS = {
    "a": {"b": "c", "c": "c", "d": "d"},
    "b": {"a": "c", "c": "c", "d": "d"},
    "c": {"a": "a", "b": "b", "d": "d"},
    "d": {"a": "a", "b": "b", "c": "c"},
}
RELAYED = {("a", "b"): ["a", "c", "b"], ("b", "a"): ["b", "c", "a"]}


def test_paths_follow_each_hops_own_next_hop_and_end_in_a_mark_at_a_loop() -> None:
    assert LiveMesh.path_from(HOPS, "a", "b") == ["a", "c", "b"]
    looped = {**HOPS, "c": {**HOPS["c"], "b": "a"}}
    assert LiveMesh.path_from(looped, "a", "b") == ["a", "c", "?"]
    assert LiveMesh.path_from({**HOPS, "c": {}}, "a", "b") == ["a", "c", "?"]


def test_direct_but_holds_only_when_every_other_pair_is_on_its_own_tunnel() -> None:
    assert LiveMesh.direct_but(HOPS, RELAYED)
    assert not LiveMesh.direct_but(HOPS, {})  # a <-> b relays
    d_via_a = {**HOPS, "d": {**HOPS["d"], "b": "a"}}
    assert not LiveMesh.direct_but(d_via_a, RELAYED)
    direct = {**HOPS, "a": {**HOPS["a"], "b": "b"}, "b": {**HOPS["b"], "a": "a"}}
    assert not LiveMesh.direct_but(direct, RELAYED)
