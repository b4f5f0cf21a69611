"""Real-world topologies: backbone graphs (Topology Zoo GML/GraphML) and RTT matrices (CSV).

Both become a mesh whose tunnels run over the real underlay: a backbone graph
gives each pair the shortest path along its fibre, an RTT matrix gives each
measured pair its measured RTT. Importers return warnings (dropped nodes,
skipped rows) beside the topology instead of failing, since real data is messy.
"""

from __future__ import annotations

import csv
import math
import re
import unicodedata
import xml.parsers.expat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshopt.errors import InputError, TopologyError
from meshopt.routing.dense import pair_distances
from meshopt.topology.geo import fibre_delay_ms, great_circle_km, mean_position
from meshopt.topology.limits import Limits, TextLines, inner_path, open_text_lines, read_input
from meshopt.topology.model import NODE_NAME, FloatMatrix, Node, Topology
from meshopt.topology.names import NAME_RULE
from meshopt.units import parse_loss, parse_time_ms

HOP_MS = 0.05  # one-way forwarding delay per backbone router
RIPE_MIN_COUNT = 100
PLAIN_COLUMNS = ("a", "b", "rtt_ms", "jitter_ms", "loss")
RIPE_COLUMNS = ("cty1", "cty2", "rtt_cnt", "rtt_avg", "rtt_std", "rtt_min", "rtt_max")
COUNTRY = re.compile(r"[A-Z]{2}")
NOT_COUNTRIES = frozenset({"EU"})  # RIPE uses it for probes only known to be "in Europe"


@dataclass
class Imported:
    """A topology and what the importer had to leave out or guess to build it."""

    topology: Topology
    warnings: list[str] = field(default_factory=list)


# --- backbone graphs -------------------------------------------------------------------


def import_graph(
    path: str | Path, *, hop_ms: float = HOP_MS, limits: Limits | None = None
) -> Imported:
    """A full mesh whose pair delays follow the shortest path over the backbone's fibre.

    Each backbone edge costs its great-circle fibre delay plus ``hop_ms``. Nodes
    without coordinates are placed at the centre of their placed neighbours;
    those that stay unplaced are dropped, and only the largest connected part is
    kept, each with a warning.
    """
    source = str(path)
    if not math.isfinite(hop_ms) or hop_ms < 0:
        raise TopologyError(f"hop_ms must be >= 0, got {hop_ms}", source=source)
    g = _simple_graph(_read_graph(Path(path), limits or Limits()))
    warnings: list[str] = []
    coords = _place_nodes(g, warnings)
    keep = _largest_component(g, coords, warnings, source)
    nodes = _graph_nodes(g, keep, coords)
    delay = _backbone_delays(g, keep, coords, hop_ms)
    topo = _topology(inner_path(Path(path)).stem, nodes, delay, source=source)
    return Imported(topo, warnings)


def _read_graph(path: Path, limits: Limits) -> Any:
    """The graph of a GML or GraphML file, checked for size and nesting before parsing."""
    import networkx as nx

    source = str(path)
    graphml = inner_path(path).suffix.lower() == ".graphml"
    data = read_input(path, limits)
    try:
        if graphml:
            _scan_graphml(data, limits, source)
            return nx.parse_graphml(data)
        text = _gml_text(data)
        _scan_gml(text, limits, source)
        return nx.parse_gml(text, label="id")
    except TopologyError:
        raise
    except Exception as e:  # the parsers raise many types; all mean "not a usable graph"
        kind = "GraphML" if graphml else "GML"
        message = " ".join(str(e).split())[:200] or type(e).__name__
        raise TopologyError(f"cannot parse {kind}: {message}", source=source) from None


