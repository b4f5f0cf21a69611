"""Operating the agent as its systemd unit does, in a real lab (issue 13): unprivileged
with ambient capabilities, reloaded with SIGHUP, stopped cleanly, next to `wg syncconf`.

One mesh for the module: topologies/lab4.yaml in the single-interface layout (n1<->n4 is
relayed through n2 or n3). n2-n4 and the controller run as usual; n1's agent runs as an
unused uid through setpriv with only CAP_NET_ADMIN, CAP_NET_RAW and CAP_DAC_OVERRIDE
(wireguard-go's UAPI sockets are root-only: the unit's drop-in for wireguard-go),
no_new_privs, and no write+execute memory (PR_SET_MDWE, what MemoryDenyWriteExecute=yes
asks of systemd). Its config, key, broker credentials and state are copies owned by that
uid. The tests run in order and share that agent; the last one stops it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshopt.lab.agents import agent_config, agent_log, controller_key, dump_toml
from meshopt.lab.lab import Lab
from meshopt.lab.mesh import QUIET_AGENT, LiveMesh, wait_until
from meshopt.lab.state import lab_dir

from .conftest import EXAMPLES, new_lab_id
from .test_agent import telemetry
from .tools import need_tools

UID = GID = 64_977  # in no /etc/passwd: the agent owns nothing but its copies
CAPS = "+net_admin,+net_raw,+dac_override"
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
# Host-like values set in n1 before its agent starts; it must put exactly these back.
HOST_SYSCTLS = {
    "net.ipv4.ip_forward": "0",
    "net.ipv4.conf.all.rp_filter": "1",
    "net.ipv4.conf.wg0.rp_filter": "1",
    "net.ipv6.conf.all.forwarding": "0",
    "net.ipv6.conf.wg0.forwarding": "0",
}
# The interpreter lives under /root (0700) on the development machines: the agent's
# mount namespace (ip netns exec made one) gets a 0755 /root holding only .pyenv. On an
# operator's machine the venv in /opt/meshopt is world-readable and needs none of this.
MOUNT_SCRIPT = """set -e
stage="$1"; shift
if [ -d /root/.pyenv ]; then
  mount --bind /root/.pyenv "$stage"
  mount -t tmpfs -o mode=0755 meshopt-test /root
  mkdir /root/.pyenv
  mount --move "$stage" /root/.pyenv
fi
exec "$@"
"""
MDWE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0:\n"
    "    sys.exit('PR_SET_MDWE: ' + os.strerror(ctypes.get_errno()))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'meshopt.cli.main', *sys.argv[1:]])\n"
)


@dataclass
class Unprivileged:
    """n1's agent as the unit runs it; ``config`` is its (uid-owned) file."""

    mesh: LiveMesh
    home: Path
    config: Path
    data: dict[str, dict[str, Any]]

    @property
    def lab(self) -> Lab:
        return self.mesh.lab

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.mesh.agents["n1"]

    def state_file(self, kind: str) -> Path:
        return self.home / "state" / f"{kind}-{self.data['agent']['mesh']}-n1.json"

    def log(self) -> str:
        return agent_log(self.lab, "n1")

    def write(self, data: dict[str, dict[str, Any]]) -> None:
        self.config.write_text(dump_toml(data))  # root writes; the uid keeps owning it

    def sysctl(self, name: str) -> str:
        path = "/proc/sys/" + name.replace(".", "/")
        return self.lab.run("n1", ["cat", path]).stdout.strip()

    def start(self, env: dict[str, str] | None = None) -> None:
        """(Re)start n1's agent as the unit would; its log goes to the lab's n1.log."""
        log = (lab_dir(self.lab.plan.lab_id) / "agents" / "n1.log").open("ab")
        try:
            self.mesh.agents["n1"] = self.lab.popen(
                "n1",
                unprivileged_argv(self.home, self.config),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or {},
            )
        finally:
            log.close()

    def routes(self) -> str:
        argv = ["ip", "route", "show", "table", "7701", "proto", "77"]
        return self.lab.run("n1", argv).stdout


