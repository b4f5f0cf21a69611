"""The gate a full pass waits at while urgent route sets wait on the daemon's loop.

At 1000 nodes a full pass runs for many seconds in a worker thread, and its Python
(route building, bulk settings) takes half the GIL from the loop, which meanwhile
plans, signs and sends the sets that route around a dead node: a death reached the
median affected node in 5.5 s, twice the CPU the loop needed. The pass now stops at
its next checkpoint (between its steps and its rows, a few ms apart) while the loop
has urgent work, for at most ``max_hold_s`` per pass, so a loop that cannot send (no
lease, a slow broker) delays the pass but never stalls it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MAX_HOLD_S = 10.0


class PassGate:
    def __init__(
        self, max_hold_s: float = MAX_HOLD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_hold_s = max_hold_s
        self.clock = clock
        self._open = threading.Event()
        self._open.set()
        self._held = 0.0  # this pass's time at the gate
        self.held_s = 0.0  # all passes', for metrics and logs
        self.holds = 0

    def begin_pass(self) -> None:
        self._held = 0.0

    def hold(self) -> None:
        """The loop has urgent work: passes stop at their next checkpoint."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def held_this_pass_s(self) -> float:
        return self._held

    @property
    def holding(self) -> bool:
        return not self._open.is_set()

    def checkpoint(self) -> None:
        """In the pass's thread: wait while held, up to what is left of ``max_hold_s``."""
        if self._open.is_set():
            return
        left = self.max_hold_s - self._held
        if left <= 0:
            return
        t = self.clock()
        self._open.wait(left)
        waited = self.clock() - t
        self._held += waited
        self.held_s += waited
        self.holds += 1
