"""``torch.library`` custom op so MoE layers compile with ``torch.compile(fullgraph=True)``.

The op wraps ``fused_moe`` for plain (unquantized) weights; its fake implementation only
describes the output (``[T, H]`` in the hidden dtype), so the compiler never traces into the
backends' data-dependent code (host reads of expert offsets, Triton launches).
"""

from __future__ import annotations

import torch

from .api import fused_moe


@torch.library.custom_op("moerunner::fused_experts", mutates_args=())
def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    backend: str,
    check_ids: bool = True,
) -> torch.Tensor:
    """``fused_moe`` as an opaque graph node (same arguments, positional)."""
    out = fused_moe(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        gate_up_interleaved=gate_up_interleaved,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        backend=backend,
        check_ids=check_ids,
    )
    return out if out.numel() else out.clone()


@fused_experts.register_fake
def _fused_experts_fake(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    w13_bias,
    w2_bias,
    activation,
    swiglu_alpha,
    swiglu_limit,
    gate_up_interleaved,
    backend,
    check_ids=True,
):
    return hidden_states.new_empty(hidden_states.shape)  # row-major, as every backend returns