def own_copy(src: str, dst: Path) -> str:
    shutil.copyfile(src, dst)
    os.chown(dst, UID, GID)
    dst.chmod(0o600)
    return str(dst)


def unprivileged_argv(home: Path, config: Path) -> list[str]:
    setpriv = [
        *("setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups"),
        *(f"--inh-caps=-all,{CAPS}", f"--ambient-caps=-all,{CAPS}"),
        *(f"--bounding-set=-all,{CAPS}", "--no-new-privs"),
    ]
    agent = [sys.executable, "-c", MDWE, "agent", "--config", str(config)]
    return ["sh", "-c", MOUNT_SCRIPT, "sh", str(home / "stage"), *setpriv, *agent]


def start_unprivileged(mesh: LiveMesh, home: Path) -> Unprivileged:
    lab = mesh.lab
    _, public = controller_key(lab)
    data = agent_config(lab, "n1", controller_keys=[public], sections=QUIET_AGENT)
    files = home / "etc"
    files.mkdir()
    os.chown(files, UID, GID)
    data["agent"]["identity_key"] = own_copy(data["agent"]["identity_key"], files / "agent.key")
    data["agent"]["state_dir"] = str(home / "state")
    for key, value in list(data["broker"].items()):
        if key.endswith("_file") and value:
            data["broker"][key] = own_copy(value, files / Path(value).name)
    config = files / "agent.toml"
    config.write_text(dump_toml(data))
    os.chown(config, UID, GID)
    config.chmod(0o640)
    (home / "stage").mkdir()
    agent = Unprivileged(mesh, home, config, data)
    agent.start()
    return agent


@pytest.fixture(scope="module")
def n1(lab_ok: None) -> Iterator[Unprivileged]:
    need_tools("mosquitto", "wireguard-go", "wg", "setpriv", "mosquitto_sub")
    lab = Lab.up(str(EXAMPLES / "lab4.yaml"), name=new_lab_id(), layout="single")
    mesh = LiveMesh(lab)
    home = Path(tempfile.mkdtemp(prefix="mo-h3-"))
    home.chmod(0o755)
    try:
        mesh.start_controller()
        for node in ("n2", "n3", "n4"):
            mesh.start_agent(node)
        for name, value in HOST_SYSCTLS.items():
            lab.run("n1", ["sysctl", "-q", "-w", f"{name}={value}"], check=True)
        agent = start_unprivileged(mesh, home)
        # Both halves of the agent's apply: AllowedIPs go first when it gains a relay and
        # its routes a moment after, so the relayed path alone can be read before the
        # route is in the table (CI: the tests below found the table still empty).
        n4 = lab.overlay_ip("n4")
        relayed = wait_until(
            lambda: len(mesh.path("n1", "n4")) == 3 and mesh.installed("n1").get(n4) == "wg0",
            60,
        )
        assert relayed is not None, f"n1->n4 never relayed:\n{mesh.logs()}"
        yield agent
    finally:
        mesh.stop()
        lab.down()
        shutil.rmtree(home, ignore_errors=True)


