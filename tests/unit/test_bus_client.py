"""BusClient against a real mosquitto on 127.0.0.1 (a free port) and on a unix socket.

The broker is started by the fixture below, tracked by PID and stopped by PID; the
tests skip when mosquitto is not installed (scripts/bootstrap.sh installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from meshopt.bus.client import BrokerAddress, BusClient, parse_broker
from meshopt.bus.messages import AgentStatus, BusMessageError, decode_status, encode
from meshopt.bus.topics import Topics
from meshopt.errors import InputError

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
Msg = tuple[str, bytes, bool]
TOPICS = Topics("lab")


# -- parse_broker (no broker needed) --------------------------------------------------


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("mqtt://broker.example:1884", BrokerAddress("tcp", "broker.example", 1884)),
        ("tcp://10.0.0.1", BrokerAddress("tcp", "10.0.0.1", 1883)),
        ("10.0.0.1:8883", BrokerAddress("tcp", "10.0.0.1", 8883)),
        ("localhost", BrokerAddress("tcp", "localhost", 1883)),
        ("[fd00::1]:1885", BrokerAddress("tcp", "fd00::1", 1885)),
        ("mqtt://agent:s%40cret@h:1", BrokerAddress("tcp", "h", 1, "agent", "s@cret")),
        ("unix:///run/meshopt/mqtt.sock", BrokerAddress("unix", "/run/meshopt/mqtt.sock", 0)),
        ("mqtts://broker.example", BrokerAddress("tcp", "broker.example", 8883, tls=True)),
        ("MQTTS://10.0.0.1:9883", BrokerAddress("tcp", "10.0.0.1", 9883, tls=True)),
        ("mqtts://[fd00::1]", BrokerAddress("tcp", "fd00::1", 8883, tls=True)),
        ("mqtts://n1:pw@h", BrokerAddress("tcp", "h", 8883, "n1", "pw", tls=True)),
    ],
)
def test_parse_broker(url: str, want: BrokerAddress) -> None:
    assert parse_broker(url) == want


@pytest.mark.parametrize(
    "url",
    ["", "  ", "http://h", "ssl://h", "mqtts://h:0", "mqtts://", "mqtts://h/x", "h:0",
     "h:65536", "h:x", "unix://relative", "unix://",
     "mqtt://h/path", "mqtt://h?q=1", "bad_host", "-h", "mqtt://:1883", "unix:///" + "x" * 200],
)  # fmt: skip
def test_parse_broker_refuses_garbage(url: str) -> None:
    with pytest.raises(InputError):
        parse_broker(url)


def test_broker_address_str_hides_password() -> None:
    assert str(parse_broker("mqtt://u:secret@h:5")) == "mqtt://h:5"
    assert str(parse_broker("unix:///x.sock")) == "unix:///x.sock"
    assert str(parse_broker("mqtts://u:secret@h")) == "mqtts://h:8883"


# -- a real broker --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    """One mosquitto process: TCP on 127.0.0.1:port and a unix socket; start/stop by PID."""

    def __init__(self, directory: Path, port: int) -> None:
        self.dir = directory
        self.port = port
        self.sock = directory / "mqtt.sock"
        self.log = directory / "mosquitto.log"
        self.conf = directory / "mosquitto.conf"
        self.conf.write_text(
            "persistence false\nallow_anonymous true\n"
            f"user {os.environ.get('USER') or 'root'}\n"
            "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"
            f"listener {port} 127.0.0.1\nlistener 0 {self.sock}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def tcp_url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.sock}"

    def start(self, timeout: float = 10.0) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                ["mosquitto", "-c", str(self.conf)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log.read_text(errors='replace')}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                if self.sock.exists():
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"mosquitto not listening on {self.port} after {timeout} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None


@pytest.fixture
def broker() -> Iterator[Broker]:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed (scripts/bootstrap.sh installs it)")
    # A short directory: a unix socket path must fit in 107 bytes.
    directory = Path(tempfile.mkdtemp(prefix="meshopt-mq-"))
    b = Broker(directory, free_port())
    try:
        b.start()
        yield b
    finally:
        b.stop()
        shutil.rmtree(directory, ignore_errors=True)


# -- helpers --------------------------------------------------------------------------


def run(coro: Awaitable[T]) -> T:
    async def with_timeout() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(with_timeout())


class Inbox:
    """A handler that queues (topic, payload, retained)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def __call__(self, topic: str, payload: bytes, retained: bool) -> None:
        assert isinstance(payload, bytes)
        await self.queue.put((topic, payload, retained))

    async def get(self, timeout: float = 10.0) -> Msg:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def until(self, want: Callable[[Msg], bool], timeout: float = 15.0) -> Msg:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            msg = await self.get(max(left, 0.001))
            if want(msg):
                return msg


