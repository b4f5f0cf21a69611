"""wireguard-go processes and the userspace backend that configures them over UAPI.

Facts measured here (wireguard-go 0.0.20220316, Debian):
- Started through ``ip netns exec NS``, it creates its TUN device inside NS (the
  process's namespace) and binds its UDP port there; it starts with a random listen
  port and no key.
- Its UAPI socket path is compiled in: ``/var/run/wireguard/<ifname>.sock``, on the
  filesystem every namespace shares, so names must be unique across a lab. For a
  private directory, ``run_dir`` bind-mounts it over ``/var/run/wireguard`` in the
  process's own mount namespace (``ip netns exec`` makes one; ``unshare -m``
  otherwise), so the socket appears as ``<run_dir>/<ifname>.sock`` and nowhere else.
- It watches the socket file (inotify) and exits if it is deleted; on SIGTERM it
  removes the socket itself and exits in ~15 ms. After SIGKILL the socket stays and
  is removed here; the TUN device goes away with the process either way.
- Start to first UAPI answer: ~8 ms here.
- ``-f`` keeps it in the foreground so the PID we hold is the daemon's own (``ip netns
  exec`` and the ``sh`` wrapper both exec in place); ``WG_PROCESS_FOREGROUND=1`` does
  the same and silences the start-up banner of older versions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO

from meshopt.wireguard.backend import AsyncBackendBase, BackendBase
from meshopt.wireguard.errors import UapiError, WireGuardGoError
from meshopt.wireguard.model import DeviceUpdate, InterfaceState
from meshopt.wireguard.uapi import (
    DEFAULT_RUN_DIR,
    DEFAULT_TIMEOUT,
    AsyncUapiClient,
    UapiClient,
    socket_path,
)

WIREGUARD_GO = "wireguard-go"
IFNAMSIZ = 16
# In the process's own mount namespace: put the private directory where wireguard-go
# looks, then become wireguard-go (exec keeps the PID).
_BIND_SCRIPT = 'mkdir -p /var/run/wireguard && mount --bind "$0" /var/run/wireguard && exec "$@"'
_STRIP_ENV = ("WG_TUN_FD", "WG_UAPI_FD")  # inherited ones would make it adopt stray fds


def wireguard_go_path(binary: str = WIREGUARD_GO) -> str | None:
    """Full path of the wireguard-go binary, or None where it is not installed."""
    return shutil.which(binary)


def check_ifname(ifname: str) -> None:
    """Raise WireGuardGoError unless ``ifname`` is a usable Linux interface name."""
    if not 1 <= len(ifname.encode()) < IFNAMSIZ or any(c in ifname for c in "/: \t\n"):
        raise WireGuardGoError(f"bad interface name {ifname!r}: 1..15 bytes, no '/', ':', space")


def _is_default_run_dir(run_dir: str) -> bool:
    return os.path.realpath(run_dir) == os.path.realpath(DEFAULT_RUN_DIR)


def private_run_dir_argv(run_dir: str, argv: Sequence[str]) -> list[str]:
    """``argv`` seeing ``run_dir`` as ``/var/run/wireguard``; run it in its own mount
    namespace (``ip netns exec`` makes one), or the bind mount leaks to everyone."""
    return ["sh", "-c", _BIND_SCRIPT, os.path.abspath(run_dir), *argv]


def wireguard_go_argv(
    ifname: str,
    *,
    netns: str | None = None,
    run_dir: str = DEFAULT_RUN_DIR,
    binary: str = WIREGUARD_GO,
) -> list[str]:
    """The command line that runs wireguard-go for ``ifname`` as wanted (pure)."""
    check_ifname(ifname)
    argv = [binary, "-f", ifname]
    private = not _is_default_run_dir(run_dir)
    if private:
        argv = private_run_dir_argv(run_dir, argv)
    if netns is not None:
        return ["ip", "netns", "exec", netns, *argv]
    if private:
        return ["unshare", "--mount", "--propagation", "slave", *argv]
    return argv


def wireguard_go_env(
    extra: Mapping[str, str] | None = None,
    *,
    log_level: str = "error",
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for wireguard-go: ours, minus inherited fds, plus ``extra``.

    ``extra`` is where the lab puts its tag (e.g. ``MESHOPT_LAB=<id>``) so a crashed
    run's processes can be found by their environment.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _STRIP_ENV}
    env["WG_PROCESS_FOREGROUND"] = "1"
    env["LOG_LEVEL"] = log_level
    env.update(extra or {})
    return env


@dataclass(eq=False)
class WireGuardGo:
    """A running wireguard-go we started: its Popen (PID), socket and captured log."""

    ifname: str
    netns: str | None
    run_dir: str
    socket_path: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes] = field(repr=False)
    start_seconds: float = 0.0
    owns_socket: bool = False  # True once our process answered on the socket

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def client(self, *, timeout: float = DEFAULT_TIMEOUT) -> UapiClient:
        return UapiClient(self.socket_path, timeout=timeout)

    def async_client(self, *, timeout: float = DEFAULT_TIMEOUT) -> AsyncUapiClient:
        return AsyncUapiClient(self.socket_path, timeout=timeout)

    def backend(self) -> UserspaceBackend:
        return UserspaceBackend(run_dir=self.run_dir)

    def log_text(self, limit: int = 4000) -> str:
        """The last ``limit`` characters wireguard-go wrote (stdout and stderr)."""
        if self.log.closed:
            return ""
        # pread: the child shares this file's offset, so never move it.
        fd = self.log.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - limit)
        return os.pread(fd, size - start, start).decode(errors="replace").strip()

    def stop(self, timeout: float = 3.0) -> int:
        """SIGTERM, SIGKILL after ``timeout`` s; remove our socket. Returns the exit code."""
        stop_all([self], timeout=timeout)
        code = self.proc.returncode
        assert code is not None
        return code

    def __enter__(self) -> WireGuardGo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _finish(self) -> None:
        """After the process is reaped: remove a socket it left behind, close the log."""
        if self.owns_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self.owns_socket = False
        if not self.log.closed:
            self.log.close()


def _answers(path: str, timeout: float = 0.5) -> bool:
    try:
        UapiClient(path, timeout=timeout).get()
    except UapiError:
        return False
    return True


def start_wireguard_go(
    ifname: str,
    *,
    netns: str | None = None,
    run_dir: str = DEFAULT_RUN_DIR,
    env: Mapping[str, str] | None = None,
    timeout: float = 10.0,
    binary: str = WIREGUARD_GO,
    log_level: str = "error",
    log_path: str | None = None,
) -> WireGuardGo:
    """Start wireguard-go for ``ifname`` (in ``netns``) and wait until UAPI answers.

    ``env`` is added to the process's environment (lab tags). ``run_dir`` other than
    the default must exist; the socket is ``<run_dir>/<ifname>.sock``. The log goes to
    ``log_path`` or to an anonymous file. Raises WireGuardGoError (with wireguard-go's
    own words) if it exits or does not answer within ``timeout``; nothing is left running.
    """
    if wireguard_go_path(binary) is None:
        raise WireGuardGoError(f"{binary} not found: install the wireguard-go package")
    path = socket_path(ifname, run_dir)
    if not _is_default_run_dir(run_dir) and not os.path.isdir(run_dir):
        raise WireGuardGoError(f"run directory {run_dir} does not exist")
    if _answers(path):
        raise WireGuardGoError(f"{path} is in use: another wireguard-go serves {ifname}")
    argv = wireguard_go_argv(ifname, netns=netns, run_dir=run_dir, binary=binary)
    log: IO[bytes] = open(log_path, "ab") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=wireguard_go_env(env, log_level=log_level),
        )
    except BaseException:
        log.close()
        raise
    wg = WireGuardGo(
        ifname=ifname, netns=netns, run_dir=run_dir, socket_path=path, proc=proc, log=log
    )
    try:
        _wait_ready(wg, t0 + timeout)
    except BaseException:
        stop_all([wg])
        raise
    wg.start_seconds = time.monotonic() - t0
    return wg


def _wait_ready(wg: WireGuardGo, deadline: float) -> None:
    where = f" in namespace {wg.netns}" if wg.netns else ""
    while True:
        code = wg.proc.poll()
        if code is not None:
            raise WireGuardGoError(
                f"wireguard-go for {wg.ifname}{where} exited with status {code}: "
                f"{wg.log_text(1000) or '(no output)'}"
            )
        if os.path.exists(wg.socket_path) and _answers(wg.socket_path):
            wg.owns_socket = True
            return
        if time.monotonic() > deadline:
            raise WireGuardGoError(
                f"wireguard-go for {wg.ifname}{where} did not answer on {wg.socket_path} "
                f"in time: {wg.log_text(1000) or '(no output)'}"
            )
        time.sleep(0.005)


def stop_all(instances: Iterable[WireGuardGo], *, timeout: float = 3.0) -> None:
    """Stop several wireguard-go processes by PID: SIGTERM to all, then wait, then SIGKILL.

    All are signalled before any is waited for, so a slow one delays the rest by at
    most ``timeout`` in total, not each.
    """
    todo = list(instances)
    for wg in todo:
        if wg.proc.poll() is None:  # not reaped yet, so the PID is still ours
            wg.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for wg in todo:
        try:
            wg.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            wg.proc.kill()
            wg.proc.wait()
        wg._finish()


class UserspaceBackend(BackendBase):
    """WireGuardBackend over wireguard-go UAPI sockets in ``run_dir``."""

    def __init__(self, run_dir: str = DEFAULT_RUN_DIR, *, timeout: float = DEFAULT_TIMEOUT):
        self.run_dir = run_dir
        self.timeout = timeout

    def client(self, ifname: str) -> UapiClient:
        return UapiClient.for_interface(ifname, self.run_dir, timeout=self.timeout)

    def get(self, ifname: str) -> InterfaceState:
        return self.client(ifname).get()

    def apply(self, ifname: str, update: DeviceUpdate) -> None:
        self.client(ifname).set(update)

    def interfaces(self) -> list[str]:
        """Interfaces with a socket in ``run_dir`` (what ``wg show interfaces`` lists)."""
        return _socket_names(self.run_dir)


class AsyncUserspaceBackend(AsyncBackendBase):
    """AsyncWireGuardBackend over wireguard-go UAPI sockets in ``run_dir``."""

    def __init__(self, run_dir: str = DEFAULT_RUN_DIR, *, timeout: float = DEFAULT_TIMEOUT):
        self.run_dir = run_dir
        self.timeout = timeout

    def client(self, ifname: str) -> AsyncUapiClient:
        return AsyncUapiClient.for_interface(ifname, self.run_dir, timeout=self.timeout)

    async def get(self, ifname: str) -> InterfaceState:
        return await self.client(ifname).get()

    async def apply(self, ifname: str, update: DeviceUpdate) -> None:
        await self.client(ifname).set(update)

    def interfaces(self) -> list[str]:
        return _socket_names(self.run_dir)


def _socket_names(run_dir: str) -> list[str]:
    try:
        names: Sequence[str] = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(n[: -len(".sock")] for n in names if n.endswith(".sock"))
