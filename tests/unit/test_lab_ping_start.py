"""The outage pinger is timed from its first reply, with a real ping on loopback.

A ping that starts late (a busy 16-node lab: three runs of three) had its first reply
after the change it was to time; with no reply before the cut there was no gap, and
the outage read 0.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import pytest

from meshopt.lab import measure
from meshopt.lab.measure import outage_time, pinging

pytestmark = pytest.mark.skipif(shutil.which("ping") is None, reason="no ping")

LATE_S = 1.0  # how late the ping starts


@dataclass
class _LateLab:
    """Runs the ping here (loopback), ``LATE_S`` after it was asked for."""

    def popen(self, node: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        late = ["sh", "-c", f'sleep {LATE_S}; exec "$@"', "sh", *argv]
        return subprocess.Popen(late, **kwargs)

    def overlay_ip(self, node: str) -> str:
        return "127.0.0.1"


@dataclass
class _Mesh:
    lab: _LateLab


def test_the_block_is_entered_once_the_ping_has_a_reply() -> None:
    with pinging(_Mesh(_LateLab()), "a", "b", lead=0.1) as log:  # type: ignore[arg-type]
        assert log.replies, "entered before the first reply"


def test_an_outage_without_a_reply_before_the_cut_counts_from_the_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        measure, "START_S", 0.0, raising=False
    )  # entered before the late ping answers
    got = outage_time(_Mesh(_LateLab()), "a", "b", lambda: None, timeout=5.0, hold=0.5)  # type: ignore[arg-type]
    assert got is not None and 0.2 <= got <= LATE_S + 1.0, got
