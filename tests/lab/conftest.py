"""Fixtures for lab tests: namespaces per node and an emulated underlay between them.

Everything a test creates carries this run's id (namespace names, interface names, the
lab id of the emulator and its run directory), processes are ended by their PID, and a
session fixture checks that ``ip netns list`` is left exactly as it was found.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from meshopt.lab.emulator import (
    EmulatorClient,
    EmulatorSpec,
    NodeSpec,
    start_emulator,
    stop_emulator,
    tun_name,
    write_spec,
)
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import LiveMesh
from meshopt.lab.netns import create_netns, delete_netns, list_netns, netns_exists
from meshopt.lab.procs import tagged_pids

from .tools import lab_required, need_tools

__all__ = ["Lab", "need_tools"]

RUN_ID = uuid.uuid4().hex[:4]  # in every name this test run creates
RUN_ROOT = Path("/run/meshopt")
EXAMPLES = Path(__file__).resolve().parents[2] / "topologies"
_counter = itertools.count()

Matrix = Sequence[Sequence[float | None]]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test on a live mesh carries the mesh's state in its report: CI keeps
    only the output, and a failure that comes once in a few runs must be explained
    from it."""
    report = yield
    if report.when == "call" and report.failed:
        funcargs = getattr(item, "funcargs", {})
        for value in funcargs.values():
            if isinstance(value, LiveMesh):
                report.sections.append(("live mesh at the failure", value.diagnose()))
                break
    return report


