"""Two real mosquitto brokers bridged over TLS, with meshopt's own files and clients.

Broker 1 (central) holds the controller, node ``a`` and the bridge identity ``r2``;
broker 2 (regional) holds nodes ``b``, ``c``, ``d`` and the bridge section that
:func:`meshopt.broker.bridge.write_bridge` writes. Both run exactly what ``meshopt
broker init`` writes (TLS with client certificates, passwords, the ACL), on 127.0.0.1
ports, started and stopped by PID. The agent and controller sides are the real
:class:`BusClient` with signed messages; an aiomqtt subscriber shows the QoS and retain
flag a message arrives with.

Every wait is for an event (a message, with a generous timeout under load), never for
a time bound. mosquitto drops what the ACL denies without telling the sender, so each
"not forwarded" check sends a control message after the denied one on the same
connection and asserts that the control message arrives and the denied one never did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshopt.broker.bridge import bridge_topic, write_bridge
from meshopt.broker.mosquitto import (
    MAX_PACKET_SIZE,
    BrokerRequest,
    make_identities,
    write_broker_dir,
)
from meshopt.bus.client import BrokerSettings, BusClient, client_kwargs
from meshopt.bus.messages import (
    MAX_PAYLOAD_BYTES,
    AgentStatus,
    BusMessageError,
    Lease,
    Route,
    RouteSet,
)
from meshopt.bus.signing import (
    generate_signing_key,
    save_private_key,
    sign,
    sign_route_set,
    verify_lease,
    verify_route_set,
    verify_status,
)
from meshopt.bus.topics import Topics
from meshopt.errors import InputError

from .test_bus_client import REPO, Broker, Inbox, free_port, run, running

MESH = "m"
T = Topics(MESH)
KEY_A = "A" * 43 + "="  # WireGuard-style base64 keys for route via/backup
KEY_B = "B" * 43 + "="
WAIT = 30.0  # seconds to wait for an event that should come (generous: a busy 2-core VM)


class PkiBroker(Broker):
    """A mosquitto running the conf of a ``broker init`` directory."""

    def __init__(self, directory: Path, port: int, pki: Path) -> None:
        super().__init__(directory, port)
        self.pki = pki
        self.conf = pki / "broker" / "mosquitto.conf"

    def start(self, timeout: float = 10.0) -> None:
        super().start(timeout)

    def kill(self) -> None:
        """SIGKILL by PID: a crash, no clean goodbyes to the bridge or the clients."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def settings(self, who: str) -> BrokerSettings:
        d = self.pki / "clients" / who
        return BrokerSettings(
            url=f"mqtts://127.0.0.1:{self.port}",
            ca_file=str(d / "ca.crt"),
            cert_file=str(d / "client.crt"),
            key_file=str(d / "client.key"),
            username=who,
            password_file=str(d / "password"),
        )


@dataclass
class Mesh:
    central: PkiBroker
    regional: PkiBroker
    controller_key: Ed25519PrivateKey
    controller_pub: str
    node_keys: dict[str, tuple[Ed25519PrivateKey, str]]
    tmp: Path


def _request(ids: object, port: int, sock: Path) -> BrokerRequest:
    return BrokerRequest(
        mesh=MESH,
        identities=tuple(ids),  # type: ignore[call-overload]
        hosts=("127.0.0.1", "localhost"),
        port=port,
        install_dir="",
        client_dir="",
        bind_address="127.0.0.1",
        unix_socket=str(sock),
        persistence_dir="",
        run_as=os.environ.get("USER") or "root",
        log_dest="stderr",
    )


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed (scripts/bootstrap.sh installs it)")
    tmp = Path(tempfile.mkdtemp(prefix="meshopt-br-"))  # short: unix socket paths
    d1, d2 = tmp / "b1", tmp / "b2"
    d1.mkdir()
    d2.mkdir()
    p1, p2 = free_port(), free_port()
    central_ids = make_identities(["a"], ["ctl"], ["reader"], bridges={"r2": ["b", "c", "d"]})
    write_broker_dir(_request(central_ids, p1, d1 / "mqtt.sock"), tmp / "pki1")
    regional_ids = make_identities(["b", "c", "d"], [], ["reader"])
    write_broker_dir(_request(regional_ids, p2, d2 / "mqtt.sock"), tmp / "pki2")
    write_bridge(tmp / "pki2", tmp / "pki1", "r2", install_dir="")
    central = PkiBroker(d1, p1, tmp / "pki1")
    regional = PkiBroker(d2, p2, tmp / "pki2")
    ctl_key, ctl_pub = generate_signing_key()
    node_keys = {n: generate_signing_key() for n in "abcd"}
    try:
        central.start()
        regional.start()
        m = Mesh(central, regional, ctl_key, ctl_pub, node_keys, tmp)
        run(bridge_state(m, "1"))  # the bridge is up before any test starts
        yield m
    finally:
        regional.stop()
        central.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# --- helpers ---------------------------------------------------------------------------

