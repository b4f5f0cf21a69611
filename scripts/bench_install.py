#!/usr/bin/env python3
"""What a node pays for meshopt (issue 13 item 1); one JSON object out.

Figures, each with its goal and pass/fail:

1. ``installed_base``: a fresh venv, ``pip install <wheel>`` (no extras: the agent and
   the CLI), then the bytes under site-packages minus pip, setuptools and wheel (the
   venv's own tools). Goal <= 60 MB (10^6 bytes). Per distribution, from each one's
   RECORD. Installed sizes are deterministic: one install, not a median.
2. ``installed_controller`` and ``installed_transfer``: the same with ``[controller]``
   (numpy, scipy, networkx) and with ``[transfer]`` (zstandard, pyfastcdc), for reference.
3. ``agent_rss``: a 16-node lab (full mesh, 1 ms), an agent in each run by the BASE
   venv's ``meshopt`` command (so it can only import what the base install has); after
   every agent of n1 sees its 15 peers alive and a warm-up (bandwidth trains at 5 s),
   VmRSS of every agent. The median over the 16 agents per run; median of ``--runs``
   runs (default 3). Goal <= 60 MB (MiB, as the kernel counts). Needs root,
   wireguard-go, mosquitto.

    .venv/bin/python scripts/bench_install.py [--runs 3] [--no-rss] [--wheel X.whl]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MB = 1_000_000
TOOLS = ("pip", "setuptools", "wheel")  # the venv's own, not meshopt's weight

# Run by the measured venv's python: bytes per distribution (from RECORD) and the
# total under site-packages minus the tools' files.
SIZE_CODE = r"""
import json, os, site, sys
from importlib import metadata
tools = set(sys.argv[1:])
sp = site.getsitepackages()[0]
per, tool_files = {}, set()
for d in metadata.distributions():
    name = d.metadata["Name"]
    files = [os.path.realpath(str(f.locate())) for f in (d.files or [])]
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    if name.lower() in tools:
        tool_files.update(files)
    else:
        per[name] = size
total = 0
for root, _, names in os.walk(sp):
    for n in names:
        p = os.path.realpath(os.path.join(root, n))
        if p not in tool_files and "/pip/" not in p and "/setuptools/" not in p \
                and "/pkg_resources/" not in p and "/_distutils_hack/" not in p:
            total += os.path.getsize(p)
print(json.dumps({"total": total, "per": per}))
"""


def run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command; its stderr in the error when it fails."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}: {proc.stderr.strip()[-500:]}")
    return proc


# Not copied for a build: setuptools would otherwise leave build/ and *.egg-info in the
# checkout, and reuse build/lib (stale modules in the wheel) across builds.
BUILD_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


def build_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` of a clean copy of this checkout, into ``out``."""
    src = out / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=BUILD_IGNORE)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)])
    shutil.rmtree(src)
    return next(out.glob("meshopt_wg-*.whl"))


def make_venv(where: Path, spec: str) -> Path:
    """A fresh venv at ``where`` with ``spec`` installed; its python."""
    run([sys.executable, "-m", "venv", str(where)])
    py = where / "bin" / "python"
    run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", spec])
    return py


def installed_size(py: Path) -> dict[str, Any]:
    """site-packages bytes without pip/setuptools/wheel, and per distribution."""
    out = json.loads(run([str(py), "-c", SIZE_CODE, *TOOLS], cwd="/").stdout)  # not a checkout
    per = {k: round(v / MB, 2) for k, v in sorted(out["per"].items(), key=lambda kv: -kv[1])}
    return {"mb": round(out["total"] / MB, 1), "per_distribution_mb": per}


def size_figure(wheel: Path, extra: str, tmp: Path, goal_mb: float | None) -> dict[str, Any]:
    spec = f"{wheel}[{extra}]" if extra else str(wheel)
    py = make_venv(tmp / f"venv-{extra or 'base'}", spec)
    size = installed_size(py)
    out: dict[str, Any] = {"value": size["mb"], "unit": "MB (10^6 bytes)", "spec": extra or "base"}
    if goal_mb is not None:
        out.update(goal=f"<= {goal_mb:g} MB", ok=size["mb"] <= goal_mb)
    out["per_distribution_mb"] = size["per_distribution_mb"]
    return out


def rss_kb(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(rest.split()[0])
    return fields


def rss_run(base_py: Path, tag: str, warmup_s: float) -> dict[str, Any]:
    """One 16-node lab, agents from the base venv: VmRSS per agent after warm-up."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_probe import alive_peers, lab_up, stop, wait_for

    from meshopt.lab.agents import agent_config, agent_log, write_agent_config

    meshopt_cmd = str(base_py.parent / "meshopt")
    lab = lab_up(tag, 16, 1.0)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        nodes = [n.name for n in lab.plan.nodes]
        started = time.monotonic()
        for n in nodes:
            path = write_agent_config(lab, n, agent_config(lab, n))
            with path.with_suffix(".log").open("ab") as log:
                procs[n] = lab.popen(
                    n,
                    [meshopt_cmd, "agent", "--config", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd="/",
                )
        seen = wait_for(lambda: alive_peers(lab, "n1") >= len(nodes) - 1, 90, step=2.0)
        time.sleep(max(0.0, warmup_s - (time.monotonic() - started)))
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"agents exited: {dead}; {agent_log(lab, dead[0])[-400:]}")
        per = {n: rss_kb(p.pid) for n, p in procs.items()}
        vm = [v["VmRSS"] / 1024 for v in per.values()]
        return {
            "median_mib": round(statistics.median(vm), 1),
            "max_mib": round(max(vm), 1),
            "n1_kb": per["n1"],
            "n1_peers_alive": alive_peers(lab, "n1"),
            "all_peers_seen": seen,
            "seconds_since_start": round(time.monotonic() - started, 1),
        }
    finally:
        for p in procs.values():
            stop(p)
        lab.down()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_install.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="labs for the RSS figure (median)")
    ap.add_argument("--wheel", help="measure this wheel instead of building one")
    ap.add_argument("--no-rss", action="store_true", help="sizes only (no root needed)")
    ap.add_argument("--warmup-s", type=float, default=40.0, help="seconds before reading RSS")
    args = ap.parse_args(argv)
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="meshopt-bench-install-") as tmp_s:
        tmp = Path(tmp_s)
        wheel = Path(args.wheel) if args.wheel else build_wheel(tmp)
        figures["wheel"] = {"file": wheel.name, "kb": round(wheel.stat().st_size / 1000)}
        figures["installed_base"] = size_figure(wheel, "", tmp, 60.0)
        figures["installed_controller"] = size_figure(wheel, "controller", tmp, None)
        figures["installed_transfer"] = size_figure(wheel, "transfer", tmp, None)
        if not args.no_rss:
            if os.geteuid() != 0:
                figures["agent_rss"] = {"error": "needs root (a namespace lab)"}
            else:
                base_py = tmp / "venv-base" / "bin" / "python"
                runs = []
                for i in range(args.runs):
                    runs.append(rss_run(base_py, f"bi{os.getpid() % 1000}{i}", args.warmup_s))
                med = statistics.median(r["median_mib"] for r in runs)
                figures["agent_rss"] = {
                    "value": med,
                    "unit": "MiB VmRSS, median over runs of the median over 16 agents",
                    "goal": "<= 60 MB with 15 peers",
                    "ok": med <= 60.0,
                    "runs": runs,
                    "agent": "the base venv's meshopt command (no extras installed)",
                }
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
