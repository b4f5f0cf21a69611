"""sd_notify over a real unix datagram socket, and a real controller process telling
systemd's protocol what it does: READY=1 only once the broker (a real mosquitto) is
connected, WATCHDOG=1 from its loop, RELOADING=1/READY=1 on SIGHUP, STOPPING=1 on stop."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshopt import sdnotify
from meshopt.bus.signing import generate_signing_key, save_private_key

from .test_bus_client import Broker, free_port


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket at a short path, named in $NOTIFY_SOCKET."""
    directory = Path(tempfile.mkdtemp(prefix="mo-notify-"))
    path = str(directory / "n.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    try:
        yield s, path
    finally:
        s.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_nothing_to_tell_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready("x") is False
    assert sdnotify.watchdog() is False


def test_messages_reach_a_path_socket(listener: tuple[socket.socket, str]) -> None:
    s, _ = listener
    assert sdnotify.ready("up: 3 peers")
    assert s.recv(4096) == b"READY=1\nSTATUS=up: 3 peers"
    assert sdnotify.stopping()
    assert s.recv(4096) == b"STOPPING=1\nSTATUS=stopping"
    assert sdnotify.reloading()
    lines = s.recv(4096).decode().split("\n")
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")
    usec = int(lines[1].partition("=")[2])
    assert 0 < usec <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_abstract_address(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"meshopt-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.watchdog()
        assert s.recv(4096) == b"WATCHDOG=1"


def test_a_gone_supervisor_is_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody.sock"))
    assert sdnotify.ready() is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    assert sdnotify.watchdog_interval() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "garbage")
    assert sdnotify.watchdog_interval() is None


def controller_config(tmp: Path, port: int) -> Path:
    key = tmp / "controller.key"
    save_private_key(key, generate_signing_key()[0])
    path = tmp / "controller.toml"
    path.write_text(
        "[controller]\n"
        'mesh = "nt"\nid = "ctl1"\n'
        f'signing_key = "{key}"\n'
        f'broker = "mqtt://127.0.0.1:{port}"\n'
        "[node_keys]\n"
        f'fra = "{generate_signing_key()[1]}"\n'
    )
    return path


def receive(s: socket.socket, until: float) -> list[str]:
    """Every message that arrives before ``until`` (monotonic)."""
    out: list[str] = []
    while (left := until - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            out.append(s.recv(4096).decode())
        except TimeoutError:
            break
    return out


def wait_for(s: socket.socket, want: str, timeout: float) -> list[str]:
    """Messages up to and including the first that contains the line ``want``."""
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            msg = s.recv(4096).decode()
        except TimeoutError:
            break
        out.append(msg)
        if want in msg.split("\n"):
            return out
    raise AssertionError(f"no {want} within {timeout} s; got {out}")


def test_controller_ready_only_once_connected_then_watchdog_reload_stop(
    listener: tuple[socket.socket, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed (scripts/bootstrap.sh installs it)")
    s, path = listener
    # Only the controller gets the socket: mosquitto speaks sd_notify too.
    monkeypatch.delenv("NOTIFY_SOCKET")
    port = free_port()
    config = controller_config(tmp_path, port)
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    log = (tmp_path / "controller.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshopt.cli.main", "controller", "--config", str(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    broker_dir = Path(tempfile.mkdtemp(prefix="meshopt-mq-"))
    broker = Broker(broker_dir, port)
    try:
        # No broker yet: keep-alives, but no readiness. Start-up (imports) is not bounded
        # here: on a busy machine it took over 3 s; the first keep-alive ends it.
        before = wait_for(s, "WATCHDOG=1", 30)
        before += receive(s, time.monotonic() + 1.0)
        assert proc.poll() is None
        assert sum("WATCHDOG=1" in m.split("\n") for m in before) >= 2, before
        assert not any("READY=1" in m.split("\n") for m in before), before
        broker.start()
        got = wait_for(s, "READY=1", 30)
        assert "STATUS=running: connected to the broker, mesh nt" in got[-1].split("\n")
        # The watchdog keeps coming from the running loop (every 0.2 s asked for).
        after = receive(s, time.monotonic() + 1.5)
        assert after.count("WATCHDOG=1") >= 2, after
        # SIGHUP: RELOADING=1 with the monotonic time, then READY=1 again.
        proc.send_signal(signal.SIGHUP)
        got = wait_for(s, "READY=1", 15)
        reloading = [m for m in got if "RELOADING=1" in m.split("\n")]
        assert reloading and "MONOTONIC_USEC=" in reloading[0], got
        assert "configuration reloaded" in got[-1]
        proc.send_signal(signal.SIGTERM)
        wait_for(s, "STOPPING=1", 10)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        log.close()
        broker.stop()
        shutil.rmtree(broker_dir, ignore_errors=True)
