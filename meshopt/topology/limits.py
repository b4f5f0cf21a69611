"""Caps on what reading one topology input may cost, and the readers that enforce them.

A topology file is user input, and a hostile or broken one must end in one line naming
the file, never in a segfault, a MemoryError or minutes of swapping. Each cap stops an
amplification the formats allow:

- ``max_nodes``: a node costs five n×n matrices, so a 4 MB YAML file with 200,000 nodes
  asks for ~300 GB. 5,000 nodes is ~1 GB, the generators' cap too.
- ``max_pairs``: measured pairs, underlay entries, tunnels and backbone edges each cost a
  few hundred bytes before the matrices exist (YAML ~3 KB per underlay entry).
  2,000,000 is every pair of 2,000 nodes.
- ``max_input_mb``: the raw file and, for .gz/.bz2/.xz, the decompressed bytes (read in
  chunks with a running total: a 1 MB .gz of zeros inflates to gigabytes).
- ``max_depth``: nesting of YAML, GML and GraphML. The formats need at most 6 levels;
  libyaml's composer recurses in C, so 25,000 levels end Python with SIGSEGV.

Defaults are raised (or lowered) with ``--max-nodes``, ``--max-pairs``,
``--max-input-mb`` or the ``MESHOPT_MAX_*`` variables (see topologies/README.md).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import re
import stat
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

from meshopt.errors import InputError, TopologyError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

MIB = 1 << 20
DEFAULT_MAX_NODES = 5_000
DEFAULT_MAX_PAIRS = 2_000_000
DEFAULT_MAX_INPUT_MB = 256
DEFAULT_MAX_DEPTH = 64
ENV = {
    "max_nodes": "MESHOPT_MAX_NODES",
    "max_pairs": "MESHOPT_MAX_PAIRS",
    "max_input_mb": "MESHOPT_MAX_INPUT_MB",
    "max_depth": "MESHOPT_MAX_DEPTH",
}
FLAGS = {"max_nodes": "--max-nodes", "max_pairs": "--max-pairs", "max_input_mb": "--max-input-mb"}
COMPRESSIONS = (".gz", ".bz2", ".xz")
CHUNK = 1 << 16
MAX_LINE = 1 << 16  # characters in one line of a CSV file
MAX_ROW_LINES = 8  # physical lines one CSV row may span (quoted newlines)
# Lines of a CSV beyond its pairs (header, comments, blank and skipped rows): without a
# cap, 256 MiB of blank lines is 268 million of them, three minutes to refuse.
LINES_PER_PAIR = 2
EXTRA_LINES = 100_000


@dataclass(frozen=True)
class Limits:
    """What one topology input may hold; see the module docstring for why each."""

    max_nodes: int = DEFAULT_MAX_NODES
    max_pairs: int = DEFAULT_MAX_PAIRS
    max_input_mb: int = DEFAULT_MAX_INPUT_MB
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{f.name.replace('_', '-')} must be a whole number >= 1")

    @property
    def max_bytes(self) -> int:
        return self.max_input_mb * MIB

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """Defaults, overridden by the ``MESHOPT_MAX_*`` variables that are set."""
        env = os.environ if environ is None else environ
        given: dict[str, int] = {}
        for key, var in ENV.items():
            text = env.get(var, "").strip()
            if not text:
                continue
            if not (text.isascii() and text.isdigit()) or len(text) > 18 or int(text) < 1:
                raise InputError(f"{var} must be a whole number >= 1, got {text[:40]!r}")
            given[key] = int(text)
        return cls(**given)

    def with_values(self, **given: int | None) -> Limits:
        """These limits with the given (not None) values replaced: flags over variables."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def exceeded(self, what: str, key: str) -> str:
        """The message for a cap hit: what it is and how to raise it."""
        cap = getattr(self, key)
        how = f"{FLAGS[key]} or {ENV[key]}" if key in FLAGS else ENV[key]
        unit = " MiB" if key == "max_input_mb" else ""
        return f"more than {cap:,}{unit} {what} (the limit; raise it with {how})"


# --- reading files within the limits ---------------------------------------------------


def compression(path: Path) -> str | None:
    """'.gz', '.bz2' or '.xz' when the name ends so, else None."""
    name = path.name.lower()
    return next((c for c in COMPRESSIONS if name.endswith(c)), None)


def inner_path(path: Path) -> Path:
    """The name without its compression suffix: 'a.csv.gz' -> 'a.csv'."""
    c = compression(path)
    return path.with_name(path.name[: -len(c)]) if c else path


def base_name(path: Path) -> str:
    """The topology's default name: the file name up to its first dot."""
    return path.name.split(".")[0] or "topology"


