# Stage "experts" of the triton backend: LoRA shrink and expand kernels (private).
#
# The punica / S-LoRA formulation over the rows of the hooked sequence. Row r computes with
# the factor pair p(r) = adapter * E + expert of its expert and its token's adapter (none
# when either is -1 or the expert is past the adapters' E):
#   shrink: t[r, s, :] = A[p(r)][:, K split s] @ x[r // a_row_div, K split s]   (float32)
#   expand: out[r, :] += scale(adapter) * B[p(r)] @ sum_s t[r, s, :]
# Two row layouts (constexpr ROW_BLOCKS):
#   row blocks (decode): block i is row i alone; its pair is derived in the kernel from the
#     row's expert and token (``_row_pair``), so no launch precedes the shrink. The products
#     are float32 FMAs over a [RANK, BLOCK_K] / [BLOCK_N, RANK] factor tile: memory-bound on
#     the factors, spread over K splits (shrink) and N blocks (expand).
#   grouped (prefill): ``sorted_rows`` / ``block_pair`` from ``_align.align_rows`` over the
#     pair ids (``pair_ids_kernel``): every BLOCK_M block shares one pair, so a program reads
#     its factors once and multiplies with ``tl.dot``. The rank is padded to RANK (a power of
#     two >= 16) with masked loads.
# Rows without a pair are left untouched (and are skipped before any factor load).

from __future__ import annotations

import triton
import triton.language as tl

from . import _pdl


@triton.jit
def _row_pair(row, expert_ptr, token_ptr, adapter_ptr, num_experts, num_tokens):
    """(adapter, expert, valid) of row ``row``: its expert, its token's adapter id (-1: none,
    also for a row without a token or one past the ``num_tokens`` adapter ids)."""
    expert = tl.load(expert_ptr + row).to(tl.int64)
    token = tl.load(token_ptr + row).to(tl.int64)
    has_id = (token >= 0) & (token < num_tokens)
    adapter = tl.load(adapter_ptr + tl.where(has_id, token, 0), mask=has_id, other=-1)
    adapter = adapter.to(tl.int64)
    valid = (adapter >= 0) & (expert >= 0) & (expert < num_experts)
    return adapter, expert, valid


