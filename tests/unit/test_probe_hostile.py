"""The probe responders against an attacker (issue 12): no amplification, a budget per
source, current peers only, bound addresses only, and random datagrams never hurt.

Real UDP sockets on loopback: 127.0.0.1 and 127.0.0.2 are two sources (and two
addresses) of this host, ::1 a third.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
import random
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from meshopt.agent.peers import PeerInfo
from meshopt.agent.probeaddr import probe_address
from meshopt.errors import InputError, MeshoptError
from meshopt.probe.packet import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_PROBE_BYTES,
    VERSION,
    Kind,
    ProbeFormatError,
    ProbePacket,
    decode,
    encode,
)
from meshopt.probe.prober import ProbeConfig
from meshopt.probe.responder import (
    DEFAULT_ECHO_LIMIT,
    PeerSources,
    RateLimit,
    Responder,
    SourceBuckets,
    interface_addresses,
    source_of,
)
from meshopt.probe.responder import main as responder_main
from meshopt.probe.train import (
    DEFAULT_PACKET_BYTES,
    MAX_PACKET_BYTES,
    MAX_TRAIN_PACKETS,
    REPORT_IDLE_S,
    TrainError,
    TrainPacket,
    TrainResponder,
    TrainTooShortError,
    decode_report,
    decode_train_packet,
    encode_train_packet,
    estimate_capacity,
    max_train_packets,
    report_bytes,
)
from meshopt.probe.train import main as train_main

NONCE = b"\x07" * 8
A, B = "127.0.0.1", "127.0.0.2"

AnyResponder = Responder | TrainResponder


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.002)


async def reach(read: Callable[[], int], n: int, timeout: float = 3.0) -> None:
    """Until the responder has read ``n`` datagrams."""
    await until(lambda: read() == n, timeout)


@contextmanager
def client(host: str = A) -> Iterator[socket.socket]:
    """A non-blocking UDP socket sending from ``host``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.bind((host, 0))
        yield s


async def replies(s: socket.socket, wait: float = 0.1) -> list[bytes]:
    """Every datagram ``s`` receives until it has been quiet for ``wait`` seconds."""
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    while True:
        try:
            got.append(await asyncio.wait_for(loop.sock_recv(s, 65535), wait))
        except TimeoutError:
            return got


def request(size: int = HEADER_BYTES, seq: int = 1) -> bytes:
    return encode(ProbePacket(Kind.REQUEST, NONCE, seq, 123, padding=size - HEADER_BYTES))


def train(train_id: int, count: int, size: int, indexes: range | None = None) -> list[bytes]:
    return [
        encode_train_packet(TrainPacket(train_id, NONCE, i, count), size)
        for i in indexes or range(count)
    ]


def echo_total(r: Responder) -> int:
    """Datagrams the echo responder has read: each lands in exactly one of these."""
    c = r.counters
    keys = ("echoed", "bad_packet", "unknown_source", "rate_limited", "send_error")
    return sum(c[k] for k in keys)


def train_drops(r: TrainResponder) -> int:
    return sum(v for k, v in r.counters.items() if k.startswith("drop_"))


# --- 1. amplification ---------------------------------------------------------------------


def test_echo_reply_is_never_larger_than_its_request_at_any_accepted_size() -> None:
    """Every request size the format accepts, 30..1,372 bytes: bytes out / bytes in <= 1."""

    async def main() -> dict[int, float]:
        loop = asyncio.get_running_loop()
        responder = Responder(limit=None)
        await responder.start(A, 0)
        factors: dict[int, float] = {}
        try:
            with client() as s:
                for size in range(HEADER_BYTES, MAX_PROBE_BYTES + 1):
                    s.sendto(request(size, seq=size), (A, responder.port))
                    data = await asyncio.wait_for(loop.sock_recv(s, 65535), 2.0)
                    assert decode(data).seq == size
                    factors[size] = len(data) / size
                # a REPLY sent to it and garbage: nothing back at all
                s.sendto(request()[:3] + bytes([Kind.REPLY]) + request()[4:], (A, responder.port))
                s.sendto(b"x" * 9000, (A, responder.port))
                assert await replies(s) == []
        finally:
            responder.close()
        return factors

    factors = asyncio.run(main())
    assert len(factors) == MAX_PROBE_BYTES - HEADER_BYTES + 1
    assert max(factors.values()) <= 1.0
    assert factors[HEADER_BYTES] == 1.0  # the smallest request: a reply of the same size
    print(f"\necho amplification: max {max(factors.values())}, at 1,372 B {factors[1372]:.3f}")


