"""What ``torch.utils.flop_counter.FlopCounterMode`` counts for moerunner's custom ops, so a
model's MoE layers enter its FLOP count (a training loop's MFU, a profile's totals) instead
of counting zero: the ops are opaque to the counter, which sees neither their kernels nor
the PyTorch ops of their backward.

The count follows the counter's own rule for ``aten.mm`` (two FLOPs per multiply-add of a
GEMM; elementwise work is not counted) over every (token, slot) pair of ``topk_ids``: the
counter sees shapes, not values, so pairs an expert-parallel rank does not serve (id -1)
count too. Forward: the gate/up GEMM (``H -> N``, N = 2I gated) and the down GEMM
(``I -> H``) per pair, with the LoRA factors' GEMMs where a call has them (``r (K + N)``
per row of a rank-r delta). Backward: per GEMM, its input gradient where anything before it
takes a gradient, its weight gradient where the weight (or its LoRA factors) does. The
backward's recomputation of the forward is not counted, as a model's FLOPs leave out
activation checkpointing's.

PyTorch (2.11-2.13) has no count for ``aten._grouped_mm`` either, the GEMM of the torch
backend's training and grouped paths (and of transformers' own grouped experts): one is
registered here where PyTorch has none, so those calls count too.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

from .ops import _PLAIN_GRADS as PLAIN_GRADS
from .ops import _QUANTIZED_GRADS as QUANTIZED_GRADS

__all__ = ["experts_backward_flops", "experts_flops", "grouped_mm_flops"]


def _gemm(rows: int, k: int, n: int, rank: int) -> int:
    """FLOPs of ``rows`` rows through a ``K -> N`` GEMM plus a rank-``rank`` LoRA delta."""
    return 2 * rows * (k * n + rank * (k + n))


def _rank(factor) -> int:
    return 0 if factor is None else int(factor[2])  # LoRA A factors are [L, E, r, K]


def _dims(args: dict, quantized: bool, transposed: bool) -> tuple[int, int, int, int, int]:
    """Pairs, hidden size, gate/up width, intermediate size and the two LoRA ranks of a call
    (its tensors given as shapes)."""
    if quantized:
        (_, n13, hidden), intermediate = args["w13_shape"], args["w2_shape"][2]
    elif transposed:
        w13, w2 = args.get("w13_t", args.get("w13")), args.get("w2_t", args.get("w2"))
        (_, hidden, n13), intermediate = w13, w2[1]
    else:
        (_, n13, hidden), intermediate = args["w13"], args["w2"][2]
    pairs = math.prod(args["topk_ids"])
    ranks = (_rank(args.get("lora_w13_a")), _rank(args.get("lora_w2_a")))
    return pairs, hidden, n13, intermediate, *ranks


def experts_flops(args: dict, quantized: bool = False, transposed: bool = False) -> int:
    """FLOPs of a forward op's call (``args``: its arguments by name, tensors as shapes)."""
    pairs, hidden, n13, intermediate, r13, r2 = _dims(args, quantized, transposed)
    return _gemm(pairs, hidden, n13, r13) + _gemm(pairs, intermediate, hidden, r2)


def experts_backward_flops(args: dict, quantized: bool = False) -> int:
    """FLOPs of a backward op's call: the gradients its ``needs`` asks for."""
    pairs, hidden, n13, intermediate, r13, r2 = _dims(args, quantized, args.get("transposed"))
    names = QUANTIZED_GRADS if quantized else PLAIN_GRADS
    needs = dict(zip(names, [*args["needs"], *[False] * len(names)], strict=False))
    lora13 = needs.get("lora_w13_a") or needs.get("lora_w13_b")
    lora2 = needs.get("lora_w2_a") or needs.get("lora_w2_b")
    # (only ``hidden_states`` takes the gate/up GEMM's input gradient; the down GEMM's is
    # taken by what lies before it: the hidden states, w13, its bias and its LoRA factors)
    before_down = needs["hidden_states"] or needs.get("w13") or needs["w13_bias"] or lora13
    flops = 0
    if needs["hidden_states"]:
        flops += _gemm(pairs, n13, hidden, r13)
    if before_down:
        flops += _gemm(pairs, hidden, intermediate, r2)
    if needs.get("w13"):
        flops += 2 * pairs * hidden * n13
    if needs.get("w2"):
        flops += 2 * pairs * intermediate * hidden
    # A LoRA factor's gradients: grad x B (shared with the input gradient where that is
    # taken), then A's and B's own products.
    if lora13:
        flops += 2 * pairs * r13 * (hidden + n13)
        if not needs["hidden_states"]:
            flops += 2 * pairs * n13 * r13
    if lora2:
        flops += 2 * pairs * r2 * (intermediate + hidden)
        if not before_down:
            flops += 2 * pairs * hidden * r2
    return flops


def _register(op, count) -> None:
    """Register ``count`` (of the op's arguments by their schema's names; trailing defaults
    may be absent) as the op's FLOP formula."""
    if op in flop_registry:  # (a reloaded module)
        return
    names = [a.name for a in op.default._schema.arguments]

    @register_flop_formula(op)
    def formula(*args, out_shape=None, **kwargs) -> int:
        return count({**dict(zip(names, args, strict=False)), **kwargs})


def grouped_mm_flops(a, b, offs=None, bias=None, out_dtype=None, *, out_shape=None) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)`` (shapes): two per multiply-add summed over
    its groups. ``a [M, K]`` with ``b [G, K, N]``, ``a [M, K_total]`` with ``b [K_total, N]``
    (groups along K) and ``a [G, M, K]`` with ``b [G, K, N]`` multiply each of ``a``'s
    elements by ``N`` columns; ``a [G, M, K]`` with ``b [K, N_total]`` (groups along N) by
    its group's columns alone."""
    if len(a) == 3 and len(b) == 2:
        return 2 * math.prod(a[1:]) * b[1]
    return 2 * math.prod(a) * b[-1]


_OPS = torch.ops.moerunner
_register(_OPS.fused_experts, experts_flops)
_register(_OPS.fused_experts_transposed, lambda a: experts_flops(a, transposed=True))
_register(_OPS.fused_experts_quantized, lambda a: experts_flops(a, quantized=True))
_register(_OPS.fused_experts_backward, experts_backward_flops)
_register(_OPS.fused_experts_quantized_backward, lambda a: experts_backward_flops(a, True))
if torch.ops.aten._grouped_mm not in flop_registry:
    register_flop_formula(torch.ops.aten._grouped_mm)(grouped_mm_flops)
