"""The choices of ``modelsize estimate --generate``, as ``generate()`` keyword arguments.

Torch-free (the CLI builds its choices from these enums before importing torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from modelsize.errors import UsageError


class CacheChoice(str, Enum):
    """``--cache``: which cache ``generate()`` builds (transformers' ``cache_implementation``)."""

    DYNAMIC = "dynamic"
    """``DynamicCache`` (``generate()``'s default): grows by concatenation every step."""
    STATIC = "static"
    """``StaticCache``: every layer allocated at the prompt plus new tokens up front."""
    OFFLOADED = "offloaded"
    """``DynamicCache(offloading=True)``: layers moved to host memory between uses (CUDA)."""
    SLIDING = "sliding"
    """``cache_implementation="sliding_window"``: transformers 5 builds a ``StaticCache``
    whose layers follow the config (sliding layers sized to the window)."""
    QUANTIZED = "quantized"
    """``QuantizedCache``: keys and values stored quantized (``--kv-dtype``, default fp8)."""

    def __str__(self) -> str:
        return self.value


class KvDtype(str, Enum):
    """``--kv-dtype``: the element type of the cached keys and values."""

    AUTO = "auto"
    """The model's dtype (what every transformers cache but the quantized one stores)."""
    FP8 = "fp8"
    """float8_e4m3fn with one scale per tensor: ``QuantizedCache(backend="fp8")``."""
    INT4 = "int4"
    """4-bit groups: ``QuantizedCache(backend="quanto", nbits=4)`` (needs optimum-quanto)."""
    INT2 = "int2"
    """2-bit groups: ``QuantizedCache(backend="quanto", nbits=2)`` (needs optimum-quanto)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GenerateOptions:
    """The ``--generate`` options that become ``generate()`` keyword arguments."""

    cache: CacheChoice = CacheChoice.DYNAMIC
    kv_dtype: KvDtype = KvDtype.AUTO
    beams: int = 1
    prefill_chunk: int | None = None

    def generation(self) -> dict[str, Any]:
        """The keyword arguments ``generate()`` takes for these options."""
        cache, kv = CacheChoice(self.cache), KvDtype(self.kv_dtype)
        out: dict[str, Any] = {}
        if kv is not KvDtype.AUTO and cache not in (CacheChoice.DYNAMIC, CacheChoice.QUANTIZED):
            raise UsageError(f"--kv-dtype {kv} needs the quantized cache (transformers stores "
                             f"the {cache} cache in the model's dtype): use --cache quantized")
        if kv is not KvDtype.AUTO or cache is CacheChoice.QUANTIZED:
            config: dict[str, Any] = {"backend": "fp8"}
            if kv in (KvDtype.INT4, KvDtype.INT2):
                config = {"backend": "quanto", "nbits": 4 if kv is KvDtype.INT4 else 2}
            out["cache_implementation"] = "quantized"
            out["cache_config"] = config
        elif cache is not CacheChoice.DYNAMIC:
            out["cache_implementation"] = {CacheChoice.SLIDING: "sliding_window"}.get(
                cache, cache.value)
        if self.beams < 1:
            raise UsageError(f"--beams must be at least 1, not {self.beams}")
        if self.beams > 1:
            out["num_beams"] = self.beams
        if self.prefill_chunk is not None:
            if self.prefill_chunk < 1:
                raise UsageError(f"--prefill-chunk must be at least 1, not {self.prefill_chunk}")
            out["prefill_chunk_size"] = self.prefill_chunk
        return out
