"""Node names are host names (``fra-1``, ``node-0``, ``db.eu``), and link specs that join
two of them with ``-`` (``fra-1-ams-2``) are split against the names a mesh has.

Light on purpose (no numpy): the CLI, the YAML reader, the importers and the event parser
all use it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from meshopt.errors import InputError

if TYPE_CHECKING:
    from meshopt.sim.events import Event

# Letters, digits, '-', '_' and '.', starting with a letter or digit and not ending in
# '-' or '.' (as host names), at most 63 characters. Linux accepts every such name in a
# network namespace's name and in an interface name (the lab shortens long ones).
NODE_NAME: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9_])?")
NAME_RULE: Final = (
    "use letters, digits, '-', '_' and '.' (start with a letter or digit, "
    "end with a letter, digit or '_', at most 63 characters)"
)


def is_node_name(name: str) -> bool:
    return NODE_NAME.fullmatch(name) is not None


def check_node_name(name: str) -> str:
    """``name`` if it is a valid node name; InputError saying the rule otherwise."""
    if not is_node_name(name):
        raise InputError(f"bad node name {name!r}: {NAME_RULE}")
    return name


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    directed: bool  # 'a->b': one direction only


def _sample(names: Collection[str], limit: int = 8) -> str:
    shown = sorted(names)
    return ", ".join(shown[:limit]) + (", ..." if len(shown) > limit else "")


def split_link(text: str, names: Collection[str], *, directed_ok: bool = True) -> Link:
    """Split ``a-b`` or ``a->b`` where both ends are nodes in ``names``.

    A name may itself hold '-': ``fra-1-ams-2`` is split at the one dash that leaves two
    known names. When more than one dash does, or none, the error names the candidates;
    spaces around the joining dash (``a-b - c``) or ``->`` always say which it is.
    """
    spec = text.strip()
    known = set(names)
    if "->" in spec:
        a, _, b = (s.strip() for s in spec.partition("->"))
        if not directed_ok:
            raise InputError(f"{spec!r}: links here are two-way, write {a}-{b}")
        return _checked(spec, a, b, True, known)
    if "," in spec:  # 'a,b': a comma is in no name, so it says where to split
        head, _, tail = spec.partition(",")
        return _checked(spec, head.strip(), tail.strip(), False, known)
    spaced = [m.start() for m in re.finditer(r"\s+-\s+", spec)]
    if len(spaced) == 1:
        head, tail = re.split(r"\s+-\s+", spec, maxsplit=1)
        return _checked(spec, head.strip(), tail.strip(), False, known)
    dashes = [i for i, ch in enumerate(spec) if ch == "-"]
    if not dashes:
        form = "'a-b' or 'a->b'" if directed_ok else "'a-b'"
        raise InputError(f"bad link {spec!r}: write {form}")
    splits = [(spec[:i].strip(), spec[i + 1 :].strip()) for i in dashes]
    fits = [(a, b) for a, b in splits if a in known and b in known]
    if len(fits) == 1:
        a, b = fits[0]
        return _checked(spec, a, b, False, known)
    if len(fits) > 1:
        options = " or ".join(f"'{a} - {b}'" for a, b in fits)
        raise InputError(
            f"ambiguous link {spec!r}: it splits into known nodes as {options}; "
            "write one of these (spaces around the joining dash)"
        )
    # One end known: the split that keeps the longest known name names the other end.
    halves = [(a, b) if a in known else (b, a) for a, b in splits if a in known or b in known]
    if halves:
        _, unknown = max(halves, key=lambda half: len(half[0]))
        hint = _near(unknown, known)
        raise InputError(f"link {spec!r}: unknown node {unknown!r}{hint}")
    raise InputError(
        f"link {spec!r}: no dash splits it into two known nodes (nodes: {_sample(known)})"
    )


def _near(name: str, known: Collection[str]) -> str:
    """' (did you mean fra-1?)' for a near miss, else the list of nodes."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=3)
    if close:
        return f" (did you mean {' or '.join(close)}?)"
    return f" (nodes: {_sample(known)})"


def _checked(spec: str, a: str, b: str, directed: bool, known: set[str]) -> Link:
    for end in (a, b):
        if not end:
            raise InputError(f"bad link {spec!r}: write 'a-b' or 'a->b'")
        if end not in known:
            raise InputError(f"link {spec!r}: unknown node {end!r}{_near(end, known)}")
    if a == b:
        raise InputError(f"link {spec!r} joins a node to itself")
    return Link(a, b, directed)


def resolve_event_links(events: Sequence[Event], names: Collection[str]) -> list[Event]:
    """``link=fra-1-ams-2`` in a sim or lab event: the event parser splits at the first
    dash; split again against the topology's names. 'a->b' is kept: '>' is in no name."""
    out = []
    for ev in events:
        if ev.link is not None and ev.both_ways:
            spec = f"{ev.link[0]}-{ev.link[1]}"
            try:
                link = split_link(spec, names)
            except InputError as exc:
                raise InputError(f"event {ev.text!r}: {exc.message}") from None
            ev = dataclasses.replace(ev, link=(link.a, link.b))
        out.append(ev)
    return out
