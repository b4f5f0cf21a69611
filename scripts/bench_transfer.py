#!/usr/bin/env python3
"""Benchmark ``meshopt transfer`` in a lab: 50 Mbit/s, 40 ms RTT, through WireGuard; JSON out.

Every figure is measured in the same run against a plain TCP copy of the same bytes (a
small Python socket copy in the nodes, fsync at the end like the receiver) and against a
``zstd -3 | tcp copy | zstd -d`` pipeline:
  (a) a tarball of this machine's Python standard library (goal >= 3x plain, >= zstd);
  (b) random data (goal >= 0.95x plain);
  (c) the tarball sent a second time (goal >= 20x plain);
  (d) a large random file (1 GB; --quick 256 MB) with 1 % changed since the last send:
      half of the changed bytes overwritten, half inserted (goal >= 10x plain). The first
      version is sent once at an unlimited rate; plain TCP of the large file is
      extrapolated from (b)'s plain goodput unless --full-plain measures it once.
Times are end to end as the sender sees them (hashing, offer, chunks, the receiver's hash
check, fsync and rename). Medians of --runs runs. Needs root.

    .venv/bin/python scripts/bench_transfer.py [--runs 3] [--quick] [--full-plain]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOPOLOGY = """\
name: xfer
defaults: {delay: 20ms, jitter: 0ms, loss: 0%, rate: 50Mbit}
nodes:
  a: {address: 10.99.0.1}
  b: {address: 10.99.0.2}
