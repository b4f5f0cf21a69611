"""Reading docs/deploy.md as a script: its config files, its commands, its placeholders.

The guide's conventions (stated at its top): a config file is a fenced block whose first
line is ``# <path> on <machines>``; a shell block's first line is ``# on <machines>``
(names, or "each node"); ``<name>`` is a placeholder, ``NODE`` inside one means the
machine the block runs on, and a trailing ``# prints <X>`` says the command's output is
the value of ``<X>``. The rehearsal test runs what this module reads, so the guide
cannot drift from what works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_CONFIG_MARK = re.compile(r"#\s*(/\S+)\s+on\s+(.+?)\s*$")
_SHELL_MARK = re.compile(r"#\s*on\s+(.+?)\s*$")
_PRINTS = re.compile(r"\s+#\s*prints\s+(<[\w-]+>)\s*$")
_COMMENT = re.compile(r"\s+#.*$")
REHEARSAL_HEADING = "\n## The rehearsal"
PLACEHOLDER = re.compile(r"<[A-Za-z][\w-]*>")


class GuideError(AssertionError):
    """The guide breaks its own conventions (a test failure, with the block)."""


@dataclass(frozen=True)
class ConfigBlock:
    path: str  # as on the machine, e.g. /etc/meshopt/agent.toml
    machines: tuple[str, ...]
    text: str  # the whole block, marker line included (a comment in TOML and INI)


@dataclass(frozen=True)
class Command:
    line: str  # one command, continuation lines joined, trailing comment removed
    prints: str | None  # "<NODE-identity-key>": the output's placeholder


@dataclass(frozen=True)
class ShellBlock:
    machines: tuple[str, ...]
    commands: tuple[Command, ...]


Block = ConfigBlock | ShellBlock


def read_guide(machines: tuple[str, ...], path: Path = GUIDE) -> list[Block]:
    """The guide's config and shell blocks in order; other blocks (nftables) are prose."""
    out: list[Block] = []
    text = path.read_text().partition(REHEARSAL_HEADING)[0]  # how to run it: not a step
    for m in _FENCE.finditer(text):
        lang, body = m[1], m[2]
        first, _, rest = body.partition("\n")
        if lang in ("toml", "ini"):
            mark = _CONFIG_MARK.fullmatch(first.strip())
            if not mark:
                raise GuideError(f"config block without '# <path> on <machine>': {first!r}")
            out.append(ConfigBlock(mark[1], _machines(mark[2], machines), body))
        elif lang == "sh":
            mark = _SHELL_MARK.fullmatch(first.strip())
            if not mark:
                raise GuideError(f"shell block without '# on <machines>': {first!r}")
            out.append(ShellBlock(_machines(mark[1], machines), _commands(rest)))
    return out


def _machines(text: str, machines: tuple[str, ...]) -> tuple[str, ...]:
    if "each node" in text or "every" in text:
        return machines
    named = tuple(m for m in machines if re.search(rf"\b{re.escape(m)}\b", text))
    if not named:
        raise GuideError(f"block for no known machine: 'on {text}'")
    return named


def _commands(body: str) -> tuple[Command, ...]:
    lines: list[str] = []
    pending = ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        lines.append(pending + line.strip())
        pending = ""
    out = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        prints = _PRINTS.search(line)
        out.append(Command(_COMMENT.sub("", line), prints[1] if prints else None))
    return tuple(out)


def fill(text: str, values: dict[str, str], *, node: str | None = None) -> str:
    """``text`` with every placeholder replaced; GuideError naming any left unknown."""

    def one(m: re.Match[str]) -> str:
        key = m[0].replace("NODE", node) if node else m[0]
        if key not in values:
            raise GuideError(f"placeholder {key} has no value yet (in {text.strip()[:80]!r})")
        return values[key]

    return PLACEHOLDER.sub(one, text)


def placeholder_for(prints: str, node: str) -> str:
    return prints.replace("NODE", node)