def _gml_text(data: bytes) -> str:
    """File text declared as a multigraph: many Zoo files repeat edges, which the
    plain GML reader rejects; the duplicates are merged afterwards."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    if re.search(r"^\s*multigraph\s", text, flags=re.M):
        return text
    return re.sub(r"\bgraph\s*\[", "graph [ multigraph 1", text, count=1)  # same lines


_GML_TOKEN = re.compile(r'"[^"]*"|#[^\n]*|\[|\]|[^\s\[\]"#]+')
# Tokens a backbone file spends per node or edge (Topology Zoo: at most 20) and on
# its header: more is not a backbone, and networkx would hold every one in memory.
TOKENS_PER_ENTRY = 40
TOKENS_BASE = 1000


def _scan_gml(text: str, limits: Limits, source: str) -> None:
    """Bracket depth, node/edge counts and a token budget, before networkx's recursive
    parser runs (it recurses per bracket and keeps every value)."""
    depth = nodes = edges = 0
    for tokens, m in enumerate(_GML_TOKEN.finditer(text), 1):
        token = m.group()
        if tokens > TOKENS_BASE + TOKENS_PER_ENTRY * (nodes + edges):
            raise TopologyError(
                f"GML: {tokens:,} tokens for {nodes:,} nodes and {edges:,} edges "
                f"(a backbone needs at most {TOKENS_PER_ENTRY} per node or edge)",
                source=source,
                line=_line_of(text, m.start()),
            )
        if token == "[":
            depth += 1
            if depth > limits.max_depth:
                message = limits.exceeded("levels of nesting", "max_depth")
                raise TopologyError(message, source=source, line=_line_of(text, m.start()))
        elif token == "]":
            depth -= 1
        elif depth == 1 and token in ("node", "edge"):
            if token == "node":
                nodes += 1
                over = limits.exceeded("nodes", "max_nodes") if nodes > limits.max_nodes else ""
            else:
                edges += 1
                over = limits.exceeded("edges", "max_pairs") if edges > limits.max_pairs else ""
            if over:
                raise TopologyError(over, source=source, line=_line_of(text, m.start()))


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _scan_graphml(data: bytes, limits: Limits, source: str) -> None:
    """Depth and node/edge counts with expat (streaming, no recursion) before the tree
    is built; a DTD is refused outright, as GraphML needs none and entities can expand."""
    parser = xml.parsers.expat.ParserCreate()
    depth = elements = 0
    counts = {"node": 0, "edge": 0}

    def fail(message: str) -> TopologyError:
        return TopologyError(message, source=source, line=parser.CurrentLineNumber)

    def start(name: str, attrs: object) -> None:
        nonlocal depth, elements
        depth += 1
        elements += 1
        entries = counts["node"] + counts["edge"]
        if elements > TOKENS_BASE + TOKENS_PER_ENTRY * entries:
            raise fail(
                f"GraphML: {elements:,} elements for {entries:,} nodes and edges "
                f"(a backbone needs at most {TOKENS_PER_ENTRY} per node or edge)"
            )
        if depth > limits.max_depth:
            raise fail(limits.exceeded("levels of nesting", "max_depth"))
        local = name.rpartition(":")[2]
        if local in counts:
            counts[local] += 1
            key = "max_nodes" if local == "node" else "max_pairs"
            if counts[local] > getattr(limits, key):
                raise fail(limits.exceeded(f"{local}s", key))

    def end(name: str) -> None:
        nonlocal depth
        depth -= 1

    def doctype(*args: object) -> None:
        raise fail("GraphML with a DTD (<!DOCTYPE>): not accepted (entities could expand)")

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.StartDoctypeDeclHandler = doctype
    parser.EntityDeclHandler = doctype
    try:
        parser.Parse(data, True)
    except xml.parsers.expat.ExpatError as e:
        message = xml.parsers.expat.ErrorString(e.code)
        raise TopologyError(
            f"cannot parse GraphML: {message}", source=source, line=e.lineno
        ) from None


def _simple_graph(g: Any) -> Any:
    """Undirected, no parallel edges, no self-loops: a backbone is about adjacency."""
    import networkx as nx

    h = nx.Graph()
    h.add_nodes_from(g.nodes(data=True))
    h.add_edges_from((u, v) for u, v in g.edges() if u != v)
    return h


def _coordinate(data: dict[str, Any], keys: tuple[str, ...], limit: float) -> float | None:
    for key in keys:
        if key in data:
            try:
                value = float(data[key])
            except (TypeError, ValueError):
                return None
            return value if -limit <= value <= limit else None
    return None


def _place_nodes(g: Any, warnings: list[str]) -> dict[Any, tuple[float, float]]:
    """Known coordinates, plus neighbour-centre guesses for the rest, round by round.

    Each round looks only at the neighbours of the nodes placed in the round before
    (any other unplaced node has no newly placed neighbour), so a long chain of nodes
    without coordinates costs its edges, not its length times the whole graph.
    """
    coords: dict[Any, tuple[float, float]] = {}
    for v, data in g.nodes(data=True):
        lat = _coordinate(data, ("Latitude", "latitude", "lat"), 90.0)
        lon = _coordinate(data, ("Longitude", "longitude", "lon", "lng"), 180.0)
        if lat is not None and lon is not None:
            coords[v] = (lat, lon)
    order = {v: i for i, v in enumerate(g.nodes)}
    guessed = 0
    placed = list(coords)
    while True:
        frontier = {u for v in placed for u in g.neighbors(v) if u not in coords}
        found = {}
        for v in sorted(frontier, key=order.__getitem__):
            known = [coords[u] for u in g.neighbors(v) if u in coords]
            lats, lons = np.array(known).T
            found[v] = mean_position(lats, lons)
        if not found:
            break
        coords.update(found)
        guessed += len(found)
        placed = list(found)
    if guessed:
        warnings.append(f"placed {guessed} nodes without coordinates at their neighbours' centre")
    lost = [_label(g, v) for v in g.nodes if v not in coords]
    if lost:
        warnings.append(f"dropped {len(lost)} nodes without coordinates: {_short_list(lost)}")
    return coords


def _largest_component(
    g: Any, coords: dict[Any, tuple[float, float]], warnings: list[str], source: str
) -> list[Any]:
    import networkx as nx

    placed = g.subgraph([v for v in g.nodes if v in coords])
    parts = sorted(nx.connected_components(placed), key=len, reverse=True)
    if not parts or len(parts[0]) < 2:
        reason = "no node has coordinates" if not coords else "no two placed nodes are connected"
        raise TopologyError(f"fewer than 2 usable nodes: {reason}", source=source)
    if len(parts) > 1:
        warnings.append(
            f"kept the largest connected part: {len(parts[0])} of {len(placed)} placed nodes"
        )
    return [v for v in g.nodes if v in parts[0]]  # file order, for stable names


def _graph_nodes(g: Any, keep: list[Any], coords: dict[Any, tuple[float, float]]) -> list[Node]:
    names = unique_names([_label(g, v) for v in keep], [f"n{v}" for v in keep])
    nodes = []
    for v, name in zip(keep, names, strict=True):
        country = g.nodes[v].get("Country")
        lat, lon = coords[v]
        site = country.strip() if isinstance(country, str) and country.strip() else None
        nodes.append(Node(name, site=site, lat=lat, lon=lon))
    return nodes


def _backbone_delays(
    g: Any, keep: list[Any], coords: dict[Any, tuple[float, float]], hop_ms: float
) -> FloatMatrix:
    index = {v: i for i, v in enumerate(keep)}
    rows, cols, weights = [], [], []
    for u, v in g.subgraph(keep).edges():
        km = great_circle_km(*coords[u], *coords[v])
        rows.append(index[u])
        cols.append(index[v])
        weights.append(max(float(fibre_delay_ms(km)) + hop_ms, 1e-9))  # 0 would be "no edge"
    ij = np.array([rows, cols], dtype=np.int64).reshape(2, -1)
    return pair_distances(len(keep), ij[0], ij[1], np.array(weights, dtype=np.float64))[2]


def _label(g: Any, v: Any) -> str:
    label = g.nodes[v].get("label")
    return label if isinstance(label, str) and label.strip() else f"n{v}"


def sanitize_name(text: str) -> str:
    """A node name from free text: accents folded, other characters become '_'."""
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", folded).strip("_.-")
    return name[:56]


def unique_names(labels: Sequence[str], fallbacks: Sequence[str]) -> list[str]:
    """Sanitized, de-duplicated names (Zoo files repeat labels and leave some out)."""
    used: set[str] = set()
    out = []
    for i, (label, fallback) in enumerate(zip(labels, fallbacks, strict=True)):
        base = sanitize_name(label) or sanitize_name(fallback) or f"n{i}"
        name, k = base, 2
        while name in used:
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        out.append(name)
    return out


def _short_list(items: Sequence[str], limit: int = 5) -> str:
    head = ", ".join(items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


# --- RTT matrices ----------------------------------------------------------------------


@dataclass
class _Pairs:
    """Measured pairs in file order: RTT, RTT jitter and round-trip loss per pair."""

    limits: Limits = field(default_factory=Limits)
    names: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    rows: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)

    def node(self, name: str, source: str, line: int) -> int:
        if name not in self.index:
            if len(self.names) >= self.limits.max_nodes:
                message = self.limits.exceeded("nodes", "max_nodes")
                raise TopologyError(message, source=source, line=line)
            self.index[name] = len(self.names)
            self.names.append(name)
        return self.index[name]


def import_rtt_csv(
    path: str | Path,
    *,
    min_count: int | None = None,
    countries: Sequence[str] | None = None,
    limits: Limits | None = None,
) -> Imported:
    """An RTT matrix, plain (``a,b,rtt_ms[,jitter_ms][,loss]``) or RIPE Atlas, by its header.

    Measured pairs become tunnels (all pairs: full mesh); unmeasured pairs get
    no tunnel. ``min_count`` and ``countries`` apply to RIPE Atlas files only.
    """
    source = str(path)
    pairs = _Pairs(limits or Limits())
    with _open_csv(Path(path), pairs.limits) as rows:
        header = _header(rows, source)
        columns = [c.strip().lower() for c in header[1]]
        if {"cty1", "cty2", "rtt_avg"} <= set(columns):
            warnings = _read_ripe(rows, columns, source, min_count, countries, pairs)
        elif {"a", "b", "rtt_ms"} <= set(columns):
            if min_count is not None or countries is not None:
                raise TopologyError(
                    "min_count and countries apply to RIPE Atlas files only", source=source
                )
            _read_plain(rows, columns, source, header[0], pairs)
            warnings = []
        else:
            raise TopologyError(
                f"unknown CSV header {','.join(header[1])!r}: expected a,b,rtt_ms "
                "(optional jitter_ms,loss) or RIPE Atlas cty1,cty2,rtt_cnt,rtt_avg,rtt_std,...",
                source=source,
                line=header[0],
            )
    return _from_pairs(pairs, Path(path), warnings)


class _CsvRows:
    """Rows with their line numbers; reading errors become TopologyError."""

    def __init__(self, lines: TextLines, source: str) -> None:
        self.source = source
        self._lines = lines
        self._reader = csv.reader(lines)

    def __iter__(self) -> Iterator[tuple[int, list[str]]]:
        while True:
            try:
                row = next(self._reader)
            except StopIteration:
                return
            except csv.Error as e:
                line = self._reader.line_num or None
                message = " ".join(str(e).split()) or type(e).__name__
                raise TopologyError(
                    f"cannot read CSV: {message}", source=self.source, line=line
                ) from None
            self._lines.row_start = self._lines.line
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            yield self._reader.line_num, row


@contextmanager
def _open_csv(path: Path, limits: Limits) -> Iterator[_CsvRows]:
    with open_text_lines(path, limits) as lines:
        yield _CsvRows(lines, str(path))


def _header(rows: _CsvRows, source: str) -> tuple[int, list[str]]:
    for line, row in rows:
        return line, row
    raise TopologyError("empty CSV file", source=source)


def _read_plain(
    rows: _CsvRows, columns: list[str], source: str, header_line: int, pairs: _Pairs
) -> None:
    unknown = [c for c in columns if c not in PLAIN_COLUMNS]
    if unknown or len(set(columns)) != len(columns):
        raise TopologyError(
            f"bad CSV header: columns must be distinct and among {', '.join(PLAIN_COLUMNS)}",
            source=source,
            line=header_line,
        )
    for line, row in rows:
        values = _row_dict(row, columns, source, line)
        a, b = _pair_names(values["a"], values["b"], source, line)
        try:
            rtt = parse_time_ms(values["rtt_ms"], "rtt_ms")
            jitter = parse_time_ms(values.get("jitter_ms") or "0", "jitter_ms")
            loss = parse_loss(values.get("loss") or "0")
        except InputError as e:
            raise TopologyError(e.message, source=source, line=line) from None
        _add_pair(pairs, a, b, (rtt, jitter, loss), source, line)


def _read_ripe(
    rows: _CsvRows,
    columns: list[str],
    source: str,
    min_count: int | None,
    countries: Sequence[str] | None,
    pairs: _Pairs,
) -> list[str]:
    """RIPE Atlas aggregates: rtt_avg as the RTT, rtt_std (capped) as its jitter."""
    min_count = RIPE_MIN_COUNT if min_count is None else min_count
    wanted = _country_filter(countries, source)
    few = pseudo = same = 0
    for line, row in rows:
        values = _row_dict(row, columns, source, line)
        a, b = values["cty1"], values["cty2"]
        count, avg, std = _ripe_numbers(values, source, line)
        if a == b:
            same += 1  # RTT inside one country: no pair of the mesh
            continue
        if not _is_country(a) or not _is_country(b):
            pseudo += 1
            continue
        if count < min_count:
            few += 1
            continue
        if wanted is not None and not (a in wanted and b in wanted):
            continue
        _add_pair(pairs, a, b, (avg, min(std, avg / 2), 0.0), source, line)
    warnings = []
    if few:
        warnings.append(f"skipped {few} pairs with rtt_cnt < {min_count}")
    if same:
        warnings.append(f"skipped {same} rows within one country")
    if pseudo:
        warnings.append(f"skipped {pseudo} rows whose code is not a country (None, Unknown, EU)")
    if wanted is not None and (absent := sorted(wanted - set(pairs.names))):
        warnings.append(f"countries without usable pairs: {', '.join(absent)}")
    return warnings


def _country_filter(countries: Sequence[str] | None, source: str) -> set[str] | None:
    if countries is None:
        return None
    wanted = {c.strip().upper() for c in countries if c.strip()}
    bad = sorted(c for c in wanted if not COUNTRY.fullmatch(c))
    if bad:
        raise TopologyError(f"bad country codes: {', '.join(bad)}", source=source)
    if len(wanted) < 2:
        raise TopologyError("countries: give at least 2 country codes", source=source)
    return wanted


def _is_country(code: str) -> bool:
    return bool(COUNTRY.fullmatch(code)) and code not in NOT_COUNTRIES


def _ripe_numbers(values: dict[str, str], source: str, line: int) -> tuple[int, float, float]:
    try:
        count = int(values.get("rtt_cnt") or "0")
        avg = float(values["rtt_avg"])
        std = float(values.get("rtt_std") or "0")
    except ValueError:
        raise TopologyError("bad number in RIPE Atlas row", source=source, line=line) from None
    if count < 0 or not (math.isfinite(avg) and avg >= 0 and math.isfinite(std) and std >= 0):
        raise TopologyError(
            "RIPE Atlas row: values must be finite and >= 0", source=source, line=line
        )
    return count, avg, std


def _row_dict(row: list[str], columns: list[str], source: str, line: int) -> dict[str, str]:
    if len(row) != len(columns):
        raise TopologyError(
            f"expected {len(columns)} fields, found {len(row)}", source=source, line=line
        )
    return {c: v.strip() for c, v in zip(columns, row, strict=True)}


def _pair_names(a: str, b: str, source: str, line: int) -> tuple[str, str]:
    for name in (a, b):
        if not NODE_NAME.fullmatch(name):
            raise TopologyError(f"bad node name {name!r}: {NAME_RULE}", source=source, line=line)
    if a == b:
        raise TopologyError(f"pair {a},{b} joins a node to itself", source=source, line=line)
    return a, b


def _add_pair(
    pairs: _Pairs, a: str, b: str, values: tuple[float, float, float], source: str, line: int
) -> None:
    i, j = pairs.node(a, source, line), pairs.node(b, source, line)
    key = (min(i, j), max(i, j))
    if key in pairs.rows:
        raise TopologyError(f"duplicate pair {a},{b}", source=source, line=line)
    if len(pairs.rows) >= pairs.limits.max_pairs:
        raise TopologyError(pairs.limits.exceeded("pairs", "max_pairs"), source=source, line=line)
    pairs.rows[key] = values


def _from_pairs(pairs: _Pairs, path: Path, warnings: list[str]) -> Imported:
    """Measured pairs → tunnels; unmeasured pairs get the best relayed delay, no tunnel."""
    source = str(path)
    n = len(pairs.names)
    if not pairs.rows:
        raise TopologyError("no usable pairs in the file", source=source)
    ii, jj = np.array(list(pairs.rows)).T
    rtt, jit, loss = np.array(list(pairs.rows.values())).T
    # numpy for small meshes (no scipy import), bit-identical to scipy's Dijkstra
    count, label, delay = pair_distances(n, ii, jj, np.maximum(rtt / 2, 1e-9))
    keep = np.flatnonzero(label == np.bincount(label).argmax())
    if count > 1:
        warnings.append(f"kept the largest connected part: {len(keep)} of {n} nodes")
    if len(keep) < 2:
        raise TopologyError("fewer than 2 connected nodes", source=source)
    tunnels = np.zeros((n, n), dtype=bool)
    jitter, lossm = np.zeros((n, n)), np.zeros((n, n))
    for m, vals in ((delay, rtt / 2), (jitter, jit / math.sqrt(2)), (lossm, 1 - np.sqrt(1 - loss))):
        m[ii, jj] = m[jj, ii] = vals
    tunnels[ii, jj] = tunnels[jj, ii] = True
    sub = np.ix_(keep, keep)
    nodes = [Node(pairs.names[k]) for k in keep]
    topo = _topology(
        path.name.split(".")[0],
        nodes,
        delay[sub],
        jitter=jitter[sub],
        loss=lossm[sub],
        tunnels=tunnels[sub],
        source=source,
    )
    return Imported(topo, warnings)


def _topology(
    name: str,
    nodes: list[Node],
    delay: FloatMatrix,
    *,
    source: str,
    jitter: FloatMatrix | None = None,
    loss: FloatMatrix | None = None,
    tunnels: Any = None,
) -> Topology:
    return Topology.from_matrices(
        name, nodes, delay, source=source, jitter=jitter, loss=loss, tunnels=tunnels
    )