def test_train_reports_are_never_larger_than_any_packet_of_their_train() -> None:
    """Trains of every length 1..200 at their smallest accepted packets (and some larger),
    whole and with only their first packet: each report <= the smallest packet it answers."""

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        responder = TrainResponder(limit=None)
        await responder.start(A, 0)
        worst, bytes_in, bytes_out = 0.0, 0, 0
        try:
            with client() as s:
                dest = (A, responder.port)
                cases = [(c, report_bytes(c)) for c in range(1, MAX_TRAIN_PACKETS + 1)]
                cases += [(c, 1172) for c in (2, 48, max_train_packets(1172))]
                for tid, (count, size) in enumerate(cases):
                    for pkt in train(tid, count, size):
                        s.sendto(pkt, dest)
                        bytes_in += len(pkt)
                    data = await asyncio.wait_for(loop.sock_recv(s, 65535), 2.0)
                    rep = decode_report(data)
                    assert (rep.train_id, rep.received) == (tid, count)
                    worst = max(worst, len(data) / size)
                    bytes_out += len(data)
                # tails lost: one packet of a long train, answered when idle
                for tid, count in enumerate((2, 50, MAX_TRAIN_PACKETS), start=10_000):
                    (pkt,) = train(tid, count, report_bytes(count), range(1))
                    s.sendto(pkt, dest)
                    bytes_in += len(pkt)
                got = await replies(s, REPORT_IDLE_S * 3)
                assert len(got) == 3
                worst = max(worst, *(len(d) / report_bytes(decode_report(d).count) for d in got))
                bytes_out += sum(len(d) for d in got)
        finally:
            responder.close()
        assert train_drops(responder) == 0
        return worst, bytes_out / bytes_in

    worst, overall = asyncio.run(main())
    assert worst <= 1.0
    assert overall <= 1.0
    print(f"\ntrain amplification: worst datagram {worst:.3f}, overall {overall:.4f}")


def test_train_packets_shorter_than_their_report_are_refused_and_counted() -> None:
    """Today's smallest train (22 bytes, answered with 40) and every size one short."""
    smallest = struct.pack("!4sBBI8sHH", b"MOTR", 1, 1, 1, NONCE, 0, 1)
    assert len(smallest) == 22
    with pytest.raises(TrainTooShortError):
        decode_train_packet(smallest)
    with pytest.raises(TrainError, match="at least 40"):
        encode_train_packet(TrainPacket(1, NONCE, 0, 1), 22)

    async def main() -> None:
        responder = TrainResponder(limit=None)
        await responder.start(A, 0)
        try:
            with client() as s:
                dest = (A, responder.port)
                s.sendto(smallest, dest)
                counts = (1, 2, 10, 100, MAX_TRAIN_PACKETS)
                for tid, count in enumerate(counts, start=2):
                    pkt = train(tid, count, report_bytes(count))[-1]
                    s.sendto(pkt[:-1], dest)  # one byte short, the train's last packet
                assert await replies(s, REPORT_IDLE_S * 2) == []
                assert responder.counters["drop_short"] == 1 + len(counts)
                assert responder.counters["trains"] == 0
        finally:
            responder.close()

    asyncio.run(main())