"""
PORT, BIG_PORT, COPY_PORT = 51897, 51898, 51899
MB = 1_000_000


# --- the copy helpers, run inside the nodes -------------------------------------------


def copy_recv(port: int, out: str, unzstd: bool) -> None:
    """Accept one connection, write what arrives to ``out`` (through zstd -d), fsync, close."""
    srv = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = srv.accept()
    with open(out, "wb") as f:
        dec = (
            subprocess.Popen(["zstd", "-d", "-q", "-c"], stdin=subprocess.PIPE, stdout=f)
            if unzstd
            else None
        )
        sink = dec.stdin if dec is not None else f
        assert sink is not None
        while data := conn.recv(1 << 20):
            sink.write(data)
        if dec is not None:
            sink.close()
            dec.wait()
        f.flush()
        os.fsync(f.fileno())
    conn.close()


def copy_send(host: str, port: int, path: str, zstd3: bool) -> None:
    """Send ``path`` (through zstd -3); print the seconds until the receiver closed."""
    t0 = time.perf_counter()
    sock = socket.create_connection((host, port))
    if zstd3:
        comp = subprocess.Popen(["zstd", "-3", "-q", "-c", path], stdout=subprocess.PIPE)
        assert comp.stdout is not None
        while data := comp.stdout.read(1 << 20):
            sock.sendall(data)
        comp.wait()
    else:
        with open(path, "rb") as f:
            sock.sendfile(f)
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(1 << 16):
        pass
    print(json.dumps({"seconds": time.perf_counter() - t0}))


# --- the benchmark --------------------------------------------------------------------


def _copy(lab: Any, src: str, out: str, *, zstd: bool) -> float:
    recv = lab.popen(
        "b",
        [PY, __file__, "_copy-recv", str(COPY_PORT), out, "1" if zstd else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
        argv = [PY, __file__, "_copy-send", lab.overlay_ip("b"), str(COPY_PORT), src]
        r = lab.run("a", [*argv, "1" if zstd else "0"], timeout=1800, check=True)
        recv.wait(60)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    if Path(out).stat().st_size != Path(src).stat().st_size:
        raise SystemExit(f"copy of {src} is incomplete")
    Path(out).unlink()
    return float(json.loads(r.stdout)["seconds"])


def _receiver(lab: Any, port: int, directory: Path, cache: Path) -> subprocess.Popen[str]:
    """The receiver in b on its overlay address, with the default limits except that the
    large file's receiver lets a's resends replace the file (each counts to the quota)."""
    directory.mkdir(parents=True)
    argv = [PY, "-m", "meshopt.cli.main", "transfer", "serve", "--dir", str(directory)]
    argv += ["--allow", f"{lab.overlay_ip('a')}/32", "--port", str(port)]
    argv += ["--bind", lab.overlay_ip("b"), "--cache-dir", str(cache)]
    if port == BIG_PORT:
        argv += ["--allow-overwrite", "--quota-gib", "100"]
    proc: subprocess.Popen[str] = lab.popen("b", argv, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening on" in line:
            return proc
    raise SystemExit("receiver did not start")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _send(lab: Any, src: Path, port: int, cache: Path) -> dict[str, Any]:
    argv = [PY, "-m", "meshopt.cli.main", "transfer", "send", str(src)]
    argv += [f"{lab.overlay_ip('b')}:", "--port", str(port), "--json", "--cache-dir", str(cache)]
    if port == BIG_PORT:
        argv.append("--overwrite")  # the changed large file replaces its last version
    r = lab.run("a", argv, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"transfer failed: {r.stderr.strip()}")
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _stdlib_tar(path: Path) -> None:
    stdlib = Path(os.__file__).parent
    with tarfile.open(path, "w") as tar:
        tar.add(
            stdlib,
            arcname=stdlib.name,
            filter=lambda t: None if "site-packages" in t.name or "dist-packages" in t.name else t,
        )


def _random_file(path: Path, size: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 << 20)
            f.write(rng.randbytes(n))
            left -= n


def _change_one_percent(path: Path, seed: int) -> int:
    """Rewrite ``path`` with 1 % of it changed: 50 spots overwritten and 50 inserted."""
    rng = random.Random(seed)
    size = path.stat().st_size
    spot = size // 100 // 100  # 100 spots of 1/10,000 of the file each
    starts = sorted(rng.sample(range(0, size - spot, spot * 2), 100))
    tmp = path.with_name(path.name + ".new")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        pos = 0
        for k, s in enumerate(starts):
            dst.write(src.read(s - pos))
            dst.write(rng.randbytes(spot))
            pos = s
            if k % 2 == 0:  # overwrite: skip the old bytes
                src.seek(spot, os.SEEK_CUR)
                pos += spot
        shutil.copyfileobj(src, dst, 16 << 20)
    os.replace(tmp, path)
    return 100 * spot


def _ratio(plain: float, ours: float) -> float:
    return round(plain / ours, 2)


def bench(runs: int, big: int, full_plain: bool) -> dict[str, Any]:
    from meshopt.lab.lab import Lab

    work = Path(tempfile.mkdtemp(prefix="meshopt-bench-transfer-", dir="/var/tmp"))
    topo = work / "xfer.yaml"
    topo.write_text(TOPOLOGY)
    src = work / "src"
    src.mkdir()
    tar, rnd, large = src / "stdlib.tar", src / "random.bin", src / "large.bin"
    _stdlib_tar(tar)
    _random_file(rnd, 64 * MB, seed=1)
    _random_file(large, big, seed=2)
    rows: list[dict[str, Any]] = []
    notes: dict[str, Any] = {}
    lab = Lab.up(str(topo), name=f"benchxfer{os.getpid()}")
    procs: list[subprocess.Popen[str]] = []
    try:
        lab.run("a", ["ping", "-c", "2", lab.overlay_ip("b")])  # WireGuard handshake
        # The large file's first version, sent once at an unlimited rate.
        big_recv = _receiver(lab, BIG_PORT, work / "big-dst", work / "big-rcache")
        procs.append(big_recv)
        lab.set("a-b rate=unlimited")
        seed_send = _send(lab, large, BIG_PORT, work / "big-scache")
        lab.set("a-b rate=50Mbit")
        notes["large_first_send_unlimited_rate_s"] = seed_send["seconds"]
        if full_plain:
            notes["large_plain_measured_s"] = _copy(lab, str(large), str(work / "cp"), zstd=False)
        for r in range(runs):
            row: dict[str, Any] = {"run": r}
            recv = _receiver(lab, PORT, work / f"dst{r}", work / f"rcache{r}")
            procs.append(recv)
            scache = work / f"scache{r}"
            out = str(work / "copy.out")
            for key, path in (("a_text", tar), ("b_random", rnd)):
                plain = _copy(lab, str(path), out, zstd=False)
                zpipe = _copy(lab, str(path), out, zstd=True)
                ours = _send(lab, path, PORT, scache)
                row[key] = {
                    "file_mb": round(path.stat().st_size / MB, 2),
                    "plain_s": round(plain, 3),
                    "zstd3_pipeline_s": round(zpipe, 3),
                    "meshopt_s": ours["seconds"],
                    "meshopt": ours,
                    "x_plain": _ratio(plain, ours["seconds"]),
                    "x_zstd3": _ratio(zpipe, ours["seconds"]),
                }
            again = _send(lab, tar, PORT, scache)
            row["c_second_send"] = {
                "plain_s": row["a_text"]["plain_s"],
                "meshopt_s": again["seconds"],
                "meshopt": again,
                "x_plain": _ratio(row["a_text"]["plain_s"], again["seconds"]),
            }
            changed = _change_one_percent(large, seed=100 + r)
            ours = _send(lab, large, BIG_PORT, work / "big-scache")
            plain_bps = row["b_random"]["file_mb"] * MB / row["b_random"]["plain_s"]
            plain_big = notes.get("large_plain_measured_s") or large.stat().st_size / plain_bps
            row["d_large_1pct"] = {
                "file_mb": round(large.stat().st_size / MB, 1),
                "changed_mb": round(changed / MB, 2),
                "plain_s": round(plain_big, 2),
                "plain_how": "measured once (--full-plain)"
                if full_plain
                else "extrapolated: file size / plain goodput of (b) in the same run",
                "meshopt_s": ours["seconds"],
                "meshopt": ours,
                "x_plain": _ratio(plain_big, ours["seconds"]),
            }
            _stop(recv)
            shutil.rmtree(work / f"dst{r}", ignore_errors=True)
            shutil.rmtree(work / f"rcache{r}", ignore_errors=True)
            rows.append(row)
            print(f"run {r}: " + _line(row), file=sys.stderr)
    finally:
        for p in procs:
            _stop(p)
        lab.down()
        shutil.rmtree(work, ignore_errors=True)
    keys = ("a_text", "b_random", "c_second_send", "d_large_1pct")
    medians = {
        k: {
            f: statistics.median(r[k][f] for r in rows) for f in ("x_plain", "meshopt_s", "plain_s")
        }
        for k in keys
    }
    for k in ("a_text", "b_random"):
        medians[k]["x_zstd3"] = statistics.median(r[k]["x_zstd3"] for r in rows)
    goals = {
        "a_text": medians["a_text"]["x_plain"] >= 3 and medians["a_text"]["x_zstd3"] >= 1,
        "b_random": medians["b_random"]["x_plain"] >= 0.95,
        "c_second_send": medians["c_second_send"]["x_plain"] >= 20,
        "d_large_1pct": medians["d_large_1pct"]["x_plain"] >= 10,
    }
    return {
        "link": "50 Mbit/s, 40 ms RTT (20 ms each way), lab emulator, wireguard-go",
        "runs": runs,
        "large_file_mb": big / MB,
        "median": medians,
        "goals_met": goals,
        "notes": notes,
        "per_run": rows,
    }


def _line(row: dict[str, Any]) -> str:
    parts = []
    for k in ("a_text", "b_random", "c_second_send", "d_large_1pct"):
        v = row[k]
        z = f", {v['x_zstd3']}x zstd" if "x_zstd3" in v else ""
        parts.append(f"{k} {v['x_plain']}x plain{z} ({v['meshopt_s']:.2f} s)")
    return "; ".join(parts)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_copy-recv":
        copy_recv(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_copy-send":
        copy_send(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 run, a 256 MB large file")
    ap.add_argument("--full-plain", action="store_true", help="measure plain TCP of the large file")
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    big = 256 * MB if args.quick else 1000 * MB
    if os.geteuid() != 0:
        print("bench_transfer: needs root (network namespaces)", file=sys.stderr)
        return 2
    result = bench(runs, big, args.full_plain)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
