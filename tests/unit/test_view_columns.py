"""The controller reads a snapshot's peer arrays straight from its columns (issue 15,
N = 1000): the arrays, the keys and the matrices must be what the PeerReport rows
give, unusable values cleared the same way, and a change report on top must count."""

from __future__ import annotations

import base64
import math

import numpy as np

from meshopt.bus.messages import PeerReport, PeerTable, Telemetry, peer_table
from meshopt.controller.view import MeshView, _PeerArrays, _Rows, usable_peer


def _key(i: int) -> str:
    return base64.b64encode(bytes([i]) * 32).decode()


def _peers() -> list[PeerReport]:
    out = []
    for j in range(1, 9):
        out.append(
            PeerReport(
                public_key=_key(j),
                ifname="wg0",
                alive=None if j == 3 else j != 4,
                rtt_ms=None if j == 2 else 70_000.0 if j == 5 else 10.0 + j * 1.37,
                jitter_ms=0.31 * j,
                noise_ms=0.07 * j,
                loss=0.0123 * j,
                samples=10 * j,
                probes_sent=7 * j,
                loss_outcomes=0 if j == 1 else 40 * j,
                bandwidth_mbit=2e7 if j == 6 else 100.0 * j if j % 2 else None,
                pmtu=100 if j == 7 else 1420 if j % 2 else None,
            )
        )
    return out


def _same(a: _PeerArrays, b: _PeerArrays) -> None:
    assert a.keys == b.keys
    for f in (
        "alive",
        "rtt",
        "jitter",
        "loss",
        "noise",
        "samples",
        "sent",
        "loss_n",
        "bandwidth",
        "pmtu",
    ):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


def test_arrays_from_columns_equal_arrays_from_rows() -> None:
    table = peer_table(_peers())
    cols = _PeerArrays.of_table(table)
    rows = _PeerArrays.of(_Rows({p.public_key: usable_peer(p)[0] for p in table.rows()}))
    _same(cols, rows)
    # What routing cannot use is cleared: an RTT over a minute, a PMTU under 576, a
    # rate over 10 Tbit/s; an unknown alive is -1, a dead peer 0.
    assert math.isnan(cols.rtt[4]) and math.isnan(cols.pmtu[6]) and math.isnan(cols.bandwidth[5])
    assert cols.alive[2] == -1 and cols.alive[3] == 0 and cols.alive[0] == 1


def _telemetry(node: str, keys: list[str], full: bool, table: PeerTable, at: float) -> Telemetry:
    return Telemetry(
        mesh="m",
        node=node,
        public_key=keys[0],
        seq=int(at * 1000),
        sent_at=at,
        public_keys=keys,
        addresses=[],
        full=full,
        table=table,
    )


def test_view_matrices_are_the_same_read_from_columns_or_rows() -> None:
    peers = _peers()

    def view() -> MeshView:
        v = MeshView("m")
        v.take("n0", _telemetry("n0", [_key(0)], True, peer_table(peers), 100.0), 100.0)
        for j in range(1, 9):  # every peer a node, so each report is a link
            v.take(f"n{j}", _telemetry(f"n{j}", [_key(j)], True, peer_table([]), 100.0), 100.0)
        return v

    fast, slow = view(), view()
    slow.nodes["n0"].peers  # noqa: B018 - build the rows: the old path
    assert fast.nodes["n0"]._table_only() is not None  # not built: the columns' path
    assert slow.nodes["n0"]._table_only() is None
    assert fast.nodes["n0"].peer_keys() == list(slow.nodes["n0"].peers)
    a, b = fast.matrices(101.0), slow.matrices(101.0)
    for f in ("cost", "noise", "bandwidth", "rtt", "pmtu", "jitter"):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f
    # A change report on top (peer 1 much slower) counts, on either path.
    moved = [PeerReport(public_key=_key(1), ifname="wg0", alive=True, rtt_ms=500.0, samples=64)]
    for v in (fast, slow):
        v.take("n0", _telemetry("n0", [_key(0)], False, peer_table(moved), 101.0), 101.0)
    a, b = fast.matrices(102.0), slow.matrices(102.0)
    assert np.array_equal(a.rtt, b.rtt, equal_nan=True) and np.array_equal(a.cost, b.cost)
    assert a.rtt[0, 1] == 500.0
    assert fast.measured(1) == slow.measured(1)
