# Stage "experts" of the triton backend: LoRA kernels (private).
#
# The punica / S-LoRA formulation over the rows of the hooked sequence. Row r computes with
# the factor pair p(r) = adapter * E + expert of its expert and its token's adapter (none
# when either is -1 or the expert is past the adapters' E):
#   t[r, :] = A[p(r)] @ x[r // a_row_div]                 (shrink, float32)
#   out[r, :] += scale(adapter) * B[p(r)] @ t[r, :]       (expand)
# Two row layouts:
#   row blocks (decode, ``lora_rows_kernel``): one launch. Program (r, g) takes row r alone,
#     derives its pair from the row's expert and token (``_row_pair``, no launch before it;
#     the token read from a row array, or r // rows_per_token for (token, slot) rows),
#     computes all of t[r] (rank values: cheap, so each of the row's N groups recomputes it
#     rather than a second launch reading it back) and the expand of its N group's blocks,
#     added to ``out`` (the hooked sequence) or stored as they are, zero for rows without a
#     pair (the fused sequence, whose GEMMs add them). The products are float32 FMAs over
#     [RANK, BLOCK_K] / [BLOCK_N, RANK] factor tiles: memory-bound on the factors. At
#     decode every launch costs about as much device time as the work, hence one launch,
#     not a shrink and an expand.
#   grouped (prefill, ``lora_shrink_kernel`` then ``lora_expand_kernel``): ``sorted_rows`` /
#     ``block_pair`` from ``_align.align_rows`` over the pair ids (``pair_ids_kernel``): every
#     BLOCK_M block shares one pair, so a program reads its factors once and multiplies with
#     ``tl.dot``.
# The rank is padded to RANK (a power of two >= 16) with masked loads. Rows without a pair
# are left untouched (and are skipped before any factor load).

from __future__ import annotations

import triton
import triton.language as tl

from . import _pdl


@triton.jit
def _row_pair(
    row,
    expert_ptr,
    token_ptr,
    adapter_ptr,
    num_experts,
    num_tokens,
    rows_per_token,
    ROW_TOKENS: tl.constexpr,
):
    """(adapter, expert, valid) of row ``row``: its expert, its token's adapter id (-1: none,
    also for a row without a token or one past the ``num_tokens`` adapter ids). The token:
    ``row // rows_per_token`` (ROW_TOKENS: (token, slot) rows), else ``token_ptr[row]``."""
    expert = tl.load(expert_ptr + row).to(tl.int64)
    if ROW_TOKENS:
        token = (row // rows_per_token).to(tl.int64)
    else:
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
        safe, expert_ptr, token_ptr, adapter_ptr, num_experts, num_tokens, 1, False
    )
    pair = tl.where(valid, adapter * num_experts + expert, -1)
    tl.store(pair_ptr + rows, pair.to(tl.int32), mask=inside)


@triton.jit
def _block_rows(
    pid_m,
    sorted_rows_ptr,
    block_pair_ptr,
    num_padded_ptr,
    num_rows,
    num_experts,
    BLOCK_M: tl.constexpr,
):
    """(rows [BLOCK_M] with the sentinel ``num_rows`` for none, adapter, expert, valid) of
    grouped block ``pid_m``."""
    valid = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    pair = tl.load(block_pair_ptr + pid_m, mask=valid, other=0).to(tl.int64)
    rows = tl.load(
        sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M), mask=valid, other=num_rows
    )
    return rows.to(tl.int64), pair // num_experts, pair % num_experts, valid


@triton.jit
def _scale(scales_ptr, scale_value, adapter, HAS_SCALES: tl.constexpr):
    """The adapter's scale: ``scales[adapter]`` (HAS_SCALES) or ``scale_value``."""
    if HAS_SCALES:
        scale = tl.load(scales_ptr + adapter).to(tl.float32)
    else:
        scale = scale_value
    return scale


