"""``meshopt status``: the comparison, the status file and the command's exit codes.

The kernel side here is this namespace's real rtnetlink (reading needs no root); the
lab test (tests/lab/test_status.py) changes a node's kernel routes and watches the
command see it.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from meshopt.cli import main as cli_main
from meshopt.cli.main import Entry, main
from meshopt.cli.status_cmd import compare, render_text, report
from meshopt.errors import InputError
from meshopt.install.model import DesiredRoute, DesiredRule
from meshopt.metrics.statusfile import (
    AgentStatus,
    StatusPeer,
    StatusRoute,
    StatusRouteSet,
    StatusSetRoute,
    read_status,
    status_path,
    write_status,
)

KEY_B = "B" * 43 + "="
KEY_C = "C" * 43 + "="


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command as the lead registers it in meshopt.cli.main.COMMANDS."""
    monkeypatch.setitem(
        cli_main.COMMANDS,
        "status",
        Entry("meshopt.cli.status_cmd:status_cmd", "This node's kernel routes vs its agent."),
    )


def route(dst: str, dev: str = "wg0", table: int = 7701, **kw: object) -> DesiredRoute:
    return DesiredRoute(dst=dst, oif=dev, table=table, **kw)  # type: ignore[arg-type]


RULE = DesiredRule(priority=7701, table=7701)


def test_compare_names_missing_extra_and_wrong() -> None:
    want = [route("10.9.0.2/32"), route("10.9.0.3/32", "wg1"), route("10.9.0.4/32")]
    have = [route("10.9.0.2/32"), route("10.9.0.3/32", "wg2"), route("10.9.0.5/32")]
    cmp = compare(want, have, [RULE], [])
    states = {(r.want or r.have).dst: r.state for r in cmp.routes}  # type: ignore[union-attr]
    assert states == {
        "10.9.0.2/32": "ok",
        "10.9.0.3/32": "wrong",
        "10.9.0.4/32": "missing",
        "10.9.0.5/32": "extra",
    }
    assert [r.state for r in cmp.rules] == ["missing"]
    assert not cmp.in_sync and cmp.count("missing") == 2
    assert compare(want, list(reversed(want)), [RULE], [RULE]).in_sync
    # An attribute the agent set (a route MTU) that the kernel lost is a difference too.
    assert not compare([route("10.9.0.2/32", mtu=1380)], [route("10.9.0.2/32")], [], []).in_sync


def status(**kw: object) -> AgentStatus:
    base: dict[str, object] = dict(
        mesh="m",
        node="fra-1",
        pid=0,
        written_at=1_800_000_000.0,
        started_at=1_799_999_000.0,
        interval_s=5.0,
        broker_connected=False,
        fast_table=7701,
        bulk_table=7702,
        applied=True,
        route_set=StatusRouteSet(
            version=7,
            term=3,
            controller="ctl1",
            issued_at=1_799_999_990.0,
            routes=[StatusSetRoute(dst="10.9.0.2/32", via=KEY_B)],
        ),
        routes=[StatusRoute(dst="10.9.0.2/32", oif="wg0", table=7701)],
        peers=[
            StatusPeer(
                key=KEY_B,
                interface="wg0",
                alive=True,
                rtt_ms=10.25,
                loss=0.0,
                probe_class="idle",
                probe_interval_s=5.75,
                probe_dead_after_s=13.939,
            )
        ],
    )
    base.update(kw)
    return AgentStatus(**base)  # type: ignore[arg-type]


def test_status_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    path = status_path(tmp_path / "state", "m", "fra-1")
    assert path.name == "status-m-fra-1.json"
    write_status(path, status())
    assert read_status(path) == status()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    path.write_text("{not json")
    with pytest.raises(InputError, match="not an agent status file"):
        read_status(path)
    path.write_bytes(msgspec.json.encode(status(v=2)))
    with pytest.raises(InputError, match="version 2"):
        read_status(path)


