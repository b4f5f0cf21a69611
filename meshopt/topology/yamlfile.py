"""The YAML topology format: read with line numbers for every error, write to round-trip.

The file is composed into PyYAML's node tree (not loaded into plain dicts) so
every value keeps its position: a user with a typo on line 40 of a 60-node
file is told "line 40", not "bad delay somewhere". topologies/README.md
documents the format.
"""

from __future__ import annotations

import gc
import ipaddress
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import yaml
from yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)

from meshopt.errors import InputError, TopologyError
from meshopt.topology.geo import distance_matrix_km, fibre_delay_ms
from meshopt.topology.limits import Limits, inner_path, read_input
from meshopt.topology.model import NODE_NAME, FloatMatrix, Node, Topology
from meshopt.topology.names import NAME_RULE, split_link
from meshopt.units import parse_loss, parse_rate_mbit, parse_spike, parse_time_ms

TOP_KEYS = ("name", "description", "defaults", "nodes", "underlay", "tunnels", "geo_delay")
NODE_KEYS = ("address", "site", "lat", "lon")
LINK_KEYS = ("delay", "jitter", "loss", "rate", "spike")  # spike: a lab fault (1/N)
UNLIMITED = "unlimited"  # rate with no limit (the default when no rate is given)

Props = dict[str, float]  # subset of LINK_KEYS -> value in ms, fraction or Mbit/s

# libyaml when present: a 300-node mesh with distinct pairs is ~45,000 entries,
# where the pure-Python parser and emitter take several times longer.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_RESOLVER = yaml.resolver.Resolver()

# The composer's budget: a node or pair entry is at most its key, a mapping and four
# key/value pairs; the top level adds name, description, defaults and a few keys.
VALUES_PER_ENTRY = 10
VALUES_BASE = 64
_SECTIONS = {"nodes": "nodes", "underlay": "pairs", "tunnels": "pairs"}
_NODE_EVENTS = (ScalarEvent, MappingStartEvent, SequenceStartEvent, AliasEvent)


# --- reading -------------------------------------------------------------------------


def load_yaml(path: str | Path, limits: Limits | None = None) -> Topology:
    """Read a topology file; every problem becomes a TopologyError naming file and line."""
    limits = limits or Limits()
    data = read_input(Path(path), limits)
    return parse_yaml(
        data, source=str(path), default_name=inner_path(Path(path)).stem, limits=limits
    )


