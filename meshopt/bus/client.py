"""A long-lived MQTT connection for the daemons (aiomqtt 2.x), reconnecting forever.

:class:`BusClient` owns one aiomqtt ``Client`` per connection attempt: connect,
subscribe, run the ``on_connect`` hook (where an agent republishes its retained status
and a full snapshot), then hand every message to the handler. Any ``MqttError`` or
socket error ends the attempt; the loop waits with exponential backoff plus jitter and
tries again, until the task running :meth:`BusClient.run` is cancelled. A handler that
raises is logged once and counted; it never ends the loop.

Publishing while disconnected returns False instead of queueing: telemetry is only
useful fresh, and the hook republishes the state that matters after a reconnect.

Keepalive (default 4 s) and the will: the broker publishes a client's will at once when
its TCP connection drops (a crashed or killed process: the kernel closes the socket;
measured here: the will arrives within milliseconds of SIGKILL), and otherwise once it has
heard nothing for more than 1.5 x keepalive. mosquitto counts that in whole seconds, and
aiomqtt sends PINGREQ from a loop that wakes once a second, so an idle client's ping may
leave up to keepalive + 1 s after its last packet: 4 s keeps that (<= 5 s) clear of the
broker's limit (> 6 s); 3 s or less would leave no margin, and a falsely expired client
would read as a dead node to the controller. Cost: two 2-byte packets per 4 s when idle.
For a silently dead client (host gone, process stopped) mosquitto 2.0.11 (Debian 12)
scans keepalives only every ~6 s, so the will took 11.4 s at keepalive 4, 5.4 s at 2 and
~5 s at 1 (SIGSTOP, measured here); brokers that check every second give ~1.5 x
keepalive. The controller's stale-telemetry timeout and the agents' probes (dead peer
within 1 s) cover that case faster; the will is the cheap, certain signal.

A clean stop (cancelling ``run``) sends a normal DISCONNECT, on which the broker drops
the will; so the will message is published explicitly first, and a stopped agent reads
as offline just like a dead one.

Security (:class:`BrokerSettings`): ``mqtts://`` is TLS (port 8883 by default) with the
broker's CA (``ca_file``; the system's CAs when empty), an optional client certificate
and key, and a user name with a password read from ``password_file`` (its first line).
:func:`check_broker_settings` refuses, in one line each, what would otherwise only show
up as a connection that keeps failing: missing or unreadable files, a file that is not a
PEM certificate or key, a key that does not belong to the certificate, an empty password
file, TLS files for a plain ``mqtt://`` url. :func:`client_kwargs` turns settings into
aiomqtt ``Client`` arguments; files are read again at every connect, so a renewed
certificate or password is picked up at the next reconnect without a restart.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import logging
import os
import random
import re
import ssl
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal
from urllib.parse import unquote, urlsplit

import aiomqtt
from paho.mqtt.subscribeoptions import SubscribeOptions

from meshopt.bus.certs import Certificate, key_pair_problem, load_pem_certificates
from meshopt.bus.messages import Counters
from meshopt.errors import InputError
from meshopt.smallfile import read_small_file

log = logging.getLogger("meshopt.bus")

DEFAULT_PORT: Final = 1883
DEFAULT_TLS_PORT: Final = 8883
DEFAULT_URL: Final = "mqtt://127.0.0.1:1883"
DEFAULT_KEEPALIVE_S: Final = 4
MAX_QUEUED_INCOMING: Final = 10_000
DISPATCH_SLICE_S: Final = 0.01  # longest run of queued messages handled in one turn

Handler = Callable[[str, bytes, bool], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]
WillSpec = tuple[str, bytes, bool]  # topic, payload, retain

_LABEL: Final = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE: Final = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")
_UNIX_PATH_MAX: Final = 107  # sun_path is 108 bytes with the terminating NUL


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is: TCP ``host:port`` (``tls``: mqtts://) or a unix socket ``path``."""

    transport: Literal["tcp", "unix"]
    host: str  # hostname or IP for tcp, socket path for unix
    port: int = DEFAULT_PORT
    username: str | None = None
    password: str | None = None
    tls: bool = False

    def __str__(self) -> str:
        """The address without credentials, for logs."""
        if self.transport == "unix":
            return f"unix://{self.host}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"


