"""The probe class in telemetry: how each peer is probed travels with its report.

Every peer's class (in use: a next hop, a backup or traffic, probed fast; idle: probed
slowly), its probe interval and its failure-detection time go from the prober's budget
into the agent's telemetry, one byte a peer in the columnar table; the controller decodes
them, refuses impossible ones with a counted BusMessageError reason, and keeps them in its
view. Telemetry without them (older agents) still decodes, and older decoders read the
new messages (unknown fields are ignored).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from meshopt.agent.core import AgentCore, RouteState
from meshopt.agent.peers import PeerInfo
from meshopt.agent.telemetry import Plan, peer_report, signed_telemetry
from meshopt.bus.messages import (
    MAX_PROBE_RATES,
    BusMessageError,
    PeerReport,
    ProbeRate,
    Signed,
    Telemetry,
    decode,
    decode_telemetry,
    encode,
    peer_table,
)
from meshopt.bus.signing import _to_sign, generate_signing_key, key_id, public_key_b64
from meshopt.controller.config import ControllerConfig, Enrolment
from meshopt.controller.core import ControllerCore
from meshopt.probe.budget import BudgetConfig, ProbeBudget
from meshopt.probe.stats import ProbeStats
from meshopt.wireguard.keys import generate_keypair

KEYS = [generate_keypair()[1] for _ in range(6)]
OWN = generate_keypair()[1]
WALL = 1_700_000_000.0


def budget_reports() -> list[PeerReport]:
    """Six peers as the agent reports them: two next hops (in use), four idle."""
    budget = ProbeBudget(BudgetConfig())
    plan = budget.plan(KEYS, {KEYS[0], KEYS[1]}, {}, now=100.0)
    out = []
    for k in KEYS:
        peer = PeerInfo(
            public_key=k, ifname="wg0", own_key=OWN, layout="single", allowed_ips=(),
            endpoint=None, handshake_age_s=None, rx_bytes=0, tx_bytes=0,
        )  # fmt: skip
        stats = ProbeStats(
            sent=10, received=10, lost=0, loss=0.0, samples=10, rtt_min_ms=5.0,
            rtt_median_ms=5.0, rtt_p95_ms=5.0, srtt_ms=5.0, jitter_ms=0.1, noise_ms=0.1,
            last_rtt_ms=5.0,
        )  # fmt: skip
        out.append(peer_report(peer, stats, True, None, 100.0, None, plan.rates[k]))
    return out


def telemetry(peers: list[PeerReport], **kw: Any) -> Telemetry:
    base: dict[str, Any] = dict(
        mesh="lab", node="a", public_key=OWN, public_keys=[OWN], addresses=["10.99.0.1/32"],
        seq=7, sent_at=WALL, full=True, table=peer_table(peers), full_interval_s=5.0,
    )  # fmt: skip
    base.update(kw)
    return Telemetry(**base)


def test_the_agents_report_carries_each_peers_class_rate_and_dead_time() -> None:
    reports = budget_reports()
    assert [r.probe_class for r in reports] == ["in_use"] * 2 + ["idle"] * 4
    assert reports[0].probe_interval_s == 0.33 and reports[0].probe_dead_after_s == 0.8
    assert reports[2].probe_interval_s == 2.0
    assert reports[2].probe_dead_after_s == pytest.approx(2.0 * 0.8 / 0.33, abs=1e-3)
    back = decode_telemetry(encode(telemetry(reports))).peers
    assert [(p.probe_class, p.probe_interval_s, p.probe_dead_after_s) for p in back] == [
        (r.probe_class, r.probe_interval_s, r.probe_dead_after_s) for r in reports
    ]


def test_one_byte_a_peer_and_the_few_rates_once() -> None:
    t = telemetry(budget_reports())
    assert t.table is not None
    assert len(t.table.probe_rates) == 2 and len(t.table.probe) == len(KEYS)
    # Every peer probed the same way (budget off): no per-peer column at all.
    same = [msgspec.structs.replace(r, probe_class="in_use", probe_interval_s=0.33,
                                    probe_dead_after_s=0.8) for r in budget_reports()]  # fmt: skip
    t2 = telemetry(same)
    assert t2.table is not None and t2.table.probe == b"" and len(t2.table.probe_rates) == 1
    assert {p.probe_class for p in decode_telemetry(encode(t2)).peers} == {"in_use"}


def test_unreported_peers_stay_unreported_beside_reported_ones() -> None:
    reports = budget_reports()
    bare = PeerReport(public_key=reports[3].public_key, ifname="wg0", rtt_ms=4.0)
    back = decode_telemetry(encode(telemetry([*reports[:3], bare]))).peers
    assert back[3] == bare
    assert back[3].probe_class is None and back[3].probe_dead_after_s is None
    assert back[0].probe_class == "in_use"


def test_telemetry_without_the_class_still_decodes_and_old_decoders_read_the_new() -> None:
    old = [PeerReport(public_key=k, ifname="wg0", rtt_ms=3.0) for k in KEYS]
    t = decode(encode(telemetry(old)), Telemetry)
    assert t.table is not None and t.table.probe_rates == [] and t.table.probe == b""
    assert all(p.probe_class is None for p in t.reports())

    # A decoder of the schema before the class (no such fields) reads the new message.
    new = encode(telemetry(budget_reports()))
    read = msgspec.msgpack.decode(new, type=OldTelemetry)
    assert read.node == "a" and read.table is not None and len(read.table.keys) == 32 * 6


class OldTable(msgspec.Struct):
    """The table as a decoder before the probe columns sees it (a part of it)."""

    keys: bytes
    ifnames: list[str]
    rtt: bytes = b""


class OldTelemetry(msgspec.Struct):
    v: int
    node: str
    table: OldTable | None = None


def with_probe(**columns: Any) -> bytes:
    t = telemetry(budget_reports())
    assert t.table is not None
    bad = msgspec.structs.replace(t, table=msgspec.structs.replace(t.table, **columns))
    return msgspec.msgpack.encode(bad)


@pytest.mark.parametrize(
    ("columns", "reason"),
    [
        ({"probe": bytes([0, 1, 2, 0, 0, 0])}, "bad_value"),  # index past the two rates
        ({"probe": bytes([0, 1])}, "bad_value"),  # not one per peer
        ({"probe_rates": [ProbeRate("idle", 0.0, 1.0)]}, "bad_value"),
        ({"probe_rates": [ProbeRate("idle", -1.0, 1.0)]}, "bad_value"),
        ({"probe_rates": [ProbeRate("idle", 1.0, math.inf)]}, "bad_value"),
        ({"probe_rates": [ProbeRate("idle", 1.0, math.nan)]}, "bad_value"),
        ({"probe_rates": [ProbeRate("idle", 1e9, 2e9)]}, "bad_value"),
        ({"probe_rates": [ProbeRate("idle", 1.0, 2.0)] * (MAX_PROBE_RATES + 1)}, "bad_value"),
        ({"probe_rates": [ProbeRate("fast", 1.0, 2.0)]}, "bad_schema"),  # type: ignore[arg-type]
        ({"probe_rates": "in_use"}, "bad_schema"),
    ],
)
def test_impossible_probe_columns_are_refused(columns: dict[str, Any], reason: str) -> None:
    with pytest.raises(BusMessageError) as info:
        decode(with_probe(**columns), Telemetry)
    assert info.value.reason == reason


def test_the_agent_cannot_send_an_impossible_class_or_rate() -> None:
    r = budget_reports()[0]
    for bad in (
        {"probe_class": "fast"},
        {"probe_interval_s": 0.0},
        {"probe_dead_after_s": -0.5},
        {"probe_interval_s": math.nan},
    ):
        with pytest.raises(BusMessageError) as info:
            encode(telemetry([msgspec.structs.replace(r, **bad)]))
        assert info.value.reason == "bad_value", bad
    with pytest.raises(BusMessageError):
        peer_table([msgspec.structs.replace(r, probe_interval_s=1.0 + i) for i in range(17)])


def test_the_controller_keeps_the_class_and_counts_hostile_columns() -> None:
    key, _ = generate_signing_key()
    cfg = ControllerConfig(
        mesh="lab", id="ctl1", signing_key="/unused",
        node_keys=(Enrolment("a", public_key_b64(key)),),
    )  # fmt: skip
    core = ControllerCore(cfg, generate_signing_key()[0])
    agent = AgentCore("lab", "a", key, [], RouteState(), WALL)
    reports = budget_reports()

    def send(plan: Plan) -> bytes:
        return signed_telemetry(
            agent, WALL, public_keys=[OWN], addresses=["10.99.0.1/32"], plan=plan, counters={}
        )

    core.on_message("meshopt/lab/telemetry/a", send(Plan(True, reports, 5.0)), False, 1.0, WALL)
    assert core.dropped() == {}
    peers = core.view.nodes["a"].peers
    assert peers[KEYS[0]].probe_class == "in_use" and peers[KEYS[0]].probe_dead_after_s == 0.8
    assert peers[KEYS[5]].probe_class == "idle" and peers[KEYS[5]].probe_interval_s == 2.0

    # A signed message with an impossible probe column: one refusal and a counter.
    t = telemetry(reports)
    assert t.table is not None
    for columns in (
        {"probe": bytes([9] * 6)},
        {"probe_rates": [ProbeRate("idle", 0.0, 0.0)]},
    ):
        evil_t = msgspec.structs.replace(
            t, seq=agent.next_seq(), table=msgspec.structs.replace(t.table, **columns)
        )
        payload = msgspec.msgpack.encode(evil_t)  # unchecked, as a hostile agent would
        evil = encode(
            Signed(
                kind="telemetry",
                payload=payload,
                signature=key.sign(_to_sign("telemetry", payload)),
                key_id=key_id(key),
            )
        )
        core.on_message("meshopt/lab/telemetry/a", evil, False, 2.0, WALL + 1)
    assert core.dropped() == {"telemetry_bad_value": 2}
    assert core.view.nodes["a"].peers[KEYS[0]].probe_class == "in_use"  # the last good one