Got = tuple[str, bytes, int, bool]  # topic, payload, qos, retain


class Subscriber:
    """An aiomqtt session recording every message with its QoS and retain flag."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.queue: asyncio.Queue[Got] = asyncio.Queue()

    async def until(self, want: Callable[[Got], bool], timeout: float = WAIT) -> Got:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            got = await asyncio.wait_for(self.queue.get(), max(left, 0.001))
            if want(got):
                return got


@contextlib.asynccontextmanager
async def subscribed(settings: BrokerSettings, *topics: str) -> AsyncIterator[Subscriber]:
    client = aiomqtt.Client(**client_kwargs(settings), identifier=f"t-{os.urandom(4).hex()}")
    async with client:
        for t in topics:
            await client.subscribe(t, qos=1)
        sub = Subscriber(client)

        async def pump() -> None:
            async for msg in client.messages:
                payload = msg.payload if isinstance(msg.payload, bytes) else b""
                await sub.queue.put((msg.topic.value, payload, msg.qos, bool(msg.retain)))

        task = asyncio.create_task(pump())
        try:
            yield sub
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def bridge_state(m: Mesh, want: str) -> None:
    """Wait until broker 1 holds the bridge's link state ``want`` ("1" up, "0" down)."""
    topic = bridge_topic(MESH, "r2")
    async with subscribed(m.central.settings("reader"), topic) as sub:
        await sub.until(lambda g: g[0] == topic and g[1] == want.encode())


def bus(settings: BrokerSettings, name: str, *subs: str) -> BusClient:
    return BusClient(
        settings,
        client_id=f"test-{name}-{os.getpid()}-{os.urandom(2).hex()}",
        subscriptions=subs,
        backoff_min_s=0.1,
        backoff_max_s=0.5,
    )


def route_set(m: Mesh, node: str, version: int, routes: int = 2) -> bytes:
    rs = RouteSet(
        mesh=MESH,
        node=node,
        version=version,
        issued_at=time.time(),
        controller="ctl",
        term=1,
        routes=[
            Route(dst=f"10.{i // 250}.{i % 250}.0/24", via=KEY_A, backup=KEY_B, mtu=1420)
            for i in range(routes)
        ],
    )
    return sign_route_set(rs, m.controller_key)


def status(m: Mesh, node: str, online: bool, seq: int) -> bytes:
    st = AgentStatus(mesh=MESH, node=node, online=online, since=time.time(), seq=seq)
    return sign("status", st, m.node_keys[node][0])


def version_of(m: Mesh, node: str, payload: bytes) -> int:
    return verify_route_set(payload, [m.controller_pub], mesh=MESH, node=node).version


# --- the files -------------------------------------------------------------------------