def test_text_shows_each_difference_and_the_verdict() -> None:
    st = status()
    cmp = compare(
        [route("10.9.0.2/32"), route("10.9.0.3/32", "wg1")],
        [route("10.9.0.3/32", "wg2"), route("10.9.0.9/32")],
        [RULE],
        [RULE],
    )
    doc = report(st, cmp, st.written_at + 2, Path("/x"))
    text = render_text(doc, color=False)
    assert "MISSING 10.9.0.2/32 dev wg0 table meshopt-fast (7701)" in text
    assert "WRONG   10.9.0.3/32 dev wg2 table meshopt-fast (7701)  (agent wants dev wg1)" in text
    assert "EXTRA   10.9.0.9/32 dev wg0" in text
    assert "ok      7701: from all lookup meshopt-fast (7701) (inet)" in text
    assert "kernel differs from the last route set: 1 missing, 1 extra, 1 wrong" in text
    assert "route set: v7 term 3 from ctl1, issued 12 s ago, 1 routes" in text
    assert "broker NOT connected" in text and "10.25 ms" in text
    assert "idle: every 5.75 s, dead after 13.9 s" in text  # how the peer is probed
    assert doc["peers"][0]["probe_dead_after_s"] == 13.939
    assert "\x1b[" not in text
    assert doc["kernel"]["missing"] == 1 and doc["in_sync"] is False


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["status", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "status.json"
    code, _, err = run(capsys, "--state", str(path))
    assert code == 3 and "no agent status at" in err and err.count("\n") == 1
    path.write_text("garbage")
    code, _, err = run(capsys, "--state", str(path))
    assert code == 2 and "not an agent status file" in err and err.count("\n") == 1
    # No route set installed yet: nothing to compare, nothing wrong.
    write_status(path, status(applied=False, route_set=None, routes=[]))
    code, out, _ = run(capsys, "--state", str(path))
    assert code == 0 and "not compared" in out and "none received yet" in out
    # A route the kernel of this namespace does not have (nobody installs proto-77
    # routes for 192.0.2.77, a documentation address): exit 1, and JSON says why.
    write_status(path, status(routes=[StatusRoute(dst="192.0.2.77/32", oif="lo", table=7701)]))
    code, out, _ = run(capsys, "--state", str(path), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["schema"] == "meshopt.status/1" and doc["in_sync"] is False
    rows = [r for r in doc["kernel"]["routes"] if r["state"] == "missing"]
    assert [r["want"]["dst"] for r in rows] == ["192.0.2.77/32"]
    assert doc["agent"]["running"] is None and doc["agent"]["broker_connected"] is False
    code, _, err = run(capsys, "--state", str(path), "--netns", "../x")
    assert code == 2 and "not a namespace name" in err


def test_config_gives_the_status_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[agent]\nmesh = "m"\nnode = "fra-1"\nstate_dir = "{tmp_path}"\n')
    write_status(status_path(tmp_path, "m", "fra-1"), status(applied=False, routes=[]))
    code, out, err = run(capsys, "--config", str(cfg))
    assert code == 0, err
    assert "agent fra-1 (mesh m)" in out
    cfg.write_text('[agent]\nmesh = "m"\n')
    code, _, err = run(capsys, "--config", str(cfg))
    assert code == 2 and "[agent] node" in err
    code, _, err = run(capsys, "--config", str(tmp_path / "nope.toml"))
    assert code == 2 and err.count("\n") == 1


def test_stopped_agent_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The last file of a clean stop: routes withdrawn, so nothing is wanted any more."""
    path = tmp_path / "s.json"
    write_status(path, status(running=False, routes=[], rules=[]))
    code, out, _ = run(capsys, "--state", str(path), "--json")
    doc = json.loads(out)
    assert doc["agent"]["stopped_cleanly"] is True and doc["agent"]["running"] is False
    assert doc["agent"]["stale"] is False  # an old file of a stopped agent is not "hung"
    assert [r for r in doc["kernel"]["routes"] if r["state"] != "extra"] == []
    assert code == int(not doc["in_sync"])  # 0 unless this namespace has proto-77 routes
    _, out, _ = run(capsys, "--state", str(path))
    assert "stopped (clean stop" in out


def test_apply_lock_keeps_reader_and_agent_apart(tmp_path: Path) -> None:
    """A reader holding the lock makes the agent's apply wait; never the other way
    round for longer than the agent's bound (routes never wait for a reader)."""
    import asyncio

    from meshopt.metrics.statusfile import ApplyLock, lock_path, reading

    path = tmp_path / "status-m-a.json"
    with reading(path) as held:
        assert held is False  # no agent has applied yet: no lock file, nothing to wait for
    lock = ApplyLock(path)

    async def scenario() -> list[bool]:
        got = [await lock.acquire(wait_s=0.05)]  # nobody reads: at once
        with reading(path, wait_s=0.05) as held:
            got.append(held)  # the agent holds it: the reader gives up, says so
        lock.release()
        with reading(path) as held:
            got.append(held)
            got.append(await lock.acquire(wait_s=0.05))  # a reader holds it: bounded wait
        got.append(await lock.acquire(wait_s=0.05))  # the reader is gone
        lock.release()
        return got

    assert asyncio.run(scenario()) == [True, False, True, False, True]
    assert lock_path(path).exists()
    lock.close()


def test_refused_routes_are_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "status.json"
    refused = "10.9.0.1/32 dev wg0 table 7701: no interface wg0"
    write_status(path, status(routes=[], apply_errors=[refused]))
    code, out, _ = run(capsys, "--state", str(path))
    assert code == 0 and "refused by the kernel: " + refused in out
    _, out, _ = run(capsys, "--state", str(path), "--json")
    assert json.loads(out)["apply_errors"] == [refused]
