"""Time and order bounds on signed messages: clock skew, replays, terms that clocks explain.

A signature proves who wrote a message, not when. A message is refused when it claims
to come from the future (more than ``max_skew_s`` ahead of our clock: accepting it would
let one bad clock, or a captured message, lock newer messages out), when it is older
than ``max_age_s`` (a recording played back), and when its sequence number is not newer
than the newest already accepted from the same sender (a replay). Sequence numbers,
route-set versions and controller terms all grow with the wall clock (microseconds or
seconds since the epoch, plus one per message), so each also has a ceiling: what the
clock can explain plus :data:`TERM_SLACK_S`. A term or version beyond it would, once
persisted by an agent, refuse every honest controller's later sets for ever.

Pure: the wall clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from meshopt.bus.messages import BusMessageError

MAX_SKEW_S: Final = 30.0
MAX_AGE_S: Final = 300.0
# How far terms/versions may run ahead of the clock: one claim per settle time for an
# hour of contention between controllers is far more than happens.
TERM_SLACK_S: Final = 3600.0
US: Final = 1_000_000


def term_ceiling(wall: float, max_skew_s: float = MAX_SKEW_S) -> int:
    """The largest controller term (unix seconds based) a clock at ``wall`` can explain."""
    return int(wall + max_skew_s + TERM_SLACK_S)


def seq_ceiling(wall: float, max_skew_s: float = MAX_SKEW_S) -> int:
    """The largest microsecond-based sequence number or route-set version."""
    return int((wall + max_skew_s + TERM_SLACK_S) * US)


def first_seq(wall: float) -> int:
    """Where a process starts counting: later than anything it sent before a restart."""
    return int(wall * US)


def check_time(sent_at: float, wall: float, *, max_skew_s: float, max_age_s: float | None) -> None:
    """Refuse ``sent_at`` from the future ("future") or, with ``max_age_s``, too old."""
    if sent_at > wall + max_skew_s:
        raise BusMessageError(
            "future", f"sent {sent_at - wall:.0f} s ahead of this clock (max {max_skew_s:g})"
        )
    if max_age_s is not None and sent_at < wall - max_age_s:
        raise BusMessageError("too_old", f"sent {wall - sent_at:.0f} s ago (max {max_age_s:g})")


@dataclass
class SequenceGuard:
    """Newest sequence number accepted per sender; refuses anything not newer.

    ``check`` only looks; ``accept`` records (call it once the message was taken), so a
    message refused for another reason later does not advance the sender's sequence.
    """

    max_skew_s: float = MAX_SKEW_S
    newest: dict[str, int] = field(default_factory=dict)

    def check(self, sender: str, seq: int, wall: float) -> None:
        if seq > seq_ceiling(wall, self.max_skew_s):
            raise BusMessageError("bad_seq", f"{sender}: seq {seq} runs ahead of the clock")
        last = self.newest.get(sender)
        if last is not None and seq <= last:
            raise BusMessageError(
                "replay" if seq < last else "duplicate", f"{sender}: seq {seq} <= {last}"
            )

    def accept(self, sender: str, seq: int) -> None:
        self.newest[sender] = max(seq, self.newest.get(sender, seq))

    def forget(self, sender: str) -> None:
        self.newest.pop(sender, None)
