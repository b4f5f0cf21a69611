"""Every agent's telemetry as the broker carries it, recorded beside a lab run.

The twin benchmark reads what the agents measured through the lab's tunnels (an RTT a
little above the topology's, a little more spread) to tell the simulator; tests read
it to see what an agent reported. mosquitto_sub runs as the lab's read-only identity and
writes to a file (a pipe nobody reads fills up, and the broker then drops the
subscriber); :meth:`TelemetryTap.stop` ends it by its PID.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from meshopt.bus.messages import PeerReport, decode_telemetry
from meshopt.bus.signing import unsigned_payload
from meshopt.errors import MeshoptError
from meshopt.lab.lab import Lab
from meshopt.lab.state import lab_dir


@dataclass(frozen=True)
class Heard:
    """One peer report: ``at`` is wall-clock time (s) the tap received it."""

    at: float
    node: str
    peer: str  # the peer's node name ("?" for a key no node of the lab has)
    report: PeerReport


class TelemetryTap:
    def __init__(self, lab: Lab, path: Path | None = None) -> None:
        self.lab = lab
        self.path = path or lab_dir(lab.plan.lab_id) / "telemetry.tap"
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None

    def start(self) -> TelemetryTap:
        topic = f"meshopt/{self.lab.plan.name}/telemetry/+"
        self._out = self.path.open("wb")
        argv = ["stdbuf", "-oL", "mosquitto_sub", *self.lab.mosquitto_cli_args()]
        argv += ["-t", topic, "-F", "%U %x"]  # receive time, payload in hex: one line each
        self._proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.DEVNULL)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._out is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> TelemetryTap:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def heard(
        self, owner: dict[str, str], since: float = 0.0, until: float = math.inf
    ) -> list[Heard]:
        """Every peer report received from ``since`` to ``until`` (wall clock); ``owner`` maps
        WireGuard keys to node names (``LiveMesh.key_owner``). A message that does not
        decode (cut off when the tap stopped) is skipped."""
        out: list[Heard] = []
        for line in self.path.read_bytes().splitlines():
            at_text, _, payload = line.partition(b" ")
            try:
                at = float(at_text)
                if not since <= at <= until:
                    continue
                t = decode_telemetry(unsigned_payload(bytes.fromhex(payload.decode()), "telemetry"))
            except (ValueError, MeshoptError):
                continue
            out.extend(Heard(at, t.node, owner.get(p.public_key, "?"), p) for p in t.reports())
        return out
