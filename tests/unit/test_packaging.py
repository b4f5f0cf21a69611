"""Installing meshopt like software: the distribution, its wheel, and packaging/install.sh.

The install test builds the real wheel, runs the real installer into a temporary prefix
(a fresh venv; pip's cache or index) with ``--root`` for the system files, and runs the
installed ``meshopt``: no mocks, and nothing outside the temporary directory is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from meshopt.errors import InputError
from meshopt.topologies import DIR, names, packaged, resolve

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "packaging" / "install.sh"
SHIPPED = {"bench8.yaml", "demo.yaml", "europe.yaml", "hub.yaml", "lab4.yaml", "triangle.yaml"}


def _project() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return data


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a clean copy (no build/ or egg-info left in the checkout)."""
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
    )
    shutil.copytree(REPO, src, symlinks=True, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("meshopt_wg-*.whl")
    return whl


# --- the distribution -----------------------------------------------------------------


def test_distribution_name_command_and_license() -> None:
    project = _project()
    assert project["name"] == "meshopt-wg"  # "meshopt" on PyPI is someone else's
    assert project["scripts"] == {"meshopt": "meshopt.cli.main:main"}
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_base_install_is_the_agent_and_cli_only() -> None:
    project = _project()
    base = _names(project["dependencies"])
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    offline = {"numpy", "scipy", "networkx", "numba", "matplotlib", "scapy", "zstandard"}
    offline |= {"pyfastcdc"}
    assert base & offline == set()
    assert {"pyroute2", "aiomqtt", "msgspec", "pynacl", "click", "prometheus-client"} <= base
    assert extras["controller"] == {"numpy", "scipy", "networkx", "numba"}
    assert "matplotlib" in extras["graph"]
    assert extras["transfer"] == {"zstandard", "pyfastcdc"}
    assert {"pytest", "mypy", "ruff", "hypothesis"} <= extras["dev"]
    # [lab] and [all] are the others by name, so they cannot drift apart.
    for key in ("lab", "all", "graph"):
        for req in project["optional-dependencies"][key]:
            assert req.startswith("meshopt-wg[") or not req.startswith("meshopt")


def test_topologies_live_in_the_package_and_the_root_symlink_points_there() -> None:
    link = REPO / "topologies"
    assert link.is_symlink() and os.readlink(link) == "meshopt/topologies"  # relative
    assert link.resolve() == DIR
    assert set(names()) >= SHIPPED
    assert (DIR / "README.md").is_file()
    assert packaged("demo") == packaged("demo.yaml") == packaged("topologies/demo.yaml")
    assert packaged("lab4").read_text() == (REPO / "topologies" / "lab4.yaml").read_text()


@pytest.mark.parametrize("bad", ["nope", "../pyproject.toml", ".hidden", "a/b.yaml", ""])
def test_unknown_packaged_topology_is_one_line(bad: str) -> None:
    with pytest.raises(InputError, match="no shipped topology") as err:
        packaged(bad)
    assert "\n" not in str(err.value) and "demo.yaml" in str(err.value)


def test_resolve_prefers_a_file_then_the_shipped_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve("demo.yaml") == str(DIR / "demo.yaml")  # none here: the shipped one
    (tmp_path / "demo.yaml").write_text("x")
    assert resolve("demo.yaml") == "demo.yaml"  # a file in the working directory wins
    assert resolve("gen:geo:n=5,seed=1") == "gen:geo:n=5,seed=1"
    assert resolve("nothing.yaml") == "nothing.yaml"  # the loader says it is missing
    for odd in ("a\0b.yaml", "x" * 5000, "europe.yaml?k=v"):
        assert resolve(odd) == odd  # never raises: the loader's one-line errors apply


def test_demo_and_bench_default_to_the_packaged_topologies() -> None:
    """Not paths into a checkout: installed, the package directory is all there is."""
    from meshopt.bench.convergence import TOPOLOGY
    from meshopt.cli.demo_cmd import DEFAULT_TOPOLOGY

    assert Path(DEFAULT_TOPOLOGY) == DIR / "demo.yaml"
    assert TOPOLOGY == DIR / "bench8.yaml"


def test_wheel_carries_topologies_license_and_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        meta = z.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    assert {f"meshopt/topologies/{n}" for n in SHIPPED} <= files
    assert "meshopt/topologies/README.md" in files
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files)
    assert "Name: meshopt-wg" in meta
    provides = set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    assert {"controller", "graph", "transfer", "lab", "dev", "all"} <= provides
    assert not any(f.startswith(("tests/", "scripts/", "topologies/")) for f in files)


# --- packaging/install.sh -------------------------------------------------------------


def _install(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL), *args], capture_output=True, text=True, check=check, timeout=300
    )