@contextlib.asynccontextmanager
async def running(
    client: BusClient, handler: Callable[[str, bytes, bool], Awaitable[None]] | None = None
) -> AsyncIterator[asyncio.Task[None]]:
    async def ignore(topic: str, payload: bytes, retained: bool) -> None:
        return None

    task = asyncio.create_task(client.run(handler or ignore))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def status(node: str, online: bool) -> bytes:
    return encode(AgentStatus(mesh="lab", node=node, online=online, since=time.time()))


# -- tests with the broker ------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_publish_subscribe_round_trip(broker: Broker, transport: str) -> None:
    url = broker.tcp_url if transport == "tcp" else broker.unix_url

    async def main() -> None:
        inbox = Inbox()
        sub = BusClient(url, client_id="sub", subscriptions=[TOPICS.all_telemetry()])
        pub = BusClient(url, client_id="pub")
        async with running(sub, inbox), running(pub):
            assert await sub.wait_connected(10) and await pub.wait_connected(10)
            assert pub.connected
            assert await pub.publish(TOPICS.telemetry("a"), b"hello", qos=1)
            assert await pub.publish(TOPICS.status("a"), b"not subscribed", qos=1)
            assert await pub.publish(TOPICS.telemetry("b"), b"world")
            assert await inbox.get() == (TOPICS.telemetry("a"), b"hello", False)
            assert await inbox.get() == (TOPICS.telemetry("b"), b"world", False)
            assert pub.published == 3 and sub.received == 2

    run(main())


def test_tcp_and_unix_clients_share_the_broker(broker: Broker) -> None:
    async def main() -> None:
        inbox = Inbox()
        sub = BusClient(broker.unix_url, client_id="sub", subscriptions=[TOPICS.all_status()])
        pub = BusClient(broker.tcp_url, client_id="pub")
        async with running(sub, inbox), running(pub):
            assert await sub.wait_connected(10) and await pub.wait_connected(10)
            await pub.publish(TOPICS.status("x"), b"tcp->unix", qos=1)
            assert (await inbox.get())[1] == b"tcp->unix"

    run(main())


def test_no_local_subscriptions_do_not_bring_our_own_publishes_back(broker: Broker) -> None:
    """A controller's own route sets are not sent back to it (MQTT 5 No Local); other
    clients' publishes on those topics are, and so are its own on other topics."""

    async def main() -> None:
        inbox = Inbox()
        ctl = BusClient(
            broker.tcp_url,
            client_id="ctl",
            subscriptions=[TOPICS.all_routes(), TOPICS.all_status()],
            no_local=[TOPICS.all_routes()],
        )
        other = BusClient(broker.unix_url, client_id="other")
        async with running(ctl, inbox), running(other):
            assert await ctl.wait_connected(10) and await other.wait_connected(10)
            assert await ctl.publish(TOPICS.routes("a"), b"mine", qos=1)
            assert await ctl.publish(TOPICS.status("a"), b"my status", qos=1)
            assert await other.publish(TOPICS.routes("b"), b"theirs", qos=1)
            got = [await inbox.get(), await inbox.get()]
            assert sorted(p for _, p, _ in got) == [b"my status", b"theirs"]
            with pytest.raises(TimeoutError):
                await inbox.get(0.5)

    run(main())


def test_no_local_must_name_a_subscription() -> None:
    with pytest.raises(InputError):
        BusClient("mqtt://127.0.0.1:1", client_id="x", no_local=[TOPICS.all_routes()])