def test_bridge_conf_and_acl_forward_exactly_the_regions_topics(mesh: Mesh) -> None:
    conf = (mesh.tmp / "pki2" / "broker" / "mosquitto.conf").read_text()
    topics = sorted(line for line in conf.splitlines() if line.startswith("topic "))
    want = [f"topic meshopt/m/{k}/{n} {d} 1" for n in "bcd" for k, d in
            (("telemetry", "out"), ("status", "out"), ("routes", "in"))]  # fmt: skip
    want += ["topic meshopt/m/controller/lease in 1", "topic meshopt/m/controller/status/+ in 1"]
    assert topics == sorted(want)
    assert f"bridge_max_packet_size {MAX_PACKET_SIZE}" in conf
    assert f"max_packet_size {MAX_PACKET_SIZE}" in conf
    assert "try_private true" in conf and "bridge_insecure false" in conf
    assert (mesh.tmp / "pki2" / "broker" / "mosquitto.conf").stat().st_mode & 0o077 == 0
    acl = (mesh.tmp / "pki1" / "broker" / "acl").read_text()
    block = acl.split("user r2\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert sorted(block) == sorted(
        [f"topic write meshopt/m/{k}/{n}" for n in "bcd" for k in ("telemetry", "status")]
        + [f"topic read meshopt/m/routes/{n}" for n in "bcd"]
        + [
            "topic read meshopt/m/controller/lease",
            "topic read meshopt/m/controller/status/+",
            "topic write meshopt/m/bridge/r2",
        ]
    )


def test_broker_init_rerun_keeps_the_bridge_section_and_bridge_nodes(tmp_path: Path) -> None:
    ids = make_identities(["a"], ["ctl"], bridges={"r2": ["b"]})
    write_broker_dir(_request(ids, 18883, tmp_path / "s1"), tmp_path / "c")
    write_broker_dir(_request(make_identities(["b"], []), 18884, tmp_path / "s2"), tmp_path / "r")
    write_bridge(tmp_path / "r", tmp_path / "c", "r2", install_dir="")
    write_bridge(tmp_path / "r", tmp_path / "c", "r2", install_dir="")  # replaces, not adds
    conf = tmp_path / "r" / "broker" / "mosquitto.conf"
    assert conf.read_text().count("connection r2") == 1
    # re-runs of broker init: the regional conf keeps its bridge, the central ACL its nodes
    more = make_identities(["b", "e"], [])
    write_broker_dir(_request(more, 18884, tmp_path / "s2"), tmp_path / "r", force=True)
    assert conf.read_text().count("connection r2") == 1
    assert conf.stat().st_mode & 0o077 == 0
    write_broker_dir(
        _request(make_identities([], ["ctl2"]), 18883, tmp_path / "s1"), tmp_path / "c", force=True
    )
    assert "topic read meshopt/m/routes/b" in (tmp_path / "c" / "broker" / "acl").read_text()


def test_bad_bridge_input_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="give the nodes of its region"):
        make_identities([], [], bridges={"r2": []})
    with pytest.raises(InputError, match="bad node name"):
        make_identities([], [], bridges={"r2": ["a/b"]})
    with pytest.raises(InputError, match="given as a node and as a bridge"):
        make_identities(["r2"], [], bridges={"r2": ["x"]})
    ids = make_identities(["a"], [], bridges={"r2": ["b", "z"]})
    write_broker_dir(_request(ids, 18883, tmp_path / "s1"), tmp_path / "c")
    write_broker_dir(_request(make_identities(["b"], []), 18884, tmp_path / "s2"), tmp_path / "r")
    with pytest.raises(InputError, match="does not have: z"):
        write_bridge(tmp_path / "r", tmp_path / "c", "r2")
    with pytest.raises(InputError, match="has no bridge 'a'"):
        write_bridge(tmp_path / "r", tmp_path / "c", "a")
    with pytest.raises(InputError, match="no usable"):
        write_bridge(tmp_path / "nowhere", tmp_path / "c", "r2")


# --- across the bridge -----------------------------------------------------------------


