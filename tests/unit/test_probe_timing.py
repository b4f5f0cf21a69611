"""Where the prober's RTT starts (the kernel's transmit stamp) and when it probes each peer.

Real UDP sockets on loopback, a real responder, the real kernel stamps. Issue 14 item 7:
the agent's RTT read 0.28-0.38 ms high at its default probe rate; two of the causes
were the prober's own: the user-space send stamp (the ``sendto`` system call counted
as path) and probes to every peer leaving together (each queued behind the others).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from meshopt.probe import prober as prober_module
from meshopt.probe.packet import Kind, ProbePacket, decode, encode
from meshopt.probe.prober import PHASES, ProbeConfig, Prober, Target
from meshopt.probe.responder import Responder
from meshopt.probe.timestamps import (
    IP_RECVERR,
    IPV6_RECVERR,
    SCM_TIMESTAMPING,
    SCM_TSTAMP_SCHED,
    SCM_TSTAMP_SND,
    SO_EE_ORIGIN_TIMESTAMPING,
    drain_tx_timestamps,
    enable_tx_timestamps,
    open_udp_socket,
    parse_tx_timestamp,
    recv_timestamped,
)

INTERVAL_S, DEAD_AFTER_S = 0.05, 0.2
SKEW_NS = 800_000  # the skewed user clock below reads 0.8 ms early (under SLACK_S)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)


# --- parsing the error queue's ancillary data (pure) --------------------------------------


def _ext_err(origin: int, info: int) -> bytes:
    return struct.pack("@IBBBBII", 42, origin, 0, 0, 0, info, 7)


def _stamps(sec: int, nsec: int) -> bytes:
    return struct.pack("@ll", sec, nsec) + bytes(32)  # software, (legacy), hardware


@pytest.mark.parametrize(
    ("level", "ctype"), [(socket.IPPROTO_IP, IP_RECVERR), (socket.IPPROTO_IPV6, IPV6_RECVERR)]
)
@pytest.mark.parametrize("kind", [SCM_TSTAMP_SND, SCM_TSTAMP_SCHED])
def test_parse_tx_timestamp_reads_the_software_stamp(level: int, ctype: int, kind: int) -> None:
    anc = [
        (socket.SOL_SOCKET, SCM_TIMESTAMPING, _stamps(12, 345)),
        (level, ctype, _ext_err(SO_EE_ORIGIN_TIMESTAMPING, kind)),
    ]
    assert parse_tx_timestamp(anc) == (12 * 10**9 + 345, kind)


def test_parse_tx_timestamp_ignores_what_is_not_a_transmit_stamp() -> None:
    icmp_error = _ext_err(2, 0)  # SO_EE_ORIGIN_ICMP
    assert parse_tx_timestamp([(socket.IPPROTO_IP, IP_RECVERR, icmp_error)]) is None
    assert parse_tx_timestamp([(socket.SOL_SOCKET, SCM_TIMESTAMPING, _stamps(1, 2))]) is None
    ack = _ext_err(SO_EE_ORIGIN_TIMESTAMPING, 2)  # SCM_TSTAMP_ACK: TCP only, not ours
    both = [(socket.SOL_SOCKET, SCM_TIMESTAMPING, _stamps(1, 2)), (0, IP_RECVERR, ack)]
    assert parse_tx_timestamp(both) is None
    zero = [
        (socket.SOL_SOCKET, SCM_TIMESTAMPING, _stamps(0, 0)),
        (socket.IPPROTO_IP, IP_RECVERR, _ext_err(SO_EE_ORIGIN_TIMESTAMPING, 0)),
    ]
    assert parse_tx_timestamp(zero) is None  # no software stamp generated
    assert parse_tx_timestamp([(socket.SOL_SOCKET, SCM_TIMESTAMPING, b"short")]) is None
    assert parse_tx_timestamp([]) is None


def test_transmit_stamps_do_not_disturb_receive_stamps() -> None:
    """The socket reports SCM_TIMESTAMPING on receive too: the receive stamp still parses."""
    rx = open_udp_socket("::", 0)
    tx = open_udp_socket("::", 0)
    try:
        assert enable_tx_timestamps(rx) and enable_tx_timestamps(tx)
        before = time.time_ns()
        tx.sendto(b"x" * 30, ("::1", rx.getsockname()[1]))
        rx.setblocking(True)
        rx.settimeout(5.0)
        data, _addr, rx_ns = recv_timestamped(rx, 100)
        assert data == b"x" * 30 and rx_ns is not None and rx_ns >= before
    finally:
        rx.close()
        tx.close()


# --- the RTT starts at the kernel's transmit stamp ---------------------------------------


def _skewed_clock() -> SimpleNamespace:
    """``time`` for the prober module, whose wall clock reads ``SKEW_NS`` early.

    A user-space send stamp taken from it makes every RTT 0.8 ms longer; a kernel
    transmit stamp does not see it. (The skew stays under the prober's clock-step
    check, which compares the wall span with the monotonic one.)
    """
    return SimpleNamespace(
        time_ns=lambda: time.time_ns() - SKEW_NS,
        monotonic=time.monotonic,
    )


async def _median_rtt(target: str, *, use_tx: bool, padding: int = 0) -> tuple[float, Prober]:
    responder = Responder()
    await responder.start("::1" if ":" in target else "127.0.0.1", 0)
    cfg = ProbeConfig(
        interval_s=INTERVAL_S,
        dead_after_s=DEAD_AFTER_S,
        port=responder.port,
        padding=padding,
        tx_timestamps=use_tx,
    )
    prober = Prober(cfg)
    prober.set_targets([Target("peer", target)])
    await prober.start()
    assert prober.tx_timestamps is use_tx
    try:
        await until(lambda: (s := prober.stats("peer")) is not None and s.received >= 20)
    finally:
        await prober.close()
        responder.close()
    stats = prober.stats("peer")
    assert stats is not None and stats.rtt_median_ms is not None
    return stats.rtt_median_ms, prober


@pytest.mark.parametrize("target", ["127.0.0.1", "::1"])
@pytest.mark.parametrize("padding", [0, 100])
def test_rtt_is_timed_from_the_kernel_transmit_stamp(
    target: str, padding: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prober_module, "time", _skewed_clock())
    median_ms, prober = asyncio.run(_median_rtt(target, use_tx=True, padding=padding))
    assert prober.tx_timestamps
    received = prober.stats("peer")
    assert received is not None
    assert prober.counters["tx_ts"] == received.samples and prober.counters["no_tx_ts"] == 0
    assert prober.counters["clock_step"] == 0
    # Loopback RTT is tens of µs; the skewed user stamp would add 800 µs to every one.
    assert median_ms < SKEW_NS / 1e6


def test_without_transmit_stamps_the_user_stamp_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same run on the user-space stamp carries the clock's skew."""
    monkeypatch.setattr(prober_module, "time", _skewed_clock())
    median_ms, prober = asyncio.run(_median_rtt("127.0.0.1", use_tx=False))
    received = prober.stats("peer")
    assert received is not None
    assert prober.counters["no_tx_ts"] == received.samples and prober.counters["tx_ts"] == 0
    assert median_ms > SKEW_NS / 1e6