def test_retained_message_seen_by_late_subscriber(broker: Broker) -> None:
    async def main() -> None:
        pub = BusClient(broker.tcp_url, client_id="pub")
        async with running(pub):
            assert await pub.wait_connected(10)
            assert await pub.publish(TOPICS.routes("a"), b"routes v1", qos=1, retain=True)
            assert await pub.publish(TOPICS.routes("b"), b"live only", qos=1)
        inbox = Inbox()
        late = BusClient(broker.tcp_url, client_id="late", subscriptions=[TOPICS.all_routes()])
        async with running(late, inbox):
            assert await inbox.get() == (TOPICS.routes("a"), b"routes v1", True)
            with pytest.raises(TimeoutError):
                await inbox.get(0.5)  # the non-retained one is gone

    run(main())


VICTIM = textwrap.dedent(
    """
    import asyncio, sys
    from meshopt.bus.client import BusClient

    url, topic, keepalive = sys.argv[1], sys.argv[2], int(sys.argv[3])

    async def main():
        client = BusClient(url, client_id="victim", will=(topic, b"offline", True),
                           keepalive_s=keepalive)
        async def hello():
            await client.publish(topic, b"online", qos=1, retain=True)
            print("ready", flush=True)
        client.on_connect = hello
        async def ignore(t, p, r):
            pass
        await client.run(ignore)

    asyncio.run(main())
    """
)


