"""The agent runs on every node: it must not carry the offline tools' heavy libraries."""

from __future__ import annotations

import subprocess
import sys


def test_agent_command_imports_no_scipy_networkx_or_matplotlib() -> None:
    code = (
        "import sys, click\n"
        "import meshopt.cli.main as m\n"
        "m.cli.get_command(click.Context(m.cli), 'agent')\n"
        "import meshopt.agent.daemon\n"
        "print(sorted(k for k in ('scipy', 'networkx', 'matplotlib', 'scapy') "
        "if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
