"""``meshopt transfer`` between two lab nodes through real WireGuard (root only).

The receiver runs in node b as ``meshopt transfer serve``; the sender is the CLI in node
a. A second receiver writes into a 1 MiB tmpfs mounted in a mount namespace of its own:
an offer bigger than its free space is refused before a byte is written. A receiver
given only the mesh prefix listens on b's overlay address, not on the underlay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshopt.lab.lab import Lab

from .conftest import LabMaker
from .tools import need_tools

pytestmark = pytest.mark.lab

TOPOLOGY = """\
name: xfer
defaults: {delay: 5ms, jitter: 0ms, loss: 0%, rate: 100Mbit}
nodes:
  a: {address: 10.99.0.1}
  b: {address: 10.99.0.2}
"""
CLI = [sys.executable, "-m", "meshopt.cli.main", "transfer"]


def _serve(
    lab: Lab,
    directory: Path,
    cache: Path,
    port: int,
    wrap: list[str] | None = None,
    bind: list[str] | None = None,
    allow: str | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """``meshopt transfer serve`` in b (a's address only, on b's overlay address) and
    its "listening on" line."""
    argv = [*CLI, "serve", "--dir", str(directory), "--port", str(port)]
    argv += ["--allow", allow or f"{lab.overlay_ip('a')}/32", "--cache-dir", str(cache)]
    for address in [lab.overlay_ip("b")] if bind is None else bind:
        argv += ["--bind", address]
    proc = lab.popen("b", [*(wrap or []), *argv], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening on" in line:
            return proc, line
    pytest.fail(f"receiver did not start (exit {proc.wait()})")


def _send(
    lab: Lab, src: Path, dest: str, port: int, cache: Path
) -> subprocess.CompletedProcess[str]:
    argv = [*CLI, "send", str(src), f"{lab.overlay_ip('b')}:{dest}", "--port", str(port)]
    return lab.run("a", [*argv, "--json", "--cache-dir", str(cache)], timeout=120)


@pytest.fixture
def lab(make_lab: LabMaker, tmp_path: Path) -> Iterator[Lab]:
    topo = tmp_path / "xfer.yaml"
    topo.write_text(TOPOLOGY)
    made = make_lab(str(topo), broker=False)
    made.run("a", ["ping", "-c", "2", made.overlay_ip("b")])  # WireGuard handshake
    yield made


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_transfer_through_wireguard(lab: Lab, tmp_path: Path) -> None:
    root, src = tmp_path / "recv", tmp_path / "data.txt"
    root.mkdir()
    src.write_bytes(b"".join(b"line %d of a compressible file\n" % i for i in range(100_000)))
    recv, _ = _serve(lab, root, tmp_path / "rcache", 51897)
    try:
        r = _send(lab, src, "inbox", 51897, tmp_path / "scache")
        assert r.returncode == 0, r.stderr
        first = json.loads(r.stdout)
        assert (root / "inbox" / "data.txt").read_bytes() == src.read_bytes()
        assert first["ratio"] > 3 and first["chunks_sent"] == first["chunks_total"]
        again = json.loads(_send(lab, src, "inbox", 51897, tmp_path / "scache").stdout)
        assert again["already_present"] and again["bytes_on_wire"] < 2000
        bad = _send(lab, src, "../escape", 51897, tmp_path / "scache")
        assert bad.returncode == 2 and bad.stdout == ""
        assert bad.stderr.strip().count("\n") == 0 and "'..' is not allowed" in bad.stderr
        assert recv.poll() is None  # still serving
    finally:
        _stop(recv)
    # The bytes went through b's WireGuard interface.
    rx = lab.run("b", ["wg", "show", "wg0", "transfer"]).stdout.split()
    assert int(rx[1]) > first["bytes_on_wire"]


def test_receiver_listens_on_the_overlay_only(lab: Lab, tmp_path: Path) -> None:
    root = tmp_path / "recv"
    root.mkdir()
    recv, listening = _serve(lab, root, tmp_path / "rcache", 51895, bind=[], allow="10.99.0.0/16")
    try:
        b = lab.overlay_ip("b")
        assert f"listening on [{b}]:51895," in listening
        ss = lab.run("b", ["ss", "-Hltn", "sport", "= :51895"]).stdout.split()
        assert f"{b}:51895" in ss and "*:51895" not in ss and "0.0.0.0:51895" not in ss
    finally:
        _stop(recv)


def test_full_disk_is_a_clear_error_and_the_service_keeps_running(lab: Lab, tmp_path: Path) -> None:
    need_tools("unshare", "mount")
    root = tmp_path / "small"
    root.mkdir()
    mount = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    mount += ['mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"', str(root)]
    recv, _ = _serve(lab, root, tmp_path / "rcache", 51896, wrap=mount)
    try:
        big, small = tmp_path / "big.bin", tmp_path / "small.bin"
        big.write_bytes(bytes(range(256)) * 16_384)  # 4 MiB into a 1 MiB disk
        small.write_bytes(b"fits\n" * 1000)
        r = _send(lab, big, "", 51896, tmp_path / "scache")
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.strip().count("\n") == 0
        assert "receiver refused: receiver's disk is too full for big.bin" in r.stderr
        ok = _send(lab, small, "", 51896, tmp_path / "scache")
        assert ok.returncode == 0, ok.stderr
        inside = Path(f"/proc/{recv.pid}/root") / str(root).lstrip("/")
        assert (inside / "small.bin").read_bytes() == small.read_bytes()
        assert sorted(p.name for p in inside.iterdir()) == ["small.bin"]  # no big.bin, no part
        assert list(root.iterdir()) == []  # the tmpfs is the receiver's alone
    finally:
        _stop(recv)