def start_victim(broker: Broker, topic: str, keepalive: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, broker.tcp_url, topic, str(keepalive)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"victim did not connect: {line!r}"
    return proc


def kill_by_pid(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.parametrize("death", ["SIGKILL", "SIGSTOP"])
def test_will_published_when_client_dies(broker: Broker, death: str) -> None:
    """SIGKILL: the kernel closes the socket, the will goes out at once. SIGSTOP: the
    socket stays open and silent; the broker gives up after 1.5 x keepalive (1 s here)."""
    topic = TOPICS.status("victim")

    async def main() -> None:
        victim = await asyncio.to_thread(start_victim, broker, topic, 1)
        try:
            inbox = Inbox()
            watcher = BusClient(broker.tcp_url, client_id="watch", subscriptions=[topic])
            async with running(watcher, inbox):
                assert (await inbox.get())[1] == b"online"
                t0 = time.monotonic()
                os.kill(victim.pid, getattr(signal, death))
                got = await inbox.get(15)
                took = time.monotonic() - t0
                assert got == (topic, b"offline", False)
                print(f"will after {death}: {took:.2f} s")
        finally:
            kill_by_pid(victim)
        # The will was retained: whoever looks later sees the agent offline.
        inbox = Inbox()
        async with running(
            BusClient(broker.tcp_url, client_id="late", subscriptions=[topic]), inbox
        ):
            assert await inbox.get() == (topic, b"offline", True)

    run(main())


def test_an_agent_stalled_for_seconds_keeps_its_session(broker: Broker) -> None:
    """A VM stall is not a dead node: an agent stopped for 8 s keeps its session, so no
    will goes out. At the bus's default keepalive (4 s) the broker may end a session
    after 6 s of silence; at the agent's (10 s), after 15 s."""
    from meshopt.agent.daemon import AGENT_KEEPALIVE_S

    topic = TOPICS.status("victim")

    async def main() -> None:
        victim = await asyncio.to_thread(start_victim, broker, topic, AGENT_KEEPALIVE_S)
        try:
            inbox = Inbox()
            watcher = BusClient(broker.tcp_url, client_id="watch", subscriptions=[topic])
            async with running(watcher, inbox):
                assert (await inbox.get())[1] == b"online"
                os.kill(victim.pid, signal.SIGSTOP)
                await asyncio.sleep(8)
                os.kill(victim.pid, signal.SIGCONT)
                with pytest.raises(TimeoutError):
                    await inbox.get(3)
        finally:
            kill_by_pid(victim)

    run(main())


def test_clean_stop_publishes_the_will(broker: Broker) -> None:
    """A normal DISCONNECT makes the broker drop the will, so the client sends it itself."""
    topic = TOPICS.status("a")

    async def main() -> None:
        inbox = Inbox()
        watcher = BusClient(broker.tcp_url, client_id="watch", subscriptions=[topic])
        fresh = 0

        def will() -> tuple[str, bytes, bool]:
            nonlocal fresh
            fresh += 1
            return topic, status("a", online=False), True

        agent = BusClient(broker.tcp_url, client_id="agent", will=will)
        async with running(watcher, inbox):
            assert await watcher.wait_connected(10)
            async with running(agent):
                assert await agent.wait_connected(10)
                await agent.publish(topic, status("a", online=True), qos=1, retain=True)
                assert decode_status((await inbox.get())[1]).online
            got = decode_status((await inbox.get())[1])
            assert not got.online
            assert fresh >= 2  # built at connect and again at stop

    run(main())


def test_reconnects_after_broker_restart(broker: Broker) -> None:
    async def main() -> None:
        inbox = Inbox()
        connects: list[float] = []

        async def on_connect() -> None:
            connects.append(time.monotonic())

        client = BusClient(
            broker.tcp_url,
            client_id="agent",
            subscriptions=[TOPICS.all_telemetry()],
            on_connect=on_connect,
            backoff_min_s=0.1,
            backoff_max_s=0.5,
        )
        async with running(client, inbox) as task:
            assert await client.wait_connected(10)
            assert len(connects) == 1
            await asyncio.to_thread(broker.stop)
            for _ in range(100):
                if not client.connected:
                    break
                await asyncio.sleep(0.05)
            assert not client.connected
            assert not await client.publish(TOPICS.telemetry("a"), b"lost")  # not queued
            assert client.counters["publish_offline"] == 1
            await asyncio.sleep(1.0)  # a few failed attempts while the broker is down
            assert client.counters["connect_failed"] >= 1
            await asyncio.to_thread(broker.start)
            assert await client.wait_connected(15)
            for _ in range(100):
                if len(connects) == 2:
                    break
                await asyncio.sleep(0.05)
            assert len(connects) == 2, "on_connect did not run again"
            assert client.connects == 2 and client.counters["disconnected"] == 1
            # Subscriptions came back with the new connection.
            assert await client.publish(TOPICS.telemetry("a"), b"after", qos=1)
            assert await inbox.get() == (TOPICS.telemetry("a"), b"after", False)
            assert not task.done()

    run(main())


def test_connects_once_the_broker_appears(broker: Broker) -> None:
    async def main() -> None:
        await asyncio.to_thread(broker.stop)
        client = BusClient(broker.unix_url, client_id="early", backoff_min_s=0.1)
        async with running(client):
            assert not await client.wait_connected(0.5)
            assert client.counters["connect_failed"] >= 1
            await asyncio.to_thread(broker.start)
            assert await client.wait_connected(15)

    run(main())


def test_garbage_reaches_handler_and_handler_errors_do_not_kill_run(broker: Broker) -> None:
    async def main() -> None:
        seen: list[Msg] = []
        decoded: list[AgentStatus] = []
        good = asyncio.Event()

        async def handler(topic: str, payload: bytes, retained: bool) -> None:
            seen.append((topic, payload, retained))
            decoded.append(decode_status(payload))  # raises BusMessageError on garbage
            good.set()

        hook_calls = 0

        async def bad_hook() -> None:
            nonlocal hook_calls
            hook_calls += 1
            raise RuntimeError("hook bug")

        sub = BusClient(
            broker.tcp_url,
            client_id="sub",
            subscriptions=[TOPICS.all_status()],
            on_connect=bad_hook,
        )
        pub = BusClient(broker.tcp_url, client_id="pub")
        garbage = [b"", b"\xff\xfe\x00garbage", b"{" * 1000, os.urandom(300_000)]
        async with running(sub, handler) as task, running(pub):
            assert await sub.wait_connected(10) and await pub.wait_connected(10)
            assert hook_calls == 1 and sub.counters["hook_error"] == 1
            for g in garbage:
                assert await pub.publish(TOPICS.status("a"), g, qos=1)
            await pub.publish(TOPICS.status("a"), status("a", online=True), qos=1)
            await asyncio.wait_for(good.wait(), 10)
            assert not task.done()
            assert [p for _, p, _ in seen[:-1]] == garbage
            assert all(isinstance(p, bytes) for _, p, _ in seen)
            assert len(decoded) == 1 and decoded[0].online
            assert sub.counters["handler_error"] == len(garbage)
            with pytest.raises(BusMessageError):
                decode_status(garbage[-1])

    run(main())


def test_bad_client_arguments() -> None:
    with pytest.raises(InputError):
        BusClient("mqtt://h", client_id="")
    with pytest.raises(InputError):
        BusClient("mqtt://h", client_id="x", backoff_min_s=5, backoff_max_s=1)
    with pytest.raises(InputError):
        BusClient("not a url!", client_id="x")
