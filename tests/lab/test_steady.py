"""A mesh at rest stays at rest: lab4 with jitter, for minutes, through whole-machine
stalls (issue 14 item 7).

Every process of the lab (agents, wireguard-go, the emulator that is the network, the
broker and the controller) is stopped together for 1.5-3 s, five times: what a VM that
loses its CPU does to a real mesh, and what CI's busy machines did to earlier lab tests.
Nothing failed in the mesh, so no agent may declare a peer dead or fail over, and the
routes read from the nodes' kernels may not move: the stalled processes must not read
their own silence as their peers'.

The jitter is a standard deviation of 1 ms on every link (20 % of the 5 ms ones), the
noise the policy's margins and noise test exist for.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from meshopt.lab import procs
from meshopt.lab.agents import agent_log
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh, wait_until

from .conftest import EXAMPLES, new_lab_id
from .tools import need_tools

STALLS_S = [1.5, 2.0, 1.5, 3.0, 1.5]
GAP_S = 20.0  # between stalls: routes are read from the kernels every second meanwhile
# Next-hop changes allowed over the whole run, all pairs together (12 directed pairs,
# ~2 minutes): the goal is at most 1 change per pair per hour.
MAX_CHANGES = 1


STARTUP_S = 15.0


def _on_optimum(hops: dict[str, dict[str, str]]) -> bool:
    """Every pair direct but n1 <-> n4, which relays through n2 (34 ms against 80 ms;
    n1-n3's 30 ms ties with n1-n2-n3, and the direct path has the fewer hops)."""
    want = {("n1", "n4"): ["n1", "n2", "n4"], ("n4", "n1"): ["n4", "n2", "n1"]}
    return LiveMesh.direct_but(hops, want)


def _count(lab: Lab, pattern: str) -> int:
    return sum(len(re.findall(pattern, agent_log(lab, n))) for n in lab.topo.names)


def test_a_mesh_at_rest_stays_at_rest_through_stalls(lab_ok: None, tmp_path: Path) -> None:
    need_tools("mosquitto", "wireguard-go", "wg", "ip")
    topo = tmp_path / "lab4-jitter.yaml"
    text = (EXAMPLES / "lab4.yaml").read_text()
    assert "jitter: 0.2ms" in text
    topo.write_text(text.replace("jitter: 0.2ms", "jitter: 1ms"))
    lab = Lab.up(str(topo), name=new_lab_id(), underlay="emulator")
    # The controller's start-up phase takes small gains after a short hold: the mesh is
    # not at rest until it ends, so it is shortened here and waited out.
    live = LiveMesh(lab, controller_settings={"startup_s": STARTUP_S})
    try:
        started = time.monotonic()
        live.start()
        settled = wait_until(lambda: _on_optimum(live.next_hops()), 60, interval=0.5)
        assert settled is not None, f"never every pair on its optimum:\n{live.logs()}"
        # The phase counts from the first telemetry (~3 s after the agents start).
        time.sleep(max(0.0, started + STARTUP_S + 5.0 - time.monotonic()))
        assert _on_optimum(live.next_hops()), live.logs()
        dead, failovers = _count(lab, r"peer \S+ DEAD"), _count(lab, r"fail-over ")
        hops = live.next_hops()
        changes: list[tuple[float, str, str, str, str]] = []
        t0 = time.monotonic()

        def sample() -> None:
            nonlocal hops
            now = live.next_hops()
            for src, row in now.items():
                for dst, via in row.items():
                    if hops[src].get(dst) != via:
                        changes.append(
                            (time.monotonic() - t0, src, dst, hops[src].get(dst, "?"), via)
                        )
            hops = now

        stalled_total = 0
        for seconds in STALLS_S:
            end = time.monotonic() + GAP_S
            while time.monotonic() < end:
                time.sleep(1.0)
                sample()
            pids = list(procs.tagged_pids(lab.plan.lab_id))
            stalled = lab.stall("n1", seconds, pids=pids)
            # agents, wireguard-go, the emulator, the broker and the controller
            assert len(stalled) >= 2 * len(lab.topo.names) + 3, stalled
            stalled_total += 1
        end = time.monotonic() + GAP_S
        while time.monotonic() < end:
            time.sleep(1.0)
            sample()

        assert stalled_total == len(STALLS_S)
        report = f"changes (t, src, dst, from, to): {changes}\n{live.logs()}"
        assert _count(lab, r"peer \S+ DEAD") == dead, report
        assert _count(lab, r"fail-over ") == failovers, report
        assert len(changes) <= MAX_CHANGES, report
        # Every agent saw each stall as its own (the prober's stall credit).
        woke = {n: len(re.findall(r"woke \S+ s late", agent_log(lab, n))) for n in lab.topo.names}
        assert all(k >= len(STALLS_S) for k in woke.values()), woke
    finally:
        live.stop()
        lab.down()
