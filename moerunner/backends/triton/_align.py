# Stage "experts", step 1 of the triton kernel sequence: expert alignment (private).
#
# Input: one expert id per row (``-1``: the row contributes nothing). Output, all on the
# device with no host synchronisation (so a call is CUDA-graph capturable):
#   sorted_rows  [max_padded] int32  row ids grouped by expert, each expert's segment padded
#                                    to a multiple of BLOCK_M with the sentinel ``num_rows``
#   block_expert [max_padded / BLOCK_M] int32  expert of each BLOCK_M block
#   num_padded   [1] int32            used length of sorted_rows
# Within an expert, rows keep ascending order: the one-program path (decode sizes) and the
# multi-program path (count per block of rows, scan, scatter) give identical results.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch, _pdl
from ._launch import cdiv as _cdiv
from ._launch import next_power_of_2 as _pow2
from .options import TritonOptions

# Up to this many rows one program aligns everything (one launch: decode); above it the
# work is spread over programs of ROWS_PER_PROGRAM rows each (three launches, all on device).
SINGLE_PROGRAM_MAX_ROWS = 2048
ROWS_PER_PROGRAM = 1024
# The most experts the alignment takes: the multi-program path's [16, E_POW2] one-hot tiles stay
# within Triton's largest tensor (2**20 elements), the one-program path's (expert, row) keys
# within int32. The backend declares it (``TritonBackend.supports``).
MAX_EXPERTS = 2**16


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of ``num_padded``: at most min(E, rows) segments, each padded < BLOCK_M."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return _cdiv(bound, block_m) * block_m


def _e_pow2(num_experts: int) -> int:
    return max(16, _pow2(num_experts))