def test_agent_runs_unprivileged_and_installs_and_publishes(n1: Unprivileged) -> None:
    status = Path(f"/proc/{n1.proc.pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[0] == str(UID) and fields["Gid"].split()[0] == str(GID)
    # net_admin (12), net_raw (13), dac_override (1): nothing else, even in the bounding set.
    want = (1 << 12) | (1 << 13) | (1 << 1)
    assert int(fields["CapEff"], 16) == want and int(fields["CapBnd"], 16) == want
    assert fields["NoNewPrivs"].strip() == "1"
    assert "Traceback" not in n1.log()
    # Like a root agent: the relayed route in its table, AllowedIPs moved, telemetry out.
    lab = n1.lab
    assert n1.mesh.installed("n1").get(lab.overlay_ip("n4")) == "wg0"
    t = telemetry(lab, "n1")
    assert t["node"] == "n1" and len(t["peers"]) == 3
    assert t["addresses"] == [f"{lab.overlay_ip('n1')}/32"]


def test_only_the_needed_sysctls_change_while_it_runs(n1: Unprivileged) -> None:
    assert n1.sysctl("net.ipv4.ip_forward") == "1"
    assert n1.sysctl("net.ipv4.conf.all.rp_filter") == "2"  # strict -> loose, said in the log
    assert n1.sysctl("net.ipv4.conf.wg0.rp_filter") == "0"
    assert n1.sysctl("net.ipv6.conf.all.forwarding") == "0"  # never the global switch
    if n1.sysctl("net.ipv6.conf.wg0.force_forwarding"):  # Linux 6.17+: per interface
        assert n1.sysctl("net.ipv6.conf.wg0.forwarding") == "1"
    assert "strict" in n1.log()
    record = json.loads(n1.state_file("sysctl").read_text())
    for name in ("net.ipv4.ip_forward", "net.ipv4.conf.all.rp_filter"):
        assert record[name] == HOST_SYSCTLS[name]


def watch_routes(n1: Unprivileged, stop: threading.Event, seen: list[str]) -> None:
    while not stop.is_set():
        seen.append(n1.routes())
        time.sleep(0.05)


def wait_log(n1: Unprivileged, text: str, after: int, timeout: float = 20) -> str:
    found = wait_until(lambda: text in n1.log()[after:], timeout, interval=0.1)
    assert found is not None, f"{text!r} not logged:\n{n1.log()[after:]}"
    return n1.log()[after:]


def test_sighup_reloads_without_dropping_a_route(n1: Unprivileged) -> None:
    n4 = n1.lab.overlay_ip("n4")
    assert n4 in n1.routes()
    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_routes, args=(n1, stop, seen))
    watcher.start()
    try:
        # A file that does not load: one error line, the agent and its routes stay.
        start = len(n1.log())
        n1.config.write_text("[agent\n")
        n1.proc.send_signal(signal.SIGHUP)
        text = wait_log(n1, "reload failed", start)
        assert len([ln for ln in text.splitlines() if "reload failed" in ln]) == 1
        assert n1.proc.poll() is None
        # Thresholds change now; the probe port needs a restart and keeps its value.
        data = json.loads(json.dumps(n1.data))
        data.setdefault("probe", {}).update({"dead_after_s": 1.5, "port": 51000})
        data.setdefault("telemetry", {})["rtt_change_ms"] = 2.5
        n1.write(data)
        start = len(n1.log())
        n1.proc.send_signal(signal.SIGHUP)
        text = wait_log(n1, "reloaded ", start)
        time.sleep(3.0)  # a peer poll and a re-plan after the reload, still watched
    finally:
        stop.set()
        watcher.join()
    assert "probe.port changed: needs a restart" in text, text
    line = next(ln for ln in text.splitlines() if "reloaded " in ln)
    assert "probe.dead_after_s 0.8 -> 1.5" in line and "telemetry.rtt_change_ms 1.0 -> 2.5" in line
    assert len(seen) > 20 and all(n4 in s for s in seen), [s for s in seen if n4 not in s][:3]
    assert n1.proc.poll() is None
    assert n1.mesh.installed("n1").get(n4) == "wg0"


