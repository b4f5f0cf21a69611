"""Scheduled changes to a simulated underlay: ``at=30s link=a-b delay=200ms``.

The same words as topology files and ``meshopt lab set``: ``a-b`` changes both
directions, ``a->b`` one; delays are one-way; ``down``/``up`` for links and nodes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from meshopt.errors import InputError
from meshopt.topology.model import Topology
from meshopt.units import parse_duration_s, parse_loss, parse_rate_mbit, parse_time_ms

_LINK_KEYS = {"delay", "jitter", "loss", "rate"}


@dataclass(frozen=True)
class Event:
    at_s: float
    text: str
    node: str | None = None  # node=c down|up
    link: tuple[str, str] | None = None
    both_ways: bool = True
    state: str | None = None  # "down" | "up" | None
    changes: dict[str, float] = field(default_factory=dict)  # delay_ms, jitter_ms, loss, rate_mbit

    def describe(self) -> str:
        return self.text


def parse_event(text: str) -> Event:
    """Parse one ``--event`` value; raises InputError naming the bad word."""
    try:
        words = shlex.split(text.replace(",", " "))
    except ValueError as exc:
        raise InputError(f"bad event {text!r}: {exc}") from None
    at: float | None = None
    node: str | None = None
    link: tuple[str, str] | None = None
    both = True
    state: str | None = None
    changes: dict[str, float] = {}
    for word in words:
        if word in ("down", "up"):
            state = word
            continue
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise InputError(f"bad event {text!r}: expected key=value, got {word!r}")
        if key == "at":
            at = parse_duration_s(value, "event time")
        elif key == "node":
            node = value
        elif key == "link":
            if "->" in value:
                a, _, b = value.partition("->")
                both = False
            else:
                a, _, b = value.partition("-")
            if not a or not b:
                raise InputError(f"bad event {text!r}: link must look like a-b or a->b")
            link = (a, b)
        elif key == "delay":
            changes["delay_ms"] = parse_time_ms(value, "delay")
        elif key == "jitter":
            changes["jitter_ms"] = parse_time_ms(value, "jitter")
        elif key == "loss":
            changes["loss"] = parse_loss(value)
        elif key == "rate":
            changes["rate_mbit"] = parse_rate_mbit(value)
        else:
            known = ", ".join(sorted({"at", "node", "link", *_LINK_KEYS}))
            raise InputError(f"bad event {text!r}: unknown key {key!r} (known: {known})")
    if at is None:
        raise InputError(f"bad event {text!r}: missing at=TIME")
    if (node is None) == (link is None):
        raise InputError(f"bad event {text!r}: give exactly one of node=NAME or link=A-B")
    if node is not None and (state is None or changes):
        raise InputError(f"bad event {text!r}: a node event is 'node=NAME down' or 'up'")
    if link is not None and state is None and not changes:
        raise InputError(f"bad event {text!r}: nothing to change (delay=, loss=, down, ...)")
    return Event(at, text, node, link, both, state, changes)


def check_events(events: list[Event], topo: Topology) -> None:
    """Reject events naming nodes the topology does not have."""
    for ev in events:
        names = [ev.node] if ev.node is not None else list(ev.link or ())
        for name in names:
            if name not in topo.names:
                raise InputError(f"event {ev.text!r}: unknown node {name!r} in {topo.name}")
        if ev.link is not None and ev.link[0] == ev.link[1]:
            raise InputError(f"event {ev.text!r}: a link needs two different nodes")
