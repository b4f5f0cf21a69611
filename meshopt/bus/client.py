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
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import unquote, urlsplit

import aiomqtt

from meshopt.bus.messages import Counters
from meshopt.errors import InputError

log = logging.getLogger("meshopt.bus")

DEFAULT_PORT: Final = 1883
DEFAULT_KEEPALIVE_S: Final = 4
MAX_QUEUED_INCOMING: Final = 10_000

Handler = Callable[[str, bytes, bool], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]
WillSpec = tuple[str, bytes, bool]  # topic, payload, retain

_LABEL: Final = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE: Final = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")
_UNIX_PATH_MAX: Final = 107  # sun_path is 108 bytes with the terminating NUL


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is: TCP ``host:port`` or a unix socket ``path``."""

    transport: Literal["tcp", "unix"]
    host: str  # hostname or IP for tcp, socket path for unix
    port: int = DEFAULT_PORT
    username: str | None = None
    password: str | None = None

    def __str__(self) -> str:
        """The address without credentials, for logs."""
        if self.transport == "unix":
            return f"unix://{self.host}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"


def parse_broker(url: str) -> BrokerAddress:
    """``mqtt://[user:pass@]host[:port]``, ``host[:port]``, ``unix:///path``; else InputError."""
    if not isinstance(url, str) or not url.strip():
        raise InputError("empty broker address (want mqtt://host:port or unix:///path)")
    text = url.strip()
    shown = text if "@" not in text else "…@" + text.rsplit("@", 1)[1]
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if not path.startswith("/") or "\0" in path or len(path.encode()) > _UNIX_PATH_MAX:
            raise InputError(f"bad broker socket {shown!r}: want unix:///absolute/path")
        return BrokerAddress("unix", path, 0)
    scheme, sep, rest = text.partition("://")
    if not sep:
        rest = text
    elif scheme.lower() not in ("mqtt", "tcp"):
        raise InputError(f"bad broker address {shown!r}: scheme must be mqtt:// or unix://")
    try:
        parts = urlsplit("//" + rest)
        port = parts.port
    except ValueError:
        raise InputError(f"bad broker address {shown!r}: bad port") from None
    host = parts.hostname
    if parts.path not in ("", "/") or parts.query or parts.fragment or not host:
        raise InputError(f"bad broker address {shown!r}: want mqtt://host:port")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME_RE.fullmatch(host):
            raise InputError(f"bad broker address {shown!r}: bad host name") from None
    if port == 0:
        raise InputError(f"bad broker address {shown!r}: port 0")
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return BrokerAddress("tcp", host, port or DEFAULT_PORT, user, password)


class BusClient:
    """One daemon's connection to the broker; see the module docstring."""

    def __init__(
        self,
        broker: str | BrokerAddress,
        *,
        client_id: str,
        will: WillSpec | Callable[[], WillSpec] | None = None,
        subscriptions: Sequence[str] = (),
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
        AgentStatus with ``since``) is fresh for each connection.
        """
        self.broker = broker if isinstance(broker, BrokerAddress) else parse_broker(broker)
        if not client_id or len(client_id) > 128:
            raise InputError("MQTT client id must have 1-128 characters")
        if not 0 < backoff_min_s <= backoff_max_s:
            raise InputError("want 0 < backoff_min_s <= backoff_max_s")
        if keepalive_s < 1:
            raise InputError("keepalive_s must be at least 1 s")
        self.client_id = client_id
        self.will = will
        self.subscriptions = tuple(subscriptions)
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
        b = self.broker
        return aiomqtt.Client(
            b.host,
            b.port if b.transport == "tcp" else DEFAULT_PORT,  # paho ignores it for unix
            transport=b.transport,
            username=b.username,
            password=b.password,
            identifier=self.client_id,
            will=will,
            keepalive=self.keepalive_s,
            timeout=self.timeout_s,
            max_queued_incoming_messages=self.max_queued_incoming,
        )

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
