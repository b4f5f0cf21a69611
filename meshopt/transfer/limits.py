"""What one receiver lets its senders use: disk, time, connections. Pure checks, no I/O.

A sender inside the mesh is still not trusted with the receiver's disk: every offer is
checked against a quota (bytes of files received this run, partial ones included) and a
free-space reserve before a single byte is written, and the answer is a refusal the
sender can print, not a full disk discovered half way through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshopt.transfer.errors import TransferError

if TYPE_CHECKING:
    from meshopt.agent.config import TransferSettings

GIB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """A receiver's limits; the defaults are the agent's ``[transfer]`` defaults."""

    quota_bytes: int = 10 * GIB  # files received this run, partial ones included
    min_free_bytes: int = GIB  # free space to keep: the smaller of this ...
    min_free_fraction: float = 0.05  # ... and this share of the filesystem
    partial_max_age_s: float = 24 * 3600.0  # an untouched partial file is removed after this
    idle_timeout_s: float = 60.0  # the longest a sender may stay silent
    max_transfers: int = 8  # connections served at once; more are refused as busy
    max_per_sender: int = 2  # of those, from one sender
    allow_overwrite: bool = False  # replace an existing file when the sender asks to

    def check(self) -> None:
        """Raise TransferError (code "config") for a value that cannot work."""
        bad = []
        if self.quota_bytes < 0 or self.min_free_bytes < 0:
            bad.append("quota and free-space reserve must be >= 0")
        if not 0 <= self.min_free_fraction < 1:
            bad.append("the free-space share must be in [0, 1)")
        if self.partial_max_age_s <= 0 or self.idle_timeout_s <= 0:
            bad.append("partial file age and idle timeout must be > 0")
        if self.max_transfers < 1 or self.max_per_sender < 1:
            bad.append("max transfers (in all and per sender) must be >= 1")
        if bad:
            raise TransferError("receiver limits: " + "; ".join(bad), code="config")

    @property
    def sweep_interval_s(self) -> float:
        """How often partial files are checked for expiry: often enough to be on time."""
        return min(max(self.partial_max_age_s / 4, 0.5), 3600.0)


def reserve_bytes(fs_total: int, limits: Limits) -> int:
    """Free space to keep on a filesystem of ``fs_total`` bytes.

    The smaller of the two settings, so a small disk is not refused outright by a reserve
    bigger than itself, and a large one keeps at most ``min_free_bytes``.
    """
    return min(limits.min_free_bytes, int(limits.min_free_fraction * fs_total))


def quota_refusal(name: str, need: int, used: int, limits: Limits) -> TransferError | None:
    """Refusal of ``need`` more bytes when ``used`` are already taken this run, or None."""
    if used + need <= limits.quota_bytes:
        return None
    return TransferError(
        f"{name}: {_size(need)} would exceed the receiver's quota "
        f"({_size(used)} of {_size(limits.quota_bytes)} used)",
        code="quota",
    )


def space_refusal(
    name: str, need: int, *, free: int, total: int, pending: int, limits: Limits
) -> TransferError | None:
    """Refusal when ``need`` bytes would eat into the reserve, or None.

    ``free``: the filesystem's free bytes for unprivileged users; ``pending``: bytes other
    running transfers have been promised but not yet written.
    """
    keep = reserve_bytes(total, limits)
    if free - pending - need >= keep:
        return None
    return TransferError(
        f"receiver's disk is too full for {name}: {_size(need)} needed, "
        f"{_size(max(0, free - pending))} free, {_size(keep)} kept in reserve",
        code="no-space",
    )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def from_settings(t: TransferSettings) -> Limits:
    """The limits of the agent's ``[transfer]`` settings (GiB, hours, percent -> units)."""
    return Limits(
        quota_bytes=int(t.quota_gib * GIB),
        min_free_bytes=int(t.min_free_gib * GIB),
        min_free_fraction=t.min_free_percent / 100,
        partial_max_age_s=t.partial_max_age_h * 3600,
        idle_timeout_s=t.idle_timeout_s,
        max_transfers=t.max_transfers,
        max_per_sender=t.max_per_sender,
        allow_overwrite=t.allow_overwrite,
    )
