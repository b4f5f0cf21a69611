"""The gate that holds a full pass while the daemon's loop has urgent route sets."""

from __future__ import annotations

import threading
import time

import numpy as np

from meshopt.controller.engine import Computed, RouteEngine
from meshopt.controller.gate import PassGate
from meshopt.policy import PolicyConfig
from tests.unit.test_controller_engine import TRIANGLE, Mesh


def test_an_open_gate_lets_the_pass_through_at_once() -> None:
    gate = PassGate()
    t = time.monotonic()
    for _ in range(1000):
        gate.checkpoint()
    assert time.monotonic() - t < 0.5
    assert gate.holds == 0 and gate.held_s == 0.0


def test_a_held_pass_waits_until_the_loop_releases_it() -> None:
    gate = PassGate()
    gate.hold()
    done = threading.Event()

    def work() -> None:
        gate.checkpoint()
        done.set()

    th = threading.Thread(target=work)
    th.start()
    assert not done.wait(0.3), "the pass went on while held"
    gate.release()
    assert done.wait(5.0)
    th.join()
    assert gate.holds == 1 and gate.held_this_pass_s >= 0.3


def test_a_pass_waits_at_most_max_hold_in_all() -> None:
    gate = PassGate(max_hold_s=0.2)
    gate.hold()  # never released: a loop that cannot send
    t = time.monotonic()
    for _ in range(50):
        gate.checkpoint()
    spent = time.monotonic() - t
    assert 0.2 <= spent < 1.0
    gate.begin_pass()  # the next pass may wait again
    t = time.monotonic()
    gate.checkpoint()
    assert time.monotonic() - t >= 0.2


def test_the_engine_stops_at_checkpoints_between_steps_and_rows() -> None:
    mesh = Mesh("abcdef")
    links = {**TRIANGLE}
    for x in "abcdef":
        for y in "abcdef":
            if x != y and (x, y) not in links:
                links[(x, y)] = 30.0 + 5 * abs(ord(x) - ord(y))
    mesh.report(links, 0.0)
    free = RouteEngine(PolicyConfig(), bulk=True).compute(mesh.view, 0.0)

    engine = RouteEngine(PolicyConfig(), bulk=True)
    gate = PassGate()
    calls = 0

    def counted() -> None:
        nonlocal calls
        calls += 1
        gate.checkpoint()

    engine.checkpoint = counted
    gate.hold()
    out: list[Computed] = []
    th = threading.Thread(target=lambda: out.append(engine.compute(mesh.view, 0.0)))
    th.start()
    time.sleep(0.3)
    assert not out and calls == 1, "held at the first checkpoint"
    gate.release()
    th.join(10.0)
    assert out
    c = out[0]
    assert calls >= 6 + 3  # every row, and the steps between
    assert np.array_equal(c.decision.installed.next_hop, free.decision.installed.next_hop)
    assert c.routes == free.routes