def parse_broker(url: str) -> BrokerAddress:
    """``mqtt[s]://[user:pass@]host[:port]``, ``host[:port]``, ``unix:///path``; else InputError.

    ``mqtts://`` is TLS, on port 8883 unless given.
    """
    if not isinstance(url, str) or not url.strip():
        raise InputError("empty broker address (want mqtt[s]://host:port or unix:///path)")
    text = url.strip()
    shown = text if "@" not in text else "…@" + text.rsplit("@", 1)[1]
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if not path.startswith("/") or "\0" in path or len(path.encode()) > _UNIX_PATH_MAX:
            raise InputError(f"bad broker socket {shown!r}: want unix:///absolute/path")
        return BrokerAddress("unix", path, 0)
    scheme, sep, rest = text.partition("://")
    tls = sep != "" and scheme.lower() == "mqtts"
    if not sep:
        rest = text
    elif scheme.lower() not in ("mqtt", "tcp", "mqtts"):
        raise InputError(
            f"bad broker address {shown!r}: scheme must be mqtt://, mqtts:// or unix://"
        )
    try:
        parts = urlsplit("//" + rest)
        port = parts.port
    except ValueError:
        raise InputError(f"bad broker address {shown!r}: bad port") from None
    host = parts.hostname
    if parts.path not in ("", "/") or parts.query or parts.fragment or not host:
        raise InputError(f"bad broker address {shown!r}: want mqtt[s]://host:port")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME_RE.fullmatch(host):
            raise InputError(f"bad broker address {shown!r}: bad host name") from None
    if port == 0:
        raise InputError(f"bad broker address {shown!r}: port 0")
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    default_port = DEFAULT_TLS_PORT if tls else DEFAULT_PORT
    return BrokerAddress("tcp", host, port or default_port, user, password, tls)


# --- security settings ----------------------------------------------------------------


@dataclass(frozen=True)
class BrokerSettings:
    """How a daemon or tool reaches the broker: the ``[broker]`` table of a config file.

    Every field is a string, "" meaning unset (the TOML loader types fields by their
    defaults). ``ca_file`` empty with an ``mqtts://`` url trusts the system's CAs.
    ``username``/``password_file`` win over credentials in the url (still accepted, but
    a password in a config file's url is readable by whoever reads the config).
    """

    url: str = DEFAULT_URL
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    username: str = ""
    password_file: str = ""


BrokerLike = str | BrokerAddress | BrokerSettings


def _key(where: str, name: str) -> str:
    """How a setting is named in messages: ``broker.ca_file`` in a config file, or
    ``--ca-file`` on a command line (``where="--"``; the url is ``--broker`` there)."""
    if where == "--":
        return "--broker" if name == "url" else "--" + name.replace("_", "-")
    return where + name


def _read(path: str, what: str) -> bytes:
    return read_small_file(path, what)


def read_password(path: str, what: str = "broker.password_file") -> str:
    """The first line of ``path`` (without its newline); InputError when missing or empty."""
    data = _read(path, what)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InputError(f"{what} {path}: not UTF-8 text") from None
    lines = text.splitlines()
    password = lines[0] if lines else ""
    if not password:
        raise InputError(f"{what} {path}: empty (the password is its first line)")
    return password


def _certificates(path: str, what: str) -> list[Certificate]:
    data = _read(path, what)
    try:
        return load_pem_certificates(data)
    except ValueError:
        raise InputError(f"{what} {path}: not a PEM certificate") from None