def test_estimates_still_work_and_cap_trains_by_packet_size() -> None:
    """The estimator sizes its trains so no report outgrows a packet."""
    assert max_train_packets(DEFAULT_PACKET_BYTES - 48) == 186
    assert max_train_packets(DEFAULT_PACKET_BYTES - 28) == 189
    assert max_train_packets(report_bytes(2)) == 2 and max_train_packets(45) == 1

    async def main() -> None:
        responder = TrainResponder()
        await responder.start(A, 0)
        try:
            est = await estimate_capacity(A, port=responder.port, packet_bytes=200, trains=3)
            assert est.capacity_mbit > 0 and est.trains_used == 3
            # 200-byte IPv4 packets: 172 bytes of payload carry trains of at most 23
            assert responder.counters["packets"] <= 3 * 23
            assert train_drops(responder) == 0
            with pytest.raises(MeshoptError, match="at most 23"):
                await estimate_capacity(A, port=responder.port, packet_bytes=200, train_packets=24)
            with pytest.raises(MeshoptError, match="packet_bytes"):
                await estimate_capacity(A, port=responder.port, packet_bytes=28 + 45)
        finally:
            responder.close()

    asyncio.run(main())


# --- 2. a budget per source ---------------------------------------------------------------


def test_token_bucket_grants_burst_then_rate() -> None:
    now = [0.0]
    buckets = SourceBuckets(RateLimit(rate=10.0, burst=5.0), max_sources=3, clock=lambda: now[0])
    a, b = ipaddress.ip_address(A), ipaddress.ip_address(B)
    assert [buckets.take(a) for _ in range(7)] == [True] * 5 + [False] * 2
    assert buckets.take(b)  # another source has its own bucket
    now[0] = 0.25  # 2.5 tokens back
    assert [buckets.take(a) for _ in range(3)] == [True, True, False]
    # a bounded table: new sources are refused while every bucket is in use ...
    c, d = ipaddress.ip_address("::1"), ipaddress.ip_address("::2")
    assert buckets.take(c) and not buckets.take(d) and len(buckets) == 3
    now[0] = 10.0  # ... and idle (full) ones are forgotten
    assert buckets.take(d) and len(buckets) == 1
    assert RateLimit.for_interval(ProbeConfig().interval_s) == DEFAULT_ECHO_LIMIT
    assert DEFAULT_ECHO_LIMIT.rate == pytest.approx(4 / 0.33)
    with pytest.raises(InputError):
        RateLimit(rate=0.0, burst=5.0)


def test_echo_flood_from_one_source_gets_at_most_its_budget() -> None:
    limit = RateLimit(rate=20.0, burst=10.0)

    async def main() -> None:
        responder = Responder(limit=limit)
        await responder.start(A, 0)
        try:
            with client(A) as flood, client(B) as other:
                dest = (A, responder.port)
                started = time.monotonic()
                for seq in range(300):  # in batches the socket buffer holds
                    flood.sendto(request(seq=seq), dest)
                    if seq % 50 == 49:
                        await reach(lambda: echo_total(responder), seq + 1)
                elapsed = time.monotonic() - started
                for seq in range(5):
                    other.sendto(request(seq=seq), dest)
                got = await replies(flood)
                assert len(got) <= limit.burst + limit.rate * elapsed + 1, elapsed
                assert len(got) >= limit.burst
                assert responder.counters["rate_limited"] == 300 - len(got)
                assert len(await replies(other)) == 5  # the second source is unaffected
        finally:
            responder.close()

    asyncio.run(main())


def test_train_flood_from_one_source_gets_at_most_its_budget() -> None:
    limit = RateLimit(rate=5.0, burst=4.0)

    async def main() -> None:
        responder = TrainResponder(limit=limit)
        await responder.start(A, 0)
        try:
            with client(A) as flood, client(B) as other:
                dest = (A, responder.port)
                started = time.monotonic()
                for tid in range(100):  # trains of one packet: each answered at once
                    flood.sendto(train(tid, 1, report_bytes(1))[0], dest)
                await until(lambda: responder.counters["packets"] == 100)
                elapsed = time.monotonic() - started
                for tid in range(3):
                    for pkt in train(tid, 4, 100):
                        other.sendto(pkt, dest)
                got = await replies(flood)
                assert len(got) <= limit.burst + limit.rate * elapsed + 1, elapsed
                assert responder.counters["drop_rate_limited"] == 100 - len(got)
                assert len(await replies(other)) == 3
        finally:
            responder.close()

    asyncio.run(main())