# --- peers are probed at different moments of the interval -------------------------------


def _phases(prober: Prober, names: list[str], interval: float, origin: float) -> list[float]:
    out = []
    for name in names:
        at = prober.next_probe_at(name)
        assert at is not None
        out.append((at - origin) % interval)
    return sorted(out)


def _min_gap(phases: list[float], interval: float) -> float:
    ends = [*phases[1:], phases[0] + interval]
    return min(b - a for a, b in zip(phases, ends, strict=True))


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 9, 15, 16, 40])
def test_peers_are_spread_over_the_interval(n: int) -> None:
    interval = ProbeConfig().interval_s
    prober = Prober()
    origin = time.monotonic()
    names = [f"p{i}" for i in range(n)]
    prober.set_targets([Target(name, f"10.0.0.{i + 1}") for i, name in enumerate(names)])
    first = prober.next_probe_at("p0")
    assert first is not None and first - origin < 0.5  # the first peer is probed at once
    phases = _phases(prober, names, interval, origin)
    slots: list[float] = []
    for phase in phases:  # send times in use (peers in one slot are sent together)
        if not slots or phase - slots[-1] > 1e-6:
            slots.append(phase)
    if len(slots) > 1 and slots[0] + interval - slots[-1] < 1e-6:
        slots.pop()  # the same slot, seen across the wrap
    assert len(slots) == min(n, PHASES)
    # Halving the largest gap each time: never closer than interval / (2 * slots).
    assert _min_gap(slots, interval) >= interval / (2 * len(slots)) - 1e-9 or n == 1
    # Beyond PHASES the slots fill evenly.
    per_slot = [sum(1 for ph in phases if min(abs(ph - s), interval - abs(ph - s)) < 1e-6)
                for s in slots]  # fmt: skip
    assert max(per_slot) - min(per_slot) <= 1 and sum(per_slot) == n


