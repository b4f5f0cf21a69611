"""One way in for every topology source, so every command accepts all of them.

``load_topology`` takes what a user types: a file (YAML, GML/GraphML, CSV RTT
matrix, each optionally .gz/.bz2/.xz, and with ``?key=value&...`` importer options)
or a generator spec ``gen:KIND:key=value,...``. Every file is read within
:class:`~meshopt.topology.limits.Limits`, so a hostile one is one TopologyError.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from meshopt.configfile import printable
from meshopt.errors import InputError, TopologyError
from meshopt.topology.generators import GENERATORS, generate
from meshopt.topology.importers import HOP_MS, Imported, import_graph, import_rtt_csv
from meshopt.topology.limits import Limits, compression, inner_path
from meshopt.topology.model import Topology
from meshopt.units import parse_time_ms

log = logging.getLogger(__name__)
T = TypeVar("T")

KINDS = {".yaml": "yaml", ".yml": "yaml", ".gml": "graph", ".graphml": "graph", ".csv": "csv"}
KINDS_HELP = (
    ".yaml, .yml, .gml, .graphml, .csv (each also as .gz, .bz2 or .xz), or gen:KIND:key=value,..."
)


def load_topology(
    spec: str | os.PathLike[str],
    *,
    seed: int | None = None,
    warnings: list[str] | None = None,
    limits: Limits | None = None,
) -> Topology:
    """Load a file or build a generator spec; every bad input raises TopologyError.

    ``seed`` is the generator seed when the spec has none. Importer warnings
    (dropped nodes, skipped rows) are logged and, if given, appended to ``warnings``.
    ``limits`` default to :meth:`Limits.from_env`. MemoryError and RecursionError are
    the last wall behind the limits: they too end as one line, not a traceback.
    """
    limits = limits or Limits.from_env()
    spec = os.fspath(spec)  # a Path is a file name, as its text is
    source = printable(spec[:200])
    try:
        topo = _load(spec, seed, warnings, limits)
    except InputError as e:  # one line even for a file name or value with a newline
        if str(e).isprintable():
            raise
        raise type(e)(printable(e.message), source=printable(e.source), line=e.line) from None
    except MemoryError:
        raise TopologyError(
            "not enough memory to load this topology (lower --max-nodes/--max-pairs)",
            source=source,
        ) from None
    except RecursionError:
        raise TopologyError("nested too deeply to load", source=source) from None
    if topo.n > limits.max_nodes:
        raise TopologyError(limits.exceeded("nodes", "max_nodes"), source=source)
    return topo


def _load(spec: str, seed: int | None, warnings: list[str] | None, limits: Limits) -> Topology:
    if spec.startswith("gen:"):
        return generate(spec, seed=seed)
    from meshopt.topologies import resolve

    path, options = split_options(resolve(spec))
    kind = file_kind(path)
    try:
        exists, regular = path.exists(), path.is_file()
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission
        reason = getattr(e, "strerror", None) or str(e)
        raise TopologyError(f"cannot read file: {reason}", source=str(path)[:200]) from None
    if not exists:
        raise TopologyError("no such file", source=str(path))
    if not regular:
        raise TopologyError("not a regular file", source=str(path))
    if kind == "yaml":
        if options:
            raise TopologyError("YAML files take no ?options", source=str(path))
        from meshopt.topology.yamlfile import load_yaml  # PyYAML only for YAML files

        return load_yaml(path, limits)
    imported = _import(kind, path, options, limits)
    for message in imported.warnings:
        log.warning("%s: %s", path, message)
        if warnings is not None:
            warnings.append(message)
    return imported.topology


def save_topology(topo: Topology, path: str | Path) -> None:
    """Write YAML that ``load_topology`` reads back to the same topology."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        raise TopologyError("topologies are saved as YAML: use a .yaml name", source=str(path))
    from meshopt.topology.yamlfile import save_yaml

    save_yaml(topo, path)


def file_kind(path: Path) -> str:
    """'yaml', 'graph' or 'csv' from the file name (``.csv.gz`` counts as csv)."""
    suffix = inner_path(path).suffix.lower()
    if suffix in KINDS:
        return KINDS[suffix]
    if compression(path) and not suffix:
        suffix = path.suffix.lower()
    what = f"file type {suffix!r}" if suffix else "file without an extension"
    raise TopologyError(
        f"unknown topology {what} (use {KINDS_HELP}; generators: {', '.join(GENERATORS)})",
        source=str(path),
    )


def split_options(spec: str) -> tuple[Path, dict[str, str]]:
    """'file.csv.gz?min_count=50&countries=DE,FR' -> path and options (a file named so wins)."""
    if "?" not in spec or _exists(Path(spec)):
        return Path(spec), {}
    path, _, query = spec.partition("?")
    options: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise TopologyError(f"bad option {item!r}: write key=value", source=path)
        if key in options:
            raise TopologyError(f"option {key} given twice", source=path)
        options[key] = value.strip()
    return Path(path), options


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _import(kind: str, path: Path, options: dict[str, str], limits: Limits) -> Imported:
    allowed = ("hop_ms",) if kind == "graph" else ("min_count", "countries")
    for key in options:
        if key not in allowed:
            known = ", ".join(allowed)
            raise TopologyError(f"unknown option {key!r} (use {known})", source=str(path))
    if kind == "graph":
        hop_ms = _option(options, "hop_ms", lambda v: parse_time_ms(v, "hop_ms"), path)
        return import_graph(path, hop_ms=HOP_MS if hop_ms is None else hop_ms, limits=limits)
    return import_rtt_csv(
        path,
        min_count=_option(options, "min_count", _count, path),
        countries=_option(options, "countries", _codes, path),
        limits=limits,
    )


def _option(options: dict[str, str], key: str, parse: Callable[[str], T], path: Path) -> T | None:
    if key not in options:
        return None
    try:
        return parse(options[key])
    except InputError as e:
        raise TopologyError(f"option {key}: {e.message}", source=str(path)) from None


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise InputError(f"expected a whole number >= 0, got {text[:40]!r}")
    return int(text)


def _codes(text: str) -> list[str]:
    return [c for c in (part.strip() for part in text.split(",")) if c]
