"""Pictures of a mesh: nodes, tunnels labelled with RTTs, relay routes drawn to stand out.

Used by ``meshopt lab status --graph`` (configured underlay) and ``meshopt graph
--out`` (measured RTTs). It takes data and writes one file; matplotlib is
imported inside ``draw_mesh`` so that commands which draw nothing start fast,
and it is driven through ``Figure`` objects, never pyplot, so no global figure
state leaks between calls.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from meshopt.errors import InputError
from meshopt.topology.model import Topology

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation

FloatArray = npt.NDArray[np.float64]

FORMATS = {".png": "png", ".svg": "svg"}
LABEL_EDGES_MAX = 30  # above this many nodes, RTT labels on edges are unreadable
LABEL_TUNNELS_MAX = 120  # and above this many tunnels (a 20-node full mesh has 190)
NAME_NODES_MAX = 100  # above this, only nodes on relay paths or down are named
ADDRESS_NODES_MAX = 30  # above this, overlay addresses are left off
FAINT_EDGES_MIN = 200  # from this many nodes on, tunnels are hairlines
CROWDED_PX = 3.0  # an RTT label that would cover others by more is left out
ASYMMETRY = 0.10  # RTTs measured from the two ends that differ more are both shown
RELAY_COLOURS = ("#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#e377c2", "#17becf", "#8c564b")
RELAY_BENDS = (0.0, 0.12, -0.12, 0.24, -0.24)
NODE_COLOUR = "#1f4e79"
TUNNEL_COLOUR = "#9aa5b1"
DOWN_COLOUR = "#b0b0b0"
_BACKDROP = {"boxstyle": "round,pad=0.12", "fc": "white", "ec": "none", "alpha": 0.75}


class PictureError(InputError):
    """A picture that cannot be drawn or written (bad name, bad data for it)."""


@dataclass(frozen=True)
class _Relay:
    """One relay path in index space, with what it saves, for drawing and the legend."""

    path: tuple[int, ...]
    names: tuple[str, ...]
    colour: str
    rtt_ms: float
    direct_ms: float
    tunnel: bool  # whether there is a direct tunnel to bypass (a hub's spokes have none)


def draw_mesh(
    topo: Topology,
    out: str | Path,
    *,
    edge_label_ms: FloatArray | None = None,
    relay_paths: Sequence[Sequence[str]] = (),
    down_nodes: Collection[str] = (),
    title: str | None = None,
) -> None:
    """Draw the tunnels of ``topo`` to ``out`` (.png or .svg, chosen by the suffix).

    ``edge_label_ms[i, j]`` is the RTT of the pair as seen from i (default: the
    topology's RTT, delay one way plus delay back). ``relay_paths`` are node-name
    paths of three or more nodes: their hops are drawn thick and coloured, the
    direct tunnel they bypass dashed. ``down_nodes`` are greyed out. Where the two
    ends of a pair disagree by more than 10%, the label shows both, "x/y ms", the
    left end's first. The same input gives the same file, byte for byte.

    Raises PictureError for a suffix other than .png/.svg, bad labels or paths, or a
    file that cannot be written; TopologyError for an unknown node name.
    """
    path = check_picture_path(out)
    fmt = FORMATS[path.suffix.lower()]
    labels = _edge_labels(topo, edge_label_ms, path)
    relays = _relays(topo, relay_paths, labels, path)
    down = {topo.index(name) for name in down_nodes}
    pos, geographic = mesh_layout(topo)

    import matplotlib

    with matplotlib.rc_context(
        {"svg.fonttype": "none", "svg.hashsalt": "meshopt", "font.family": "DejaVu Sans"}
    ):
        fig = _figure(topo, pos, geographic, labels, relays, down, title)
        metadata: dict[str, str | None] = (
            {"Date": None} if fmt == "svg" else {"Software": "meshopt"}
        )
        try:
            fig.savefig(path, format=fmt, dpi=150, metadata=metadata, bbox_inches="tight")
        except OSError as e:
            raise PictureError(f"cannot write: {e.strerror or e}", source=str(path)) from None


def check_picture_path(out: str | Path) -> Path:
    """Refuse a bad ``--out`` before any work: a suffix other than .png/.svg, a
    directory, or a folder that does not exist."""
    path = Path(out)
    if path.is_dir():
        raise PictureError("is a directory; give the picture's file name", source=str(path))
    if path.suffix.lower() not in FORMATS:
        shown = path.suffix or "a name without a suffix"
        raise PictureError(f"pictures are .png or .svg, not {shown}", source=str(path))
    if not path.parent.is_dir():
        raise PictureError(f"cannot write: no directory {str(path.parent)!r}", source=str(path))
    return path


def mesh_layout(topo: Topology) -> tuple[FloatArray, bool]:
    """Node positions (n x 2) and whether they are geographic.

    Geographic (equirectangular, x scaled by cos of the mean latitude) when every
    node has lat/lon, since operators think of their mesh on a map. Otherwise a
    deterministic layout: a circle for small meshes, where any placement reads
    well, and Kamada-Kawai over shortest-path RTTs for larger ones, so that nodes
    close in latency are drawn close together.
    """
    n = topo.n
    if n and all(node.lat is not None and node.lon is not None for node in topo.nodes):
        lat = np.array([node.lat for node in topo.nodes], dtype=np.float64)
        lon = np.array([node.lon for node in topo.nodes], dtype=np.float64)
        wrapped = np.where(lon < 0, lon + 360.0, lon)
        if np.ptp(wrapped) < np.ptp(lon):  # a mesh across the antimeridian
            lon = wrapped
        x = lon * math.cos(math.radians(float(np.mean(lat))))
        return np.column_stack([x, lat]), True
    if n <= 8:
        angle = math.pi / 2 - 2 * math.pi * np.arange(n) / max(n, 1)
        return np.column_stack([np.cos(angle), np.sin(angle)]), False
    return _latency_layout(topo), False


def _latency_layout(topo: Topology) -> FloatArray:
    """Kamada-Kawai (spring for very large meshes) with RTT shortest paths as distances."""
    import networkx as nx
    from scipy.sparse.csgraph import shortest_path

    rtt = topo.rtt_ms()
    rtt = np.where(np.isfinite(rtt) & (rtt > 0), rtt, np.nan)
    finite = rtt[np.isfinite(rtt)]
    fill = float(finite.max()) if finite.size else 1.0
    rtt = np.nan_to_num(rtt, nan=fill)
    np.fill_diagonal(rtt, 0.0)
    dist = np.asarray(shortest_path(rtt, method="D", directed=False), dtype=np.float64)
    # The square root compresses the long inter-region distances, leaving room to read
    # the nodes of one region apart; + 0.05 keeps even co-located nodes apart.
    dist = np.sqrt(dist / (float(dist.max()) or 1.0)) + 0.05
    np.fill_diagonal(dist, 0.0)
    graph = nx.complete_graph(topo.n)
    if topo.n <= 150:
        dd = {i: {j: float(dist[i, j]) for j in range(topo.n)} for i in range(topo.n)}
        placed = nx.kamada_kawai_layout(graph, dist=dd)
    else:
        for i, j in graph.edges:
            graph.edges[i, j]["weight"] = 1.0 / float(dist[i, j])
        placed = nx.spring_layout(graph, seed=1, weight="weight", iterations=60)
    return np.array([placed[i] for i in range(topo.n)], dtype=np.float64)


# --- inputs ----------------------------------------------------------------------


def _edge_labels(topo: Topology, given: FloatArray | None, path: Path) -> FloatArray:
    if given is None:
        return topo.rtt_ms()
    labels = np.asarray(given, dtype=np.float64)
    if labels.shape != (topo.n, topo.n):
        raise PictureError(
            f"edge labels are {labels.shape}, the mesh has {topo.n} nodes", source=str(path)
        )
    return labels


def _relays(
    topo: Topology, paths: Sequence[Sequence[str]], labels: FloatArray, out: Path
) -> list[_Relay]:
    relays = []
    for k, names in enumerate(paths):
        if isinstance(names, str) or len(names) < 3:
            shown = names if isinstance(names, str) else "-".join(names)
            raise PictureError(
                f"relay path {shown!r} needs at least 3 nodes (source, relays, destination)",
                source=str(out),
            )
        idx = tuple(topo.index(name) for name in names)
        if len(set(idx)) != len(idx):
            raise PictureError(f"relay path {'-'.join(names)} visits a node twice", source=str(out))
        rtt = sum(_rtt(labels, a, b) for a, b in itertools.pairwise(idx))
        colour = RELAY_COLOURS[k % len(RELAY_COLOURS)]
        direct = _rtt(labels, idx[0], idx[-1])
        tunnel = bool(topo.tunnels[idx[0], idx[-1]])
        relays.append(_Relay(idx, tuple(names), colour, rtt, direct, tunnel))
    return relays


def _rtt(labels: FloatArray, i: int, j: int) -> float:
    """The RTT of a pair: the mean of what the two ends report, when they differ."""
    values = [v for v in (float(labels[i, j]), float(labels[j, i])) if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def format_ms(ms: float) -> str:
    """'24', '8', '0.6': whole milliseconds unless that would round a short RTT away."""
    if not math.isfinite(ms):
        return "?"
    if ms >= 9.95:
        return f"{ms:.0f}"
    return f"{ms:.1f}".removesuffix(".0")


def edge_text(labels: FloatArray, first: int, second: int) -> str | None:
    """'24 ms', or '20/28 ms' (as seen from ``first``/``second``) when the ends disagree."""
    a, b = float(labels[first, second]), float(labels[second, first])
    if not math.isfinite(a) and not math.isfinite(b):
        return None
    if not math.isfinite(a) or not math.isfinite(b):
        return f"{format_ms(a if math.isfinite(a) else b)} ms"
    if abs(a - b) > ASYMMETRY * min(a, b) and format_ms(a) != format_ms(b):
        return f"{format_ms(a)}/{format_ms(b)} ms"
    return f"{format_ms((a + b) / 2)} ms"


# --- drawing ---------------------------------------------------------------------


def _figure(
    topo: Topology,
    pos: FloatArray,
    geographic: bool,
    labels: FloatArray,
    relays: list[_Relay],
    down: set[int],
    title: str | None,
) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = topo.n
    lo, hi = (pos.min(axis=0), pos.max(axis=0)) if n else (np.zeros(2), np.ones(2))
    span = np.maximum(hi - lo, 1e-9)
    if float(max(span)) < 1e-6:
        span = np.ones(2)  # one node, or all in one place
    elif span[0] < 1e-6 * span[1] or span[1] < 1e-6 * span[0]:
        span = np.full(2, max(span))  # all on one line: give the picture some height
    pad = 0.07 * float(max(span))
    xlim = (float(lo[0] - pad), float(lo[0] + span[0] + pad))
    ylim = (float(lo[1] - pad), float(lo[1] + span[1] + pad))
    width = 7.5 if n <= 8 and not geographic else (11.0 if n <= LABEL_EDGES_MAX else 13.0)
    shape = (ylim[1] - ylim[0]) / (xlim[1] - xlim[0])
    aspect = min(max(shape, 0.45), 1.3)
    fig = Figure(figsize=(width, width * aspect + 0.7), dpi=150)
    renderer: RendererBase = FigureCanvasAgg(fig).get_renderer()  # type: ignore[no-untyped-call]
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.98 * width * aspect / (width * aspect + 0.7)))
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    # True shape unless that is very flat or tall (a mesh spread along one band of
    # latitude): then stretched to the page, since a squashed map hides its nodes.
    stretched = aspect != shape
    ax.set_aspect("auto" if stretched else "equal", adjustable="box")
    ax.set_axis_off()
    ax.apply_aspect()

    pairs = [(i, j) for i, j in zip(*np.nonzero(np.triu(topo.tunnels, 1)), strict=True)]
    pairs = [(int(i), int(j)) for i, j in pairs]
    labelled = n <= LABEL_EDGES_MAX and len(pairs) <= LABEL_TUNNELS_MAX
    bypassed = {
        (min(r.path[0], r.path[-1]), max(r.path[0], r.path[-1])): r for r in relays if r.tunnel
    }
    _draw_tunnels(ax, fig, pos, pairs, labels, set(bypassed), down, labelled)
    for relay in bypassed.values():
        _draw_bypassed(ax, topo, pos, relay)
    drawn: dict[tuple[int, int], int] = {}
    for relay in relays:
        _draw_relay(ax, topo, pos, relay, drawn)
    ax.apply_aspect()  # the colorbar may have moved the axes: fix pixels before measuring
    obstacles = _draw_nodes(ax, topo, pos, relays, down, renderer)
    hops = {(min(a, b), max(a, b)) for r in relays for a, b in itertools.pairwise(r.path)}
    to_label = sorted((set(pairs) if labelled else set()) | hops | set(bypassed))
    left_out, asymmetric = _label_edges(
        ax, topo.names, pos, to_label, labels, relays, bypassed, down, obstacles, renderer
    )
    note = "positions from latitude/longitude" if geographic else "positions from RTTs"
    note += " (stretched to fit)" if stretched else ""
    if labelled:
        note = f"RTT per tunnel; {note}"
        if left_out:
            note += f"; {left_out} of {len(pairs)} RTT labels left out where they would overlap"
    else:
        note = f"tunnels coloured by RTT; {note}"
    _legend(ax, relays, down, asymmetric)
    heading = title or f"{topo.name}: {n} nodes, {len(pairs)} tunnels"
    tall = float(fig.get_figheight())
    fig.text(0.5, 1 - 0.08 / tall, heading, ha="center", va="top", fontsize=14, weight="bold")
    fig.text(0.5, 1 - 0.38 / tall, note, ha="center", va="top", fontsize=9, color="#555555")
    return fig


def _draw_tunnels(
    ax: Axes,
    fig: Figure,
    pos: FloatArray,
    pairs: list[tuple[int, int]],
    labels: FloatArray,
    skip: set[tuple[int, int]],
    down: set[int],
    labelled: bool,
) -> None:
    """Every tunnel as one collection: fast at 40,000 edges, coloured by RTT when unlabelled."""
    from matplotlib.collections import LineCollection

    live = [(i, j) for i, j in pairs if (i, j) not in skip and i not in down and j not in down]
    dead = [(i, j) for i, j in pairs if (i, j) not in skip and (i in down or j in down)]
    if live and labelled:
        lines = LineCollection(
            [(pos[i], pos[j]) for i, j in live],
            linewidths=1.2,
            colors=TUNNEL_COLOUR,
            alpha=0.8,
            zorder=1,
        )
        lines.set_gid("tunnels")
        ax.add_collection(lines)
    elif live:
        # Long tunnels first so the short ones, which routes use, are drawn on top; the
        # more tunnels, the fainter each, so that density still shows at 40,000 edges.
        rtts = np.array([_rtt(labels, i, j) for i, j in live])
        rtts = np.nan_to_num(rtts, nan=float(np.nanmax(rtts)) if np.isfinite(rtts).any() else 0.0)
        order = np.argsort(-rtts, kind="stable")
        lines = LineCollection(
            [(pos[live[k][0]], pos[live[k][1]]) for k in order.tolist()],
            linewidths=0.25 if len(pos) >= FAINT_EDGES_MIN else 0.5,
            alpha=float(np.clip(500.0 / len(live), 0.02, 0.45)),
            zorder=1,
        )
        lines.set_gid("tunnels")
        lines.set_array(rtts[order])
        lines.set_cmap("viridis")
        ax.add_collection(lines)
        bar = fig.colorbar(lines, ax=ax, shrink=0.5, fraction=0.03, pad=0.01)
        bar.set_label("tunnel RTT (ms)")
        if bar.solids is not None:
            bar.solids.set_alpha(1.0)
    if dead and labelled:  # in a large mesh, a down node's fan is only noise
        lines = LineCollection(
            [(pos[i], pos[j]) for i, j in dead],
            linewidths=0.8,
            linestyles=(0, (1, 2)),
            colors=DOWN_COLOUR,
            alpha=0.7,
            zorder=1,
        )
        lines.set_gid("tunnels-down")
        ax.add_collection(lines)


def _draw_bypassed(ax: Axes, topo: Topology, pos: FloatArray, relay: _Relay) -> None:
    a, b = relay.path[0], relay.path[-1]
    (line,) = ax.plot(
        [pos[a, 0], pos[b, 0]],
        [pos[a, 1], pos[b, 1]],
        color=relay.colour,
        linestyle=(0, (5, 3)),
        linewidth=1.6,
        alpha=0.55,
        zorder=2,
    )
    line.set_gid(f"bypassed-{topo.nodes[a].name}-{topo.nodes[b].name}")


def _draw_relay(
    ax: Axes, topo: Topology, pos: FloatArray, relay: _Relay, drawn: dict[tuple[int, int], int]
) -> None:
    """Hops as arrows (the direction packets take), straight over their tunnels where the
    labels are; a hop an earlier path already took bends a little so both stay visible.
    ``drawn`` counts the hops drawn so far, across paths."""
    from matplotlib.patches import FancyArrowPatch

    for a, b in itertools.pairwise(relay.path):
        pair = (min(a, b), max(a, b))
        k = drawn.get(pair, 0)
        drawn[pair] = k + 1
        arrow = FancyArrowPatch(
            (float(pos[a, 0]), float(pos[a, 1])),
            (float(pos[b, 0]), float(pos[b, 1])),
            arrowstyle="-|>,head_length=7,head_width=4",
            connectionstyle=f"arc3,rad={RELAY_BENDS[k % len(RELAY_BENDS)]}",
            color=relay.colour,
            linewidth=3.2,
            shrinkA=9,
            shrinkB=9,
            zorder=4,
        )
        suffix = "" if k == 0 else f"-{k}"
        arrow.set_gid(f"relay-{topo.nodes[a].name}-{topo.nodes[b].name}{suffix}")
        ax.add_patch(arrow)


def _draw_nodes(
    ax: Axes,
    topo: Topology,
    pos: FloatArray,
    relays: list[_Relay],
    down: set[int],
    renderer: RendererBase,
) -> list[_Box]:
    """Nodes and their names, placed outward from the centre; returns their boxes (pixels)
    so that edge labels can keep clear of them."""
    n = topo.n
    size = 90.0 if n <= LABEL_EDGES_MAX else (30.0 if n <= NAME_NODES_MAX else 12.0)
    up = [i for i in range(n) if i not in down]
    if up:
        rim = 1.0 if n <= LABEL_EDGES_MAX else 0.3  # a thick rim makes small dots look hollow
        dots = ax.scatter(
            pos[up, 0],
            pos[up, 1],
            s=size,
            c=NODE_COLOUR,
            edgecolors="white",
            linewidths=rim,
            zorder=5,
        )
        dots.set_gid("nodes")
    if down:
        gone = sorted(down)
        dots = ax.scatter(
            pos[gone, 0],
            pos[gone, 1],
            s=size,
            c=DOWN_COLOUR,
            edgecolors="#c0392b",
            linewidths=1.5,
            zorder=5,
        )
        dots.set_gid("nodes-down")
        ax.scatter(pos[gone, 0], pos[gone, 1], s=size * 0.5, marker="x", c="#c0392b", zorder=6)

    to_px = ax.transData.transform
    radius = math.sqrt(size) / 2 * float(np.asarray(renderer.points_to_pixels(1.0)))
    boxes = [_Box(x, y, radius, radius) for x, y in to_px(pos).tolist()]
    on_relay = {i for relay in relays for i in relay.path}
    named = range(n) if n <= NAME_NODES_MAX else sorted(on_relay | down)
    few = n <= LABEL_EDGES_MAX or n > NAME_NODES_MAX  # only a few names: full size
    centre = pos.mean(axis=0) if n else np.zeros(2)
    taken_by_dots = list(boxes)
    names: list[_Box] = []
    for i in named:
        node = topo.nodes[i]
        name = ax.annotate(
            node.name + (" (down)" if i in down else ""),
            (float(pos[i, 0]), float(pos[i, 1])),
            xytext=(0.0, 0.0),
            textcoords="offset points",
            fontsize=10 if few else 6,
            fontweight="bold",
            color="#7f7f7f" if i in down else "#1a1a1a",
            zorder=7,
            bbox=_BACKDROP,
        )
        name.set_gid(f"node-{node.name}")
        address = None
        if node.address and n <= ADDRESS_NODES_MAX:
            address = ax.annotate(
                node.address,
                (0.0, 0.0),
                xycoords=name,
                xytext=(0.0, 0.0),
                textcoords="offset points",
                fontsize=7,
                color="#666666",
                zorder=7,
                bbox=_BACKDROP,
            )
            address.set_gid(f"address-{node.name}")
        # Outward from the middle of the mesh first, then turning away from it step by step;
        # keep the first spot that covers nothing, else the one that covers least.
        away = pos[i] - centre
        outward = math.atan2(float(away[1]), float(away[0])) if np.any(away) else math.pi / 2
        best: tuple[float, float] | None = None
        for turn in (0, 1, -1, 2, -2, 3, -3, 4):
            direction = outward + turn * math.pi / 4
            taken = _place_name(name, address, direction, 8.0 if few else 4.0, renderer)
            score = sum(box.overlap(other) for box in taken for other in taken_by_dots + names)
            score += abs(turn)
            if best is None or score < best[0]:
                best = (score, direction)
            if score < 2.5:
                break
        assert best is not None
        names.extend(_place_name(name, address, best[1], 8.0 if few else 4.0, renderer))
    return boxes + names


def _place_name(
    name: Annotation,
    address: Annotation | None,
    direction: float,
    offset: float,
    renderer: RendererBase,
) -> list[_Box]:
    """Put a node's name ``offset`` points from its dot towards ``direction`` (radians),
    the address on the far side of the name; return the boxes they take (pixels)."""
    dx, dy = math.cos(direction), math.sin(direction)
    ha: Literal["left", "center", "right"] = (
        "left" if dx > 0.38 else ("right" if dx < -0.38 else "center")
    )
    va: Literal["bottom", "center", "top"] = (
        "bottom" if dy > 0.38 else ("top" if dy < -0.38 else "center")
    )
    name.xyann = (dx * offset, dy * offset)
    name.set_horizontalalignment(ha)
    name.set_verticalalignment(va)
    extent = name.get_window_extent(renderer)
    taken = [_Box.of(extent.x0, extent.y0, extent.x1, extent.y1)]
    if address is not None:
        above = va == "bottom"
        address.xy = ({"left": 0.0, "right": 1.0}.get(ha, 0.5), 1.0 if above else 0.0)
        address.xyann = (0.0, 1.0 if above else -1.0)
        address.set_horizontalalignment(ha)
        address.set_verticalalignment("bottom" if above else "top")
        extent = address.get_window_extent(renderer)
        taken.append(_Box.of(extent.x0, extent.y0, extent.x1, extent.y1))
    return taken


def _label_edges(
    ax: Axes,
    names: list[str],
    pos: FloatArray,
    pairs: list[tuple[int, int]],
    labels: FloatArray,
    relays: list[_Relay],
    bypassed: dict[tuple[int, int], _Relay],
    down: set[int],
    obstacles: list[_Box],
    renderer: RendererBase,
) -> tuple[int, bool]:
    """RTT labels along their tunnels (rotated, so each reads as belonging to its line),
    each slid along the edge to the spot that covers the fewest other labels and nodes:
    in a full mesh the midpoints crowd the centre. A label with no free spot is left
    out (relay labels never are). Returns how many were, and whether any label shows two
    RTTs (the legend then explains them)."""
    hop_colour: dict[tuple[int, int], str] = {}
    for relay in relays:
        for a, b in itertools.pairwise(relay.path):
            hop_colour.setdefault((min(a, b), max(a, b)), relay.colour)  # the straight one
    px = ax.transData.transform(pos) if len(pos) else np.zeros((0, 2))
    placed = list(obstacles)
    # Relay hops and bypassed tunnels first: their labels matter most and get the best
    # spots; then the shortest tunnels, the ones routes are made of.
    order = sorted(
        pairs,
        key=lambda p: (p not in hop_colour and p not in bypassed, _rtt(labels, *p), p),
    )
    left_out = 0
    asymmetric = False
    for i, j in order:
        first, second = (i, j) if (px[i, 0], -px[i, 1]) <= (px[j, 0], -px[j, 1]) else (j, i)
        text = edge_text(labels, first, second)
        if text is None:
            continue
        colour = hop_colour.get((i, j)) or (bypassed[(i, j)].colour if (i, j) in bypassed else None)
        faded = i in down or j in down
        dx, dy = (px[second] - px[first]).tolist()
        angle = math.degrees(math.atan2(dy, dx))
        label = ax.text(
            0.0,
            0.0,
            text,
            ha="center",
            va="center",
            rotation=angle,
            rotation_mode="anchor",
            fontsize=7.5,
            fontweight="bold" if colour else "normal",
            color=colour or ("#9a9a9a" if faded else "#333333"),
            zorder=6,
            bbox={
                "boxstyle": "round,pad=0.2",
                "fc": "white",
                "ec": colour or "none",
                "lw": 0.6,
                "alpha": 0.9,
            },
        )
        label.set_gid(f"rtt-{names[i]}-{names[j]}")
        label.set_rotation(0.0)  # measure the unrotated box, then turn it back
        extent = label.get_window_extent(renderer)
        label.set_rotation(angle)
        half = (extent.width / 2 + 2.0, extent.height / 2 + 1.5)
        length = math.hypot(dx, dy)
        best: tuple[float, _Box] | None = None
        for t in (0.5, 0.42, 0.58, 0.34, 0.66, 0.26, 0.74, 0.2, 0.8):
            if length * min(t, 1 - t) < half[0] + 6.0 and t != 0.5:
                continue  # would sit on a node
            x, y = (px[first] + t * (px[second] - px[first])).tolist()
            box = _Box(x, y, half[0], half[1], math.radians(angle))
            score = sum(box.overlap(other) for other in placed) + abs(t - 0.5)
            if best is None or score < best[0]:
                best = (score, box)
            if score < 1.0:
                break
        assert best is not None
        if best[0] >= CROWDED_PX and not colour:
            label.remove()
            left_out += 1
            continue
        box = best[1]
        label.set_position(tuple(ax.transData.inverted().transform((box.x, box.y)).tolist()))
        placed.append(box)
        asymmetric = asymmetric or "/" in text
    return left_out, asymmetric


@dataclass(frozen=True)
class _Box:
    """A rectangle in pixels, centre (x, y), half sizes, turned by ``angle`` radians."""

    x: float
    y: float
    hw: float
    hh: float
    angle: float = 0.0

    @classmethod
    def of(cls, x0: float, y0: float, x1: float, y1: float) -> _Box:
        return cls((x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2)

    def _axes(self) -> tuple[tuple[float, float], tuple[float, float]]:
        c, s = math.cos(self.angle), math.sin(self.angle)
        return (c, s), (-s, c)

    def _reach(self, axis: tuple[float, float]) -> float:
        (ux, uy), (vx, vy) = self._axes()
        return self.hw * abs(ux * axis[0] + uy * axis[1]) + self.hh * abs(
            vx * axis[0] + vy * axis[1]
        )

    def overlap(self, other: _Box) -> float:
        """How far the two boxes interpenetrate (separating-axis test), 0 if apart."""
        depth = math.inf
        for axis in (*self._axes(), *other._axes()):
            gap = abs((other.x - self.x) * axis[0] + (other.y - self.y) * axis[1])
            depth = min(depth, self._reach(axis) + other._reach(axis) - gap)
            if depth <= 0:
                return 0.0
        return depth


def _legend(ax: Axes, relays: list[_Relay], down: set[int], asymmetric: bool) -> None:
    from matplotlib.lines import Line2D

    handles: list[Line2D] = []
    names: list[str] = []
    for relay in relays:
        handles.append(Line2D([], [], color=relay.colour, linewidth=3.2))
        names.append(f"{' → '.join(relay.names)}: {format_ms(relay.rtt_ms)} ms")
        ends = f"{relay.names[0]} – {relay.names[-1]}"
        if relay.tunnel:
            dashed = Line2D([], [], color=relay.colour, linewidth=1.6, linestyle=(0, (5, 3)))
            handles.append(dashed)
            names.append(f"direct {ends}: {format_ms(relay.direct_ms)} ms")
        else:
            handles.append(Line2D([], [], ls=""))
            names.append(f"no direct tunnel {ends}")
    if down:
        handles.append(
            Line2D([], [], marker="o", color=DOWN_COLOUR, markeredgecolor="#c0392b", ls="")
        )
        names.append("node down")
    if asymmetric:
        handles.append(Line2D([], [], ls=""))
        names.append("x/y ms: RTT measured from the left / right end")
    if handles:
        legend = ax.legend(
            handles, names, loc="best", fontsize=8, framealpha=0.92, title=None, borderpad=0.6
        )
        legend.set_gid("legend")
        legend.set_zorder(10)