def test_a_peer_added_later_takes_the_largest_gap() -> None:
    interval = 0.4
    prober = Prober(ProbeConfig(interval_s=interval, dead_after_s=0.9))
    targets = [Target("a", "10.0.0.1"), Target("b", "10.0.0.2")]
    prober.set_targets(targets)
    prober.set_targets([*targets, Target("c", "10.0.0.3")])
    a, b, c = (prober.next_probe_at(x) for x in "abc")
    assert a is not None and b is not None and c is not None
    assert abs((b - a) % interval - 0.2) < 0.01  # b half an interval after a
    # c lands a quarter of an interval away from both
    assert min((c - a) % interval, (a - c) % interval) > 0.09
    assert min((c - b) % interval, (b - c) % interval) > 0.09
    assert prober.next_probe_at("gone") is None


def test_a_stalled_loop_keeps_the_phases() -> None:
    """After a stall the peers skip whole intervals: they do not all fire together."""
    interval = 0.1
    cfg = ProbeConfig(interval_s=interval, dead_after_s=0.3, port=9)  # discard: no replies

    names = ["a", "b", "c", "d"]

    def phases(prober: Prober) -> dict[str, float]:
        out = {}
        for name in names:
            at = prober.next_probe_at(name)
            assert at is not None
            out[name] = at % interval
        return out

    async def main() -> tuple[dict[str, float], dict[str, float], int]:
        prober = Prober(cfg)
        prober.set_targets([Target(n, "127.0.0.1") for n in names])
        before = phases(prober)
        await prober.start()
        try:
            await asyncio.sleep(0.25)
            time.sleep(0.53)  # the loop stalls (a busy or paused VM)
            await asyncio.sleep(0.25)
            return before, phases(prober), prober.counters["sent"]
        finally:
            await prober.close()

    before, after, sent = asyncio.run(main())
    assert sent >= 8
    for name in names:
        moved = abs(after[name] - before[name])
        assert min(moved, interval - moved) < 1e-6, name


# --- the responder's turnaround ends right before its send --------------------------------


def test_turnaround_fits_inside_the_round_trip_seen_by_the_kernel() -> None:
    """The responder's turnaround (its receive stamp to its send) lies within the round
    trip the kernel stamps at the requester: it starts after the request left and ends
    before the reply arrived."""

    async def main() -> list[tuple[int, int, int]]:
        responder = Responder()
        await responder.start("127.0.0.1", 0)
        sock = open_udp_socket("127.0.0.1", 0)
        assert enable_tx_timestamps(sock)
        out = []
        try:
            for seq in range(20):
                request = encode(ProbePacket(Kind.REQUEST, b"12345678", seq, time.time_ns()))
                sock.sendto(request, ("127.0.0.1", responder.port))
                tx = [ns for _p, ns, kind in drain_tx_timestamps(sock, 4) if kind == 0]
                deadline = time.monotonic() + 5.0
                while True:
                    try:
                        data, _addr, rx_ns = recv_timestamped(sock, 100)
                        break
                    except BlockingIOError:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.001)
                tx += [ns for _p, ns, kind in drain_tx_timestamps(sock, 4) if kind == 0]
                reply = decode(data)
                assert reply.kind is Kind.REPLY and reply.seq == seq and rx_ns is not None
                out.append((tx[0], rx_ns, reply.turnaround_ns))
        finally:
            sock.close()
            responder.close()
        return out

    for tx_ns, rx_ns, turnaround_ns in asyncio.run(main()):
        assert 0 < turnaround_ns < rx_ns - tx_ns