def parse_yaml(
    data: str | bytes,
    *,
    source: str = "<string>",
    default_name: str = "topology",
    limits: Limits | None = None,
) -> Topology:
    """Parse the YAML format from text (tests and generated files go through here too)."""
    reader = _Reader(source, limits or Limits())
    with _collector_paused():
        root = reader.compose(data)
        return _Builder(reader, default_name).build(root)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection while the node tree is built and read: the collector would
    scan the growing tree again and again (half the time of a 300-node file with every
    pair listed) and there is no garbage to find."""
    collect = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collect:
            gc.enable()


class _Frame:
    """An open mapping or sequence while composing: its node, a key waiting for its
    value, and which counted section ('nodes' or 'pairs') its entries belong to."""

    __slots__ = ("is_map", "key", "node", "section")

    def __init__(self, node: yaml.Node, section: str | None) -> None:
        self.node = node
        self.is_map = isinstance(node, yaml.MappingNode)
        self.key: yaml.Node | None = None
        self.section = section


class _Reader:
    """Turns YAML nodes into checked Python values, attaching the line to every error."""

    def __init__(self, source: str, limits: Limits | None = None) -> None:
        self.source = source
        self.limits = limits or Limits()
        self._ctor = yaml.SafeLoader("")
        self._tags: dict[str, str] = {}

    def error(self, message: str, node: yaml.Node | None = None) -> TopologyError:
        line = node.start_mark.line + 1 if node is not None else None
        return TopologyError(message, source=self.source, line=line)

    def _at(self, message: str, event: yaml.Event) -> TopologyError:
        line = event.start_mark.line + 1 if event.start_mark is not None else None
        return TopologyError(message, source=self.source, line=line)

    def _compose_events(self, text: str) -> yaml.Node | None:
        """yaml.compose without recursion and within the limits, in one pass over events.

        libyaml's composer recurses in C: 25,000 nested brackets overflow the stack
        (SIGSEGV), and a file is composed whole before any count can be checked. Here
        depth, node and pair counts and the number of values are checked as each event
        arrives, so a hostile file stops at the first value over a limit.
        """
        lim = self.limits
        root: yaml.Node | None = None
        stack: list[_Frame] = []
        anchors: dict[str, yaml.Node] = {}
        counts = {"nodes": 0, "pairs": 0}
        values = documents = 0
        budget = VALUES_BASE
        for event in yaml.parse(text, Loader=_Loader):
            kind = type(event)
            if kind is MappingEndEvent or kind is SequenceEndEvent:
                stack.pop()
                continue
            if kind is DocumentStartEvent:
                documents += 1
                if documents > 1:
                    raise self._at("YAML: expected a single document, found another", event)
                continue
            if kind not in _NODE_EVENTS:  # stream and document ends
                continue
            node = self._node(event, kind, anchors)
            values += 1
            section: str | None = None
            if stack:
                top = stack[-1]
                counted = top.section
                if not top.is_map:
                    top.node.value.append(node)
                elif top.key is None:
                    top.key = node
                else:
                    top.node.value.append((top.key, node))
                    if len(stack) == 1 and isinstance(top.key, yaml.ScalarNode):
                        section = _SECTIONS.get(str(top.key.value))
                    top.key = None
                    counted = None  # counted at its key
                if counted is not None:
                    counts[counted] += 1
                    budget += VALUES_PER_ENTRY
                    key = "max_nodes" if counted == "nodes" else "max_pairs"
                    if counts[counted] > getattr(lim, key):
                        what = "nodes" if counted == "nodes" else "pairs (underlay and tunnels)"
                        raise self._at(lim.exceeded(what, key), event)
            else:
                root = node
            if values > budget:
                raise self._at(
                    f"YAML: {values:,} values for {counts['nodes']:,} nodes and "
                    f"{counts['pairs']:,} pairs (a topology holds at most "
                    f"{VALUES_PER_ENTRY} per node or pair)",
                    event,
                )
            if kind is MappingStartEvent or kind is SequenceStartEvent:
                stack.append(_Frame(node, section))
                if len(stack) > lim.max_depth:
                    raise self._at(lim.exceeded("levels of nesting", "max_depth"), event)
        return root

    def _node(
        self, event: yaml.Event, kind: type[yaml.Event], anchors: dict[str, yaml.Node]
    ) -> yaml.Node:
        """The node an event opens (or, for an alias, the node it names)."""
        if kind is AliasEvent:
            assert isinstance(event, AliasEvent)
            if event.anchor not in anchors:
                raise self._at(f"YAML: found undefined alias {event.anchor!r}", event)
            return anchors[event.anchor]
        node: yaml.Node
        # One mark for both ends: the builder only needs the line. libyaml's marks are
        # its own class with the same attributes.
        mark = cast(yaml.Mark, event.start_mark)
        if kind is ScalarEvent:
            assert isinstance(event, ScalarEvent)
            tag = event.tag
            if tag is None or tag == "!":
                tag = self._scalar_tag(event.value, event.implicit)
            node = yaml.ScalarNode(tag, event.value, mark, mark, style=event.style)
        elif kind is MappingStartEvent:
            assert isinstance(event, MappingStartEvent)
            tag = event.tag
            if tag is None or tag == "!":
                tag = _RESOLVER.DEFAULT_MAPPING_TAG
            node = yaml.MappingNode(tag, [], mark, mark, flow_style=event.flow_style)
        else:
            assert isinstance(event, SequenceStartEvent)
            tag = event.tag
            if tag is None or tag == "!":
                tag = _RESOLVER.DEFAULT_SEQUENCE_TAG
            node = yaml.SequenceNode(tag, [], mark, mark, flow_style=event.flow_style)
        anchor = event.anchor
        if anchor is not None:
            if anchor in anchors:
                raise self._at(f"YAML: found duplicate anchor {anchor!r}", event)
            anchors[anchor] = node
        return node

    def _scalar_tag(self, value: str, implicit: tuple[bool, bool]) -> str:
        """The tag PyYAML's resolver gives an untagged scalar; plain ones are cached by
        value (a mesh file repeats '10ms' and node names thousands of times)."""
        if not implicit[0]:  # quoted: a string, as the resolver has it
            return _RESOLVER.DEFAULT_SCALAR_TAG
        tag = self._tags.get(value)
        if tag is None:
            tag = _resolve(yaml.ScalarNode, value, implicit)
            if len(self._tags) < 4096:
                self._tags[value] = tag
        return tag

    def compose(self, data: str | bytes) -> yaml.Node:
        text = _decode(data, self.source) if isinstance(data, bytes) else data
        try:
            root = self._compose_events(text)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            line = mark.line + 1 if mark is not None else None
            problem = e.problem or e.context or "syntax error"
            raise TopologyError(f"YAML: {problem}", source=self.source, line=line) from None
        except yaml.YAMLError as e:
            raise TopologyError(f"YAML: {_one_line(e)}", source=self.source) from None
        except RecursionError:
            raise TopologyError("YAML: nesting too deep", source=self.source) from None
        except UnicodeError:  # lone surrogates in a str given by a caller
            raise TopologyError("not valid Unicode text", source=self.source) from None
        if root is None:
            raise TopologyError("empty file: expected a mapping with 'nodes'", source=self.source)
        return root

    def mapping(self, node: yaml.Node, what: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """(key text, key node, value node) triples; rejects duplicate and non-text keys."""
        if not isinstance(node, yaml.MappingNode):
            raise self.error(f"{what} must be a mapping", node)
        seen: set[str] = set()
        out: list[tuple[str, yaml.Node, yaml.Node]] = []
        for knode, vnode in node.value:
            if not isinstance(knode, yaml.ScalarNode):
                raise self.error(f"{what}: keys must be plain text", knode)
            key = str(knode.value)
            if key in seen:
                raise self.error(f"{what}: duplicate key {key!r}", knode)
            seen.add(key)
            out.append((key, knode, vnode))
        return out

    def scalar(self, node: yaml.Node, what: str) -> object:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(f"{what} must be a single value", node)
        try:
            return self._ctor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:
            raise self.error(f"bad {what}: {_one_line(e)}", node) from None

    def text(self, node: yaml.Node, what: str) -> str:
        """The scalar as written: 'no' stays 'no', '1.10' stays '1.10' (YAML 1.1 traps)."""
        if not isinstance(node, yaml.ScalarNode) or is_null(node):
            raise self.error(f"{what} must be text", node)
        return str(node.value)

    def number(self, node: yaml.Node, what: str, lo: float, hi: float) -> float:
        value = self.scalar(node, what)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"{what} must be a number, not {value!r}", node)
        if not lo <= value <= hi:  # also rejects NaN
            raise self.error(f"{what} {value!r} out of range [{lo:g}, {hi:g}]", node)
        return float(value)

    def boolean(self, node: yaml.Node, what: str) -> bool:
        value = self.scalar(node, what)
        if not isinstance(value, bool):
            raise self.error(f"{what} must be true or false, not {value!r}", node)
        return value

    def quantity(self, node: yaml.Node, key: str) -> float:
        value = self.scalar(node, key)
        try:
            if key == "loss":
                return parse_loss(value)
            if key == "rate":
                return math.inf if value == UNLIMITED else parse_rate_mbit(value)
            if key == "spike":
                return float(parse_spike(value))
            return parse_time_ms(value, key)
        except InputError as e:
            raise self.error(e.message, node) from None


def _resolve(kind: type[yaml.Node], value: str | None, implicit: object) -> str:
    """The implicit tag of a node, as PyYAML's composer resolves it."""
    return cast(str, _RESOLVER.resolve(kind, value, implicit))  # type: ignore[no-untyped-call]