def test_allowed_ips_put_back_after_wg_syncconf_reverts_them(n1: Unprivileged) -> None:
    """`wg syncconf` from the wg-quick file gives each peer its configured AllowedIPs
    again; for n4 that takes its address back from the relay. The agent repairs it."""
    lab, mesh = n1.lab, n1.mesh
    owner = mesh.key_owner()
    key_of = {node: key for key, node in owner.items() if node != "n1"}
    n4_ip = f"{lab.overlay_ip('n4')}/32"
    relay = next(n for n in ("n2", "n3") if n4_ip in mesh.allowed_ips("n1")[key_of[n]])
    state = json.loads(n1.state_file("agent").read_text())
    configured = state["baseline"][key_of["n4"]]
    assert n4_ip in configured
    start = len(n1.log())
    argv = ["wg", "set", "wg0", "peer", key_of["n4"], "allowed-ips", ",".join(configured)]
    # The agent paused while the change is made and read: its poll could repair it first.
    with lab.paused("n1", agent_only=True) as stopped:
        assert stopped, "n1's agent was not found to pause"
        lab.run("n1", argv, check=True)
        # What syncconf leaves: n4 has its address, the relay lost it.
        assert n4_ip not in mesh.allowed_ips("n1")[key_of[relay]]
    back = wait_until(lambda: n4_ip in mesh.allowed_ips("n1")[key_of[relay]], 20, interval=0.1)
    assert back is not None, n1.log()[start:]
    assert n4_ip not in mesh.allowed_ips("n1")[key_of["n4"]]
    assert mesh.installed("n1").get(lab.overlay_ip("n4")) == "wg0"
    assert len(mesh.path("n1", "n4")) == 3


def test_clean_stop_restores_sysctls_and_withdraws(n1: Unprivileged) -> None:
    n1.proc.send_signal(signal.SIGTERM)
    assert n1.proc.wait(20) == 0, n1.log()[-3000:]
    n1.mesh.agents.pop("n1")
    for name, value in HOST_SYSCTLS.items():
        assert n1.sysctl(name) == value, name
    if n1.sysctl("net.ipv6.conf.wg0.force_forwarding"):
        assert n1.sysctl("net.ipv6.conf.wg0.force_forwarding") == "0"
    assert not n1.state_file("sysctl").exists()
    assert n1.routes().strip() == ""
    assert "Traceback" not in n1.log()


def test_after_a_crash_the_next_run_restores_the_hosts_values(n1: Unprivileged) -> None:
    """SIGKILL leaves the agent's sysctls (and routes: fail-static) in place; the next run
    keeps the host's originals from its state directory, tells systemd it is ready once
    WireGuard is read and the broker answered, and its clean stop restores them."""
    notify_dir = n1.home / "notify"
    notify_dir.mkdir()
    notify_dir.chmod(0o755)
    path = notify_dir / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        path.chmod(0o666)  # the agent's uid sends as systemd's socket allows
        sock.settimeout(30)
        n1.start()
        assert wait_until(lambda: n1.sysctl("net.ipv4.ip_forward") == "1", 30) is not None
        assert wait_until(lambda: n1.lab.overlay_ip("n4") in n1.routes(), 60) is not None
        n1.proc.send_signal(signal.SIGKILL)
        n1.proc.wait(10)
        n1.mesh.agents.pop("n1")
        assert n1.sysctl("net.ipv4.ip_forward") == "1"  # nobody put it back
        assert n1.lab.overlay_ip("n4") in n1.routes()  # fail-static: routes stay too
        assert json.loads(n1.state_file("sysctl").read_text())["net.ipv4.ip_forward"] == "0"
        n1.start(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "2000000"})
        messages: list[str] = []
        while not any("READY=1" in m.split("\n") for m in messages):
            messages.append(sock.recv(4096).decode())  # TimeoutError after 30 s fails
    ready = next(m for m in messages if "READY=1" in m.split("\n"))
    assert "STATUS=running: 3 peers, broker connected" in ready.split("\n"), messages
    read = [i for i, m in enumerate(messages) if "STATUS=WireGuard read (3 peers)" in m]
    assert read and read[0] < messages.index(ready), messages
    n1.proc.send_signal(signal.SIGTERM)
    assert n1.proc.wait(20) == 0
    n1.mesh.agents.pop("n1")
    for name, value in HOST_SYSCTLS.items():
        assert n1.sysctl(name) == value, name
    assert not n1.state_file("sysctl").exists()