def test_route_set_from_central_reaches_agent_on_regional_signed_at_qos1(mesh: Mesh) -> None:
    async def go() -> None:
        inbox = Inbox()
        agent = bus(mesh.regional.settings("b"), "agent-b", T.routes("b"))
        ctl = bus(mesh.central.settings("ctl"), "ctl")
        reader = mesh.regional.settings("reader")
        async with running(agent, inbox), running(ctl), subscribed(reader, T.routes("b")) as sub:
            assert await agent.wait_connected(WAIT) and await ctl.wait_connected(WAIT)
            # the version tells this publish from route sets retained by earlier runs
            payload = route_set(mesh, "b", 101)
            assert await ctl.publish(T.routes("b"), payload, qos=1, retain=True)
            _, got, _ = await inbox.until(
                lambda x: x[0] == T.routes("b") and version_of(mesh, "b", x[1]) == 101
            )
            assert got == payload
            _, raw, qos, _ = await sub.until(lambda g: version_of(mesh, "b", g[1]) == 101)
            assert raw == payload and qos == 1  # QoS 1 end to end: publish, bridge, subscriber
            # an agent on the central broker is served as before, and nothing of it is
            # forwarded to the region (the bridge carries only the region's nodes)
            local = Inbox()
            agent_a = bus(mesh.central.settings("a"), "agent-a", T.routes("a"))
            async with running(agent_a, local), subscribed(reader, "meshopt/m/#") as region:
                assert await agent_a.wait_connected(WAIT)
                assert await ctl.publish(T.routes("a"), route_set(mesh, "a", 102), qos=1)
                assert await ctl.publish(T.routes("b"), route_set(mesh, "b", 103), qos=1)
                _, got, _ = await local.until(lambda x: x[0] == T.routes("a"))
                assert version_of(mesh, "a", got) == 102
                topic, got, _, _ = await region.until(lambda g: not g[3])  # live, in order
                assert (topic, version_of(mesh, "b", got)) == (T.routes("b"), 103)

    run(go())


def test_late_subscriber_on_regional_gets_retained_route_set_and_lease(mesh: Mesh) -> None:
    """Published retained on broker 1 while the link is up: retained on broker 2 too."""

    async def go() -> None:
        ctl = bus(mesh.central.settings("ctl"), "ctl")
        now = time.time()
        lease = Lease(mesh=MESH, controller="ctl", term=7, expires_at=now + 60, issued_at=now)
        async with running(ctl):
            assert await ctl.wait_connected(WAIT)
            # a regional reader sees both arrive live, so they are on broker 2 when it joins
            async with subscribed(mesh.regional.settings("reader"), T.routes("c"), T.lease()) as s:
                assert await ctl.publish(
                    T.routes("c"), route_set(mesh, "c", 202), qos=1, retain=True
                )
                assert await ctl.publish(
                    T.lease(), sign("lease", lease, mesh.controller_key), qos=1, retain=True
                )
                await s.until(
                    lambda g: g[0] == T.routes("c") and version_of(mesh, "c", g[1]) == 202
                )
                await s.until(lambda g: g[0] == T.lease())
        inbox = Inbox()
        agent = bus(mesh.regional.settings("c"), "agent-c", T.routes("c"))
        async with running(agent, inbox):
            _, payload, retained = await inbox.until(lambda x: x[0] == T.routes("c"))
            assert retained and version_of(mesh, "c", payload) == 202
        async with subscribed(mesh.regional.settings("reader"), T.lease()) as s:
            _, payload, _, retained = await s.until(lambda g: g[0] == T.lease())
            assert retained
            assert verify_lease(payload, [mesh.controller_pub], mesh=MESH).term == 7

    run(go())


AGENT = textwrap.dedent(
    """
    import asyncio, sys, time
    from meshopt.bus.client import BrokerSettings, BusClient
    from meshopt.bus.messages import AgentStatus
    from meshopt.bus.signing import load_private_key, sign
    url, ca, cert, key, user, pw, keyfile, topic, seq = sys.argv[1:10]
    k = load_private_key(keyfile)
    def st(online):
        s = AgentStatus(mesh="m", node=user, online=online, since=time.time(), seq=int(seq))
        return sign("status", s, k)
    bus = BusClient(BrokerSettings(url, ca, cert, key, user, pw), client_id="agent-" + user,
                    will=lambda: (topic, st(False), True), backoff_min_s=0.1, backoff_max_s=0.5)
    async def hello():
        await bus.publish(topic, st(True), qos=1, retain=True)
    bus.on_connect = hello
    async def ignore(t, p, r):
        pass
    asyncio.run(bus.run(ignore))
    """
)