def is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _decode(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TopologyError("not UTF-8 text", source=source, line=line) from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@dataclass
class _Pairs:
    """Underlay overrides: symmetric per unordered pair, then directed ones on top."""

    both: dict[tuple[int, int], Props] = field(default_factory=dict)
    one_way: dict[tuple[int, int], Props] = field(default_factory=dict)


class _Builder:
    def __init__(self, reader: _Reader, default_name: str) -> None:
        self.r = reader
        self.default_name = default_name
        self.index: dict[str, int] = {}

    def build(self, root: yaml.Node) -> Topology:
        top = {k: (kn, vn) for k, kn, vn in self.r.mapping(root, "topology file")}
        for key, (knode, _) in top.items():
            if key not in TOP_KEYS:
                raise self.r.error(f"unknown key {key!r} (expected {', '.join(TOP_KEYS)})", knode)
        if "nodes" not in top:
            raise self.r.error("missing 'nodes'", root)
        name = self.r.text(top["name"][1], "name") if "name" in top else self.default_name
        if "description" in top:
            self.r.text(top["description"][1], "description")
        defaults = self.link(top["defaults"][1], "defaults") if "defaults" in top else {}
        nodes = self.nodes(top["nodes"][1])
        pairs = self.underlay(top["underlay"][1]) if "underlay" in top else _Pairs()
        tunnels = self.tunnels(top["tunnels"][1]) if "tunnels" in top else None
        geo = self.r.boolean(top["geo_delay"][1], "geo_delay") if "geo_delay" in top else False
        where = top["defaults"][0] if "defaults" in top else top["nodes"][0]
        return self.assemble(name, nodes, defaults, pairs, tunnels, geo, where)

    # --- sections --------------------------------------------------------------------
    def nodes(self, node: yaml.Node) -> list[Node]:
        if is_null(node):
            raise self.r.error("no nodes", node)
        out: list[Node] = []
        addresses: set[str] = set()
        for name, knode, vnode in self.r.mapping(node, "nodes"):
            if not NODE_NAME.fullmatch(name):
                raise self.r.error(
                    f"bad node name {name!r}: {NAME_RULE}",
                    knode,
                )
            out.append(self.node(name, vnode, addresses))
            self.index[name] = len(out) - 1
        if len(out) < 2:
            raise self.r.error(f"a mesh needs at least 2 nodes, found {len(out)}", node)
        return out

    def node(self, name: str, node: yaml.Node, addresses: set[str]) -> Node:
        if is_null(node):
            return Node(name)
        fields: dict[str, object] = {}
        for key, knode, vnode in self.r.mapping(node, f"node {name}"):
            if key not in NODE_KEYS:
                raise self.r.error(
                    f"node {name}: unknown key {key!r} (expected {', '.join(NODE_KEYS)})", knode
                )
            if key == "address":
                fields[key] = self.address(vnode, name, addresses)
            elif key == "site":
                fields[key] = self.r.text(vnode, f"node {name}: site")
            elif key == "lat":
                fields[key] = self.r.number(vnode, f"node {name}: lat", -90, 90)
            else:
                fields[key] = self.r.number(vnode, f"node {name}: lon", -180, 180)
        return Node(
            name,
            address=_opt_str(fields.get("address")),
            site=_opt_str(fields.get("site")),
            lat=_opt_float(fields.get("lat")),
            lon=_opt_float(fields.get("lon")),
        )

    def address(self, node: yaml.Node, name: str, seen: set[str]) -> str:
        text = self.r.text(node, f"node {name}: address")
        try:
            addr = str(ipaddress.ip_address(text.strip()))
        except ValueError:
            raise self.r.error(f"node {name}: bad address {text!r}", node) from None
        if addr in seen:
            raise self.r.error(f"node {name}: duplicate address {addr}", node)
        seen.add(addr)
        return addr

    def link(self, node: yaml.Node, what: str) -> Props:
        if is_null(node):
            return {}
        props: Props = {}
        for key, knode, vnode in self.r.mapping(node, what):
            if key not in LINK_KEYS:
                raise self.r.error(
                    f"{what}: unknown key {key!r} (expected {', '.join(LINK_KEYS)})", knode
                )
            props[key] = self.r.quantity(vnode, key)
        return props

    def pair(self, text: str, node: yaml.Node, *, directed_ok: bool) -> tuple[int, int, bool]:
        """Indices and directedness of 'a-b' or 'a->b'."""
        form = "'a-b' or 'a->b'" if directed_ok else "'a-b'"
        if "->" in text and not directed_ok:
            a, _, b = (s.strip() for s in text.partition("->"))
            raise self.r.error(f"tunnel {text!r}: tunnels are two-way, write {a}-{b}", node)
        if "-" not in text:
            raise self.r.error(f"bad pair {text!r}: write {form}", node)
        try:
            link = split_link(text, self.index, directed_ok=directed_ok)
        except InputError as exc:
            raise self.r.error(exc.message.replace("link", "pair", 1), node) from None
        a, b = link.a, link.b
        return self.index[a], self.index[b], link.directed

    def underlay(self, node: yaml.Node) -> _Pairs:
        pairs = _Pairs()
        if is_null(node):
            return pairs
        for text, knode, vnode in self.r.mapping(node, "underlay"):
            i, j, directed = self.pair(text, knode, directed_ok=True)
            props = self.link(vnode, f"underlay {text.strip()}")
            key = (i, j) if directed else (min(i, j), max(i, j))
            table = pairs.one_way if directed else pairs.both
            if key in table:
                raise self.r.error(f"duplicate pair {text.strip()!r}", knode)
            table[key] = props
        return pairs

    def tunnels(self, node: yaml.Node) -> list[tuple[int, int]] | None:
        if isinstance(node, yaml.ScalarNode) and node.value == "full" and not is_null(node):
            return None
        if not isinstance(node, yaml.SequenceNode):
            raise self.r.error("tunnels must be 'full' or a list of pairs like [a-b, a-c]", node)
        out: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for item in node.value:
            text = self.r.text(item, "tunnel")
            i, j, _ = self.pair(text, item, directed_ok=False)
            key = (min(i, j), max(i, j))
            if key in seen:
                raise self.r.error(f"duplicate tunnel {text.strip()!r}", item)
            seen.add(key)
            out.append(key)
        return out

    # --- matrices --------------------------------------------------------------------
    def assemble(
        self,
        name: str,
        nodes: list[Node],
        defaults: Props,
        pairs: _Pairs,
        tunnels: list[tuple[int, int]] | None,
        geo: bool,
        where: yaml.Node,
    ) -> Topology:
        n = len(nodes)
        delay = np.full((n, n), defaults.get("delay", math.nan))
        if geo:
            _apply_geo(delay, nodes)
        mats = {
            "delay": delay,
            "jitter": np.full((n, n), defaults.get("jitter", 0.0)),
            "loss": np.full((n, n), defaults.get("loss", 0.0)),
            "rate": np.full((n, n), defaults.get("rate", math.inf)),
            "spike": np.full((n, n), defaults.get("spike", 0.0)),
        }
        for (i, j), props in pairs.both.items():
            _apply(mats, i, j, props)
            _apply(mats, j, i, props)
        for (i, j), props in pairs.one_way.items():
            _apply(mats, i, j, props)
        for m, diag in zip(mats.values(), (0.0, 0.0, 0.0, math.inf, 0.0), strict=True):
            np.fill_diagonal(m, diag)
        self.check_delays(delay, nodes, where)
        tun = np.ones((n, n), dtype=bool) if tunnels is None else np.zeros((n, n), dtype=bool)
        for i, j in tunnels or []:
            tun[i, j] = tun[j, i] = True
        return Topology(
            name=name,
            nodes=nodes,
            delay_ms=delay,
            jitter_ms=mats["jitter"],
            loss=mats["loss"],
            rate_mbit=mats["rate"],
            tunnels=tun,
            source=self.r.source,
            spike=mats["spike"] if mats["spike"].any() else None,
        )

    def check_delays(self, delay: FloatMatrix, nodes: list[Node], where: yaml.Node) -> None:
        missing = np.argwhere(np.isnan(delay))
        if len(missing):
            i, j = missing[0].tolist()
            raise self.r.error(
                f"no delay for {nodes[i].name}->{nodes[j].name}: set defaults.delay, "
                "list the pair under underlay, or use geo_delay with lat/lon on both nodes",
                where,
            )


def _apply(mats: dict[str, FloatMatrix], i: int, j: int, props: Props) -> None:
    for key, value in props.items():
        mats[key][i, j] = value


def _apply_geo(delay: FloatMatrix, nodes: list[Node]) -> None:
    """Fibre delay along the great circle for every pair with coordinates on both ends."""
    idx = [k for k, nd in enumerate(nodes) if nd.lat is not None and nd.lon is not None]
    if len(idx) < 2:
        return
    lat = np.array([nodes[k].lat for k in idx], dtype=np.float64)
    lon = np.array([nodes[k].lon for k in idx], dtype=np.float64)
    delay[np.ix_(idx, idx)] = fibre_delay_ms(distance_matrix_km(lat, lon))


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _opt_float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


# --- writing -------------------------------------------------------------------------


def save_yaml(topo: Topology, path: str | Path) -> None:
    """Write ``topo`` so that load_yaml gives back the same nodes, matrices and tunnels."""
    text = dump_yaml(topo)
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise TopologyError(f"cannot write file: {e.strerror or e}", source=str(path)) from None


def dump_yaml(topo: Topology) -> str:
    """The YAML text of a topology: most common values become defaults, the rest overrides."""
    _check_saveable(topo)
    mats = {
        "delay": topo.delay_ms,
        "jitter": topo.jitter_ms,
        "loss": topo.loss,
        "rate": topo.rate_mbit,
    }
    if topo.spike is not None:
        mats["spike"] = topo.spike
    defaults = {key: _mode(m) for key, m in mats.items()}
    doc: dict[str, object] = {
        "name": topo.name,
        "defaults": {
            k: _format(k, v)
            for k, v in defaults.items()
            if v != math.inf and not (k == "spike" and v == 0)
        },
        "nodes": {nd.name: _node_dict(nd) for nd in topo.nodes},
    }
    underlay = _underlay_dict(topo, mats, defaults)
    if underlay:
        doc["underlay"] = underlay
    doc["tunnels"] = _tunnels_value(topo)
    return yaml.dump(
        doc,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=None,
        allow_unicode=True,
        width=100,
    )


def _check_saveable(topo: Topology) -> None:
    for nd in topo.nodes:
        if not NODE_NAME.fullmatch(nd.name):
            raise TopologyError(f"cannot save node name {nd.name!r}", source=topo.source)
    off = ~np.eye(topo.n, dtype=bool)
    checks = (
        ("delay", topo.delay_ms, 0.0, math.inf),
        ("jitter", topo.jitter_ms, 0.0, math.inf),
        ("loss", topo.loss, 0.0, 1.0),
        *(() if topo.spike is None else (("spike", topo.spike, 0.0, 1e6),)),
    )
    for what, m, lo, hi in checks:
        v = m[off]
        if not np.all(np.isfinite(v) & (v >= lo) & (v <= hi)):
            raise TopologyError(f"cannot save {what}: values out of range", source=topo.source)
    if not np.all(topo.rate_mbit[off] > 0):  # NaN fails too
        raise TopologyError("cannot save rate: values must be > 0", source=topo.source)


def _mode(m: FloatMatrix) -> float:
    values = m[~np.eye(m.shape[0], dtype=bool)]
    uniq, counts = np.unique(values, return_counts=True)
    return float(uniq[int(np.argmax(counts))])


def _underlay_dict(
    topo: Topology, mats: dict[str, FloatMatrix], defaults: dict[str, float]
) -> dict[str, dict[str, object]]:
    differs = np.zeros((topo.n, topo.n), dtype=bool)
    for key, m in mats.items():
        differs |= m != defaults[key]
    np.fill_diagonal(differs, False)
    ii, jj = np.nonzero(np.triu(differs | differs.T, 1))
    names = topo.names
    out: dict[str, dict[str, object]] = {}
    for i, j in zip(ii.tolist(), jj.tolist(), strict=True):
        fwd = _diff(mats, defaults, i, j)
        back = _diff(mats, defaults, j, i)
        a, b = names[i], names[j]
        if fwd == back:
            out[f"{a}-{b}"] = fwd
            continue
        if fwd:
            out[f"{a}->{b}"] = fwd
        if back:
            out[f"{b}->{a}"] = back
    return out


def _diff(
    mats: dict[str, FloatMatrix], defaults: dict[str, float], i: int, j: int
) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, m in mats.items():
        value = float(m[i, j])
        if value != defaults[key]:
            out[key] = _format(key, value)
    return out


def _format(key: str, value: float) -> object:
    """Units that read well and parse back to exactly the same float."""
    if key in ("delay", "jitter"):
        return f"{_num(value)}ms"
    if key == "rate":
        return f"{_num(value)}Mbit" if value != math.inf else UNLIMITED
    if key == "spike":
        return int(value) if value else "off"
    percent = f"{_num(value * 100)}%"
    return percent if parse_loss(percent) == value else value


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


def _node_dict(nd: Node) -> dict[str, object]:
    out: dict[str, object] = {}
    if nd.address is not None:
        out["address"] = nd.address
    if nd.site is not None:
        out["site"] = nd.site
    if nd.lat is not None:
        out["lat"] = float(nd.lat)
    if nd.lon is not None:
        out["lon"] = float(nd.lon)
    return out


def _tunnels_value(topo: Topology) -> object:
    off = ~np.eye(topo.n, dtype=bool)
    if np.all(topo.tunnels[off]):
        return "full"
    return [f"{a}-{b}" for a, b in topo.tunnel_pairs()]
