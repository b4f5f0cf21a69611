"""The simulator's probe budget (meshopt.sim.budget): idle links on their phase."""

from __future__ import annotations

import numpy as np

from meshopt.probe.budget import BudgetConfig
from meshopt.sim.budget import LinkBudget


def test_an_idle_link_is_due_on_its_phase_and_its_two_ends_a_second_apart() -> None:
    """As the agents (meshopt.agent.peers.idle_phase): each direction of a tunnel is
    probed idle at its own share of the interval on the wall clock, half an interval
    from the other's; without phases, one interval after the last probe."""
    n = 4
    tunnel = ~np.eye(n, dtype=bool)
    budget = LinkBudget.start(BudgetConfig(), tunnel, np.random.default_rng(7))
    assert budget.phase is not None
    assert np.allclose((budget.phase - budget.phase.T) % 1.0, 0.5 * tunnel)
    budget.settle_until[:] = -np.inf  # every link idle
    budget.classify(100.0)
    assert not budget.in_use.any() and np.allclose(budget.idle_s, 2.0)
    sent = np.zeros((n, n), dtype=bool)
    sent[0, 1] = sent[1, 0] = True
    budget.sent(sent, 100.0)
    due = budget.next_idle
    for i, j in ((0, 1), (1, 0)):
        assert 101.0 <= due[i, j] < 103.0  # at least half an interval on
        on = ((due[i, j] + budget.wall0) / 2.0 - budget.phase[i, j]) % 1.0
        assert min(on, 1.0 - on) < 1e-9
    assert abs(abs(due[0, 1] - due[1, 0]) - 1.0) < 1e-9
    plain = LinkBudget.start(BudgetConfig(), tunnel)
    plain.settle_until[:] = -np.inf
    plain.classify(100.0)
    plain.sent(sent, 100.0)
    assert plain.next_idle[0, 1] == plain.next_idle[1, 0] == 102.0
