"""Human units for byte counts.

Decimal for files (as ``ls --si`` and file browsers show them), binary for memory.
"""

from __future__ import annotations


def _scale(n: float, base: int, units: tuple[str, ...]) -> str:
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            if unit == units[0]:
                return f"{int(value)} {unit}"
            return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def human_bytes(n: int) -> str:
    """File sizes in decimal units: ``2.6 MB``."""
    return _scale(n, 1000, ("B", "kB", "MB", "GB", "TB", "PB"))


def human_mem(n: int) -> str:
    """Memory in binary units: ``1.5 GiB``."""
    return _scale(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))


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
    if unit not in units or not number:
        raise ValueError(f"not a size: {text!r} (expected e.g. 80GiB, 24GB, 512MiB)")
    return int(float(number) * units[unit])
