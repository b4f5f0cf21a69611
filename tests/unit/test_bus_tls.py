"""The secured broker for real: mosquitto 2.0 on 127.0.0.1 (a free port) and a unix
socket, run with exactly the files ``meshopt broker init`` writes (TLS with client
certificates, our ``$7$`` password file, the ACL), and our clients against it.

mosquitto drops a publish the ACL denies without telling the sender, so each "not
delivered" check sends a control message after the denied one, on the same connection
where possible, and asserts that the control message arrives and the denied one never
did (messages from one connection are delivered in order).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest

from meshopt.broker.mosquitto import BrokerRequest, make_identities, write_broker_dir
from meshopt.bus.client import BrokerSettings, BusClient, check_broker_settings, client_kwargs
from meshopt.errors import InputError
from meshopt.live import read_bus

from .test_bus_client import Broker, Inbox, free_port, run, running

MESH = "lab"
P = f"meshopt/{MESH}"


class SecureBroker(Broker):
    """A mosquitto with the generated config: TLS on 127.0.0.1:port, plain unix socket."""

    def __init__(self, directory: Path, port: int) -> None:
        super().__init__(directory, port)
        self.pki = directory / "pki"
        req = BrokerRequest(
            mesh=MESH,
            identities=tuple(make_identities(["a", "b"], ["ctl1"], ["reader"])),
            hosts=("127.0.0.1", "localhost"),
            port=port,
            install_dir="",
            client_dir="",
            bind_address="127.0.0.1",
            unix_socket=str(self.sock),
            persistence_dir="",
            run_as=os.environ.get("USER") or "root",
            log_dest="stderr",
        )
        write_broker_dir(req, self.pki)
        self.conf = self.pki / "broker" / "mosquitto.conf"  # start() runs this one

    def settings(self, who: str, **changes: str) -> BrokerSettings:
        d = self.pki / "clients" / who
        fields = {
            "url": f"mqtts://127.0.0.1:{self.port}",
            "ca_file": str(d / "ca.crt"),
            "cert_file": str(d / "client.crt"),
            "key_file": str(d / "client.key"),
            "username": who,
            "password_file": str(d / "password"),
            **changes,
        }
        return BrokerSettings(**fields)

    def unix(self, who: str) -> BrokerSettings:
        d = self.pki / "clients" / who
        return BrokerSettings(
            url=f"unix://{self.sock}", username=who, password_file=str(d / "password")
        )


@pytest.fixture(scope="module")
def broker() -> Iterator[SecureBroker]:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed (scripts/bootstrap.sh installs it)")
    directory = Path(tempfile.mkdtemp(prefix="meshopt-tls-"))  # short: a unix socket path
    b = SecureBroker(directory, free_port())
    try:
        b.start()
        yield b
    finally:
        b.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def refused(settings: BrokerSettings | str, timeout: float = 5.0) -> str:
    """Connect once; the error text if the broker (or TLS) refused, '' if it let us in.

    A TLS failure surfaces in aiomqtt only as a CONNACK timeout (paho logs the reason).
    """
    client = aiomqtt.Client(**client_kwargs(settings), timeout=timeout)
    try:
        async with client:
            return ""
    except aiomqtt.MqttError as exc:
        return str(exc) or type(exc).__name__


def client(settings: BrokerSettings, name: str, subscriptions: tuple[str, ...] = ()) -> BusClient:
    return BusClient(
        settings,
        client_id=f"test-{name}-{os.getpid()}",
        subscriptions=subscriptions,
        backoff_min_s=0.1,
        backoff_max_s=0.5,
    )


# --- who gets in ---------------------------------------------------------------------------


def test_node_connects_with_tls_and_publishes_its_telemetry(broker: SecureBroker) -> None:
    async def go() -> None:
        inbox = Inbox()
        ctl = client(broker.settings("ctl1"), "ctl1", (f"{P}/telemetry/+",))
        node = client(broker.settings("a"), "a")
        async with running(ctl, inbox), running(node):
            assert await ctl.wait_connected(10) and await node.wait_connected(10)
            assert await node.publish(f"{P}/telemetry/a", b"hello", qos=1)
            assert await inbox.get() == (f"{P}/telemetry/a", b"hello", False)
        assert "connect_failed" not in node.counters

    run(go())


def test_anonymous_and_passwordless_clients_are_refused(broker: SecureBroker) -> None:
    async def go() -> None:
        good = broker.settings("a")
        assert await refused(good) == ""
        # TLS with a valid certificate, but no user name or password.
        no_login = broker.settings("a", username="", password_file="")
        assert "not authori" in (await refused(no_login)).lower()
        # A wrong password.
        bad = Path(broker.dir / "wrong")
        bad.write_text("not-the-password\n")
        bad.chmod(0o600)
        assert (
            "not authori" in (await refused(broker.settings("a", password_file=str(bad)))).lower()
        )
        # Plain MQTT on the TLS port.
        assert await refused(f"mqtt://127.0.0.1:{broker.port}", timeout=1.5) != ""
        # The unix socket: anonymous refused, the password accepted (no TLS there).
        assert "not authori" in (await refused(f"unix://{broker.sock}")).lower()
        assert await refused(broker.unix("reader")) == ""

    run(go())


def test_client_without_a_certificate_is_refused(
    broker: SecureBroker, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        no_cert = broker.settings("a", cert_file="", key_file="")
        check_broker_settings(no_cert)  # a valid client setup: the broker says no
        assert await refused(no_cert, timeout=1.5) != ""

    with caplog.at_level("DEBUG"):
        run(go())
    assert "certificate required" in caplog.text


def test_client_checks_the_broker_certificate(broker: SecureBroker, tmp_path: Path) -> None:
    """A client trusting another CA (another mesh's) does not talk to this broker."""
    other = tmp_path / "other"
    write_broker_dir(
        BrokerRequest(mesh="other", identities=tuple(make_identities(["a"], [])), hosts=("h",)),
        other,
    )

    async def go() -> None:
        stranger = broker.settings("a", ca_file=str(other / "ca.crt"))
        assert "certificate verify failed" in (await refused(stranger)).lower()
        assert await refused(broker.settings("a")) == ""

    run(go())
    # The broker's name is checked too: its certificate names 127.0.0.1 and localhost.
    ctx = client_kwargs(broker.settings("a"))["tls_context"]
    for name, ok in (("127.0.0.1", True), ("localhost", True), ("broker.example", False)):
        with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as raw:
            try:
                ctx.wrap_socket(raw, server_hostname=name).close()
                got = True
            except ssl.SSLCertVerificationError as exc:
                assert "match" in str(exc) or "mismatch" in str(exc), exc
                got = False
        assert got is ok, name


# --- the ACL -------------------------------------------------------------------------------


def test_node_cannot_publish_another_nodes_telemetry(broker: SecureBroker) -> None:
    async def go() -> None:
        inbox = Inbox()
        ctl = client(broker.settings("ctl1"), "ctl1", (f"{P}/telemetry/+", f"{P}/status/+"))
        node = client(broker.settings("a"), "a")
        async with running(ctl, inbox), running(node):
            assert await ctl.wait_connected(10) and await node.wait_connected(10)
            # mosquitto acks a denied publish (MQTT 3.1.1 has no way to say no) and drops it.
            assert await node.publish(f"{P}/telemetry/b", b"forged", qos=1)
            assert await node.publish(f"{P}/status/b", b"forged", qos=1)
            assert await node.publish(f"{P}/routes/a", b"forged", qos=1)
            assert await node.publish(f"{P}/telemetry/a", b"control", qos=1)
            assert await inbox.get() == (f"{P}/telemetry/a", b"control", False)
            await asyncio.sleep(0.3)
            assert inbox.queue.empty()

    run(go())


def test_reader_cannot_publish_and_node_reads_only_its_routes(broker: SecureBroker) -> None:
    async def go() -> None:
        a_inbox, b_inbox = Inbox(), Inbox()
        reader = client(broker.settings("reader"), "reader")
        ctl = client(broker.settings("ctl1"), "ctl1")
        # Node a asks for b's route set too: the broker grants the subscription nothing.
        a = client(broker.settings("a"), "a", (f"{P}/routes/a", f"{P}/routes/b"))
        b = client(broker.settings("b"), "b", (f"{P}/routes/b",))
        async with running(reader), running(ctl), running(a, a_inbox), running(b, b_inbox):
            for c in (reader, ctl, a, b):
                assert await c.wait_connected(10)
            assert await reader.publish(f"{P}/routes/a", b"from-reader", qos=1)
            assert await reader.publish(f"{P}/telemetry/reader", b"from-reader", qos=1)
            assert await ctl.publish(f"{P}/routes/b", b"for-b", qos=1)
            assert await ctl.publish(f"{P}/routes/a", b"for-a", qos=1)
            assert await a_inbox.get() == (f"{P}/routes/a", b"for-a", False)
            assert await b_inbox.get() == (f"{P}/routes/b", b"for-b", False)
            await asyncio.sleep(0.3)
            assert a_inbox.queue.empty() and b_inbox.queue.empty()

    run(go())


def test_reader_reads_the_whole_mesh_over_the_unix_socket(broker: SecureBroker) -> None:
    async def go() -> list[tuple[str, bytes]]:
        ctl = client(broker.settings("ctl1"), "ctl1")
        async with running(ctl):
            assert await ctl.wait_connected(10)
            assert await ctl.publish(f"{P}/controller/lease", b"lease", qos=1, retain=True)
            try:
                return await read_bus(broker.unix("reader"), f"{P}/#", timeout_s=5)
            finally:
                await ctl.publish(f"{P}/controller/lease", b"", qos=1, retain=True)

    assert (f"{P}/controller/lease", b"lease") in run(go())


# --- our one-line errors -------------------------------------------------------------------


def test_bad_or_missing_certificate_is_one_line_input_error(
    broker: SecureBroker, tmp_path: Path
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    d = broker.pki / "clients"
    cases = [
        (broker.settings("a", cert_file="/nonexistent/client.crt"), "no such file"),
        (broker.settings("a", cert_file=str(garbage)), "not a PEM certificate"),
        (broker.settings("a", key_file=str(d / "b" / "client.key")), "not the key of"),
        (broker.settings("a", ca_file=str(garbage)), "broker.ca_file"),
        (broker.settings("a", url="mqtt://127.0.0.1:1"), "is not mqtts://"),
    ]
    for settings, message in cases:
        with pytest.raises(InputError, match=message) as info:
            client(settings, "bad")
        assert "\n" not in str(info.value)


def test_certificate_replaced_by_garbage_is_counted_not_fatal(
    broker: SecureBroker, tmp_path: Path
) -> None:
    """Files are read per connect: a broken file after the start costs a counted retry."""
    d = broker.pki / "clients" / "b"
    pw = tmp_path / "pw"
    pw.write_text((d / "password").read_text())
    pw.chmod(0o600)
    bus = client(broker.settings("b", password_file=str(pw)), "b")

    async def go() -> None:
        pw.write_text("")  # emptied after the check in BusClient()
        async with running(bus):
            await asyncio.sleep(0.5)
            assert not bus.connected
        assert bus.counters["settings_error"] >= 1

    run(go())
