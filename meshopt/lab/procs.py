"""The lab's processes: started tagged, ended by PID, and only if still ours.

Every process a lab starts carries ``MESHOPT_LAB=<lab id>`` in its environment. A lab
outlives the ``meshopt lab up`` that built it, so ``lab down`` is usually another
process: before it signals a recorded PID it reads ``/proc/<pid>/environ`` to check
the tag, so a PID the kernel has since given to someone else is never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from meshopt.lab.netns import netns_argv

TAG = "MESHOPT_LAB"


def spawn(
    argv: Sequence[str],
    lab_id: str,
    log: Path,
    *,
    netns: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (in ``netns``) in its own process group, tagged, output to ``log``.

    Its own process group: the lab's daemons must not die with the terminal or the
    ``lab up`` command that started them (a hang-up or Ctrl-C reaches only the
    terminal's foreground group). Not its own session, as every lab process: with the
    kernel's autogroups (``sched_autogroup_enabled``, on here as on most VMs) a session
    is a scheduling group of its own, and on this 2-core VM (kernel 6.18) such groups
    starved for seconds beside a busy lab. With two spinning processes beside a 16-node
    lab, a process that sleeps 50 ms and works 1 ms woke up to 2.5 s late (p99) in a
    session of its own (1.3 s with the group's nice at -10), 1.9 ms late in the lab's.
    The controller and the broker had sessions of their own then: passes that take
    ~10 ms of CPU took up to 7 s, and telemetry reached the controller 0.4-2 s late
    (median; 5 s at worst), where it takes 2 ms on a quiet machine.
    """
    full_env = {**os.environ, **(env or {}), TAG: lab_id}
    cmd = netns_argv(netns, argv) if netns else list(argv)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            process_group=0,
        )


def lab_of(pid: int) -> str | None:
    """The lab tag in ``pid``'s environment, or None (no such process, no tag, zombie)."""
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = TAG.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def tagged_pids(lab_id: str | None = None) -> dict[int, str]:
    """PID -> lab id of every live process tagged with ``lab_id`` (any lab if None)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        tag = lab_of(pid)
        if tag is not None and (lab_id is None or tag == lab_id) and alive(pid):
            found[pid] = tag
    return found


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is our child (in-process labs); harmless otherwise."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait (reaping our own children) until the PIDs are gone; those still alive."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left:
        for pid in left:
            _reap(pid)
        left = [pid for pid in left if alive(pid)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return left


def stop_pids(pids: Sequence[int], lab_id: str, *, timeout: float = 5.0) -> list[int]:
    """SIGTERM every PID still tagged ``lab_id``, SIGKILL what outlives ``timeout``.

    Returns the PIDs that were signalled. PIDs no longer ours are skipped.
    """
    ours = [pid for pid in pids if lab_of(pid) == lab_id]
    _signal(ours, signal.SIGTERM)
    left = _wait_gone(ours, timeout)
    kill_pids([pid for pid in left if lab_of(pid) == lab_id])
    return ours


def kill_pids(pids: Sequence[int], *, timeout: float = 2.0) -> None:
    """SIGKILL and wait: for processes that must go now (they hold a namespace)."""
    _signal(pids, signal.SIGKILL)
    _wait_gone(pids, timeout)


# The emulator stands in for the network and runs at real-time priority: a real
# underlay does not wait for the CPU behind user processes, so a busy machine must not
# stretch the emulated delays. Measured on the 2-core VM with two spinning processes:
# 18 % of its packets left more than 1 ms late at nice -10, 0 % at SCHED_FIFO. It is
# one thread, so it can take at most one core, and the kernel's real-time throttling
# (sched_rt_runtime_us) keeps 5 % of that core for everyone else.
#
# wireguard-go stands in for kernel WireGuard but is not given real-time priority: at
# ~90 Mbit/s through a relay, six wireguard-go processes at SCHED_FIFO (Go runtimes that
# spin for work) took both cores for tens of seconds; the agents, the broker client and
# wireguard-go's own control socket starved, every peer read as dead and the controller
# withdrew every route (seen in CI and reproduced with a stall plus iperf3). At nice -10
# it still wins the CPU over normal processes ~9:1, and it yields it back.
EMULATOR_RT_PRIORITY = 20
WIREGUARD_NICE = -10
REALTIME_ENV = "MESHOPT_LAB_REALTIME"  # "0": leave the lab's processes at normal priority


def realtime(pid: int, priority: int) -> str | None:
    """SCHED_FIFO at ``priority`` for every thread of ``pid`` (threads it creates later
    inherit it); None when done, else why not (the lab then runs without it)."""
    param = os.sched_param(priority)
    return _each_thread(
        pid, lambda tid: os.sched_setscheduler(tid, os.SCHED_FIFO, param), "SCHED_FIFO"
    )


def favour(pid: int, nice: int) -> str | None:
    """``nice`` for every thread of ``pid`` (Linux keeps one per thread; threads created
    later inherit it); None when done, else why not."""
    return _each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice), f"nice {nice}")


def _each_thread(pid: int, apply: Callable[[int], None], what: str) -> str | None:
    """``apply`` to every thread, listing them again until a pass finds no new one: a
    thread started meanwhile by one not yet done would inherit the old setting."""
    if os.environ.get(REALTIME_ENV, "1") == "0":
        return f"{REALTIME_ENV}=0"
    done: set[int] = set()
    while True:
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done
        except OSError as exc:
            return f"pid {pid}: {exc.strerror}"
        if not tids:
            return None
        for tid in tids:
            done.add(tid)
            try:
                apply(tid)
            except ProcessLookupError:
                continue  # a thread that just ended
            except OSError as exc:
                return f"{what} refused: {exc.strerror}"