# --- 3. current peers only ----------------------------------------------------------------


def key(n: int) -> str:
    return base64.b64encode(bytes([n]) * 32).decode()


def peer(n: int, ifname: str, *allowed_ips: str) -> PeerInfo:
    return PeerInfo(key(n), ifname, key(0), "single", tuple(allowed_ips), None, None, 0, 0)


def test_peer_sources_are_probe_addresses_on_their_interface_and_allowed_ips() -> None:
    sources = PeerSources.from_peers(
        [peer(1, "wg0", "10.0.0.2/32", "fd00:1::/64"), peer(2, "wg1", "10.9.0.0/24")]
    )
    ip = ipaddress.ip_address
    p1 = probe_address(key(1))
    assert sources(ip(f"{p1}%wg0"))
    assert not sources(ip(f"{p1}%wg1"))  # the right address on the wrong interface
    assert not sources(ip(f"{probe_address(key(3))}%wg0"))  # not a peer
    assert sources(ip("10.0.0.2")) and not sources(ip("10.0.0.3"))
    assert sources(ip("10.9.0.77")) and not sources(ip("10.9.1.1"))
    assert sources(ip("fd00:1::42")) and not sources(ip("fd00:2::1"))
    assert not PeerSources()(ip(A))  # no peers: nobody
    # what the responders see of a datagram's sender
    assert source_of(("::ffff:127.0.0.2", 9, 0, 0)) == ip(B)
    lo = socket.if_nametoindex("lo")
    assert source_of(("fe80::1", 9, 0, lo)) == ip("fe80::1%lo")
    assert source_of(("not an address", 9)) is None


@pytest.mark.parametrize("kind", ["echo", "train"])
def test_unknown_sources_get_nothing_and_are_counted(kind: str) -> None:
    only_a = PeerSources([(f"{A}/32", None)])

    async def main() -> None:
        responder: AnyResponder = (
            Responder(allowed=only_a) if kind == "echo" else TrainResponder(allowed=only_a)
        )
        await responder.start([A, B], 0)
        try:
            with client(A) as known, client(B) as stranger, client("::1") as stranger6:
                tid = 0
                for s in (stranger, known, stranger6):
                    for dest in (A, B) if s.family == socket.AF_INET else ("::1",):
                        tid += 1
                        if isinstance(responder, Responder):
                            s.sendto(request(), (dest, responder.port))
                        else:
                            s.sendto(train(tid, 1, report_bytes(1))[0], (dest, responder.port))
                assert await replies(stranger) == [] and await replies(stranger6) == []
                assert len(await replies(known)) == 2  # on both addresses
        finally:
            responder.close()
        # ::1 is not bound: only the two IPv4 strangers' datagrams arrived
        counter = "unknown_source" if kind == "echo" else "drop_unknown_source"
        assert responder.counters[counter] == 2

    asyncio.run(main())


def test_replacing_the_allowed_sources_takes_effect_at_once() -> None:
    """The responder judges each sender once and remembers it; a new peer list (the agent
    replaces ``allowed`` when its peers change) is applied to the very next datagram."""

    async def main() -> None:
        responder = Responder(allowed=PeerSources([(f"{A}/32", None)]))
        await responder.start([B], 0)
        try:
            with client(A) as a, client(B) as b:
                for _ in range(3):  # judged once, answered each time
                    a.sendto(request(), (B, responder.port))
                assert len(await replies(a)) == 3
                b.sendto(request(), (B, responder.port))
                assert await replies(b) == []
                responder.allowed = PeerSources([(f"{B}/32", None)])  # A gone, B a peer
                a.sendto(request(), (B, responder.port))
                b.sendto(request(), (B, responder.port))
                assert await replies(a) == [] and len(await replies(b)) == 1
        finally:
            responder.close()
        assert responder.counters["unknown_source"] == 2
        assert responder.counters["echoed"] == 4

    asyncio.run(main())