def _check_validity(cert: Certificate, path: str, what: str) -> None:
    now = dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc < now:
        raise InputError(f"{what} {path}: expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    if cert.not_valid_before_utc > now + dt.timedelta(minutes=5):
        raise InputError(
            f"{what} {path}: not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )


def _check_key_pair(settings: BrokerSettings, where: str) -> None:
    """OpenSSL's match of key to certificate (bus.certs: no ``cryptography`` in the agent)."""
    cert_what, key_what = _key(where, "cert_file"), _key(where, "key_file")
    cert = _certificates(settings.cert_file, cert_what)[0]
    _check_validity(cert, settings.cert_file, cert_what)
    _read(settings.key_file, key_what)
    try:
        problem = key_pair_problem(settings.cert_file, settings.key_file)
    except OSError as exc:
        raise InputError(f"{key_what} {settings.key_file}: {exc.strerror or exc}") from None
    if problem == "encrypted":
        raise InputError(
            f"{key_what} {settings.key_file}: encrypted; use an unencrypted key (mode 0600)"
        )
    if problem == "not a key":
        raise InputError(f"{key_what} {settings.key_file}: not a PEM private key")
    if problem == "mismatch":
        raise InputError(
            f"{key_what} {settings.key_file}: not the key of {cert_what} {settings.cert_file}"
        )


def check_broker_settings(settings: BrokerSettings, *, where: str = "broker.") -> BrokerAddress:
    """Check ``settings`` completely (files read and parsed); InputError in one line.

    Returns the address with the resolved credentials. A password file readable by
    group or others is only warned about (logged): it works, but should be 0600.
    ``where`` prefixes the key names in messages: "broker." for a config's table, "--"
    for command-line options.
    """
    try:
        address = parse_broker(settings.url)
    except InputError as exc:
        raise InputError(f"{_key(where, 'url')}: {exc.message}") from None
    files = [("ca_file", settings.ca_file), ("cert_file", settings.cert_file)]
    files.append(("key_file", settings.key_file))
    if not address.tls:
        given = [name for name, value in files if value]
        if given:
            raise InputError(
                f"{_key(where, given[0])} is set but {_key(where, 'url')} {address} "
                "is not mqtts:// (TLS)"
            )
    if bool(settings.cert_file) != bool(settings.key_file):
        have, want = ("cert_file", "key_file") if settings.cert_file else ("key_file", "cert_file")
        raise InputError(f"{_key(where, have)} needs {_key(where, want)} too")
    if settings.ca_file:
        for cert in _certificates(settings.ca_file, _key(where, "ca_file")):
            _check_validity(cert, settings.ca_file, _key(where, "ca_file"))
    if settings.cert_file:
        _check_key_pair(settings, where)
    if settings.username and not is_valid_username(settings.username):
        raise InputError(
            f"{_key(where, 'username')} {settings.username!r}: want 1-256 printable, no ':'"
        )
    resolved = resolve_broker(settings, where=where)
    if settings.password_file:
        mode = os.stat(settings.password_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "%s %s is readable by group or others (mode %o): chmod 600 it",
                _key(where, "password_file"),
                settings.password_file,
                stat.S_IMODE(mode),
            )
    if settings.password_file and not resolved.username:
        raise InputError(
            f"{_key(where, 'password_file')} needs a user name ({_key(where, 'username')})"
        )
    if address.tls:
        tls_context(settings, where=where)  # what OpenSSL itself makes of the files
    return resolved


def fold_broker_shorthand(top: dict[str, Any], rest: dict[str, Any], table: str) -> None:
    """Config files: ``[agent] broker = "url"`` (the old form) means ``[broker] url``.

    Moves it into ``rest["broker"]`` in place; giving both forms is an error.
    """
    if "broker" not in top:
        return
    url = top.pop("broker")
    if "broker" in rest:
        raise InputError(f"give the broker as [{table}] broker or as a [broker] table, not both")
    if not isinstance(url, str):
        raise InputError(f"broker must be a url string (or a [broker] table), got {url!r}")
    rest["broker"] = {"url": url}


def with_default_username(settings: BrokerSettings, name: str) -> BrokerSettings:
    """A password file and no user name (in the settings or the url): log in as ``name``
    (the node name or controller id: what ``meshopt broker init`` made the user)."""
    if not settings.password_file or settings.username:
        return settings
    try:
        if parse_broker(settings.url).username:
            return settings
    except InputError:
        return settings  # the check reports the url
    return replace(settings, username=name)


def is_valid_username(name: str) -> bool:
    """MQTT allows any UTF-8; mosquitto's password file cannot hold ':' or newlines."""
    return 0 < len(name) <= 256 and name.isprintable() and ":" not in name


def resolve_broker(settings: BrokerSettings, *, where: str = "broker.") -> BrokerAddress:
    """The url's address with the settings' user name and password (file) applied."""
    try:
        address = parse_broker(settings.url)
    except InputError as exc:
        raise InputError(f"{_key(where, 'url')}: {exc.message}") from None
    username = settings.username or address.username
    password = address.password
    if settings.password_file:
        password = read_password(settings.password_file, _key(where, "password_file"))
    return replace(address, username=username or None, password=password)


def tls_context(settings: BrokerSettings, *, where: str = "broker.") -> ssl.SSLContext:
    """A client context: verify the broker (its name too) against ``ca_file`` or the
    system's CAs; present ``cert_file``/``key_file`` when given; TLS 1.2 at least."""
    try:
        ctx = ssl.create_default_context(cafile=settings.ca_file or None)
    except (ssl.SSLError, OSError) as exc:
        raise InputError(f"{_key(where, 'ca_file')} {settings.ca_file}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.cert_file:
        try:
            ctx.load_cert_chain(settings.cert_file, settings.key_file or None)
        except (ssl.SSLError, OSError) as exc:
            raise InputError(f"{_key(where, 'cert_file')} {settings.cert_file}: {exc}") from None
    return ctx


def client_kwargs(broker: BrokerLike) -> dict[str, Any]:
    """aiomqtt ``Client`` connection arguments: hostname, port, transport, username,
    password, tls_context. Reads the password and TLS files now (call per connect)."""
    if isinstance(broker, BrokerSettings):
        address = resolve_broker(broker)
        ctx = tls_context(broker) if address.tls else None
    else:
        address = broker if isinstance(broker, BrokerAddress) else parse_broker(broker)
        ctx = tls_context(BrokerSettings(url=str(address))) if address.tls else None
    return {
        "hostname": address.host,
        # paho ignores the port for a unix socket
        "port": address.port if address.transport == "tcp" else DEFAULT_PORT,
        "transport": address.transport,
        "username": address.username,
        "password": address.password,
        "tls_context": ctx,
    }


class BusClient:
    """One daemon's connection to the broker; see the module docstring."""

    def __init__(
        self,
        broker: BrokerLike,
        *,
        client_id: str,
        will: WillSpec | Callable[[], WillSpec] | None = None,
        subscriptions: Sequence[str] = (),
        no_local: Sequence[str] = (),
        in_flight: int = 10,
        on_connect: Hook | None = None,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 10.0,
        keepalive_s: int = DEFAULT_KEEPALIVE_S,
        timeout_s: float = 5.0,
        publish_will_on_stop: bool = True,
        max_queued_incoming: int = MAX_QUEUED_INCOMING,
    ) -> None:
        """``client_id`` must be unique on the broker (it drops the older of two).

        ``will`` may be a callable, called at every connect, so a will's payload (e.g. an
        AgentStatus with ``since``) is fresh for each connection. ``broker`` settings are
        checked now (InputError for a bad file), and their files read again per connect.
        ``no_local``: subscriptions (of ``subscriptions``) on which the broker does not
        send this client's own publishes back (MQTT 5's No Local; the session speaks
        MQTT 5 then, 3.1.1 otherwise). A controller publishing a thousand route sets of
        60 kB read each back, 37 MB per burst, and the acknowledgements and the news
        (a node's death) queued behind them (issue 15). ``in_flight``: QoS 1 publishes
        this client awaits at once without a warning (aiomqtt warns above 10).
        """
        if isinstance(broker, BrokerSettings):
            check_broker_settings(broker)
            self.broker = parse_broker(broker.url)
        else:
            self.broker = broker if isinstance(broker, BrokerAddress) else parse_broker(broker)
        self._source: BrokerLike = broker
        if not client_id or len(client_id) > 128:
            raise InputError("MQTT client id must have 1-128 characters")
        if not 0 < backoff_min_s <= backoff_max_s:
            raise InputError("want 0 < backoff_min_s <= backoff_max_s")
        if keepalive_s < 1:
            raise InputError("keepalive_s must be at least 1 s")
        self.client_id = client_id
        self.will = will
        self.subscriptions = tuple(subscriptions)
        self.no_local = frozenset(no_local)
        self.in_flight = in_flight
        if not self.no_local <= set(self.subscriptions):
            raise InputError("no_local names topics that are not subscribed")
        self.on_connect = on_connect
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.keepalive_s = keepalive_s
        self.timeout_s = timeout_s
        self.publish_will_on_stop = publish_will_on_stop
        self.max_queued_incoming = max_queued_incoming
        self.counters = Counters("mqtt", log)
        self.connects = 0  # successful connections so far
        self.received = 0
        self.published = 0
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()

    @property
    def connected(self) -> bool:
        """Connected and subscribed (publishing can succeed)."""
        return self._client is not None and self._connected.is_set()

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """True once connected (and subscribed), False after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False
    ) -> bool:
        """Publish now; False (and counted) when offline or the broker did not take it."""
        client = self._client
        if client is None or not self._connected.is_set():
            self.counters.count("publish_offline", topic)
            return False
        try:
            await client.publish(topic, payload, qos=qos, retain=retain, timeout=self.timeout_s)
        except aiomqtt.MqttError as exc:
            self.counters.count("publish_failed", f"{topic}: {exc}")
            return False
        self.published += 1
        return True

    def _new_client(self) -> aiomqtt.Client:
        will = None
        spec = self.will() if callable(self.will) else self.will
        if spec is not None:
            topic, payload, retain = spec
            will = aiomqtt.Will(topic, payload, qos=1, retain=retain)
        client = aiomqtt.Client(
            **client_kwargs(self._source),
            identifier=self.client_id,
            will=will,
            keepalive=self.keepalive_s,
            timeout=self.timeout_s,
            max_queued_incoming_messages=self.max_queued_incoming,
            protocol=aiomqtt.ProtocolVersion.V5 if self.no_local else aiomqtt.ProtocolVersion.V311,
            max_inflight_messages=max(20, self.in_flight + 4),  # paho's default is 20
        )
        client.pending_calls_threshold = max(10, self.in_flight)
        return client

    async def run(self, handler: Handler) -> None:
        """Connect, subscribe and deliver messages to ``handler``, forever (until cancelled)."""
        delay = self.backoff_min_s
        while True:
            before = self.connects
            try:
                await self._session(handler)
            except (aiomqtt.MqttError, OSError) as exc:
                reason = "disconnected" if self.connects > before else "connect_failed"
                self.counters.count(reason, f"{self.broker}: {exc}")
                log.debug("%s from %s: %s", reason, self.broker, exc)
            except InputError as exc:
                # A password or certificate file gone or broken since the start: say
                # which, and keep trying (it may be replaced, e.g. by a renewal).
                self.counters.count("settings_error", f"{self.broker}: {exc}")
            except Exception as exc:
                # A bug in aiomqtt/paho or here: keep the daemon alive (fail-static),
                # with the traceback logged once and the backoff keeping it cheap.
                self.counters.count("client_error", repr(exc), exc_info=exc)
            finally:
                self._connected.clear()
                self._client = None
            if self.connects > before:
                delay = self.backoff_min_s
            await asyncio.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, self.backoff_max_s)

    async def _session(self, handler: Handler) -> None:
        client = self._new_client()
        async with client:
            try:
                for topic in self.subscriptions:
                    if topic in self.no_local:
                        await client.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True))
                    else:
                        await client.subscribe(topic, qos=1)
                self._client = client
                self.connects += 1
                self._connected.set()
                log.info("connected to %s as %s", self.broker, self.client_id)
                if self.on_connect is not None:
                    await self._call_hook(self.on_connect)
                async for message in client.messages:
                    self.received += 1
                    await self._dispatch(handler, message)
                    await self._dispatch_queued(client, handler)
            except asyncio.CancelledError:
                if self._connected.is_set():
                    self._connected.clear()
                    await self._farewell(client)
                raise

    async def _call_hook(self, hook: Hook) -> None:
        try:
            await hook()
        except Exception as exc:
            self.counters.count("hook_error", repr(exc), exc_info=exc)

    async def _dispatch_queued(self, client: aiomqtt.Client, handler: Handler) -> None:
        """The messages already queued behind the one just handled, for up to
        ``DISPATCH_SLICE_S``. aiomqtt hands out one message per two or three turns of
        the event loop (a task and a wait each); a controller whose turns carry the
        signing of eight route sets then read ~40 messages a second while ~230 came in,
        and a node's death waited seconds behind the backlog (issue 15, 1000 nodes)."""
        queue = getattr(client, "_queue", None)  # aiomqtt 2.x's own (no public way)
        if not isinstance(queue, asyncio.Queue):
            return
        started = time.perf_counter()
        while not queue.empty() and time.perf_counter() - started < DISPATCH_SLICE_S:
            self.received += 1
            await self._dispatch(handler, queue.get_nowait())

    async def _dispatch(self, handler: Handler, message: aiomqtt.Message) -> None:
        payload = message.payload
        data = payload if isinstance(payload, bytes) else str(payload).encode()
        try:
            await handler(message.topic.value, data, bool(message.retain))
        except Exception as exc:
            self.counters.count("handler_error", repr(exc), exc_info=exc)

    async def _farewell(self, client: aiomqtt.Client) -> None:
        """On a clean stop, publish the will ourselves (the broker drops it on DISCONNECT)."""
        if not self.publish_will_on_stop or self.will is None:
            return
        topic, payload, retain = self.will() if callable(self.will) else self.will
        try:
            await client.publish(topic, payload, qos=1, retain=retain, timeout=1.0)
        except (aiomqtt.MqttError, OSError) as exc:
            log.debug("could not publish the will on stop: %s", exc)
