"""Stage 2 and 4, dispatch and combine: the layouts tokens travel in to the expert runner.

Each dispatcher returns a frozen ``DispatchOutput`` of a declared format; only its own
``combine`` reads the metadata it records. Formats:

- ``standard``: ``[T, H]`` hidden states plus ``TopK`` (local ids or -1);
- ``permuted``: rows grouped by local expert with per-expert offsets (all-to-all receive side);
- ``masked``: ``[E, C, H]`` fixed capacity per expert plus valid counts (CUDA-graph decode).
"""

from .formats import (
    DISPATCH_FORMATS,
    MaskedDispatchOutput,
    PermutedDispatchOutput,
    StandardDispatchOutput,
)
from .standard import StandardDispatcher

__all__ = [
    "DISPATCH_FORMATS",
    "MaskedDispatchOutput",
    "PermutedDispatchOutput",
    "StandardDispatchOutput",
    "StandardDispatcher",
]