def _lab_unavailable() -> str | None:
    """Why lab tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "lab tests need root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "lab tests need /dev/net/tun"
    if shutil.which("ip") is None:
        return "lab tests need the ip command (iproute2)"
    probe = f"mo{RUN_ID}probe"
    try:
        create_netns(probe)
        delete_netns(probe)
    except Exception as exc:
        return f"ip netns does not work here: {exc}"
    return None


@pytest.fixture(scope="session")
def lab_ok() -> None:
    """Skip (with the reason) where namespaces or TUN devices are unavailable.

    With ``MESHOPT_REQUIRE_LAB=1`` (CI sets it) that is a failure instead: a machine that
    should run the lab tests must not pass by skipping them.
    """
    reason = _lab_unavailable()
    if reason:
        if lab_required():
            pytest.fail(f"MESHOPT_REQUIRE_LAB=1 but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session", autouse=True)
def netns_left_as_found() -> Iterator[None]:
    """Every lab test session must leave the namespaces and lab processes as it found them.

    ``MESHOPT_LAB_SHARED=1`` turns the check off where other lab runs share the machine
    (parallel development); CI runs alone and keeps it on.
    """
    if os.environ.get("MESHOPT_LAB_SHARED") == "1":
        yield
        return
    before = list_netns()
    procs_before = set(tagged_pids())
    yield
    after = list_netns()
    assert after == before, (
        f"namespaces changed: +{set(after) - set(before)} -{set(before) - set(after)}"
    )
    left = {pid: tag for pid, tag in tagged_pids().items() if pid not in procs_before}
    assert not left, f"lab processes left running: {left}"


def new_lab_id() -> str:
    """A lab id unique to this run and fixture instance (short: it goes in ifnames)."""
    return f"t{RUN_ID}{next(_counter)}"


@pytest.fixture
def make_netns(lab_ok: None) -> Iterator[Callable[[str, int], list[str]]]:
    """``make_netns(lab, n)``: n fresh namespaces named ``mo<lab>n<i>``, removed after."""
    created: list[str] = []

    def make(lab: str, n: int) -> list[str]:
        names = [f"mo{lab}n{i}" for i in range(n)]
        for name in names:
            create_netns(name)
            created.append(name)
        return names

    yield make
    for name in reversed(created):
        if netns_exists(name):
            delete_netns(name)


@dataclass
class Underlay:
    """A running emulator and the namespaces it connects."""

    lab: str
    spec: EmulatorSpec
    spec_path: Path
    proc: subprocess.Popen[bytes]
    client: EmulatorClient
    netns: list[str]
    addresses: list[str]  # without prefix length
    ifnames: list[str]
    addresses6: list[str] = field(default_factory=list)
    children: list[subprocess.Popen[Any]] = field(default_factory=list)

    def ns(self, i: int) -> str:
        return self.netns[i]


def _matrix(value: float | Matrix | None, n: int, diagonal: float | None) -> list[list[Any]]:
    if isinstance(value, (int, float)) or value is None:
        return [[diagonal if i == j else value for j in range(n)] for i in range(n)]
    return [list(row) for row in value]


class UnderlayFactory:
    """Starts underlays and tears every one of them down (emulator first, by PID)."""

    def __init__(self, make_netns: Callable[[str, int], list[str]]) -> None:
        self._make_netns = make_netns
        self._made: list[Underlay] = []

    def __call__(
        self,
        n: int,
        *,
        delay_ms: float | Matrix = 0.0,
        jitter_ms: float | Matrix = 0.0,
        loss: float | Matrix = 0.0,
        rate_mbit: float | Matrix | None = None,
        seed: int = 1,
        mtu: int = 1500,
        ipv6: bool = False,
    ) -> Underlay:
        lab = new_lab_id()
        netns = self._make_netns(lab, n)
        run_dir = RUN_ROOT / lab
        run_dir.mkdir(parents=True, mode=0o700)
        addresses = [f"172.31.0.{i + 1}" for i in range(n)]
        addresses6 = [f"fd00:31::{i + 1}" for i in range(n)] if ipv6 else []
        ifnames = [tun_name(lab, i) for i in range(n)]
        spec = EmulatorSpec(
            lab=lab,
            control=str(run_dir / "emu.sock"),
            nodes=[
                NodeSpec(
                    name=f"n{i}",
                    netns=netns[i],
                    ifname=ifnames[i],
                    address=f"{addresses[i]}/16",
                    address6=f"{addresses6[i]}/64" if ipv6 else None,
                )
                for i in range(n)
            ],
            delay_ms=_matrix(delay_ms, n, 0.0),
            jitter_ms=_matrix(jitter_ms, n, 0.0),
            loss=_matrix(loss, n, 0.0),
            rate_mbit=_matrix(rate_mbit, n, None),
            seed=seed,
            mtu=mtu,
        )
        spec_path = run_dir / "emu.json"
        try:
            write_spec(spec, spec_path)
            proc = start_emulator(spec_path, timeout=30.0)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        underlay = Underlay(
            lab=lab,
            spec=spec,
            spec_path=spec_path,
            proc=proc,
            client=EmulatorClient(spec.control),
            netns=netns,
            addresses=addresses,
            ifnames=ifnames,
            addresses6=addresses6,
        )
        self._made.append(underlay)
        return underlay

    def close(self) -> None:
        for u in reversed(self._made):
            for child in u.children:  # helpers a test started (iperf3 ...), by PID
                if child.poll() is None:
                    child.kill()
                    child.wait()
            u.client.close()
            stop_emulator(u.proc)
            shutil.rmtree(u.spec_path.parent, ignore_errors=True)
        self._made.clear()


@pytest.fixture
def underlay_factory(
    make_netns: Callable[[str, int], list[str]],
) -> Iterator[UnderlayFactory]:
    """``underlay_factory(n, delay_ms=..., ...)`` starts an emulated underlay of n nodes."""
    factory = UnderlayFactory(make_netns)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def shared_underlay(lab_ok: None) -> Iterator[Underlay]:
    """One 3-node underlay for a module's tests (they set the parameters they need)."""
    created: list[str] = []

    def make(lab: str, n: int) -> list[str]:
        names = [f"mo{lab}n{i}" for i in range(n)]
        for name in names:
            create_netns(name)
            created.append(name)
        return names

    factory = UnderlayFactory(make)
    try:
        yield factory(3)
    finally:
        factory.close()
        for name in reversed(created):
            if netns_exists(name):
                delete_netns(name)


LabMaker = Callable[..., Lab]


def _lab_name() -> str:
    return f"t{RUN_ID}{next(_counter)}"


@pytest.fixture
def make_lab(lab_ok: None) -> Iterator[LabMaker]:
    """``make_lab("topologies/lab4.yaml", layout=...)``: a running lab, removed after the test.

    Takes what ``Lab.up`` takes (a topology file, a generator spec or a Topology); the
    lab gets a name unique to this test run unless one is given.
    """
    made: list[Lab] = []

    def make(topology: Any, **kwargs: Any) -> Lab:
        kwargs.setdefault("name", _lab_name())
        lab = Lab.up(topology, **kwargs)
        made.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in reversed(made):
            lab.down()


@pytest.fixture(scope="module")
def lab4(lab_ok: None) -> Iterator[Lab]:
    """One lab of topologies/lab4.yaml for a module's tests (restore what you change)."""
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=_lab_name())
    try:
        yield lab
    finally:
        lab.down()
