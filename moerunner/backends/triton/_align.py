# Stage "experts", step 1 of the triton kernel sequence: expert alignment (private).
#
# Input: one expert id per row (``-1``: the row contributes nothing). Output, all on the
# device with no host synchronisation (so a call is CUDA-graph capturable):
#   sorted_rows  [max_padded] int32  row ids grouped by expert, each expert's segment padded
#                                    to a multiple of BLOCK_M with the sentinel ``num_rows``
#   block_expert [max_padded / BLOCK_M] int32  expert of each BLOCK_M block
#   num_padded   [1] int32            used length of sorted_rows
# Within an expert, rows keep ascending order, so the Triton kernel (one program, for decode
# sizes) and its PyTorch twin (any size) produce identical results.

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Above this many rows the single-program kernel is slower than the PyTorch twin's sort.
SINGLE_PROGRAM_MAX_ROWS = 2048


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of ``num_padded``: at most min(E, rows) segments, each padded < BLOCK_M."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _align_kernel(
    ids_ptr, sorted_rows_ptr, block_expert_ptr, num_padded_ptr,
    num_rows, num_experts,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
):
    """One program: count per expert, prefix-sum padded counts, fill, scatter row ids."""
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_rows, other=-1)
        onehot = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(
            tl.int32)
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # Expert of each used block: the number of segments that end at or before its start.
    for b0 in range(0, total // BLOCK_M, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < num_experts)
        tl.store(block_expert_ptr + blocks, tl.sum(ended.to(tl.int32), axis=1),
                 mask=blocks * BLOCK_M < total)
    for p0 in range(0, total, FILL):
        offs = p0 + tl.arange(0, FILL)
        tl.store(sorted_rows_ptr + offs, tl.full((FILL,), 0, tl.int32) + num_rows,
                 mask=offs < total)
    tl.debug_barrier()  # the fill above must land before the scatter below
    running = starts
    for start in range(0, num_rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_rows, other=-1)
        onehot = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(
            tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier rows of the same expert
        dest = tl.sum(onehot * (before + running[None, :]), axis=1)
        valid = (ids >= 0) & (ids < num_experts) & (offs < num_rows)
        tl.store(sorted_rows_ptr + dest, offs.to(tl.int32), mask=valid)
        running += tl.sum(onehot, axis=0)


def align_rows_torch(row_expert: torch.Tensor, num_experts: int, block_m: int,
                     sorted_rows: torch.Tensor, block_expert: torch.Tensor,
                     num_padded: torch.Tensor) -> None:
    """PyTorch twin of the alignment kernel (same outputs); sort based, no host sync."""
    num_rows = row_expert.shape[0]
    device = row_expert.device
    valid = (row_expert >= 0) & (row_expert < num_experts)
    key = torch.where(valid, row_expert.long(), num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    padded_starts = torch.cat((zero, torch.cumsum(padded, 0)))
    starts = torch.cat((zero, torch.cumsum(counts, 0)))
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(num_rows, device=device) - starts[sorted_key]
    dest = padded_starts[sorted_key.clamp(max=num_experts - 1)] + rank
    capacity = sorted_rows.shape[0]
    dest = torch.where(sorted_key < num_experts, dest, capacity)
    scratch = torch.full((capacity + 1,), num_rows, dtype=torch.int32, device=device)
    scratch.scatter_(0, dest, order.to(torch.int32))
    sorted_rows.copy_(scratch[:capacity])
    block_starts = torch.arange(block_expert.shape[0], device=device) * block_m
    block_expert.copy_(torch.searchsorted(padded_starts[1:], block_starts, right=True))
    num_padded.copy_(padded_starts[num_experts:])


def align_rows(row_expert: torch.Tensor, num_experts: int, block_m: int,
               sorted_rows: torch.Tensor, block_expert: torch.Tensor,
               num_padded: torch.Tensor) -> None:
    """Fill the alignment outputs for ``row_expert`` (int32 [rows]); picks kernel or twin."""
    num_rows = row_expert.shape[0]
    if num_rows > SINGLE_PROGRAM_MAX_ROWS:
        align_rows_torch(row_expert, num_experts, block_m, sorted_rows, block_expert, num_padded)
        return
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, min(64, 8192 // e_pow2))
    _align_kernel[(1,)](
        row_expert, sorted_rows, block_expert, num_padded, num_rows, num_experts,
        BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, FILL=1024, num_warps=4,
    )


@triton.jit
def _topk_sum_kernel(
    src_ptr, ids_ptr, out_ptr, H, stride_sm, stride_om,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum over slots j with ids[t, j] >= 0 of src[t * TOP_K + j] (float32 sum)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        row = src_ptr + (t * TOP_K + j) * stride_sm
        acc += tl.load(row + offs, mask=mask & (e >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def topk_sum(src_PH: torch.Tensor, ids_TK: torch.Tensor, out_TH: torch.Tensor) -> None:
    """Reduce the k weighted expert outputs of each token; slots with id -1 are skipped."""
    num_tokens, top_k = ids_TK.shape
    hidden = out_TH.shape[1]
    block_h = min(1024, triton.next_power_of_2(hidden))
    _topk_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        src_PH, ids_TK, out_TH, hidden, src_PH.stride(0), out_TH.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
    )