# --- 4. bound addresses only --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["echo", "train"])
def test_responders_answer_only_on_their_bound_addresses(kind: str) -> None:
    async def main() -> None:
        responder: AnyResponder = Responder() if kind == "echo" else TrainResponder()

        def ask(s: socket.socket, dest: str) -> None:
            if isinstance(responder, Responder):
                s.sendto(request(), (dest, responder.port))
            else:
                s.sendto(train(int.from_bytes(os.urandom(4)), 1, 40)[0], (dest, responder.port))

        await responder.start(port=0)  # no address given: loopback only
        try:
            assert responder.addresses == [A, "::1"]
            with client(A) as s, client("::1") as s6:
                ask(s, B)  # another address of this host: not listened on
                assert await replies(s) == []
                ask(s, A)
                ask(s6, "::1")
                assert len(await replies(s)) == 1 and len(await replies(s6)) == 1
                # the agent moves it: 127.0.0.2 only, plus one that cannot be bound
                responder.listen_on([B, "192.0.2.1"])
                assert responder.addresses == [B]
                assert responder.counters["bind_error"] == 1
                ask(s, A)
                ask(s6, "::1")
                assert await replies(s) == [] and await replies(s6) == []
                ask(s, B)
                assert len(await replies(s)) == 1
        finally:
            responder.close()
        assert responder.addresses == []

    asyncio.run(main())


def test_start_on_an_address_not_of_this_host_fails_with_nothing_bound() -> None:
    async def main() -> None:
        for responder, error in ((Responder(), InputError), (TrainResponder(), MeshoptError)):
            with pytest.raises(error, match=r"192\.0\.2\.1"):
                await responder.start([A, "192.0.2.1"], 0)
            assert responder.addresses == []
            await responder.start([A], 0)  # and it can start again
            responder.close()

    asyncio.run(main())


def test_standalone_binds_interfaces_addresses_or_refuses_to_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert set(asyncio.run(interface_addresses(["lo"]))) >= {A, "::1"}
    assert responder_main(["--interface", "no-such-if*", "--port", "0"]) == 2
    assert "give --host" in capsys.readouterr().err
    assert train_main(["--serve", "--interface", "no-such-if*", "--port", "0"]) == 2
    assert "give --host" in capsys.readouterr().err


# --- 5. random datagrams ------------------------------------------------------------------


def echo_datagrams(rng: random.Random, n: int) -> list[bytes]:
    """Random bytes, mutated requests, random headers and truncated requests."""
    out: list[bytes] = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(0, 1500)))
        elif kind == 1:
            d = bytearray(
                request(rng.randrange(HEADER_BYTES, MAX_PROBE_BYTES + 1), rng.randrange(9))
            )
            for _ in range(rng.randrange(0, 4)):
                d[rng.randrange(min(len(d), 40))] = rng.randrange(256)
            out.append(bytes(d))
        elif kind == 2:
            size = rng.randrange(HEADER_BYTES, 200)
            head = HEADER.pack(
                rng.choice([MAGIC, b"MO", b"OM"]),
                rng.choice([VERSION, VERSION, rng.randrange(256)]),
                rng.randrange(4),
                rng.choice([size, rng.randrange(65536)]),
                rng.randbytes(8),
                rng.randrange(2**32),
                rng.randrange(2**64),
                rng.randrange(2**32),
            )
            out.append(head + bytes(size - HEADER_BYTES))
        else:
            out.append(request(rng.randrange(HEADER_BYTES, 300))[: rng.randrange(0, 40)])
    return out


