"""Human units for byte counts.

One set for every report, files and memory alike: binary IEC units (KiB, MiB, GiB), as
``nvidia-smi``, ``torch.cuda.memory_summary`` and ``ls -lh`` count. A file of 2.32 GiB that
needs 2.32 GiB of memory reads the same in ``inspect``, ``estimate`` and the HTML page.
Sizes typed by the user may be decimal (``500MB``) or binary (``2GiB``): :func:`parse_size`.
"""

from __future__ import annotations

import math


def _scale(n: float, base: int, units: tuple[str, ...]) -> str:
    value = float(n)
    for unit in units:
        if abs(value) < base - 0.5 or unit == units[-1]:  # never "1024 MiB"
            if unit == units[0]:
                return f"{int(value)} {unit}"
            return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def human_bytes(n: int) -> str:
    """A byte count in binary units: ``1.5 GiB``, ``2.5 KiB``, ``999 B``."""
    return _scale(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))


#: The same as :func:`human_bytes` (memory and files share one set of units).
human_mem = human_bytes


def percent(part: int, whole: int) -> str:
    """``33%`` (``<1%`` for small non-zero parts)."""
    if whole <= 0:
        return "0%"
    p = 100.0 * part / whole
    if 0 < p < 1:
        return "<1%"
    return f"{p:.0f}%"


def parse_size(text: str) -> int:
    """``80GiB``, ``80GB``, ``1.5e9`` -> bytes. ``ValueError`` if it is not a size."""
    t = text.strip().replace("_", "").replace(" ", "")
    units = {
        "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
        "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20,
        "G": 2**30, "T": 2**40,
    }
    i = len(t)
    while i > 0 and t[i - 1].isalpha():
        i -= 1
    number, unit = t[:i], t[i:].upper()
    bad = ValueError(f"not a size: {text!r} (expected e.g. 80GiB, 24GB, 512MiB)")
    if unit not in units or not number:
        raise bad
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise bad from None
    if not math.isfinite(value) or value < 0:
        raise bad
    return int(value)
