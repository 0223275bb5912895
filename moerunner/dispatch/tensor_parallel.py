"""Tensor parallelism of the experts: each rank holds a slice of every expert's I.

Stage 3 input (weights), used with the ``standard`` dispatcher: every rank computes all of
its tokens on its slice of I, and ``StandardDispatcher.combine`` sums the partial outputs
with an all-reduce. Because ``act(gate) * up`` is elementwise in I and GEMM2 sums over I,
the sum of the slices equals the unsharded expert exactly (up to accumulation order).

When a slice is not a multiple of ``align`` (16 by default, what grouped-GEMM kernels need;
e.g. I = 7688 over 8 ranks gives 961), each slice is zero-padded at its end: the gate and up
halves of ``w13`` separately (so the kernel's split into halves stays aligned), the matching
columns of ``w2``, and the biases. Padded rows produce ``act(0) * 0 = 0`` (or
``relu(0)^2 = 0``), and padded ``w2`` columns are zero, so padding adds nothing. ``w2_bias``
is kept on rank 0 only (zeros elsewhere), so the all-reduce adds it once.
"""

from __future__ import annotations

import torch

from ..config import Activation
from ..errors import MoeInputError
from ..weights import ExpertWeights, is_quantized

__all__ = ["intermediate_shard", "shard_intermediate"]


def intermediate_shard(intermediate_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(start, length) of ``tp_rank``'s slice of I: the first ``I % tp`` slices get one more."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise MoeInputError(f"tp_size must be a positive int, got {tp_size!r}")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise MoeInputError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank!r}")
    if intermediate_size < tp_size:
        raise MoeInputError(
            f"intermediate_size={intermediate_size} cannot be split over tp_size={tp_size} ranks"
        )
    base, extra = divmod(intermediate_size, tp_size)
    return tp_rank * base + min(tp_rank, extra), base + (1 if tp_rank < extra else 0)


def _pad_rows(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    missing = rows - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def shard_intermediate(
    weights: ExpertWeights,
    activation: Activation | str,
    tp_rank: int,
    tp_size: int,
    align: int = 16,
) -> ExpertWeights:
    """``tp_rank``'s slice of every expert's I, zero-padded to a multiple of ``align``.

    All ranks get the same padded size (``align``-rounded largest slice), so their weights
    have one shape. Plain (bf16/fp16/fp32) weights only.
    """
    act = Activation.of(activation)
    weights.validate(act)
    if is_quantized(weights.w13):
        raise TypeError("shard_intermediate takes plain weights; shard before quantizing")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise MoeInputError(f"align must be a positive int, got {align!r}")
    size = weights.intermediate_size(act)
    start, length = intermediate_shard(size, tp_rank, tp_size)
    longest = intermediate_shard(size, 0, tp_size)[1]
    padded = -(-longest // align) * align

    def rows13(t: torch.Tensor) -> torch.Tensor:  # slices dim 1 of w13 [E, N, H] / bias [E, N]
        if not act.gated:
            return _pad_rows(t[:, start : start + length], padded, 1)
        if weights.gate_up_interleaved:  # rows 2j, 2j+1 = gate j, up j: pairs stay together
            return _pad_rows(t[:, 2 * start : 2 * (start + length)], 2 * padded, 1)
        gate = _pad_rows(t[:, start : start + length], padded, 1)
        up = _pad_rows(t[:, size + start : size + start + length], padded, 1)
        return torch.cat([gate, up], dim=1)

    w2 = _pad_rows(weights.w2[:, :, start : start + length], padded, 2)
    w13_bias = None if weights.w13_bias is None else rows13(weights.w13_bias)
    w2_bias = weights.w2_bias
    if w2_bias is not None and tp_rank != 0:
        w2_bias = torch.zeros_like(w2_bias)
    return ExpertWeights(
        rows13(weights.w13).contiguous(),
        w2.contiguous(),
        w13_bias,
        w2_bias,
        w13_order=weights.w13_order,
    )
