"""``TopK``: the routing decision, what stage 1 (route) hands to stage 2 (dispatch).

``select_experts`` (``moerunner.routing``) and the triton routing kernel make it; the
dispatchers, the experts' entry points and the backends read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TopK"]


@dataclass(frozen=True)
class TopK:
    """Routing decision. ``ids`` are expert ids (or -1: slot contributes nothing)."""

    # float32 and int32; a fused op with ``routing_dtypes`` may get the caller's dtypes
    # among those it declares (the triton backend's: int64 ids, bf16/fp16 weights).
    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int32

    @property
    def top_k(self) -> int:
        """Slots per token."""
        return self.ids.shape[1]


# A pytree node: ``torch.export`` takes a TopK argument (``MoE(x, topk=...)``) and returns
# one (``select_experts``) as its two tensors; ``torch.load(weights_only=True)`` reads one
# (an exported program saves its example inputs).
torch.export.register_dataclass(TopK, serialized_type_name="moerunner.TopK")
torch.serialization.add_safe_globals([TopK])
