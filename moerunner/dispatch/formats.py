"""The dispatch formats: frozen records a dispatcher hands to the runner.

Invariants (every producer guarantees them, every consumer may rely on them):

- ``StandardDispatchOutput.topk.ids`` are local expert ids in ``[0, E)`` or -1.
- ``PermutedDispatchOutput``: rows ``expert_offsets[e]:expert_offsets[e+1]`` belong to local
  expert ``e``; ``expert_offsets`` is int64 ``[E+1]``, non-decreasing, starting at 0, on the
  hidden states' device; rows at or past ``expert_offsets[E]`` are padding.
- ``MaskedDispatchOutput``: ``hidden_states[e, :counts[e]]`` are valid rows of expert ``e``;
  the rest of each expert's capacity is padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..routing import TopK

STANDARD = "standard"
PERMUTED = "permuted"
MASKED = "masked"
DISPATCH_FORMATS = (STANDARD, PERMUTED, MASKED)


@dataclass(frozen=True)
class StandardDispatchOutput:
    """All tokens with their routing; the runner returns ``[T, H]`` combined output."""

    format: ClassVar[str] = STANDARD
    hidden_states: torch.Tensor  # [T, H]
    topk: TopK
    #: The ids are not checked yet: a fused op of a backend with ``checks_ids_on_device``
    #: checks them inside its kernels (``device_checks.IdFlags``).
    check_ids: bool = False

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.hidden_states.shape[0]


@dataclass(frozen=True)
class PermutedDispatchOutput:
    """Rows grouped by local expert; the runner returns unweighted expert outputs ``[M, H]``."""

    format: ClassVar[str] = PERMUTED
    hidden_states: torch.Tensor  # [M, H]
    expert_offsets: torch.Tensor  # [E + 1] int64

    @property
    def num_tokens(self) -> int:
        """M (rows, padding included)."""
        return self.hidden_states.shape[0]


@dataclass(frozen=True)
class MaskedDispatchOutput:
    """Fixed capacity per expert; the runner returns unweighted outputs ``[E, C, H]``."""

    format: ClassVar[str] = MASKED
    hidden_states: torch.Tensor  # [E, C, H]
    counts: torch.Tensor  # [E] int32, valid rows per expert

    @property
    def num_tokens(self) -> int:
        """E * C (capacity, padding included)."""
        return self.hidden_states.shape[0] * self.hidden_states.shape[1]