@triton.jit
def pair_ids_kernel(
    expert_ptr,
    token_ptr,
    adapter_ptr,
    pair_ptr,
    num_rows,
    num_experts,
    num_tokens,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """pair[r] = adapter * E + expert of row r (int32; -1 without a pair)."""
    _pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < num_rows
    safe = tl.where(inside, rows, 0)
    adapter, expert, valid = _row_pair(
        safe, expert_ptr, token_ptr, adapter_ptr, num_experts, num_tokens
    )
    pair = tl.where(valid, adapter * num_experts + expert, -1)
    tl.store(pair_ptr + rows, pair.to(tl.int32), mask=inside)


@triton.jit
def _block_rows(
    pid_m,
    expert_ptr,
    token_ptr,
    adapter_ptr,
    sorted_rows_ptr,
    block_pair_ptr,
    num_padded_ptr,
    num_rows,
    num_experts,
    num_tokens,
    BLOCK_M: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
):
    """(rows [BLOCK_M] with the sentinel ``num_rows`` for none, adapter, expert, valid) of
    block ``pid_m``; with ROW_BLOCKS, row ``pid_m`` in the first slot."""
    if ROW_BLOCKS:
        adapter, expert, valid = _row_pair(
            pid_m, expert_ptr, token_ptr, adapter_ptr, num_experts, num_tokens
        )
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_rows)
    else:
        valid = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        pair = tl.load(block_pair_ptr + pid_m, mask=valid, other=0).to(tl.int64)
        adapter = pair // num_experts
        expert = pair % num_experts
        rows = tl.load(
            sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M), mask=valid, other=num_rows
        )
    return rows.to(tl.int64), adapter, expert, valid


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    expert_ptr,
    token_ptr,
    adapter_ptr,
    sorted_rows_ptr,
    block_pair_ptr,
    num_padded_ptr,
    K,
    rank,
    num_rows,
    num_experts,
    num_tokens,
    a_row_div,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_tm,
    stride_ts,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANK: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """t[r, s] for the rows of block ``program_id(0)`` and the K split ``program_id(1)``
    (BLOCK_K wide with ROW_BLOCKS, all of K otherwise). DOT_DTYPE: the type both operands
    meet in for ``tl.dot`` (grouped); IEEE: float32 products without TF32."""
    _pdl.enter(PDL)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows, adapter, expert, valid = _block_rows(
        pid_m, expert_ptr, token_ptr, adapter_ptr, sorted_rows_ptr, block_pair_ptr,
        num_padded_ptr, num_rows, num_experts, num_tokens, BLOCK_M, ROW_BLOCKS,
    )  # fmt: skip
    if valid == 0:  # no pair: the row (or the unused block) is left as it is
        return
    r_offs = tl.arange(0, RANK)
    a_base = a_ptr + adapter * stride_al + expert * stride_ae + r_offs[:, None] * stride_ar
    if ROW_BLOCKS:
        k_offs = split * BLOCK_K + tl.arange(0, BLOCK_K)
        x_row = x_ptr + (pid_m // a_row_div).to(tl.int64) * stride_xm
        x = tl.load(x_row + k_offs * stride_xk, mask=k_offs < K, other=0.0).to(tl.float32)
        a_mask = (r_offs[:, None] < rank) & (k_offs[None, :] < K)
        a = tl.load(a_base + k_offs[None, :] * stride_ak, mask=a_mask, other=0.0)
        t = tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        tl.store(t_ptr + pid_m * stride_tm + split * stride_ts + r_offs, t)
    else:
        in_rows = rows < num_rows
        x_rows = x_ptr + (tl.where(in_rows, rows, 0) // a_row_div) * stride_xm
        acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            x_mask = in_rows[:, None] & (k_offs[None, :] < K)
            x = tl.load(x_rows[:, None] + k_offs[None, :] * stride_xk, mask=x_mask, other=0.0)
            a_mask = (r_offs[None, :] < rank) & (k_offs[:, None] < K)
            a_t = tl.load(  # [BLOCK_K, RANK]: A transposed
                a_ptr
                + adapter * stride_al
                + expert * stride_ae
                + r_offs[None, :] * stride_ar
                + k_offs[:, None] * stride_ak,
                mask=a_mask,
                other=0.0,
            )
            if IEEE:
                acc = tl.dot(x.to(DOT_DTYPE), a_t.to(DOT_DTYPE), acc, input_precision="ieee")
            else:
                acc = tl.dot(x.to(DOT_DTYPE), a_t.to(DOT_DTYPE), acc)
        t_ptrs = t_ptr + rows[:, None] * stride_tm + r_offs[None, :]
        tl.store(t_ptrs, acc, mask=in_rows[:, None])


@triton.jit
def lora_expand_kernel(
    t_ptr,
    b_ptr,
    out_ptr,
    scales_ptr,
    scale_value,
    expert_ptr,
    token_ptr,
    adapter_ptr,
    sorted_rows_ptr,
    block_pair_ptr,
    num_padded_ptr,
    N,
    rank,
    num_rows,
    num_experts,
    num_tokens,
    stride_tm,
    stride_ts,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    SPLITS: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[r, N block ``program_id(1)``] += scale * B[p(r)] @ t[r] for the rows of block
    ``program_id(0)``. The scale is ``scales[adapter]`` (HAS_SCALES) or ``scale_value``.
    Grouped: t meets B in DOT_DTYPE (B's own type, or float32 with IEEE)."""
    _pdl.enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows, adapter, expert, valid = _block_rows(
        pid_m, expert_ptr, token_ptr, adapter_ptr, sorted_rows_ptr, block_pair_ptr,
        num_padded_ptr, num_rows, num_experts, num_tokens, BLOCK_M, ROW_BLOCKS,
    )  # fmt: skip
    if valid == 0:  # no pair: the row (or the unused block) is left as it is
        return
    if HAS_SCALES:
        scale = tl.load(scales_ptr + adapter).to(tl.float32)
    else:
        scale = scale_value
    r_offs = tl.arange(0, RANK)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    b_base = b_ptr + adapter * stride_bl + expert * stride_be
    if ROW_BLOCKS:
        t = tl.zeros((RANK,), dtype=tl.float32)
        for s in range(SPLITS):
            t += tl.load(t_ptr + pid_m * stride_tm + s * stride_ts + r_offs)
        b_mask = (n_offs[:, None] < N) & (r_offs[None, :] < rank)
        b = tl.load(
            b_base + n_offs[:, None] * stride_bn + r_offs[None, :] * stride_br,
            mask=b_mask,
            other=0.0,
        )
        d = tl.sum(b.to(tl.float32) * t[None, :], axis=1) * scale
        o_ptrs = out_ptr + pid_m * stride_om + n_offs * stride_on
        n_in = n_offs < N
        tl.store(o_ptrs, tl.load(o_ptrs, mask=n_in, other=0.0) + d, mask=n_in)
    else:
        in_rows = rows < num_rows
        safe_rows = tl.where(in_rows, rows, 0)
        t = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
        for s in range(SPLITS):
            t += tl.load(t_ptr + safe_rows[:, None] * stride_tm + s * stride_ts + r_offs[None, :])
        b_mask = (r_offs[:, None] < rank) & (n_offs[None, :] < N)
        b_t = tl.load(  # [RANK, BLOCK_N]: B transposed
            b_base + r_offs[:, None] * stride_br + n_offs[None, :] * stride_bn,
            mask=b_mask,
            other=0.0,
        )
        if IEEE:
            d = tl.dot(t.to(DOT_DTYPE), b_t.to(DOT_DTYPE), input_precision="ieee")
        else:
            d = tl.dot(t.to(DOT_DTYPE), b_t.to(DOT_DTYPE))
        o_ptrs = out_ptr + safe_rows[:, None] * stride_om + n_offs[None, :] * stride_on
        o_mask = in_rows[:, None] & (n_offs[None, :] < N)
        tl.store(o_ptrs, tl.load(o_ptrs, mask=o_mask, other=0.0) + d * scale, mask=o_mask)
