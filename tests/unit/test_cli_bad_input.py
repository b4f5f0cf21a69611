"""Garbage at every command: one line on stderr and a non-zero status, never a traceback.

Each case runs ``main`` in-process, so an exception that escapes it fails the test with
the traceback a user would have seen. Nothing here reaches past loopback (port 9 has no
listener) or builds a lab.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshopt.cli.main import main

TRIANGLE = str(Path(__file__).parents[2] / "topologies" / "triangle.yaml")
NOBODY = "mqtt://127.0.0.1:9"

CASES: list[tuple[str, ...]] = [
    ("nosuchcmd",),
    ("--nonsense",),
    ("routes", "{missing}"),
    ("routes", "{dir}"),
    ("routes", "{binary}"),
    ("routes", "{empty_csv}"),
    ("routes", "{bad_yaml}"),
    ("routes", "{hyphen_csv}", "--node", "node-9"),
    ("routes", TRIANGLE, "--relay-cost", "-5ms"),
    ("routes", TRIANGLE, "--relay-cost", "nan"),
    ("routes", TRIANGLE, "--broker", NOBODY),
    ("routes", "--broker", "garbage://", "--timeout", "1"),
    ("routes", "--timeout", "-1"),
    ("routes", "--timeout", "abc"),
    ("routes", "--controller-key", "garbage", "--broker", NOBODY),
    ("routes", "--ca-file", "{dir}", "--broker", "mqtts://127.0.0.1:9"),
    ("routes", "--password-file", "{missing}", "--username", "u", "--broker", NOBODY),
    ("path", TRIANGLE, "a", "zz"),
    ("path", TRIANGLE, "a", "b", "c", "d"),
    ("path", TRIANGLE, "a", "b", "--relay-cost", "1e400ms"),
    ("gains", TRIANGLE, "--top", "abc"),
    ("gains", "gen:geo:n=-5"),
    ("gains", "gen:geo:n=5,seed=-1"),
    ("gains", "gen:nosuch:n=3"),
    ("gains", "gen:"),
    ("gains", "gen:ring:n=100000000"),
    ("sim", TRIANGLE, "--seed", "abc"),
    ("sim", TRIANGLE, "--duration", "-5s"),
    ("sim", TRIANGLE, "--duration", "0"),
    ("sim", TRIANGLE, "--probe-interval", "0"),
    ("sim", TRIANGLE, "--probe-interval", "1s"),
    ("sim", TRIANGLE, "--recompute", "0"),
    ("sim", TRIANGLE, "--event", "garbage"),
    ("sim", TRIANGLE, "--event", "at=1s link=a-zz down"),
    ("sim", TRIANGLE, "--event", "at=-1s link=a-b down"),
    ("sim", TRIANGLE, "--event", "at=1s link=a-b delay=-5ms"),
    ("graph", TRIANGLE, "--out", "{dir}"),
    ("graph", TRIANGLE, "--out", "x.pdf"),
    ("graph", TRIANGLE, "--out", "/nonexistent-h1/x.svg"),
    ("graph", "{missing}", "--out", "x.svg"),
    ("graph", "--out", "x.svg", "--broker", NOBODY, "--timeout", "1"),
    ("graph", TRIANGLE, "--out", "x.svg", "--broker", NOBODY),
    ("topology", "check", "{binary}"),
    ("topology", "convert", TRIANGLE, "{dir}"),
    ("topology", "convert", TRIANGLE, "/nonexistent-h1/x.yaml"),
    ("controller", "keygen", "--out", "{dir}"),
    ("controller", "keygen", "--out", "{binary}/x.key"),
    ("controller", "--config", "{bad_yaml}"),
    ("agent", "--config", "{missing}"),
    ("agent", "--config", "{dir}"),
    ("agent", "--config", "{binary}"),
    ("agent", "keygen", "--out", "{dir}"),
    ("agent", "--log-level", "garbage"),
    ("lab", "up", "{missing}"),
    ("lab", "up", TRIANGLE, "--seed", "-1"),
    ("lab", "up", TRIANGLE, "--seed", "x"),
    ("lab", "down", "no-such-lab-h1"),
    ("lab", "status", "no-such-lab-h1"),
    ("lab", "set", "no-such-lab-h1", "a-b", "down"),
    ("transfer", "send", "{missing}", "a"),
    ("transfer", "send", "{dir}", "a"),
    ("transfer", "send", "{binary}", "[fd00::1"),
    ("transfer", "send", "{binary}", ":x"),
    ("transfer", "send", "{binary}", "10.0.0.1:x", "--port", "70000"),
    ("transfer", "send", "{binary}", "node-x", "--broker", NOBODY, "--timeout", "1"),
    ("transfer", "serve", "--dir", "{dir}", "--allow", "garbage"),
    ("transfer", "serve", "--dir", "{binary}", "--allow", "10.0.0.0/8"),
    ("transfer", "serve", "--dir", "{dir}", "--allow", "10.0.0.0/8", "--cache-max-mb", "-1"),
    ("transfer", "serve", "--dir", "{dir}", "--allow", "10.0.0.0/8", "--bind", "garbage"),
    ("bench", "convergence", "--runs", "abc"),
    ("bench", "convergence", "--baseline", "{binary}"),
    ("demo", "{missing}"),
]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "adir").mkdir()
    (tmp_path / "bin.dat").write_bytes(b"garbage\x00\xff")
    (tmp_path / "empty.csv").write_text("a,b,rtt_ms\n")
    (tmp_path / "bad.yaml").write_text("nodes: [\n")
    (tmp_path / "h.csv").write_text("a,b,rtt_ms\nnode-0,node-1,5\n")
    return {
        "missing": str(tmp_path / "nosuch.yaml"),
        "dir": str(tmp_path / "adir"),
        "binary": str(tmp_path / "bin.dat"),
        "empty_csv": str(tmp_path / "empty.csv"),
        "bad_yaml": str(tmp_path / "bad.yaml"),
        "hyphen_csv": str(tmp_path / "h.csv"),
    }


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c)[:60] for c in CASES])
def test_bad_input_is_one_line(
    argv: tuple[str, ...],
    files: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([a.format(**files) for a in argv])
    _, err = capsys.readouterr()
    assert code in (1, 2, 3), err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith(("meshopt: error:", "Error:"))]
    assert len(errors) == 1, err