@triton.jit
def lora_rows_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    scales_ptr,
    scale_value,
    expert_ptr,
    token_ptr,
    adapter_ptr,
    K,
    N,
    rank,
    num_experts,
    num_tokens,
    a_row_div,
    rows_per_token,
    n_blocks_per_program,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    ROW_TOKENS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row blocks, shrink and expand in one: out[r, N group ``program_id(1)``] +=
    scale * B[p(r)] @ (A[p(r)] @ x[r // a_row_div]) for row r = ``program_id(0)``; the
    group is ``n_blocks_per_program`` BLOCK_N-wide blocks of N. Without ACCUMULATE ``out``
    is set to the delta instead (0 for a row without a pair). ROW_TOKENS: ``_row_pair``."""
    _pdl.enter(PDL)
    row = tl.program_id(0)
    group = tl.program_id(1)
    adapter, expert, valid = _row_pair(
        row, expert_ptr, token_ptr, adapter_ptr, num_experts, num_tokens, rows_per_token,
        ROW_TOKENS,
    )  # fmt: skip
    o_row = out_ptr + row.to(tl.int64) * stride_om
    if valid == 0:  # no pair: the row is left as it is, or its delta is 0
        if not ACCUMULATE:
            for j in range(n_blocks_per_program):
                n_offs = (group * n_blocks_per_program + j) * BLOCK_N + tl.arange(0, BLOCK_N)
                zero = tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty)
                tl.store(o_row + n_offs * stride_on, zero, mask=n_offs < N)
        return
    r_offs = tl.arange(0, RANK)
    r_in = r_offs < rank
    a_base = a_ptr + adapter * stride_al + expert * stride_ae + r_offs[:, None] * stride_ar
    x_row = x_ptr + (row // a_row_div).to(tl.int64) * stride_xm
    t = tl.zeros((RANK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_in = k_offs < K
        x = tl.load(x_row + k_offs * stride_xk, mask=k_in, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + k_offs[None, :] * stride_ak, mask=r_in[:, None] & k_in[None, :], other=0.0
        )
        t += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    scale = _scale(scales_ptr, scale_value, adapter, HAS_SCALES)
    b_base = b_ptr + adapter * stride_bl + expert * stride_be + r_offs[None, :] * stride_br
    for j in range(n_blocks_per_program):
        n_offs = (group * n_blocks_per_program + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = n_offs < N
        b = tl.load(
            b_base + n_offs[:, None] * stride_bn, mask=n_in[:, None] & r_in[None, :], other=0.0
        )
        d = tl.sum(b.to(tl.float32) * t[None, :], axis=1) * scale
        o_ptrs = o_row + n_offs * stride_on
        if ACCUMULATE:
            d += tl.load(o_ptrs, mask=n_in, other=0.0)
        tl.store(o_ptrs, d, mask=n_in)


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    sorted_rows_ptr,
    block_pair_ptr,
    num_padded_ptr,
    K,
    rank,
    num_rows,
    num_experts,
    a_row_div,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_tm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grouped: t[r] for the rows of block ``program_id(0)``. DOT_DTYPE: the type both
    operands meet in for ``tl.dot``; IEEE: float32 products without TF32."""
    _pdl.enter(PDL)
    rows, adapter, expert, valid = _block_rows(
        tl.program_id(0), sorted_rows_ptr, block_pair_ptr, num_padded_ptr, num_rows,
        num_experts, BLOCK_M,
    )  # fmt: skip
    if valid == 0:  # an unused block
        return
    r_offs = tl.arange(0, RANK)
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
    sorted_rows_ptr,
    block_pair_ptr,
    num_padded_ptr,
    N,
    rank,
    num_rows,
    num_experts,
    stride_tm,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grouped: out[r, N block ``program_id(1)``] += scale * B[p(r)] @ t[r] for the rows of
    block ``program_id(0)``; t meets B in DOT_DTYPE (B's own type, or float32 with IEEE)."""
    _pdl.enter(PDL)
    rows, adapter, expert, valid = _block_rows(
        tl.program_id(0), sorted_rows_ptr, block_pair_ptr, num_padded_ptr, num_rows,
        num_experts, BLOCK_M,
    )  # fmt: skip
    if valid == 0:  # an unused block
        return
    scale = _scale(scales_ptr, scale_value, adapter, HAS_SCALES)
    r_offs = tl.arange(0, RANK)
    n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < num_rows
    safe_rows = tl.where(in_rows, rows, 0)
    t = tl.load(t_ptr + safe_rows[:, None] * stride_tm + r_offs[None, :])
    b_mask = (r_offs[:, None] < rank) & (n_offs[None, :] < N)
    b_t = tl.load(  # [RANK, BLOCK_N]: B transposed
        b_ptr
        + adapter * stride_bl
        + expert * stride_be
        + r_offs[:, None] * stride_br
        + n_offs[None, :] * stride_bn,
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
