"""The agent's local status file: what ``meshopt status`` reads when the broker is down.

The agent rewrites it atomically (a temporary file renamed over it) every
``metrics.status_interval_s`` and after every apply, in its ``state_dir`` as
``status-<mesh>-<node>.json``. It holds what the agent last wanted in the kernel (the
routes and rules of its last apply, i.e. the last route set after local fail-over),
the route set itself, the peers as the prober sees them and whether the broker is
connected. Reading it needs no MQTT and no running agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from meshopt.errors import InputError

if TYPE_CHECKING:
    from meshopt.agent.daemon import Agent
    from meshopt.install.model import DesiredRoute, DesiredRule

STATUS_VERSION = 1
MAX_STATUS_BYTES = 16 << 20  # 4096 routes and peers are ~1 MB


class StatusRoute(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A kernel route the agent installed (DesiredRoute's fields)."""

    dst: str
    oif: str
    table: int
    gateway: str | None = None
    metric: int = 0
    mtu: int | None = None
    advmss: int | None = None
    initcwnd: int | None = None
    initrwnd: int | None = None
    window: int | None = None
    congctl: str | None = None


class StatusRule(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A policy rule the agent installed (DesiredRule's fields)."""

    priority: int
    table: int
    family: int
    fwmark: int | None = None
    fwmask: int | None = None
    dport: tuple[int, int] | None = None
    ipproto: int | None = None
    tos: int | None = None


class StatusSetRoute(msgspec.Struct, kw_only=True, omit_defaults=True):
    dst: str
    via: str
    table: str = "fast"
    backup: str | None = None


class StatusRouteSet(msgspec.Struct, kw_only=True):
    version: int
    term: int
    controller: str
    issued_at: float
    routes: list[StatusSetRoute]


class StatusPeer(msgspec.Struct, kw_only=True):
    key: str
    interface: str
    endpoint: str | None = None
    alive: bool | None = None
    rtt_ms: float | None = None
    loss: float | None = None
    # How the prober probes the peer (meshopt.probe.budget): "in_use" or "idle", the
    # time between probes and after how long without a reply it is declared dead.
    probe_class: str | None = None
    probe_interval_s: float | None = None
    probe_dead_after_s: float | None = None


class AgentStatus(msgspec.Struct, kw_only=True):
    v: int = STATUS_VERSION
    mesh: str
    node: str
    pid: int
    written_at: float  # unix time
    started_at: float
    interval_s: float
    broker_connected: bool
    fast_table: int
    bulk_table: int
    applied: bool  # False until the agent installed a route set: kernel not compared
    running: bool = True  # False in the last file of a clean stop
    route_set: StatusRouteSet | None = None
    routes: list[StatusRoute] = msgspec.field(default_factory=list)
    rules: list[StatusRule] = msgspec.field(default_factory=list)
    failed_over: list[str] = msgspec.field(default_factory=list)  # "dst table"
    apply_errors: list[str] = msgspec.field(default_factory=list)  # what the kernel refused
    peers: list[StatusPeer] = msgspec.field(default_factory=list)


def status_path(state_dir: str | Path, mesh: str, node: str) -> Path:
    return Path(state_dir) / f"status-{mesh}-{node}.json"


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


class ApplyLock:
    """Held by the agent from changing the kernel until its status file says so.

    ``meshopt status`` holds it shared while it reads the file and dumps the kernel, so
    it never compares a half-applied kernel with the file of the apply before (which
    it once reported as a WRONG route). A reader holds it for milliseconds; the agent
    waits at most ``wait_s`` and then applies anyway: routes never wait for a reader.
    """

    def __init__(self, status: Path) -> None:
        self.path = lock_path(status)
        self._fd: int | None = None

    async def acquire(self, wait_s: float = 0.5) -> bool:
        if self._fd is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            except OSError:
                return False  # no state_dir: there is no status file to agree with either
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.005)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def reading(status: Path, wait_s: float = 2.0) -> Iterator[bool]:
    """The agent's apply lock, shared, while a reader looks at the file and the kernel.

    Yields whether it is held: False for an agent that never applied (no lock file),
    a reader without access to it, or an apply that took longer than ``wait_s``.
    """
    try:
        fd = os.open(lock_path(status), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.005)
        yield True
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _finite(x: float | None) -> float | None:
    return round(x, 3) if x is not None and x == x and abs(x) != float("inf") else None


def route_entry(r: DesiredRoute) -> StatusRoute:
    return StatusRoute(
        dst=r.dst,
        oif=r.oif,
        table=r.table,
        gateway=r.gateway,
        metric=r.metric,
        mtu=r.mtu,
        advmss=r.advmss,
        initcwnd=r.initcwnd,
        initrwnd=r.initrwnd,
        window=r.window,
        congctl=r.congctl,
    )


def rule_entry(r: DesiredRule) -> StatusRule:
    return StatusRule(
        priority=r.priority,
        table=r.table,
        family=r.family,
        fwmark=r.fwmark,
        fwmask=r.fwmask,
        dport=r.dport,
        ipproto=r.ipproto,
        tos=r.tos,
    )


def snapshot(agent: Agent, started_at: float) -> AgentStatus:
    """The agent's status now (no I/O)."""
    rs = agent.route_set
    withdrawn = not agent.running and agent.cfg.routes.withdraw_on_stop  # a clean stop
    peers = []
    for key, p in sorted(agent.tracker.peers.items(), key=lambda kv: (kv[1].ifname, kv[0])):
        stats = agent.prober.stats(key)
        rate = agent.prober.rate(key)
        peers.append(
            StatusPeer(
                key=key,
                interface=p.ifname,
                endpoint=p.endpoint,
                alive=agent.prober.alive(key),
                rtt_ms=_finite(stats.srtt_ms) if stats else None,
                loss=_finite(stats.loss) if stats and stats.sent else None,
                probe_class=rate.cls if rate else None,
                probe_interval_s=rate.interval_s if rate else None,
                probe_dead_after_s=rate.dead_after_s if rate else None,
            )
        )
    return AgentStatus(
        mesh=agent.cfg.mesh,
        node=agent.cfg.node,
        pid=os.getpid(),
        written_at=agent.wall(),
        started_at=started_at,
        interval_s=agent.cfg.metrics.status_interval_s,
        broker_connected=agent.bus.connected,
        fast_table=agent.cfg.routes.fast_table,
        bulk_table=agent.cfg.routes.bulk_table,
        applied=agent.applied,
        running=agent.running,
        route_set=None
        if rs is None
        else StatusRouteSet(
            version=rs.version,
            term=rs.term,
            controller=rs.controller,
            issued_at=rs.issued_at,
            routes=[
                StatusSetRoute(dst=r.dst, via=r.via, table=r.table, backup=r.backup)
                for r in rs.routes
            ],
        ),
        routes=[route_entry(r) for r in agent.installed],
        rules=[rule_entry(r) for r in agent.rules] if agent.applied and not withdrawn else [],
        failed_over=sorted(f"{dst} {table}" for dst, table in agent.failed_over),
        apply_errors=list(agent.apply_errors),
        peers=peers,
    )


def write_status(path: Path, status: AgentStatus) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(status))
    os.replace(tmp, path)


def read_status(path: Path) -> AgentStatus:
    """The status file, or InputError naming what is wrong with it (FileNotFoundError
    passes through: the caller decides what a missing agent means)."""
    with path.open("rb") as f:
        data = f.read(MAX_STATUS_BYTES + 1)
    if len(data) > MAX_STATUS_BYTES:
        raise InputError(f"{path}: larger than {MAX_STATUS_BYTES >> 20} MiB: not a status file")
    try:
        status = msgspec.json.decode(data, type=AgentStatus)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InputError(f"{path}: not an agent status file: {exc}") from None
    if status.v != STATUS_VERSION:
        raise InputError(
            f"{path}: status file version {status.v}, this meshopt reads {STATUS_VERSION}"
        )
    return status
