"""The agent runs on every node: it must load only what the base install (no extras) has.

The base install's size and the agent's RSS (issue 13: <= 60 MB each) depend on it:
numpy alone is ~15 MB of every agent's memory and scipy, networkx, matplotlib, scapy,
zstandard and pyfastcdc are extras a node does not install.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Everything the agent process loads: the command, the daemon and what it imports on
# its way (config check, PMTU helper process, metrics, reload) where those exist.
AGENT_CODE = r"""
import importlib, importlib.util, json, sys, click
import meshopt.cli.main as m
m.cli.get_command(click.Context(m.cli), 'agent')
for mod in ('meshopt.agent.daemon', 'meshopt.agent.config', 'meshopt.probe.pmtu',
            'meshopt.probe.icmp', 'meshopt.bus.client', 'meshopt.bus.signing',
            'meshopt.metrics', 'meshopt.metrics.agent', 'meshopt.metrics.server',
            'meshopt.metrics.statusfile', 'meshopt.reload'):
    if importlib.util.find_spec(mod.rpartition('.')[0] or mod) is None:
        continue
    if importlib.util.find_spec(mod) is not None:
        importlib.import_module(mod)
print(json.dumps(sorted({k.partition('.')[0] for k in sys.modules})))
"""


def _agent_top_modules() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", AGENT_CODE], capture_output=True, text=True, check=True, cwd=REPO
    )
    mods: list[str] = json.loads(out.stdout)
    return mods


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m is not None, req
    return _norm(m[1])


def _base_closure() -> set[str]:
    """The base dependencies of pyproject.toml and, installed, everything they require."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [_req_name(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_req_name(r) for r in reqs if "extra ==" not in r and "extra==" not in r]
    return seen


def test_agent_command_imports_no_scipy_networkx_or_matplotlib() -> None:
    mods = set(_agent_top_modules())
    heavy = {"numpy", "scipy", "networkx", "matplotlib", "scapy", "zstandard", "pyfastcdc"}
    assert sorted(mods & heavy) == []


def test_agent_imports_only_base_distributions() -> None:
    """Every third-party module the agent loads belongs to a base dependency (or theirs)."""
    owners = metadata.packages_distributions()
    allowed = _base_closure()
    outside = {}
    for mod in _agent_top_modules():
        if mod in sys.stdlib_module_names or mod in ("meshopt", "__main__", "__mp_main__"):
            continue
        if mod.startswith(("__editable__", "_distutils_hack")):
            continue  # the dev venv's editable install and setuptools' hook
        dists = {_norm(d) for d in owners.get(mod, [])}
        if dists and not dists & allowed:
            outside[mod] = sorted(dists)
    assert outside == {}, f"the agent imports modules of non-base distributions: {outside}"


def test_warm_up_tables_agree_with_the_simulator() -> None:
    """The agent's numpy-free tables are the simulator's (to a rounding of numpy's pow)."""
    from meshopt.probe import stats
    from meshopt.sim import estimator

    assert stats._TABLE == estimator._TABLE
    for half_life, interval in ((2.0, 0.33), (0.5, 0.1), (10.0, 1.0), (0.0, 0.33)):
        a = stats.alpha_for(half_life, interval)
        assert a == estimator.alpha_for(half_life, interval)
        share, gain = stats._warm_up_tables(a)
        np_share, np_gain = estimator._warm_up_tables(a)
        assert len(share) == len(np_share) == stats._TABLE
        for x, y in zip([*share, *gain], [*np_share.tolist(), *np_gain.tolist()], strict=True):
            assert math.isclose(x, y, rel_tol=1e-13, abs_tol=1e-300), (a, x, y)


@pytest.mark.parametrize("v6", [False, True])
@pytest.mark.parametrize("size", [0, 1, 7, 64, 1452])
def test_echo_requests_are_the_bytes_scapy_builds(v6: bool, size: int) -> None:
    scapy_inet = pytest.importorskip("scapy.layers.inet")
    from scapy.layers.inet6 import ICMPv6EchoRequest
    from scapy.packet import Raw

    from meshopt.probe.icmp import echo_request

    payload = os.urandom(size)
    for ident, seq in ((0, 0), (0xFFFF, 0xFFFF), (0x1234, 7)):
        if v6:
            want = bytes(ICMPv6EchoRequest(id=ident, seq=seq, cksum=0, data=payload))
        else:
            want = bytes(scapy_inet.ICMP(type=8, code=0, id=ident, seq=seq) / Raw(payload))
        assert echo_request(v6, ident, seq, payload) == want
