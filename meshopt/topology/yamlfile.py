"""The YAML topology format: read with line numbers for every error, write to round-trip.

The file is composed into PyYAML's node tree (not loaded into plain dicts) so
every value keeps its position: a user with a typo on line 40 of a 60-node
file is told "line 40", not "bad delay somewhere". topologies/README.md
documents the format.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from meshopt.errors import InputError, TopologyError
from meshopt.topology.geo import distance_matrix_km, fibre_delay_ms
from meshopt.topology.model import NODE_NAME, FloatMatrix, Node, Topology
from meshopt.units import parse_loss, parse_rate_mbit, parse_time_ms

TOP_KEYS = ("name", "description", "defaults", "nodes", "underlay", "tunnels", "geo_delay")
NODE_KEYS = ("address", "site", "lat", "lon")
LINK_KEYS = ("delay", "jitter", "loss", "rate")
UNLIMITED = "unlimited"  # rate with no limit (the default when no rate is given)
PAIR = re.compile(rf"\s*({NODE_NAME.pattern})\s*(->|-)\s*({NODE_NAME.pattern})\s*")

Props = dict[str, float]  # subset of LINK_KEYS -> value in ms, fraction or Mbit/s

# libyaml when present: a 300-node mesh with distinct pairs is ~45,000 entries,
# where the pure-Python parser and emitter take several times longer.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


# --- reading -------------------------------------------------------------------------


def load_yaml(path: str | Path) -> Topology:
    """Read a topology file; every problem becomes a TopologyError naming file and line."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TopologyError(f"cannot read file: {e.strerror or e}", source=source) from None
    return parse_yaml(data, source=source, default_name=Path(path).stem)


def parse_yaml(
    data: str | bytes, *, source: str = "<string>", default_name: str = "topology"
) -> Topology:
    """Parse the YAML format from text (tests and generated files go through here too)."""
    reader = _Reader(source)
    root = reader.compose(data)
    return _Builder(reader, default_name).build(root)


class _Reader:
    """Turns YAML nodes into checked Python values, attaching the line to every error."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._ctor = yaml.SafeLoader("")

    def error(self, message: str, node: yaml.Node | None = None) -> TopologyError:
        line = node.start_mark.line + 1 if node is not None else None
        return TopologyError(message, source=self.source, line=line)

    def compose(self, data: str | bytes) -> yaml.Node:
        text = _decode(data, self.source) if isinstance(data, bytes) else data
        try:
            root = yaml.compose(text, Loader=_Loader)
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
            return parse_time_ms(value, key)
        except InputError as e:
            raise self.error(e.message, node) from None


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
                    f"bad node name {name!r}: use letters, digits, '_' and '.' "
                    "(start with a letter or digit, at most 63 characters)",
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
        m = PAIR.fullmatch(text)
        if not m:
            form = "'a-b' or 'a->b'" if directed_ok else "'a-b'"
            raise self.r.error(f"bad pair {text!r}: write {form}", node)
        a, arrow, b = m.groups()
        if arrow == "->" and not directed_ok:
            raise self.r.error(f"tunnel {text!r}: tunnels are two-way, write {a}-{b}", node)
        for end in (a, b):
            if end not in self.index:
                raise self.r.error(f"pair {text!r}: unknown node {end!r}", node)
        if a == b:
            raise self.r.error(f"pair {text!r} joins a node to itself", node)
        return self.index[a], self.index[b], arrow == "->"

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
        }
        for (i, j), props in pairs.both.items():
            _apply(mats, i, j, props)
            _apply(mats, j, i, props)
        for (i, j), props in pairs.one_way.items():
            _apply(mats, i, j, props)
        for m, diag in zip(mats.values(), (0.0, 0.0, 0.0, math.inf), strict=True):
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
    defaults = {key: _mode(m) for key, m in mats.items()}
    doc: dict[str, object] = {
        "name": topo.name,
        "defaults": {k: _format(k, v) for k, v in defaults.items() if v != math.inf},
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
