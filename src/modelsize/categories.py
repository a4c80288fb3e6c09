"""The closed vocabulary of byte categories.

Every byte of a checkpoint lands in exactly one of these, in every format and every output
(text, JSON, API). The order here is the display order.
"""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """Where a byte of a saved model file belongs (a ``StrEnum`` that also runs on 3.10)."""

    WEIGHTS = "weights"
    """Trainable parameters."""
    BUFFERS = "buffers"
    """Non-trainable state inference needs: BatchNorm running stats and the like."""
    OPTIMIZER_STATE = "optimizer_state"
    """Optimizer slots, moments, step counters, param groups."""
    GRADIENTS = "gradients"
    """Saved ``.grad`` tensors and gradient accumulators."""
    ACTIVATIONS = "activations"
    """Cached inputs/outputs of layers (``output``, ``gradInput``, attributes of modules)."""
    UNUSED_STORAGE = "unused_storage"
    """Bytes of a saved storage that no tensor view reaches (``torch.save(big[:10])``)."""
    DUPLICATES = "duplicates"
    """Second and later copies of identical data stored separately."""
    GRAPH = "graph"
    """Model structure: pickled module objects, code, graph definitions."""
    METADATA = "metadata"
    """Headers, pickle framing, zip structures, padding, indexes."""
    OTHER = "other"
    """Anything else."""

    def __str__(self) -> str:
        return self.value


#: When two tensors of different categories view the same bytes, the bytes go to the one that
#: comes first here (a weight that is also cached as an activation is a weight).
PRECEDENCE: tuple[Category, ...] = (
    Category.WEIGHTS,
    Category.BUFFERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATE,
    Category.ACTIVATIONS,
    Category.OTHER,
    Category.GRAPH,
    Category.METADATA,
    Category.DUPLICATES,
    Category.UNUSED_STORAGE,
)

#: Categories whose bytes inference does not need.
NOT_NEEDED_FOR_INFERENCE: frozenset[Category] = frozenset(
    {
        Category.OPTIMIZER_STATE,
        Category.GRADIENTS,
        Category.ACTIVATIONS,
        Category.UNUSED_STORAGE,
        Category.DUPLICATES,
    }
)


def empty_totals() -> dict[Category, int]:
    """A ``{category: 0}`` dict with every category present, in display order."""
    return {c: 0 for c in Category}
