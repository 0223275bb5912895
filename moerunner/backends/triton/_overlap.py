# How a GEMM launch of the triton backend overlaps the launch before it (private).
#
# Under programmatic dependent launch (``_pdl``) a GEMM's programs may start while the launch
# before it still runs; two things put that time to use (``moe_gemm_kernel``'s docstring has
# the kernel side):
# - Streaming (``TritonOptions.stream_gemms``): GEMM1 counts each finished tile per block of
#   rows (STREAM_PUBLISH) and GEMM2 waits per block for that count (STREAM_CONSUME,
#   ``await_block``) instead of for all of GEMM1.
# - The early L2 prefetch (``TritonOptions.early_prefetch_steps``): fragment-layout programs
#   ask L2 for their first K steps before they wait, finding their tile's expert in the row
#   layout (EARLY_FROM_BLOCKS) or computing it from the row ids while the alignment runs
#   (EARLY_FROM_IDS, ``block_expert_from_ids``).
# Both only where ``TritonOptions.overlap_max_tokens`` allows; the sequence decides where
# (``experts.run_kernel_sequence``), the helpers below what each launch gets.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import multiprocessors
from .options import TritonOptions

# Where a GEMM's early L2 prefetch finds its tile's expert (constexpr EARLY).
EARLY_NONE, EARLY_FROM_BLOCKS, EARLY_FROM_IDS = 0, 1, 2
_EARLY_NONE = tl.constexpr(EARLY_NONE)
_EARLY_FROM_IDS = tl.constexpr(EARLY_FROM_IDS)
# GEMM1 -> GEMM2 streaming per block (constexpr STREAM).
STREAM_NONE, STREAM_PUBLISH, STREAM_CONSUME = 0, 1, 2
_STREAM_PUBLISH = tl.constexpr(STREAM_PUBLISH)
_STREAM_CONSUME = tl.constexpr(STREAM_CONSUME)


@triton.jit
def await_block(count_ptr, producers, consumers):
    """Wait until ``producers`` tiles of GEMM1 counted this block done (acquire: their stores
    are visible after it), then count this tile in; the last of the block's ``consumers``
    tiles to do so resets the count for the next call."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    while seen < producers:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    if tl.atomic_add(count_ptr, 1, sem="relaxed") == producers + consumers - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")


@triton.jit
def block_expert_from_ids(
    ids_ptr,
    num_rows,
    num_experts,
    pid_m,
    BLOCK_M: tl.constexpr,
    IDS_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """The expert that the alignment (``_align``) gives block ``pid_m`` (-1: none), computed
    from the ``num_rows`` row ids: experts in ascending order, each padded to whole blocks."""
    offs = tl.arange(0, IDS_POW2)
    ids = tl.load(ids_ptr + offs, mask=offs < num_rows, other=-1)
    experts = tl.arange(0, E_POW2)
    hit = (ids[:, None] == experts[None, :]) & (experts < num_experts)[None, :]
    counts = tl.sum(hit.to(tl.int32), axis=0)
    ends = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0)
    expert = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    return tl.where(pid_m < tl.max(ends, axis=0), expert, -1)


# GEMM1's early prefetch computes its blocks' experts from the row ids in a [rows, experts]
# one-hot per program (``block_expert_from_ids``): only while that stays small.
EARLY_IDS_MAX_ELEMENTS = 32768
# Programs per SM that may start while the launch before is still running and so prefetch
# (later ones start after it has finished, when a prefetch gains nothing).
EARLY_PROGRAMS_PER_SM = 4


def early_programs(device: torch.device) -> int:
    return EARLY_PROGRAMS_PER_SM * multiprocessors(device)


def early_prefetch(
    early: int, k_steps: int, num_experts: int, num_rows: int, options: TritonOptions
) -> tuple[int, int, int, int]:
    """(EARLY, EARLY_STEPS, IDS_POW2, E_POW2) of a fragment-layout GEMM launch asked for
    ``early`` on weights of ``k_steps`` K steps: off unless ``options.early_prefetch_steps``
    is set; steps a power of two within K; EARLY_FROM_IDS only while its one-hot of rows x
    experts stays within ``EARLY_IDS_MAX_ELEMENTS``."""
    steps = min(options.early_prefetch_steps, k_steps)
    if early == EARLY_NONE or steps < 1:
        return EARLY_NONE, 1, 1, 1
    steps = 1 << (steps.bit_length() - 1)
    if early == EARLY_FROM_IDS:
        ids_pow2 = triton.next_power_of_2(max(num_rows, 1))
        e_pow2 = triton.next_power_of_2(num_experts)
        if ids_pow2 * e_pow2 > EARLY_IDS_MAX_ELEMENTS:
            return EARLY_NONE, 1, 1, 1
        return early, steps, ids_pow2, e_pow2
    return early, steps, 1, 1


def gemm1_early(prealigned: bool, row_blocks: bool, quantized: bool, deltas) -> int:
    """Where GEMM1's early prefetch finds its tiles' experts: the row layout, if an input
    quantization launch came between it and GEMM1; else the row ids, when this call's
    alignment is the launch right before GEMM1 (not the caller's launch, not row blocks
    whose ids the launch before may have written, no delta launch between)."""
    if prealigned or row_blocks or deltas is not None:
        return EARLY_NONE
    return EARLY_FROM_BLOCKS if quantized else EARLY_FROM_IDS
