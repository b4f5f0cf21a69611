"""Parse the quantities users type: delays, rates, loss, durations.

Plain numbers are taken in the unit engineers use most for each quantity
(milliseconds, Mbit/s, fraction or percent), so ``delay: 20`` means 20 ms.
"""

from __future__ import annotations

import math
import re

from meshopt.errors import InputError

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_TIME_UNITS = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "min": 60e3, "h": 3600e3}
_RATE_UNITS = {
    "bit": 1e-6, "bps": 1e-6,
    "kbit": 1e-3, "kbps": 1e-3,
    "mbit": 1.0, "mbps": 1.0,
    "gbit": 1e3, "gbps": 1e3,
}  # fmt: skip


def _split(text: str, what: str) -> tuple[float, str]:
    m = re.fullmatch(_NUM + r"\s*([a-zA-Zµ%/]*)", text.strip())
    if not m:
        raise InputError(f"bad {what} {text!r}")
    return float(m.group(1)), m.group(2).lower()


def parse_time_ms(value: object, what: str = "delay") -> float:
    """Milliseconds from '20ms', '1.5s', '300us' or a bare number (ms)."""
    if isinstance(value, bool):
        raise InputError(f"bad {what} {value!r}")
    if isinstance(value, int | float):
        num, unit = float(value), "ms"
    elif isinstance(value, str):
        num, unit = _split(value, what)
        unit = unit or "ms"
    else:
        raise InputError(f"bad {what} {value!r}")
    if unit not in _TIME_UNITS:
        raise InputError(f"bad {what} {value!r}: unknown unit {unit!r} (use us, ms, s)")
    ms = num * _TIME_UNITS[unit]
    if not math.isfinite(ms) or ms < 0:
        raise InputError(f"bad {what} {value!r}: must be a finite value >= 0")
    return ms


def parse_duration_s(value: object, what: str = "duration") -> float:
    """Seconds from '120s', '2m', '500ms' or a bare number (seconds)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return parse_time_ms(float(value) * 1e3, what) / 1e3
    if isinstance(value, str) and re.fullmatch(_NUM, value.strip()):
        return parse_time_ms(float(value.strip()) * 1e3, what) / 1e3
    return parse_time_ms(value, what) / 1e3


def parse_rate_mbit(value: object, what: str = "rate") -> float:
    """Mbit/s from '100Mbit', '1Gbit', '500kbit' or a bare number (Mbit/s);
    'unlimited' is infinity (no rate limit)."""
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return math.inf
    if isinstance(value, bool):
        raise InputError(f"bad {what} {value!r}")
    if isinstance(value, int | float):
        num, unit = float(value), "mbit"
    elif isinstance(value, str):
        num, unit = _split(value, what)
        unit = (unit or "mbit").removesuffix("/s")
    else:
        raise InputError(f"bad {what} {value!r}")
    if unit not in _RATE_UNITS:
        raise InputError(f"bad {what} {value!r}: unknown unit {unit!r} (use kbit, Mbit, Gbit)")
    mbit = num * _RATE_UNITS[unit]
    if not math.isfinite(mbit) or mbit <= 0:
        raise InputError(f"bad {what} {value!r}: must be a finite value > 0")
    return mbit


def parse_loss(value: object, what: str = "loss") -> float:
    """Fraction 0..1 from '2%' or a bare fraction (0.02); '2%' is the clearer form."""
    if isinstance(value, bool):
        raise InputError(f"bad {what} {value!r}")
    if isinstance(value, int | float):
        frac = float(value)
    elif isinstance(value, str):
        num, unit = _split(value, what)
        if unit not in ("", "%"):
            raise InputError(f"bad {what} {value!r}: use a percentage like '2%'")
        frac = num / 100 if unit == "%" else num
    else:
        raise InputError(f"bad {what} {value!r}")
    if not math.isfinite(frac) or not 0 <= frac <= 1:
        raise InputError(f"bad {what} {value!r}: must be between 0% and 100%")
    return frac


def parse_late(value: object, what: str = "late probes") -> tuple[float, float]:
    """A busy host's late probes: (share, mean delay ms) from '3%/1.5ms'; 'off' or '0'
    for none."""
    text = str(value).strip().lower() if not isinstance(value, bool) else "?"
    if text in ("off", "0", "none"):
        return (0.0, 0.0)
    share, sep, delay = text.partition("/")
    if not sep:
        raise InputError(
            f"bad {what} {value!r}: give the share of probes late and their mean delay,"
            " like '3%/1.5ms', or 'off'"
        )
    p, ms = parse_loss(share.strip(), what), parse_time_ms(delay.strip(), what)
    if ms <= 0.0 and p > 0.0:
        raise InputError(f"bad {what} {value!r}: the mean delay must be > 0")
    return (p, ms)


MAX_SPIKE_N = 1_000_000


def parse_spike(value: object, what: str = "spike") -> int:
    """A lab fault, one packet in N held 100-300 ms: N from '20', '1/20' or 20; 0 or
    'off' for none."""
    text = str(value).strip().lower() if not isinstance(value, bool) else "?"
    if text in ("off", "0", "none"):
        return 0
    text = text.removeprefix("1/")
    if not text.isdigit() or not 1 <= int(text) <= MAX_SPIKE_N:
        raise InputError(
            f"bad {what} {value!r}: give N or 1/N (one packet in N, 1..{MAX_SPIKE_N}) or off"
        )
    return int(text)


def format_ms(ms: float) -> str:
    """Human-readable milliseconds: '12.3 ms', '∞'."""
    if math.isinf(ms):
        return "∞"
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"