def start_agent(m: Mesh, node: str, seq: int) -> subprocess.Popen[bytes]:
    """A process connected to broker 2 as ``node``: online status on connect, will offline."""
    s = m.regional.settings(node)
    keyfile = m.tmp / f"{node}.key"
    save_private_key(keyfile, m.node_keys[node][0])
    args = [s.url, s.ca_file, s.cert_file, s.key_file, node, s.password_file, str(keyfile)]
    return subprocess.Popen(
        [sys.executable, "-c", AGENT, *args, T.status(node), str(seq)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_will_of_killed_agent_on_regional_reaches_controller_on_central(mesh: Mesh) -> None:
    pub = [mesh.node_keys["d"][1]]

    def of(payload: bytes) -> AgentStatus:
        return verify_status(payload, pub, mesh=MESH, node="d")

    async def go() -> None:
        inbox = Inbox()
        ctl = bus(mesh.central.settings("ctl"), "ctl", T.all_status())
        async with running(ctl, inbox):
            assert await ctl.wait_connected(WAIT)
            proc = start_agent(mesh, "d", 5)
            try:
                await inbox.until(lambda x: x[0] == T.status("d") and of(x[1]).online, WAIT)
                os.kill(proc.pid, signal.SIGKILL)  # its TCP connection dies with it
                proc.wait(10)
                _, payload, _ = await inbox.until(
                    lambda x: x[0] == T.status("d") and not of(x[1]).online, WAIT
                )
                assert of(payload).seq == 5
            finally:
                stop(proc)
        # the will was retained on broker 1 as well: a controller starting now reads it
        late = Inbox()
        again = bus(mesh.central.settings("ctl"), "ctl2", T.status("d"))
        async with running(again, late):
            _, payload, retained = await late.until(lambda x: x[0] == T.status("d"))
            assert retained and not of(payload).online

    run(go())


def test_200kB_route_set_crosses_and_oversized_is_seen_not_lost(mesh: Mesh) -> None:
    """The size meshopt needs crosses; above its 256 KiB limit (and under the brokers'
    and bridge's 512 KiB packets) a message still arrives, for the agent to refuse and count."""
    routes = 1150
    payload = route_set(mesh, "b", 303, routes)
    while len(payload) < 200_000:
        routes += 50
        payload = route_set(mesh, "b", 303, routes)
    assert 200_000 <= len(payload) <= MAX_PAYLOAD_BYTES
    junk = b"x" * (MAX_PAYLOAD_BYTES + 40_000)

    async def go() -> None:
        inbox = Inbox()
        agent = bus(mesh.regional.settings("b"), "agent-b", T.routes("b"))
        ctl = bus(mesh.central.settings("ctl"), "ctl")
        async with running(agent, inbox), running(ctl):
            assert await agent.wait_connected(WAIT) and await ctl.wait_connected(WAIT)
            assert await ctl.publish(T.routes("b"), payload, qos=1, retain=True)
            _, got, _ = await inbox.until(lambda x: len(x[1]) == len(payload))
            assert got == payload
            rs = verify_route_set(got, [mesh.controller_pub], mesh=MESH, node="b")
            assert (rs.version, len(rs.routes)) == (303, routes)
            assert await ctl.publish(T.routes("b"), junk, qos=1)
            _, got, _ = await inbox.until(lambda x: len(x[1]) == len(junk))
            with pytest.raises(BusMessageError) as err:
                verify_route_set(got, [mesh.controller_pub], mesh=MESH, node="b")
            assert err.value.reason == "too_large"

    run(go())


def test_a_2000_destination_route_set_crosses_and_the_agent_takes_it(mesh: Mesh) -> None:
    """A 2,000-node mesh's set (fast and bulk routes, packed: its JSON would be 560 kB)
    crosses the production broker config and the bridge, retained, at QoS 1, and the
    agent's own acceptance path (AgentCore) takes it with every route."""
    from meshopt.agent.core import AgentCore, RouteState
    from meshopt.wireguard.keys import generate_keypair

    peers = [generate_keypair()[1] for _ in range(2000)]
    routes = []
    for i, k in enumerate(peers):
        dst = f"10.{100 + i // 256}.{i % 256}.1/32"
        routes.append(Route(dst=dst, via=k, backup=peers[(i + 1) % len(peers)]))
        routes.append(Route(dst=dst, via=k, table="bulk", mtu=1420, advmss=1380, window=2**22))
    rs = RouteSet(mesh=MESH, node="b", version=2000, issued_at=time.time(), controller="ctl",
                  term=1, routes=routes)  # fmt: skip
    payload = sign_route_set(rs, mesh.controller_key)
    assert len(payload) <= MAX_PAYLOAD_BYTES

    async def go() -> None:
        inbox = Inbox()
        agent = bus(mesh.regional.settings("b"), "agent-b", T.routes("b"))
        ctl = bus(mesh.central.settings("ctl"), "ctl")
        async with running(agent, inbox), running(ctl):
            assert await agent.wait_connected(WAIT) and await ctl.wait_connected(WAIT)
            assert await ctl.publish(T.routes("b"), payload, qos=1, retain=True)
            _, got, _ = await inbox.until(lambda x: len(x[1]) == len(payload))
            assert got == payload
            core = AgentCore(MESH, "b", mesh.node_keys["b"][0], [mesh.controller_pub],
                             RouteState(), time.time())  # fmt: skip
            accepted = core.on_route_set(got, time.time())
            assert accepted is not None, core.counters.snapshot()
            assert accepted.route_set == rs and len(accepted.route_set.routes) == 4000

    run(go())


def test_bridge_identity_may_write_only_its_regions_topics(mesh: Mesh) -> None:
    """Logged in to broker 1 as the bridge user (another client id): its ACL in action."""
    bridge_dir = mesh.tmp / "pki1" / "clients" / "r2"
    as_bridge = BrokerSettings(
        url=f"mqtts://127.0.0.1:{mesh.central.port}",
        ca_file=str(bridge_dir / "ca.crt"),
        cert_file=str(bridge_dir / "client.crt"),
        key_file=str(bridge_dir / "client.key"),
        username="r2",
        password_file=str(bridge_dir / "password"),
    )

    async def go() -> None:
        reader = mesh.central.settings("reader")
        async with subscribed(reader, "meshopt/m/#") as sub:
            client = aiomqtt.Client(**client_kwargs(as_bridge), identifier="not-the-bridge")
            async with client:
                await client.publish(T.telemetry("a"), b"denied: not its region", qos=1)
                await client.publish(T.routes("b"), b"denied: routes are read-only", qos=1)
                await client.publish(T.lease(), b"denied: the lease", qos=1)
                await client.publish(T.telemetry("b"), b"allowed", qos=1)
            got = await sub.until(lambda g: g[1] in (b"allowed",) or g[1].startswith(b"denied"))
            assert got[:2] == (T.telemetry("b"), b"allowed")

    run(go())


def test_regional_broker_crash_and_restart(mesh: Mesh) -> None:
    """Kill broker 2 (SIGKILL), publish while it is down, start it again.

    Observed: broker 1 publishes the bridge's will (link state "0"); broker 2 comes back
    empty (no persistence here) and its bridge re-subscribes, so the route set published
    meanwhile arrives, retained, and the agent (reconnecting on its own) gets it; the link
    state goes back to "1". The agent's online status reaches the controller again.
    """

    async def go() -> None:
        inbox = Inbox()
        agent = bus(mesh.regional.settings("b"), "agent-b", T.routes("b"))
        agent.on_connect = lambda: _online(agent, mesh, "b")
        status_inbox = Inbox()
        ctl = bus(mesh.central.settings("ctl"), "ctl", T.status("b"))
        async with running(agent, inbox), running(ctl, status_inbox):
            assert await agent.wait_connected(WAIT) and await ctl.wait_connected(WAIT)
            before = agent.connects
            mesh.regional.kill()
            await bridge_state(mesh, "0")
            assert await ctl.publish(T.routes("b"), route_set(mesh, "b", 404), qos=1, retain=True)
            mesh.regional.start()
            await bridge_state(mesh, "1")
            _, payload, _ = await inbox.until(
                lambda x: x[0] == T.routes("b") and version_of(mesh, "b", x[1]) == 404
            )
            assert agent.connects > before
            # the agent's hello after its reconnect (seq = its connection count) crosses
            # too, whichever of the agent and the bridge reconnected first
            pub = [mesh.node_keys["b"][1]]
            await status_inbox.until(
                lambda x: verify_status(x[1], pub, mesh=MESH, node="b").seq == agent.connects
            )
        late = Inbox()
        again = bus(mesh.regional.settings("b"), "agent-b2", T.routes("b"))
        async with running(again, late):
            _, payload, retained = await late.until(lambda x: x[0] == T.routes("b"))
            assert retained and version_of(mesh, "b", payload) == 404

    run(go())


async def _online(client: BusClient, m: Mesh, node: str) -> None:
    seq = client.connects
    await client.publish(T.status(node), status(m, node, True, seq), qos=1, retain=True)


def test_central_broker_crash_keeps_region_static_and_queues_the_will(mesh: Mesh) -> None:
    """Kill broker 1 (SIGKILL): the link drops, broker 2 goes on alone.

    Observed: a route set retained on broker 2 before the crash is still served there
    (agents restarting in the region get their last routes: fail-static); an agent that
    dies while the link is down leaves its will on broker 2, and it reaches broker 1,
    retained, once broker 1 is back and the bridge has reconnected. Broker 1 comes back
    empty here (persistence off); its retained route sets are gone, but broker 2 keeps
    its copies (nothing clears them through an "in" topic).
    """
    pub = [mesh.node_keys["d"][1]]

    def of(payload: bytes) -> AgentStatus:
        return verify_status(payload, pub, mesh=MESH, node="d")

    async def go() -> None:
        ctl = bus(mesh.central.settings("ctl"), "ctl")
        reader = mesh.regional.settings("reader")
        async with running(ctl), subscribed(reader, T.routes("b")) as sub:
            assert await ctl.wait_connected(WAIT)
            assert await ctl.publish(T.routes("b"), route_set(mesh, "b", 505), qos=1, retain=True)
            await sub.until(lambda g: version_of(mesh, "b", g[1]) == 505)
        mesh.central.kill()
        async with subscribed(reader, T.status("d")) as sub:
            proc = start_agent(mesh, "d", 6)
            try:
                await sub.until(lambda g: of(g[1]).seq == 6 and of(g[1]).online)
                stop(proc)
                await sub.until(lambda g: of(g[1]).seq == 6 and not of(g[1]).online)
            finally:
                stop(proc)
        late = Inbox()
        agent = bus(mesh.regional.settings("b"), "agent-b3", T.routes("b"))
        async with running(agent, late):
            _, payload, retained = await late.until(lambda x: x[0] == T.routes("b"))
            assert retained and version_of(mesh, "b", payload) == 505
        mesh.central.start()
        await bridge_state(mesh, "1")
        inbox = Inbox()
        ctl2 = bus(mesh.central.settings("ctl"), "ctl3", T.status("d"))
        async with running(ctl2, inbox):
            _, payload, _ = await inbox.until(lambda x: of(x[1]).seq == 6 and not of(x[1]).online)
        async with subscribed(reader, T.routes("b")) as sub:
            _, payload, _, retained = await sub.until(lambda g: True)
            assert retained and version_of(mesh, "b", payload) == 505

    run(go())


def test_cli_writes_both_sides_and_refuses_bad_options_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshopt.cli.main import main

    base = ["broker", "init", "--mesh", "m", "--host", "127.0.0.1"]
    central, regional = str(tmp_path / "c"), str(tmp_path / "r")
    assert main([*base, "--node", "a", "--bridge", "r2=b,c", "--out", central]) == 0
    assert main([*base, "--node", "b", "--node", "c", "--bridge-to", f"r2={central}",
                 "--out", regional]) == 0  # fmt: skip
    conf = (tmp_path / "r" / "broker" / "mosquitto.conf").read_text()
    assert "connection r2" in conf and "address 127.0.0.1:8883" in conf
    assert "topic meshopt/m/routes/c in 1" in conf
    capsys.readouterr()
    for bad in (["--bridge", "r2"], ["--bridge", "r/2=b"], ["--bridge-to", "r2"]):
        assert main([*base, "--node", "x", *bad, "--out", str(tmp_path / "bad")]) != 0
        err = capsys.readouterr().err.strip()
        assert err.startswith("meshopt: error:") and "\n" not in err and "Traceback" not in err
