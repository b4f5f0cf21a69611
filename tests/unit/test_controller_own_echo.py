"""The controller knows the echoes of its own route sets without verifying them, also
an echo that arrives after the node's next set was signed (issue 15: at 1000 nodes each
such echo cost ~5 ms of the loop in a full verification)."""

from __future__ import annotations

import dataclasses
import time

import pytest

import meshopt.controller.core as core_mod
from meshopt.bench.synthetic import SyntheticMesh
from tests.unit.test_engine_route_sharing import _fed


def test_echoes_of_our_recent_sets_are_taken_unverified_and_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, _ = _fed(SyntheticMesh(8, 1), 1)
    planned = core.plan(time.monotonic(), time.time())
    a = planned[0]
    assert a.node is not None
    first = core.sign_routes(a, time.time())
    second = core.sign_routes(dataclasses.replace(a, routes=a.routes[:-1]), time.time())
    assert first is not None and second is not None and first.payload != second.payload
    tampered = bytearray(first.payload)
    tampered[len(tampered) // 2] ^= 1

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("our own echo was verified")

    with monkeypatch.context() as m:
        m.setattr(core_mod, "verify_route_set", refuse)
        core.on_message(a.topic, first.payload, True, time.monotonic(), time.time())
        v1 = core.retained_sets[a.node].version
        core.on_message(a.topic, second.payload, True, time.monotonic(), time.time())
        v2 = core.retained_sets[a.node].version
        core.on_message(a.topic, first.payload, True, time.monotonic(), time.time())
    assert v2 > v1 and core.retained_sets[a.node].version == v2  # an older echo: no step back
    before = sum(core.dropped().values())
    core.on_message(a.topic, bytes(tampered), True, time.monotonic(), time.time())
    assert sum(core.dropped().values()) == before + 1  # not ours: verified, and refused


def test_a_set_the_broker_took_is_retained_without_its_echo() -> None:
    """With No Local the broker sends none of our sets back: its acknowledgement tells
    what it retained (what agents get, what a take-over adopts)."""
    core, _ = _fed(SyntheticMesh(6, 2), 2)
    a = core.plan(time.monotonic(), time.time())[0]
    assert a.node is not None
    signed = core.sign_routes(a, time.time())
    assert signed is not None and a.node not in core.retained_sets
    core.published_ok(signed, False, time.monotonic())
    assert a.node not in core.retained_sets  # not taken: nothing retained
    core.published_ok(signed, True, time.monotonic())
    assert core.retained_sets[a.node].routes == list(a.routes)