def train_datagrams(rng: random.Random, n: int) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(n):
        kind = rng.randrange(4)
        count = rng.randrange(1, MAX_TRAIN_PACKETS + 1)
        size = rng.randrange(report_bytes(count), 1500)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(0, 1500)))
        elif kind == 1:
            tid = rng.randrange(8)
            d = bytearray(train(tid, count, size, range(rng.randrange(count), count))[0])
            for _ in range(rng.randrange(0, 3)):
                d[rng.randrange(26)] = rng.randrange(256)
            out.append(bytes(d))
        elif kind == 2:
            head = struct.pack(
                "!4sBBI8sHH",
                rng.choice([b"MOTR", b"MOTX"]),
                rng.choice([1, 1, rng.randrange(256)]),
                rng.randrange(4),
                rng.randrange(2**32),
                rng.randbytes(8),
                rng.randrange(65536),
                rng.randrange(65536),
            )
            out.append(head + bytes(rng.randrange(0, 1400)))
        else:
            out.append(train(1, count, size)[0][: rng.randrange(0, report_bytes(count))])
    out.append(bytes(MAX_PACKET_BYTES + 500))
    return out


def run_fuzz(
    responder: AnyResponder,
    datagrams: list[bytes],
    read: Callable[[], int],
    settle_s: float,
) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Send ``datagrams`` in small batches (each read before the next: no buffer drops);
    the replies and whatever the loop's exception handler caught."""
    errors: list[dict[str, Any]] = []

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        await responder.start(A, 0)
        got: list[bytes] = []
        try:
            with client(A) as s:
                for start in range(0, len(datagrams), 32):
                    batch = datagrams[start : start + 32]
                    for d in batch:
                        s.sendto(d, (A, responder.port))
                    await reach(read, start + len(batch))
                got = await replies(s, settle_s)
        finally:
            responder.close()
        return got

    return asyncio.run(main()), errors


def test_echo_fuzz_never_raises_never_answers_garbage_and_counts_everything() -> None:
    datagrams = echo_datagrams(random.Random(1212), 3000)

    def answerable(d: bytes) -> bool:
        try:
            return decode(d).kind is Kind.REQUEST
        except ProbeFormatError:
            return False

    expected = sorted(decode(d).seq for d in datagrams if answerable(d))
    assert 50 < len(expected) < len(datagrams) - 1000  # a mix of both
    responder = Responder(limit=None)
    got, errors = run_fuzz(responder, datagrams, lambda: echo_total(responder), 0.1)
    assert errors == []
    assert echo_total(responder) == len(datagrams)
    assert responder.counters["echoed"] == len(expected)
    assert sorted(decode(d).seq for d in got) == expected
    assert all(len(d) == HEADER_BYTES for d in got)


def test_train_fuzz_never_raises_never_answers_garbage_and_counts_everything() -> None:
    datagrams = train_datagrams(random.Random(3434), 2000)
    smallest: dict[int, int] = {}  # decodable packets: smallest size per train id
    for d in datagrams:
        try:
            p = decode_train_packet(d)
        except TrainError:
            continue
        if len(d) <= MAX_PACKET_BYTES:
            smallest[p.train_id] = min(smallest.get(p.train_id, 1 << 30), len(d))
    responder = TrainResponder(limit=None)
    got, errors = run_fuzz(
        responder, datagrams, lambda: responder.counters["packets"], REPORT_IDLE_S * 3
    )
    assert errors == []
    c = responder.counters
    assert c["packets"] == len(datagrams)
    assert c["accepted"] + train_drops(responder) == len(datagrams)
    assert c["drop_garbage"] > 0 and c["drop_short"] > 0 and c["accepted"] > 0
    assert len(got) == c["reports"] > 0
    for data in got:
        rep = decode_report(data)
        assert rep.train_id in smallest  # only trains of well-formed packets are answered
        assert len(data) <= smallest[rep.train_id]