def _chunk(e_pow2: int) -> int:
    """Rows per step of the count and scatter loops ([CHUNK, E_POW2] one-hot tiles)."""
    return max(16, min(64, 8192 // e_pow2))


def one_program_constants(num_experts: int, block_m: int, num_rows: int) -> dict:
    """The constexprs of ``align_in_program`` for ``num_experts``, ``block_m`` and up to
    ``num_rows`` rows."""
    rows_pow2 = max(16, _pow2(num_rows))
    return dict(BLOCK_M=block_m, E_POW2=_e_pow2(num_experts), ROWS_POW2=rows_pow2, FILL=1024)


def scratch_size(num_rows: int, num_experts: int, rows_per_program: int = ROWS_PER_PROGRAM) -> int:
    """int32 elements of the scratch that the multi-program alignment needs (0: none)."""
    if num_rows <= SINGLE_PROGRAM_MAX_ROWS:
        return 0
    return _multi_scratch_size(num_rows, num_experts, rows_per_program)


def _multi_scratch_size(num_rows: int, num_experts: int, rows_per_program: int) -> int:
    return (_cdiv(num_rows, rows_per_program) + 2) * _e_pow2(num_experts)


@triton.jit
def _onehot(ids_ptr, start, row_end, num_experts, CHUNK: tl.constexpr, E_POW2: tl.constexpr):
    """Rows ``start + [0, CHUNK)`` (below ``row_end``): their ids and [CHUNK, E_POW2] one-hot."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < row_end, other=-1)
    experts = tl.arange(0, E_POW2)
    onehot = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32)
    return offs, ids, onehot


@triton.jit
def _count(ids_ptr, row_start, row_end, num_experts, CHUNK: tl.constexpr, E_POW2: tl.constexpr):
    """Rows per expert among rows [row_start, row_end)."""
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(row_start, row_end, CHUNK):
        _, _, onehot = _onehot(ids_ptr, start, row_end, num_experts, CHUNK, E_POW2)
        counts += tl.sum(onehot, axis=0)
    return counts


@triton.jit
def _segments(counts, num_padded_ptr, num_experts, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """From rows per expert: (start, end) of each expert's padded segment; stores their total
    in ``num_padded``."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded = tl.where(tl.arange(0, E_POW2) < num_experts, padded, 0)
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    return ends - padded, ends


@triton.jit
def _block_experts(
    ends,
    block_expert_ptr,
    block_start,
    block_end,
    num_experts,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Expert of each used block in [block_start, block_end): the number of segments that end
    at or before its first row (blocks past the last segment are not written)."""
    experts = tl.arange(0, E_POW2)
    total = tl.max(ends, axis=0)
    for b0 in range(block_start, block_end, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < num_experts)
        tl.store(
            block_expert_ptr + blocks,
            tl.sum(ended.to(tl.int32), axis=1),
            mask=(blocks < block_end) & (blocks * BLOCK_M < total),
        )


@triton.jit
def _fill_sentinel(sorted_rows_ptr, start, end, step, num_rows, FILL: tl.constexpr):
    """The sentinel ``num_rows`` in slots [start, end) of every ``step``-strided span of FILL
    (the scatter then overwrites the slots of real rows)."""
    for p0 in range(start, end, step):
        offs = p0 + tl.arange(0, FILL)
        tl.store(sorted_rows_ptr + offs, tl.full((FILL,), 0, tl.int32) + num_rows, mask=offs < end)


@triton.jit
def _scatter(
    ids_ptr,
    sorted_rows_ptr,
    row_start,
    row_end,
    num_experts,
    running,
    CHUNK: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """Write each row id of [row_start, row_end) at its expert's next slot (``running``: the
    slot of the expert's first row here); rows keep ascending order within an expert."""
    for start in range(row_start, row_end, CHUNK):
        offs, ids, onehot = _onehot(ids_ptr, start, row_end, num_experts, CHUNK, E_POW2)
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier rows of the same expert
        dest = tl.sum(onehot * (before + running[None, :]), axis=1)
        valid = (ids >= 0) & (ids < num_experts) & (offs < row_end)
        tl.store(sorted_rows_ptr + dest, offs.to(tl.int32), mask=valid)
        running += tl.sum(onehot, axis=0)


@triton.jit
def align_in_program(
    ids_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    num_experts,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    ROWS_POW2: tl.constexpr,
    FILL: tl.constexpr,
):
    """The whole alignment of ``num_rows`` (at most ROWS_POW2) ids in the calling program
    (``one_program_constants`` gives the constexprs): the rows sorted by (expert, row) in
    registers, counts per expert by a histogram, and each sorted row stored at its sorted
    position moved by the padding before its expert's segment. Every block of a segment
    holds a real row, so the rows write the blocks' experts too. On an H100 1.3-6.5x faster
    per launch than counting and scattering through [rows, E] one-hot tiles (256 experts,
    256 rows: 3.3 against 17.4 us)."""
    rows = tl.arange(0, ROWS_POW2)
    ids = tl.load(ids_ptr + rows, mask=rows < num_rows, other=-1)
    valid = (ids >= 0) & (ids < num_experts) & (rows < num_rows)
    # int32 from here (ids may come as int64: checked above in their own width). Skipped
    # rows sort after every expert (key E_POW2 * ROWS_POW2 and up).
    ids = tl.where(valid, ids, E_POW2).to(tl.int32)
    keys = tl.sort(ids * ROWS_POW2 + rows)
    expert = keys // ROWS_POW2
    row = keys % ROWS_POW2
    placed = expert < E_POW2
    counts = tl.histogram(ids, E_POW2, mask=valid)
    starts, ends = _segments(counts, num_padded_ptr, num_experts, BLOCK_M, E_POW2)
    # padded start - unpadded start of each expert's segment: the padding before it
    shift = starts - (tl.cumsum(counts, axis=0) - counts)
    dest = rows + tl.gather(shift, tl.where(placed, expert, 0), 0)
    _fill_sentinel(sorted_rows_ptr, 0, tl.max(ends, axis=0), FILL, num_rows, FILL)
    tl.debug_barrier()  # the sentinel fill must land before the rows
    tl.store(sorted_rows_ptr + dest, row, mask=placed)
    tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=placed)


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    num_experts,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    ROWS_POW2: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program aligns every row (``align_in_program``)."""
    _pdl.enter(PDL)
    align_in_program(
        ids_ptr,
        sorted_rows_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_rows,
        num_experts,
        BLOCK_M,
        E_POW2,
        ROWS_POW2,
        FILL,
    )


@triton.jit
def _align_count_kernel(
    ids_ptr,
    scratch_ptr,
    sorted_rows_ptr,
    num_rows,
    num_experts,
    num_slots,
    ROWS: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p: rows per expert among its ROWS rows, into scratch row p; and its share of
    the sentinel fill of all ``num_slots`` slots (the scatter, a later launch, overwrites)."""
    _pdl.enter(PDL)
    p = tl.program_id(0)
    row_end = tl.minimum(num_rows, (p + 1) * ROWS)
    counts = _count(ids_ptr, p * ROWS, row_end, num_experts, CHUNK, E_POW2)
    tl.store(scratch_ptr + p * E_POW2 + tl.arange(0, E_POW2), counts)
    _fill_sentinel(sorted_rows_ptr, p * FILL, num_slots, tl.num_programs(0) * FILL, num_rows, FILL)


@triton.jit
def _align_scan_kernel(
    scratch_ptr,
    num_padded_ptr,
    num_experts,
    num_programs,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    PT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: scratch row p becomes the count of the expert's rows in programs < p;
    the segment starts and ends go to scratch rows ``num_programs`` and ``num_programs + 1``."""
    _pdl.enter(PDL)
    experts = tl.arange(0, E_POW2)
    running = tl.zeros((E_POW2,), dtype=tl.int32)
    for p0 in range(0, num_programs, PT):
        ps = p0 + tl.arange(0, PT)
        ptrs = scratch_ptr + ps[:, None] * E_POW2 + experts[None, :]
        c = tl.load(ptrs, mask=ps[:, None] < num_programs, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + running[None, :], mask=ps[:, None] < num_programs)
        running += tl.sum(c, axis=0)
    starts, ends = _segments(running, num_padded_ptr, num_experts, BLOCK_M, E_POW2)
    tl.store(scratch_ptr + num_programs * E_POW2 + experts, starts)
    tl.store(scratch_ptr + (num_programs + 1) * E_POW2 + experts, ends)


@triton.jit
def _align_scatter_kernel(
    ids_ptr,
    scratch_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_rows,
    num_experts,
    num_programs,
    blocks_per_program,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p: scatter its rows after the rows of programs < p in each expert segment, and
    write the expert of its share of the blocks."""
    _pdl.enter(PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    starts = tl.load(scratch_ptr + num_programs * E_POW2 + experts)
    ends = tl.load(scratch_ptr + (num_programs + 1) * E_POW2 + experts)
    b0 = p * blocks_per_program
    _block_experts(
        ends, block_expert_ptr, b0, b0 + blocks_per_program, num_experts, BLOCK_M, E_POW2, CHUNK
    )
    running = starts + tl.load(scratch_ptr + p * E_POW2 + experts)
    row_end = tl.minimum(num_rows, (p + 1) * ROWS)
    _scatter(ids_ptr, sorted_rows_ptr, p * ROWS, row_end, num_experts, running, CHUNK, E_POW2)


def align_rows(
    row_expert: torch.Tensor,
    num_experts: int,
    block_m: int,
    sorted_rows: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    scratch: torch.Tensor | None = None,
    rows_per_program: int = ROWS_PER_PROGRAM,
    *,
    options: TritonOptions,
    single_program_max_rows: int = SINGLE_PROGRAM_MAX_ROWS,
) -> None:
    """Fill the alignment outputs for ``row_expert`` (int32 [rows]), on the device.

    Up to ``single_program_max_rows`` rows: one program. Above: count (and sentinel fill) per
    block of rows, one scan program over the per-block counts, scatter (and block experts)
    per block of rows; nothing proportional to the rows runs in the single scan program.
    ``scratch`` (int32, at least ``scratch_size`` elements, reused across calls) holds the
    per-block counts and the segment bounds. ``options``: the backend's (launches).
    """
    if row_expert.dim() != 1 or not row_expert.is_contiguous():
        raise ValueError(
            f"align_rows: row_expert must be 1-D and contiguous (the kernels read it densely), "
            f"got shape {list(row_expert.shape)} and strides {list(row_expert.stride())}"
        )
    if row_expert.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"align_rows: row_expert must be int32 or int64, got {row_expert.dtype}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"align_rows: at most {MAX_EXPERTS} experts, got {num_experts}")
    num_rows = row_expert.shape[0]
    if num_rows <= single_program_max_rows:
        _launch.launch(
            _align_kernel,
            (1,),
            row_expert,
            sorted_rows,
            block_expert,
            num_padded,
            num_rows,
            num_experts,
            **one_program_constants(num_experts, block_m, num_rows),
            num_warps=4,
            options=options,
        )
        return
    e_pow2 = _e_pow2(num_experts)
    chunk = _chunk(e_pow2)
    need = _multi_scratch_size(num_rows, num_experts, rows_per_program)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.int32, device=row_expert.device)
    elif scratch.numel() < need or scratch.dtype != torch.int32:
        raise ValueError(
            f"scratch must be int32 with >= {need} elements, got "
            f"{scratch.dtype} with {scratch.numel()}"
        )
    programs = _cdiv(num_rows, rows_per_program)
    _launch.launch(
        _align_count_kernel,
        (programs,),
        row_expert,
        scratch,
        sorted_rows,
        num_rows,
        num_experts,
        sorted_rows.shape[0],
        ROWS=rows_per_program,
        E_POW2=e_pow2,
        CHUNK=chunk,
        FILL=1024,
        num_warps=4,
        options=options,
    )
    _launch.launch(
        _align_scan_kernel,
        (1,),
        scratch,
        num_padded,
        num_experts,
        programs,
        BLOCK_M=block_m,
        E_POW2=e_pow2,
        PT=max(1, 4096 // e_pow2),
        num_warps=4,
        options=options,
    )
    _launch.launch(
        _align_scatter_kernel,
        (programs,),
        row_expert,
        scratch,
        sorted_rows,
        block_expert,
        num_rows,
        num_experts,
        programs,
        _cdiv(block_expert.shape[0], programs),
        ROWS=rows_per_program,
        BLOCK_M=block_m,
        E_POW2=e_pow2,
        CHUNK=chunk,
        num_warps=4,
        options=options,
    )


@triton.jit
def _topk_sum_kernel(
    src_ptr,
    ids_ptr,
    out_ptr,
    flags_ptr,
    route_w_ptr,
    H,
    num_experts,
    stride_sm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHECK_IDS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum over slots j with ids[t, j] in [0, E) of src[t * TOP_K + j] (float32 sum;
    the GEMMs write no row for any other id), each times ``route_w[t * TOP_K + j]`` when
    WEIGHTED. ``CHECK_IDS``: ids outside ``[-1, E)`` are recorded in ``flags``
    (``device_checks.IdFlags``) by the first program of each token."""
    _pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    if CHECK_IDS:
        if tl.program_id(1) == 0:
            for j in tl.static_range(TOP_K):
                e = tl.load(ids_ptr + t * TOP_K + j)
                # int64 ids saturate to the int32 flags (a wider id stays out of range).
                if e < -1:
                    tl.atomic_min(flags_ptr, tl.maximum(e, -2147483648).to(tl.int32))
                    tl.atomic_max(flags_ptr + 2, num_experts)
                if e >= num_experts:
                    tl.atomic_max(flags_ptr + 1, tl.minimum(e, 2147483647).to(tl.int32))
                    tl.atomic_max(flags_ptr + 2, num_experts)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        row = src_ptr + (t * TOP_K + j) * stride_sm
        valid = (e >= 0) & (e < num_experts)
        y = tl.load(row + offs, mask=mask & valid, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = y * tl.load(route_w_ptr + t * TOP_K + j, mask=valid, other=0.0).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def topk_sum(
    src_PH: torch.Tensor,
    ids_TK: torch.Tensor,
    out_TH: torch.Tensor,
    num_experts: int,
    *,
    options: TritonOptions,
    id_flags: torch.Tensor | None = None,
    route_w: torch.Tensor | None = None,
) -> None:
    """Reduce the k expert outputs of each token (weighted already, or by ``route_w``: float32
    ``[T * k]``); slots whose id is -1 (or not in ``[0, num_experts)``) are skipped.
    ``options``: the backend's (launches). ``id_flags``: a ``device_checks.IdFlags`` buffer
    to record ids outside ``[-1, E)`` in."""
    num_tokens, top_k = ids_TK.shape
    hidden = out_TH.shape[1]
    block_h = min(1024, _pow2(hidden))
    _launch.launch(
        _topk_sum_kernel,
        (num_tokens, _cdiv(hidden, block_h)),
        src_PH,
        ids_TK,
        out_TH,
        id_flags if id_flags is not None else ids_TK,
        route_w if route_w is not None else src_PH,
        hidden,
        num_experts,
        src_PH.stride(0),
        out_TH.stride(0),
        TOP_K=top_k,
        BLOCK_H=block_h,
        CHECK_IDS=id_flags is not None,
        WEIGHTED=route_w is not None,
        num_warps=4,
        options=options,
    )


@triton.jit
def _hook_rows_kernel(
    ids_ptr,
    expert_ptr,
    token_ptr,
    slot_ptr,
    num_rows,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row p = t * TOP_K + j: expert ids[p] if in [0, E) else -1, token t and slot j (-1
    with expert -1)."""
    _pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < num_rows
    e = tl.load(ids_ptr + rows, mask=inside, other=-1)
    valid = (e >= 0) & (e < num_experts)
    tl.store(expert_ptr + rows, tl.where(valid, e, -1).to(tl.int32), mask=inside)
    wide = rows.to(tl.int64)
    tl.store(token_ptr + rows, tl.where(valid, wide // TOP_K, -1), mask=inside)
    tl.store(slot_ptr + rows, tl.where(valid, wide % TOP_K, -1), mask=inside)


def hook_rows(
    ids_TK: torch.Tensor, num_experts: int, *, options: TritonOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert int32, token int64, slot int64), each ``[T * k]``, of the (token, slot) rows
    of ``ids_TK`` (int32, contiguous): -1 for ids outside ``[0, num_experts)``. One launch;
    fresh tensors (hooks may keep them)."""
    num_tokens, top_k = ids_TK.shape
    num_rows, dev = num_tokens * top_k, ids_TK.device
    expert = torch.empty(num_rows, dtype=torch.int32, device=dev)
    token = torch.empty(num_rows, dtype=torch.int64, device=dev)
    slot = torch.empty(num_rows, dtype=torch.int64, device=dev)
    block = 1024
    _launch.launch(
        _hook_rows_kernel,
        (_cdiv(num_rows, block),),
        ids_TK,
        expert,
        token,
        slot,
        num_rows,
        num_experts,
        TOP_K=top_k,
        BLOCK=block,
        num_warps=4,
        options=options,
    )
    return expert, token, slot
