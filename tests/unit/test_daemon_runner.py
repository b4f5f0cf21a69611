"""What systemd sees of the daemons: exit status 2 for bad config (so
RestartPreventExitStatus=2 stops a restart loop), 1 for a daemon that fails while
running, journald-ready log lines when stderr is the journal, and SIGHUP reloads that
keep the running config when the new file is bad. Real processes, real files."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from meshopt.bus.signing import generate_signing_key, save_private_key
from meshopt.cli.daemon_runner import run_daemon, setup_logging, stream_is_journal
from meshopt.errors import InputError

from .test_bus_client import free_port

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def meshopt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshopt.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def controller_toml(tmp: Path, *, port: int = 1, extra: str = "", cid: str = "ctl1") -> str:
    key = tmp / "controller.key"
    if not key.exists():
        save_private_key(key, generate_signing_key()[0])
    fra = tmp / "fra.pub"
    if not fra.exists():
        fra.write_text(generate_signing_key()[1])
    return (
        f'[controller]\nmesh = "nt"\nid = "{cid}"\nsigning_key = "{key}"\n'
        f'broker = "mqtt://127.0.0.1:{port}"\n{extra}'
        f'[node_keys]\nfra = "{fra.read_text()}"\n'
    )


def agent_toml(tmp: Path, key: Path) -> str:
    return (
        f'[agent]\nmesh = "nt"\nnode = "fra"\nidentity_key = "{key}"\n'
        f'state_dir = "{tmp / "state"}"\nbroker = "mqtt://127.0.0.1:1"\n'
    )


# --- exit status -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["agent", "controller"])
@pytest.mark.parametrize("check", [True, False])
def test_missing_or_unparsable_config_exits_2(tmp_path: Path, command: str, check: bool) -> None:
    extra = ["--check"] if check else []
    gone = meshopt(command, "--config", str(tmp_path / "nope.toml"), *extra)
    assert gone.returncode == 2, gone.stderr
    assert gone.stderr.count("\n") == 1 and "Traceback" not in gone.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent\nmesh = ")
    broken = meshopt(command, "--config", str(bad), *extra)
    assert broken.returncode == 2, broken.stderr
    assert broken.stderr.startswith("meshopt: error: ") and "Traceback" not in broken.stderr


@pytest.mark.parametrize("check", [True, False])
def test_bad_key_file_exits_2(tmp_path: Path, check: bool) -> None:
    extra = ["--check"] if check else []
    key = tmp_path / "agent.key"
    key.write_text("not a key\n")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(agent_toml(tmp_path, key))
    agent = meshopt("agent", "--config", str(cfg), *extra)
    assert agent.returncode == 2, agent.stderr
    assert str(key) in agent.stderr and "Traceback" not in agent.stderr
    ctl = tmp_path / "controller.toml"
    ctl.write_text(controller_toml(tmp_path))
    (tmp_path / "controller.key").write_text("garbage\n")
    controller = meshopt("controller", "--config", str(ctl), *extra)
    assert controller.returncode == 2, controller.stderr
    assert "controller.key" in controller.stderr and "Traceback" not in controller.stderr


def test_good_config_checks_with_0(tmp_path: Path) -> None:
    key = tmp_path / "agent.key"
    save_private_key(key, generate_signing_key()[0])
    cfg = tmp_path / "agent.toml"
    cfg.write_text(agent_toml(tmp_path, key))
    assert meshopt("agent", "--config", str(cfg), "--check").returncode == 0
    ctl = tmp_path / "controller.toml"
    ctl.write_text(controller_toml(tmp_path))
    assert meshopt("controller", "--config", str(ctl), "--check").returncode == 0


def test_a_daemon_failing_while_running_exits_1(caplog: pytest.LogCaptureFixture) -> None:
    """Not a config error: systemd should restart it (RestartPreventExitStatus is 2 only)."""

    async def broken() -> None:
        raise InputError("interface wg0 vanished")

    with pytest.raises(click.exceptions.Exit) as exc:
        run_daemon("info", broken)
    assert exc.value.exit_code == 1


# --- logging ---------------------------------------------------------------------------


def test_journal_stream_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    with (tmp_path / "err").open("w") as f, (tmp_path / "other").open("w") as g:
        st = os.fstat(f.fileno())
        mine = f"{st.st_dev}:{st.st_ino}"
        assert stream_is_journal(f, mine)
        assert not stream_is_journal(g, mine)
        assert not stream_is_journal(f, None)
        assert not stream_is_journal(f, "")
        assert not stream_is_journal(io.StringIO(), mine)  # no file descriptor


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_journal_lines_carry_priority_and_no_timestamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    with (tmp_path / "err").open("w+") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        setup_logging("debug", f)
        logging.getLogger("meshopt.agent").info("peer abc alive")
        logging.getLogger("meshopt.agent").warning("fail-over")
        logging.getLogger("meshopt.bus").error("refused")
        logging.getLogger("meshopt.x").debug("detail")
        f.flush()
        f.seek(0)
        assert f.read().splitlines() == [
            "<6>meshopt.agent: peer abc alive",
            "<4>meshopt.agent: fail-over",
            "<3>meshopt.bus: refused",
            "<7>meshopt.x: detail",
        ]


def test_other_stderr_keeps_timestamps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")  # the journal, but not our stderr
    with (tmp_path / "err").open("w+") as f:
        setup_logging("info", f)
        logging.getLogger("meshopt.agent").info("hello")
        f.flush()
        f.seek(0)
        line = f.read().splitlines()[0]
    assert STAMP.match(line) and line.endswith("meshopt.agent INFO hello"), line


def run_controller(tmp: Path, env: dict[str, str], err: Path) -> subprocess.Popen[bytes]:
    cfg = tmp / "controller.toml"
    with err.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "meshopt.cli.main", "controller", "--config", str(cfg)],
            stdout=f,
            stderr=f,
            env=env,
        )


def wait_for_text(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace")
        if text in content:
            return content
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the log:\n{path.read_text(errors='replace')}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def test_real_daemon_writes_journal_lines_to_the_journal_stream(tmp_path: Path) -> None:
    (tmp_path / "controller.toml").write_text(controller_toml(tmp_path, port=free_port()))
    err = tmp_path / "stderr"
    err.touch()
    st = os.stat(err)
    env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    env.pop("NOTIFY_SOCKET", None)
    proc = run_controller(tmp_path, env, err)
    try:
        text = wait_for_text(err, "connect_failed", proc, 30)
    finally:
        assert stop(proc) == 0
    lines = [ln for ln in text.splitlines() if ln]
    assert lines and all(re.match(r"^<[2-7]>meshopt[.\w]*: ", ln) for ln in lines), lines
    assert not any(STAMP.match(ln) for ln in lines)


# --- reload ----------------------------------------------------------------------------


def test_sighup_reload_bad_file_keeps_running_then_good_file_takes_effect(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "controller.toml"
    port = free_port()  # nobody listens: reloads do not need the broker
    cfg.write_text(controller_toml(tmp_path, port=port))
    err = tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    proc = run_controller(tmp_path, env, err)
    try:
        wait_for_text(err, "connect_failed", proc, 30)
        cfg.write_text("[controller\n")
        proc.send_signal(signal.SIGHUP)
        text = wait_for_text(err, "reload failed", proc, 15)
        failed = [ln for ln in text.splitlines() if "reload failed" in ln]
        assert len(failed) == 1 and " ERROR " in failed[0] and str(cfg) in failed[0], failed
        assert "Traceback" not in text
        assert proc.poll() is None
        # A good file: a policy threshold changes now; the id needs a restart and stays.
        extra = "[policy]\nabs_margin_ms = 7.5\n"
        cfg.write_text(
            controller_toml(tmp_path, port=port, cid="ctl9").replace(
                "[node_keys]", extra + "[node_keys]"
            )
        )
        proc.send_signal(signal.SIGHUP)
        text = wait_for_text(err, "reloaded ", proc, 15)
        assert "id changed: needs a restart" in text, text
        reloaded = next(ln for ln in text.splitlines() if "reloaded " in ln)
        assert "policy.abs_margin_ms" in reloaded and "-> 7.5" in reloaded, reloaded
        assert proc.poll() is None
    finally:
        assert stop(proc) == 0


# --- what a reload may change ------------------------------------------------------------


def test_merge_reload_keeps_restart_only_settings() -> None:
    import dataclasses

    from meshopt.agent.config import parse_config
    from meshopt.agent.daemon import AGENT_RESTART_ONLY
    from meshopt.reload import describe, merge_reload

    old = parse_config({"agent": {"mesh": "m", "node": "a", "broker": "mqtt://10.0.0.1"}})
    new = parse_config(
        {
            "agent": {"mesh": "m", "node": "b", "broker": "mqtt://10.0.0.2", "peer_poll_s": 1.0},
            "probe": {"dead_after_s": 1.5, "port": 5000},
            "telemetry": {"rtt_change_ms": 3.0},
            "routes": {"fast_table": 100},
        }
    )
    merged, now, later = merge_reload(old, new, AGENT_RESTART_ONLY)
    assert now == ["peer_poll_s", "probe.dead_after_s", "telemetry.rtt_change_ms"]
    assert later == ["broker.url", "node", "probe.port", "routes.fast_table"]
    assert merged.node == "a" and merged.broker == old.broker
    assert merged.probe == dataclasses.replace(old.probe, dead_after_s=1.5)
    assert merged.routes == old.routes and merged.telemetry == new.telemetry
    assert describe(old, merged, now) == (
        "peer_poll_s 2.0 -> 1.0, probe.dead_after_s 0.8 -> 1.5, telemetry.rtt_change_ms 1.0 -> 3.0"
    )
    assert merge_reload(old, old, AGENT_RESTART_ONLY)[1:] == ([], [])
