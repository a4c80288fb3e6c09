"""Resource limits of every reader: how much a file may make modelsize parse, inflate or build.

Memory and time grow with what is real in a file (its tensors, its storages), never with what a
header claims. Where a format makes modelsize parse a document whole (a JSON member, a
safetensors header, a pickle) or inflate a zip member, a limit bounds it, and a file that needs
more is refused with one line naming the limit and the environment variable that raises it:

=============================  ===============  ================================================
variable                       default          bounds
=============================  ===============  ================================================
MODELSIZE_MAX_HEADER_BYTES     100,000,000      a safetensors header (the Rust library's limit)
MODELSIZE_MAX_JSON_BYTES       16 MiB           a JSON document read whole: a ``.keras``
                                                ``config.json``/``metadata.json``, a sharded
                                                checkpoint's index, an HDF5 ``model_config``
MODELSIZE_MAX_INFLATE_BYTES    1 GiB            bytes inflated from a zip member that claims
                                                more than :data:`PLAUSIBLE_RATIO` times its
                                                compressed size (a deflate bomb)
MODELSIZE_MAX_READ_BYTES       256 MiB          a zip member read whole into memory: a
                                                deflated pickle (a stored one is parsed in
                                                place), TorchScript code
MODELSIZE_MAX_MEMORY_BYTES     768 MiB          memory a pickle parse may add to the process
MODELSIZE_MAX_PICKLE_OPS       20,000,000       opcodes a pickle may run beyond 200 for each
                                                tensor or array it holds (opcodes run by a
                                                method count 6)
=============================  ===============  ================================================

Values are counts (of bytes, or opcodes): ``2GiB``, ``500MB``, ``20M`` and ``1e9`` are understood
too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from modelsize._records import record
from modelsize.errors import LimitError, UsageError

#: Deflate of real tensor data rarely gets past 3:1; a member claiming more than this many
#: times its compressed size is inflated only up to ``MODELSIZE_MAX_INFLATE_BYTES``.
PLAUSIBLE_RATIO = 16

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
_VALUE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.I)


@record(frozen=True)
class Limit:
    """One resource limit: its environment variable, default and what it bounds."""

    env: str
    default: int
    what: str
    unit: str = "bytes"

    def value(self) -> int:
        """The limit in force: the environment variable's value, else the default."""
        raw = os.environ.get(self.env, "").strip()
        if not raw:
            return self.default
        m = _VALUE.match(raw)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise UsageError(f"{self.env}={raw!r} is not a count of {self.unit} "
                             "(e.g. 2000000000, 2GiB)")
        return int(float(m.group(1)) * unit)

    def hint(self) -> str:
        """How to raise it, for the end of a message."""
        return f"the limit is {self.value():,} {self.unit}; set {self.env} to raise it"

    def refuse(self, path: str | Path, reason: str) -> LimitError:
        """The error for ``path`` needing more than this limit (raise it)."""
        return LimitError(path, f"{reason} ({self.hint()})", self.env)

    def check(self, path: str | Path, nbytes: int, what: str) -> None:
        """Refuse ``what`` of ``nbytes`` bytes if that is more than the limit."""
        if nbytes > self.value():
            raise self.refuse(path, f"{what} is {nbytes:,} {self.unit}, more than modelsize "
                              "reads")


HEADER_BYTES = Limit("MODELSIZE_MAX_HEADER_BYTES", 100_000_000, "a safetensors header")
JSON_BYTES = Limit("MODELSIZE_MAX_JSON_BYTES", 16 << 20, "a JSON document read whole")
INFLATE_BYTES = Limit("MODELSIZE_MAX_INFLATE_BYTES", 1 << 30,
                      "bytes inflated from an implausibly compressed zip member")
READ_BYTES = Limit("MODELSIZE_MAX_READ_BYTES", 256 << 20, "a zip member read whole")
MEMORY_BYTES = Limit("MODELSIZE_MAX_MEMORY_BYTES", 768 << 20,
                     "memory a pickle parse may add")

PICKLE_OPS = Limit("MODELSIZE_MAX_PICKLE_OPS", 20_000_000,
                   "opcodes a pickle may run besides those of its tensors", "opcodes")
#: Opcodes a pickle may run for each tensor or array it holds, on top of MODELSIZE_MAX_PICKLE_OPS
#: (torch.save spends about 30 on a tensor of a state dict, 40 with its optimizer state).
OPS_PER_TENSOR = 200

LIMITS = (HEADER_BYTES, JSON_BYTES, INFLATE_BYTES, READ_BYTES, MEMORY_BYTES, PICKLE_OPS)


def inflate_allowance(compressed: int) -> int:
    """Bytes a zip member of ``compressed`` bytes may inflate to before it is taken for a bomb."""
    return max(INFLATE_BYTES.value(), PLAUSIBLE_RATIO * compressed)


def check_inflate(path: str | Path, name: str, compressed: int, claimed: int) -> None:
    """Refuse to inflate a member whose claimed size is past :func:`inflate_allowance`."""
    if claimed > inflate_allowance(compressed):
        raise INFLATE_BYTES.refuse(
            path,
            f"member {name!r} claims to inflate {compressed:,} bytes to {claimed:,} "
            f"({claimed // max(compressed, 1):,}:1, a deflate bomb?); modelsize inflates a "
            f"member compressed more than {PLAUSIBLE_RATIO}:1 up to a limit",
        )


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident memory now (0 where ``/proc`` cannot tell)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class ParseBudget:
    """What parsing a document may spend: opcodes (``MODELSIZE_MAX_PICKLE_OPS``, plus
    :data:`OPS_PER_TENSOR` for each tensor or array it holds) and memory added to the process
    (``MODELSIZE_MAX_MEMORY_BYTES``).

    :meth:`check` is cheap (one read of ``/proc/self/statm``); the pickle parser calls it once
    per block of opcodes, and before it makes a large string.
    """

    def __init__(self, path: str | Path, what: str) -> None:
        self.path = path
        self.what = what
        self.start = resident_bytes()
        self.memory = MEMORY_BYTES.value()
        self.ops = PICKLE_OPS.value()

    def check(self, work: int, found: int, more: int = 0) -> None:
        """Refuse if ``work`` (weighed opcodes) passes what ``found`` tensors allow, or if the
        memory added so far (plus ``more`` about to be) passes the memory limit."""
        allowed = self.ops + OPS_PER_TENSOR * found
        if work > allowed:
            raise PICKLE_OPS.refuse(
                self.path, f"parsing {self.what} takes more than {allowed:,} opcodes for the "
                f"{found:,} tensors and arrays it holds"
            )
        now = resident_bytes()
        if now and now + more - self.start > self.memory:
            raise MEMORY_BYTES.refuse(
                self.path, f"parsing {self.what} needs more than {self.memory:,} bytes of memory"
            )