def test_dry_run_prints_every_action_and_does_nothing(tmp_path: Path, wheel: Path) -> None:
    prefix = tmp_path / "opt" / "meshopt"
    root = tmp_path / "root"
    out = _install("--dry-run", "--controller", "--prefix", str(prefix), "--from", str(wheel))
    log = out.stderr
    assert f"-m venv {prefix}" in log
    assert f"{prefix}/bin/python -m pip install" in log
    assert f"{wheel}\\[controller\\]" in log  # printed as a shell word (%q)
    assert "install -d -m 0750 -o root -g meshopt /etc/meshopt" in log
    assert "install -d -m 0750 -o meshopt -g meshopt /var/lib/meshopt" in log
    if subprocess.run(["getent", "passwd", "meshopt"], capture_output=True).returncode != 0:
        assert "useradd --system --user-group" in log and "/usr/sbin/nologin" in log
    assert "Next steps" in log and "agent keygen --out /etc/meshopt/agent.key" in log
    for unit in ("meshopt-agent.service", "meshopt-controller.service"):  # --controller
        if (REPO / "packaging" / "systemd" / unit).exists():
            assert f" /etc/systemd/system/{unit}  # through sed " in log
    assert not prefix.exists() and not (tmp_path / "opt").exists()
    # staged: the same without the user, owners or apt, under the root
    out = _install("--dry-run", "--root", str(root), "--prefix", str(prefix), "--from", str(wheel))
    assert f"install -d -m 0750 {root}/etc/meshopt" in out.stderr
    assert "useradd" not in out.stderr and "apt-get" not in out.stderr
    assert not root.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown option '--bogus'"),
        (["--prefix", "relative/dir"], "--prefix must be an absolute path"),
        (["--prefix", "/opt/a b"], "only letters, digits"),
        (["--from"], "--from needs"),
        (["--from", "/etc/hostname", "--dry-run"], "not a wheel (.whl) or a directory"),
        (["--root", "x", "--dry-run"], "--root must be an absolute path"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = _install(*args, check=False)
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_install_into_a_prefix_then_run_the_installed_meshopt(tmp_path: Path, wheel: Path) -> None:
    """The real installer, staged: venv at --prefix, system files under --root."""
    prefix = tmp_path / "opt" / "meshopt"
    root = tmp_path / "root"
    args = ("--root", str(root), "--prefix", str(prefix), "--from", str(wheel))
    _install(*args)
    meshopt = prefix / "bin" / "meshopt"
    py = prefix / "bin" / "python"

    def run(*argv: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        # cwd=/ : nothing of the checkout can be imported by accident
        return subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, cwd="/", check=check
        )

    from meshopt import __version__

    assert run(meshopt, "--version").stdout.strip().endswith(__version__)
    agent_help = run(meshopt, "agent", "--help").stdout
    assert "--config" in agent_help and "keygen" in agent_help
    code = "import meshopt.topologies as t; print(t.DIR); print(' '.join(t.names()))"
    where, shipped = run(py, "-c", code).stdout.splitlines()
    assert where.startswith(str(prefix)) and set(shipped.split()) >= SHIPPED
    # base install: the agent's modules load, the offline libraries are not there
    run(py, "-c", "import meshopt.agent.daemon, meshopt.probe.pmtu, meshopt.cli.agent_cmd")
    missing = run(py, "-c", "import numpy", check=False)
    assert missing.returncode != 0 and "No module named 'numpy'" in missing.stderr
    code = "from meshopt.agent.config import TransferSettings as T; T(enabled=True).check()"
    refused = run(py, "-c", code, check=False)
    assert "pip install 'meshopt-wg[transfer]'" in refused.stderr
    # system files, staged under --root with the agreed modes
    etc = root / "etc" / "meshopt"
    assert stat.S_IMODE(etc.stat().st_mode) == 0o750
    assert stat.S_IMODE((root / "var" / "lib" / "meshopt").stat().st_mode) == 0o750
    assert (etc / "agent.toml.example").read_text() == (REPO / "agents/agent.toml").read_text()
    unit_src = REPO / "packaging" / "systemd" / "meshopt-agent.service"
    if unit_src.exists():
        unit = (root / "etc/systemd/system/meshopt-agent.service").read_text()
        assert unit == unit_src.read_text().replace("/opt/meshopt", str(prefix))
        assert f"ExecStart={prefix}/bin/meshopt agent --config" in unit
    for d in ("rt_tables.d", "rt_protos.d"):
        src = REPO / "packaging" / "iproute2" / d / "meshopt.conf"
        if src.exists():
            assert (root / "etc/iproute2" / d / "meshopt.conf").read_text() == src.read_text()
    # idempotent: a second run keeps the venv and rewrites nothing
    venv_python = (prefix / "pyvenv.cfg").stat().st_mtime_ns
    again = _install(*args)
    assert "-m venv" not in again.stderr
    assert "install -D" not in again.stderr and "unchanged:" in again.stderr
    assert (prefix / "pyvenv.cfg").stat().st_mtime_ns == venv_python