_UNDECODABLE = re.compile("[\udc80-\udcff]")
_CORRUPT = (OSError, EOFError, zlib.error, lzma.LZMAError, ValueError)


class _Capped(io.RawIOBase):
    """Bytes of ``inner`` up to ``cap``; decompression errors become TopologyError."""

    def __init__(
        self, inner: io.BufferedIOBase, limits: Limits, source: str, kind: str | None
    ) -> None:
        super().__init__()
        self._inner = inner
        self._limits = limits
        self._source = source
        self._kind = kind
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._inner.read(min(len(view), CHUNK))
        except MemoryError:  # an .xz header may ask for a huge dictionary
            raise TopologyError(
                f"{self._kind} data needs too much memory", source=self._source
            ) from None
        except _CORRUPT as e:
            why = _reason(e)
            if self._kind is None:
                raise TopologyError(f"cannot read file: {why}", source=self._source) from None
            raise TopologyError(
                f"cannot read {self._kind} data: {why}", source=self._source
            ) from None
        self.total += len(data)
        if self.total > self._limits.max_bytes:
            what = "of decompressed data" if self._kind else "of data"
            raise TopologyError(self._limits.exceeded(what, "max_input_mb"), source=self._source)
        view[: len(data)] = data
        return len(data)


def _reason(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e)
    return " ".join(str(text).split())[:200] or type(e).__name__


@contextmanager
def open_input(path: Path, limits: Limits) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed by its suffix, never more than ``limits.max_bytes``.

    Refuses what is not a regular file (a FIFO or /dev/zero never ends) and a file
    larger than the cap before reading any of it.
    """
    source = str(path)
    try:
        raw = path.open("rb")
    except (OSError, ValueError) as e:
        raise TopologyError(f"cannot read file: {_reason(e)}", source=source) from None
    with raw:
        info = os.fstat(raw.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise TopologyError("not a regular file", source=source)
        if info.st_size > limits.max_bytes:
            raise TopologyError(limits.exceeded("of file", "max_input_mb"), source=source)
        kind = compression(path)
        inner: io.BufferedIOBase
        if kind == ".gz":
            inner = gzip.GzipFile(fileobj=raw, mode="rb")
        elif kind == ".bz2":
            inner = bz2.BZ2File(raw, mode="rb")
        elif kind == ".xz":
            inner = lzma.LZMAFile(raw, mode="rb")  # noqa: SIM115 (closed by the with below)
        else:
            inner = raw
        with inner, io.BufferedReader(_Capped(inner, limits, source, kind), CHUNK) as capped:
            yield capped


def read_input(path: Path, limits: Limits) -> bytes:
    """All of a file's (decompressed) bytes, within ``limits.max_bytes``."""
    parts = []
    with open_input(path, limits) as f:
        while chunk := f.read(CHUNK):
            parts.append(chunk)
    return b"".join(parts)


class TextLines:
    """Lines of a UTF-8 text input for the csv module, each at most ``MAX_LINE`` long.

    ``row_start`` is set by the reader after each row: a row may span at most
    ``MAX_ROW_LINES`` lines, so a quoted field cannot gather a whole file into one row.
    """

    def __init__(self, file: io.TextIOBase, source: str, limits: Limits) -> None:
        self._file = file
        self._source = source
        self._limits = limits
        self._max_lines = LINES_PER_PAIR * limits.max_pairs + EXTRA_LINES
        self.line = 0
        self.row_start = 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = self._file.readline(MAX_LINE + 1)
        if not line:
            raise StopIteration
        self.line += 1
        if self.line > self._max_lines:
            raise TopologyError(
                f"more than {self._max_lines:,} lines ({LINES_PER_PAIR} per pair and "
                f"{EXTRA_LINES:,}; raise it with {FLAGS['max_pairs']} or {ENV['max_pairs']})",
                source=self._source,
                line=self.line,
            )
        if len(line) > MAX_LINE:
            raise TopologyError(
                f"line longer than {MAX_LINE:,} characters", source=self._source, line=self.line
            )
        if self.line - self.row_start > MAX_ROW_LINES:
            raise TopologyError(
                f"a row spans more than {MAX_ROW_LINES} lines (a quote left open?)",
                source=self._source,
                line=self.row_start + 1,
            )
        if _UNDECODABLE.search(line):
            raise TopologyError("not UTF-8 text", source=self._source, line=self.line)
        return line


@contextmanager
def open_text_lines(path: Path, limits: Limits) -> Iterator[TextLines]:
    """Lines of a (possibly compressed) UTF-8 text file, within the limits."""
    with open_input(path, limits) as f:
        # surrogateescape: the bad byte's own line is named, not the 8 KB chunk's first
        text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
        try:
            yield TextLines(text, str(path), limits)
        finally:
            text.detach()
