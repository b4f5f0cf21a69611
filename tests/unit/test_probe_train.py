"""Packet-train capacity: the math with known answers, the wire format against garbage,
and a real TrainResponder on loopback (IPv4 and IPv6) answering real trains."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import pytest

from meshopt.errors import MeshoptError
from meshopt.probe.train import (
    MAX_TRAIN_PACKETS,
    MAX_TRAINS_IN_FLIGHT,
    MIN_TRAIN_PACKETS,
    REPORT_IDLE_S,
    BandwidthEstimate,
    TrainError,
    TrainPacket,
    TrainReport,
    TrainResponder,
    TrainUnansweredError,
    combine,
    decode_report,
    decode_train_packet,
    dispersion_mbit,
    encode_report,
    encode_train_packet,
    estimate_capacity,
    next_train_length,
    probe_level_mbit,
    train_capacity_mbit,
    tunnel_packet_bytes,
)

NONCE = b"\x01" * 8


def report(arrivals: list[tuple[int, int]], count: int = 10) -> TrainReport:
    return TrainReport(1, NONCE, count, 1000 * len(arrivals), 123, tuple(arrivals))


def spaced(n: int, gap_ns: int) -> list[tuple[int, int]]:
    return [(i, i * gap_ns) for i in range(n)]


# --- the math --------------------------------------------------------------------------


def test_capacity_of_an_evenly_spaced_train() -> None:
    # 1,200-byte packets every 100 µs: 96 Mbit/s, by both estimators.
    r = report(spaced(10, 100_000))
    assert train_capacity_mbit(r, 1200) == pytest.approx(96.0)
    assert dispersion_mbit(r, 1200) == pytest.approx(96.0)


def test_slope_ignores_a_late_first_and_an_early_last_arrival() -> None:
    """What wireguard-go does to a train's ends: the slope keeps the rate, first-to-last
    dispersion does not."""
    arr = spaced(20, 100_000)
    arr[0] = (0, -300_000)  # first packet held back relative to the others: earlier stamp
    arr[-1] = (19, arr[-2][1] + 5_000)  # last one batched right behind its predecessor
    r = report(arr, 20)
    assert train_capacity_mbit(r, 1200) == pytest.approx(96.0)
    assert abs(dispersion_mbit(r, 1200) / 96.0 - 1) > 0.05  # type: ignore[operator]


def test_slope_counts_a_lost_packets_slot() -> None:
    arr = [a for a in spaced(10, 100_000) if a[0] != 4]  # packet 4 lost after the link
    r = report(arr)
    assert train_capacity_mbit(r, 1200) == pytest.approx(96.0)
    assert dispersion_mbit(r, 1200) == pytest.approx(96.0 * 8 / 9)


def test_no_capacity_from_one_arrival_or_no_spread() -> None:
    assert train_capacity_mbit(report([(0, 0)]), 1200) is None
    assert dispersion_mbit(report([(0, 0)]), 1200) is None
    assert train_capacity_mbit(report([(0, 0), (1, 0), (2, 0)]), 1200) is None
    assert dispersion_mbit(report([(0, 0), (1, 0)]), 1200) is None


def test_combine_takes_the_median_and_grades_confidence() -> None:
    cap, conf = combine([100.0, 100.0, 100.0, 100.0, 100.0], 0.0)
    assert (cap, conf) == (100.0, 1.0)
    cap, conf = combine([100.0, 101.0, 99.0, 500.0, 100.5], 0.0)  # one outlier train
    assert cap == 100.5 and 0.9 < conf < 1.0
    _, scattered = combine([60.0, 100.0, 140.0, 80.0, 120.0], 0.0)  # MAD 20 %
    assert scattered == 0.0
    _, lossy = combine([100.0] * 5, 0.1)
    assert lossy == pytest.approx(0.8)
    _, one = combine([100.0], 0.0)
    assert one == pytest.approx(1 / 3, abs=1e-3)
    with pytest.raises(ValueError):
        combine([], 0.0)


def test_wireguard_conversion() -> None:
    # 1,200 bytes is a multiple of 16: +60 over IPv4; 1,201 pads to 1,216.
    assert tunnel_packet_bytes(1200) == 1260
    assert tunnel_packet_bytes(1201) == 1276
    assert tunnel_packet_bytes(1200, 80) == 1280
    assert probe_level_mbit(20.0, 1200) == pytest.approx(20.0 * 1200 / 1260)
    est = BandwidthEstimate(
        capacity_mbit=probe_level_mbit(50.0, 1200),
        confidence=1.0,
        trains_used=5,
        bytes_spent=1,
        duration_s=0.1,
        packet_bytes=1200,
    )
    assert est.underlay_mbit() == pytest.approx(50.0)
    assert est.underlay_mbit(80) == pytest.approx(50.0 * 1280 / 1260)


def test_next_train_length() -> None:
    full = report(spaced(48, 100_000), 48)
    # 10 ms at 96 Mbit/s of 1,200-byte packets is 100 packets; at most twice this train.
    assert next_train_length(48, full, 96.0, 1200) == 96
    assert next_train_length(96, report(spaced(96, 100_000), 96), 96.0, 1200) == 100
    assert next_train_length(48, full, 9.6, 1200) == MIN_TRAIN_PACKETS
    assert next_train_length(200, full, 10_000.0, 1200) == MAX_TRAIN_PACKETS
    tail_lost = report(spaced(30, 100_000), 48)
    assert next_train_length(48, tail_lost, 96.0, 1200) == 24


# --- wire format -----------------------------------------------------------------------


def test_train_packet_and_report_round_trip() -> None:
    p = TrainPacket(7, NONCE, 3, 48)
    data = encode_train_packet(p, 1172)
    assert len(data) == 1172
    assert decode_train_packet(data) == p
    r = report([(0, 0), (2, 150), (1, 150), (5, 900)])
    assert decode_report(encode_report(r)) == r


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"MOTR",
        b"XXXX" + bytes(40),
        random.Random(64).randbytes(64),  # fixed: test ids must match across pytest workers
        b"MOTR\x02\x01" + bytes(40),  # version 2
        b"MOTR\x01\x02" + bytes(40),  # a report where a train packet belongs
        encode_train_packet(TrainPacket(1, NONCE, 0, 4), 100)[:20],  # truncated
    ],
)
def test_garbage_train_packets_raise(data: bytes) -> None:
    with pytest.raises(TrainError):
        decode_train_packet(data)


def test_train_packet_limits_raise() -> None:
    too_long = encode_train_packet(TrainPacket(1, NONCE, 0, MAX_TRAIN_PACKETS), 1300)
    too_long = too_long[:20] + (MAX_TRAIN_PACKETS + 1).to_bytes(2, "big") + too_long[22:]
    with pytest.raises(TrainError, match="limit"):
        decode_train_packet(too_long)
    index_out = encode_train_packet(TrainPacket(1, NONCE, 0, 4), 64)
    index_out = index_out[:18] + (4).to_bytes(2, "big") + index_out[20:]
    with pytest.raises(TrainError, match="index"):
        decode_train_packet(index_out)
    with pytest.raises(TrainError):
        encode_train_packet(TrainPacket(1, NONCE, 0, 4), 10)
    assert isinstance(TrainError("x"), MeshoptError)


def test_garbage_reports_raise() -> None:
    good = encode_report(report([(0, 0), (1, 100)]))
    bad = [
        b"",
        good[:30],  # truncated header
        good[:-1],  # truncated entry
        good + b"\x00",  # trailing byte
        b"MOTR\x01\x01" + good[6:],  # a train packet's kind
        encode_report(report([(0, 100), (1, 50)])),  # times backwards
        encode_report(report([(0, 0), (12, 50)], count=10)),  # index beyond the train
        os.urandom(len(good)),
    ]
    for data in bad:
        with pytest.raises(TrainError):
            decode_report(data)


# --- a real responder on loopback -------------------------------------------------------


@pytest.mark.parametrize(("host", "address"), [("::", "127.0.0.1"), ("::", "::1")])
def test_responder_answers_trains_on_loopback(host: str, address: str) -> None:
    async def main() -> None:
        responder = TrainResponder()
        await responder.start(host, 0)
        try:
            est = await estimate_capacity(address, port=responder.port, trains=3, train_packets=32)
        finally:
            responder.close()
        assert est.capacity_mbit > 100  # loopback: large and positive
        assert est.trains_used == 3 and est.packets_lost == 0
        assert 0.0 <= est.confidence <= 1.0
        assert responder.counters["packets"] == 96 and responder.counters["reports"] == 3
        assert all(v == 0 for k, v in responder.counters.items() if k.startswith("drop_"))
        # bytes spent: 96 train packets and 3 reports of 32 entries, at the IP level
        headers = 48 if ":" in address else 28
        report_bytes = len(encode_report(report(spaced(32, 1), 32))) + headers
        assert est.bytes_spent == 96 * est.packet_bytes + 3 * report_bytes

    asyncio.run(main())


def test_responder_drops_bad_packets_and_keeps_answering() -> None:
    async def main() -> None:
        responder = TrainResponder()
        await responder.start("127.0.0.1", 0)
        port = responder.port
        loop = asyncio.get_running_loop()
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.connect(("127.0.0.1", port))
        try:
            s.send(b"hello")  # garbage
            s.send(b"MOTR" + bytes(20))  # truncated train packet
            s.send(bytes(9100))  # oversized
            # a train of 4 missing its last packet: answered after the idle timeout
            for i in range(3):
                s.send(encode_train_packet(TrainPacket(9, NONCE, i, 4), 100))
            # same train id, another nonce: dropped
            s.send(encode_train_packet(TrainPacket(9, b"\x02" * 8, 1, 4), 100))
            s.send(encode_train_packet(TrainPacket(9, NONCE, 1, 4), 100))  # duplicate
            t0 = time.monotonic()
            data = await asyncio.wait_for(loop.sock_recv(s, 4096), 2.0)
            waited = time.monotonic() - t0
            r = decode_report(data)
            assert (r.train_id, r.nonce, r.count, r.received) == (9, NONCE, 4, 3)
            assert [i for i, _ in r.arrivals] == [0, 1, 2]
            assert waited >= REPORT_IDLE_S * 0.8
            # a late packet of the answered train does not start a new one
            s.send(encode_train_packet(TrainPacket(9, NONCE, 3, 4), 100))
            await asyncio.sleep(0.05)
            c = responder.counters
            assert c["drop_garbage"] == 2 and c["drop_oversized"] == 1
            assert c["drop_nonce"] == 1 and c["drop_duplicate"] == 1 and c["drop_late"] == 1
            # and it still measures
            est = await estimate_capacity("127.0.0.1", port=port, trains=2)
            assert est.capacity_mbit > 0
        finally:
            s.close()
            responder.close()

    asyncio.run(main())


def test_responder_bounds_trains_in_flight() -> None:
    async def main() -> None:
        responder = TrainResponder(limit=None)  # one source: no per-source budget here
        await responder.start("::1", 0)
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.connect(("::1", responder.port))
        try:
            for tid in range(MAX_TRAINS_IN_FLIGHT + 5):  # first packets only: all in flight
                s.send(encode_train_packet(TrainPacket(tid, NONCE, 0, 10), 100))
            await asyncio.sleep(0.05)
            assert responder.counters["trains"] == MAX_TRAINS_IN_FLIGHT
            assert responder.counters["drop_busy"] == 5
            await asyncio.sleep(REPORT_IDLE_S * 2 + 0.1)  # all expire and are answered
            assert responder.counters["reports"] == MAX_TRAINS_IN_FLIGHT
        finally:
            s.close()
            responder.close()

    asyncio.run(main())


def test_no_responder_is_a_clear_error() -> None:
    async def main() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        with pytest.raises(TrainUnansweredError, match="no train responder"):
            await estimate_capacity("127.0.0.1", port=port, trains=2, timeout_s=0.3)
        with pytest.raises(MeshoptError, match="not an IP address"):
            await estimate_capacity("peer.example", trains=1)
        with pytest.raises(MeshoptError, match="packet_bytes"):
            await estimate_capacity("127.0.0.1", packet_bytes=30)

    asyncio.run(main())
