"""What a running lab is made of, on disk: ``/run/meshopt/labs/<id>/state.json``.

``lab up`` writes the state before it creates anything and updates it as it goes, so
``lab down`` (and a failed ``lab up`` rolling back, and ``lab down --all`` after a
crash) knows exactly which namespaces and processes are the lab's. ``/run`` is a
tmpfs: after a reboot the namespaces and processes are gone, and so is the state.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec

from meshopt.errors import MeshoptError, UnavailableError

LABS_ROOT = Path(os.environ.get("MESHOPT_LAB_ROOT", "/run/meshopt/labs"))


class LabError(MeshoptError):
    """A lab operation that cannot be done; one line for the user."""


class LabNotRunning(LabError, UnavailableError):
    """No such lab is up: the service is unavailable (exit 3), not bad input."""


class ProcState(msgspec.Struct):
    role: str  # "emulator", "broker", "wg:<ifname>", or what a user started
    pid: int
    netns: str | None = None
    log: str | None = None


class WgState(msgspec.Struct):
    ifname: str
    node: str
    netns: str
    port: int
    private_key: str  # base64
    public_key: str  # base64
    peers: list[str]  # node names, same order as peer_ports
    peer_ports: list[int]


class LabState(msgspec.Struct):
    id: str
    name: str
    topology: str  # the topology as loaded, saved as YAML in the lab's directory
    source: str  # what the user gave to ``lab up``
    layout: str
    underlay: str  # "emulator" or "netem"
    wireguard: str  # "userspace" or "kernel"
    created: float
    phase: str = "building"  # "building" -> "up"; "tearing-down"
    netns: list[str] = msgspec.field(default_factory=list)  # created so far
    procs: list[ProcState] = msgspec.field(default_factory=list)
    wg: list[WgState] = msgspec.field(default_factory=list)
    # link loss before ``lab set a-b down``, to restore on ``up``: "a->b" -> loss
    saved_loss: dict[str, float] = msgspec.field(default_factory=dict)
    build_s: float | None = None
    # "secure": TLS, a password and certificate per identity, an ACL (the default);
    # "insecure": anonymous, plain MQTT (--insecure-broker, for debugging); "none".
    broker_mode: str = "insecure"  # what labs made before the mode existed ran
    # µs the emulator takes off each tunnel hop, as calibrated at ``up`` (None: not done)
    tunnel_latency_us: float | None = None
    # The emulator's random draws (jitter, loss, spikes) per link follow this seed: a lab
    # rebuilt with the same one draws the same sequence, runs meant as independent
    # samples (a benchmark's repeats) take different ones.
    seed: int = 1

    def pid_of(self, role: str) -> int | None:
        for p in self.procs:
            if p.role == role:
                return p.pid
        return None


def lab_dir(lab_id: str) -> Path:
    return LABS_ROOT / lab_id


def save(state: LabState) -> None:
    """Write atomically: a reader never sees half a file."""
    path = lab_dir(state.id) / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    os.replace(tmp, path)


def load(lab_id: str) -> LabState:
    path = lab_dir(lab_id) / "state.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=LabState)
    except FileNotFoundError:
        raise LabNotRunning(f"no lab with id {lab_id}") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise LabError(f"{path}: unreadable lab state: {exc}") from None


def all_labs() -> list[LabState]:
    """Every lab with a readable state file, oldest first."""
    labs = []
    if LABS_ROOT.is_dir():
        for entry in LABS_ROOT.iterdir():
            if (entry / "state.json").is_file():
                with contextlib.suppress(LabError):
                    labs.append(load(entry.name))
    return sorted(labs, key=lambda s: s.created)


def find(name_or_id: str) -> LabState:
    """The lab called ``name_or_id`` (or with that id)."""
    labs = all_labs()
    for s in labs:
        if name_or_id in (s.name, s.id):
            return s
    running = ", ".join(s.name for s in labs) or "none"
    raise LabNotRunning(f"no lab named {name_or_id!r} (running: {running})")


@contextlib.contextmanager
def registry_lock() -> Iterator[None]:
    """Serialise lab creation so two ``lab up`` cannot take the same name."""
    LABS_ROOT.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(LABS_ROOT / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
