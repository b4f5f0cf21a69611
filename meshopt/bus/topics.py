"""MQTT topic layout of one mesh.

Every topic of a mesh lives under ``meshopt/<mesh>/`` so one broker can carry several
meshes and an ACL can give each mesh (and each node) its own subtree::

    meshopt/<mesh>/telemetry/<node>              agent -> controller, QoS 0; full snapshots retained
    meshopt/<mesh>/status/<node>                 agent, retained; the agent's will sets it
                                                 offline when it dies
    meshopt/<mesh>/routes/<node>                 controller -> agent, retained, signed and
                                                 versioned route set for that node
    meshopt/<mesh>/controller/lease              retained lease of the active controller
    meshopt/<mesh>/controller/status/<id>        controller, retained; will = offline

Telemetry is not retained: a stale measurement must never look current to a controller
that starts later (it waits for the next full snapshot instead). Status, routes and the
lease are retained because a late subscriber needs the current value at once.

Names (mesh, node, controller id) are 1-64 characters of ``[A-Za-z0-9_.-]``: no ``/``
(it would add a level), no ``+``/``#`` (wildcards), no ``$`` (broker topics), nothing an
ACL pattern or a shell would trip over.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from meshopt.errors import InputError

ROOT: Final = "meshopt"
NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")

TopicKind = Literal["telemetry", "status", "routes", "lease", "controller_status"]

_PER_NODE: Final[frozenset[str]] = frozenset({"telemetry", "status", "routes"})


def is_valid_name(name: object) -> bool:
    """True if ``name`` can be a mesh, node or controller name (one topic level)."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def check_name(name: object, what: str = "name") -> str:
    """Return ``name`` if valid, else InputError naming ``what``."""
    if not is_valid_name(name):
        shown = repr(name)[:70] if isinstance(name, str) else f"a {type(name).__name__}"
        raise InputError(f"bad {what} {shown}: use 1-64 characters of A-Z a-z 0-9 _ . -")
    assert isinstance(name, str)
    return name


class Topics:
    """The topics of mesh ``mesh``; every method validates the names it is given."""

    def __init__(self, mesh: str) -> None:
        self.mesh = check_name(mesh, "mesh name")
        self.prefix = f"{ROOT}/{self.mesh}"

    def __repr__(self) -> str:
        return f"Topics({self.mesh!r})"

    def telemetry(self, node: str) -> str:
        return f"{self.prefix}/telemetry/{check_name(node, 'node name')}"

    def status(self, node: str) -> str:
        return f"{self.prefix}/status/{check_name(node, 'node name')}"

    def routes(self, node: str) -> str:
        return f"{self.prefix}/routes/{check_name(node, 'node name')}"

    def lease(self) -> str:
        return f"{self.prefix}/controller/lease"

    def controller_status(self, controller_id: str) -> str:
        return f"{self.prefix}/controller/status/{check_name(controller_id, 'controller id')}"

    def all_telemetry(self) -> str:
        return f"{self.prefix}/telemetry/+"

    def all_status(self) -> str:
        return f"{self.prefix}/status/+"

    def all_routes(self) -> str:
        return f"{self.prefix}/routes/+"

    def all_controller_status(self) -> str:
        return f"{self.prefix}/controller/status/+"

    def parse(self, topic: str) -> tuple[TopicKind, str] | None:
        """``(kind, name)`` of a topic of this mesh, None for anything else.

        ``name`` is the node for telemetry/status/routes, the controller id for
        controller_status, and "" for the lease. Topics of other meshes, unknown kinds
        and invalid names give None, so a handler can drop them with one check.
        """
        parts = topic.split("/")
        if len(parts) < 3 or parts[0] != ROOT or parts[1] != self.mesh:
            return None
        rest = parts[2:]
        if len(rest) == 2 and rest[0] in _PER_NODE and is_valid_name(rest[1]):
            kind: TopicKind = rest[0]  # type: ignore[assignment]
            return kind, rest[1]
        if rest == ["controller", "lease"]:
            return "lease", ""
        if len(rest) == 3 and rest[:2] == ["controller", "status"] and is_valid_name(rest[2]):
            return "controller_status", rest[2]
        return None
