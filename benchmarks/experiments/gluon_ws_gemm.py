# Prototype: an explicitly warp-specialised, persistent bf16 GEMM for Hopper, in Gluon.
#
#   python benchmarks/experiments/gluon_ws_gemm.py --dense M N K BM BN BK STAGES [--warps 4|8]
#   python benchmarks/experiments/gluon_ws_gemm.py --dense M N K BM BN BK STAGES [--warps 4|8] \
#       --compile-only
#   python benchmarks/experiments/gluon_ws_gemm.py --moe PRESET T [--bm 128 --bn1 128 --bn2 256
#       --bk 64 --stages1 3 --stages2 3 --warps 8] [--compile-only]
#
# C[M, N] = A[M, K] @ B[N, K]^T with bf16 operands and output and fp32 accumulation. Triton's
# automatic warp specialisation (``tl.range(..., warp_specialize=True)``) never finished on an
# H200 with Triton 3.6 (see gpu_ws_gemm.py), so this kernel spells the roles out with
# ``gl.warp_specialize``:
#
# * a loader partition (1 warp, few registers) walks this program's tiles and K steps and, per
#   step, waits for a ring stage to be free ("empty" mbarrier), arms the stage's "ready"
#   mbarrier with the byte count and issues the TMA loads of the A [BM, BK] and B [BN, BK]
#   tiles into a STAGES-deep shared-memory ring. It runs ahead across tile boundaries, so the
#   next tile's loads overlap this tile's epilogue;
# * the default partition (4 warps = one warpgroup, or 8 = two warpgroups owning BM / 2 rows
#   each) waits for "ready", issues async wgmma with the accumulator in registers, keeps one
#   wgmma in flight and releases the stage of the wgmma that has completed; after the K loop
#   it converts the tile to bf16 and stores it with TMA through shared memory (the store of
#   one tile drains while the next tile's K loop runs).
#
# Programs are persistent (grid = number of SMs, --num-sms) and walk the output tiles in a
# GROUP_M swizzle, so programs running together share A and B tiles in L2. Both partitions
# count K steps with one running counter: stage = counter % STAGES, phase = (counter //
# STAGES) & 1. M, N and K need not be multiples of the block: TMA zero-fills out-of-bounds
# loads and clips the stores (the row strides of A, B and C must be 16-byte aligned).
#
# --dense prints one line: "gluon-ws dense MxNxK bmBM bnBN bkBK sSTAGES wW: <us> us
# <TFLOP/s> TFLOP/s, torch <us> us, err <rel err>", err = ||C - A B^T|| / ||A B^T|| in float64
# on the CPU, times the median of triton.testing.do_bench. The kernel is checked before it is
# timed. A synchronisation bug hangs the GPU: run it under ``timeout``.
# --moe runs the two expert GEMMs of a MoE layer (model preset, T tokens, plain bf16, silu) on
# rows already laid out by the library's alignment (expert-sorted, each expert padded to BM
# rows; block_expert gives each BM block's expert, num_padded the rows in use, both read on
# the device) and gathered into that order (a_perm) by gpu_ws_gemm.py's gather kernel:
#
# * GEMM1 (_moe_gemm1_kernel): inter = silu(a_perm Wg^T) * (a_perm Wu^T). w13 [E, 2I, H] is
#   re-laid (relayout_w13) so that, per expert and BN1 block, the gate rows are followed by
#   the up rows: one [2 * BN1, BK] TMA box and one wgmma of width 2 * BN1 per K step give both
#   halves. Epilogue: bf16 tile to shared memory, gate / up column slices back into
#   registers, silu(g) * u in fp32, written over the gate half and TMA-stored. I % BN1 == 0
#   is required (--bn1 64 for I = 2880);
# * GEMM2 (_moe_gemm2_kernel): y[sorted_rows[pos]] = route_w[row] * (inter[pos] W2[e]^T); the
#   weighted bf16 tile goes through shared memory into a blocked layout and is scattered with
#   masked pointer stores (padding rows and columns >= H skipped).
#
# Both use the dense kernel's 1-warp TMA loader, ring protocol and persistent GROUP_M tile
# walk (grid = number of SMs; both partitions load num_padded and walk the same tiles). It
# prints "gluon-ws moe PRESET T=..: gather, gemm1, gemm2 us | shipped gemm1, gemm2 us (the
# library's GEMM kernels in the same call, by profiler) | gemms <shipped / ours>x | TFLOP/s
# | err", err = ||y summed over k - fused_standard|| / ||fused_standard|| (~4.5e-3: the two
# round the intermediate differently).
# --compile-only needs no GPU: it compiles the kernel (with --moe: both MoE kernels) for
# sm_90a and prints its shared memory, its warps (workers included), registers and spills
# and the number of wgmma, TMA and mbarrier instructions in the PTX.

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# --moe imports the library (repo root) and the benchmark helpers (this folder).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LOADER_WARPS = gl.constexpr(1)
LOADER_REGS = gl.constexpr(40)
# The loader's tile walk: dense rows, or the aligned rows of the MoE GEMMs (_loader_partition).
DENSE_TILES = gl.constexpr(False)
GROUPED_TILES = gl.constexpr(True)
H200_SMS = 132
# Hopper: 227 KB of shared memory per block at most.
SMEM_LIMIT = 232448


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (pid_m, pid_n), GROUP_M row blocks at a time (L2-friendly order)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile // tiles_per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    in_group = tile % tiles_per_group
    return first_pid_m + in_group % group_rows, in_group // group_rows


@gluon.constexpr_function
def _acc_layout(BM, WIDTH, num_warps):
    """Register layout of a [BM, WIDTH] wgmma accumulator: 16-row atoms per warp, warps
    stacked along M, one instruction spanning all WIDTH columns."""
    if BM % (16 * num_warps):
        raise ValueError(f"BM={BM} must be a multiple of 16 * num_warps = {16 * num_warps}")
    if WIDTH % 8 or WIDTH > 256:
        raise ValueError(f"a wgmma is a multiple of 8 and at most 256 wide, got {WIDTH}")
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, WIDTH, 16]
    )


@gluon.jit
def _tile_counts(rows, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(M tiles, N tiles, all tiles, K steps) of a [rows, N] output with K-deep inputs."""
    num_pid_m = gl.cdiv(rows, BM)
    num_pid_n = gl.cdiv(N, BN)
    return num_pid_m, num_pid_n, num_pid_m * num_pid_n, gl.cdiv(K, BK)


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The shared-memory ring: STAGES A and B tiles, and per stage one "ready" (TMA bytes)
    and one "empty" (one arrive) mbarrier, initialised. Returns (a_bufs, b_bufs, ready_bars,
    empty_bars)."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    # Make the initialised barriers visible to the async proxy (TMA) before any use.
    fence_async_shared()
    return a_bufs, b_bufs, ready_bars, empty_bars


@gluon.jit
def _ring_free(ready_bars, empty_bars, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
        mbarrier.invalidate(empty_bars.index(i))


@gluon.jit
def _loader_partition(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready_bars,
    empty_bars,
    M,
    N,
    K,
    num_padded_ptr,
    block_expert_ptr,
    b_rows_per_expert,
    BN: gl.constexpr,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    GROUPED: gl.constexpr,
):
    """Producer (worker partition): TMA loads of A and B tiles into the shared-memory ring.

    Walks the same tiles and K steps as the consumer. For K step number ``count`` (counted
    across all of this program's tiles) it fills stage ``count % STAGES`` once the consumer
    has released it. The wait on "empty" uses the inverted phase: a fresh mbarrier counts
    the phase before its first as complete, so the first pass over the ring does not wait,
    and pass p >= 1 waits for the consumer's p-th release of the stage.

    Dense: M rows, B box j at row j * BN. GROUPED (the MoE GEMMs): the M tiles are the BM-row
    blocks of the aligned rows in use (cdiv(num_padded, BM), read from device memory), and the
    B box of output block j of row block m starts at row block_expert[m] * b_rows_per_expert
    + j * box_rows (box_rows = 2 * BN for the gate/up pairs of GEMM1, BN otherwise).
    """
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BOX_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    if GROUPED:
        m_rows = gl.load(num_padded_ptr)
    else:
        m_rows = M
    num_pid_m, num_pid_n, num_tiles, k_steps = _tile_counts(m_rows, N, K, BM, BN, BK)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_b = pid_n * BOX_N
        if GROUPED:
            off_b += gl.load(block_expert_ptr + pid_m) * b_rows_per_expert
        for ki in range(k_steps):
            stage = count % STAGES
            phase = (count // STAGES) & 1
            mbarrier.wait(empty_bars.index(stage), phase ^ 1)
            ready = ready_bars.index(stage)
            # Out-of-bounds parts of a box are zero-filled and still count towards the bytes.
            mbarrier.expect(ready, STAGE_BYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, ki * BK], ready, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [off_b, ki * BK], ready, b_bufs.index(stage))
            count += 1


@gluon.jit
def _mma_tile(a_bufs, b_bufs, ready_bars, empty_bars, acc, k_steps, count, STAGES: gl.constexpr):
    """The K loop of one tile (consumer side); returns (acc, count) after all steps.

    One wgmma stays in flight: after issuing step ``count`` it waits until at most one wgmma
    is pending, which means step ``count - 1`` has finished reading its stage, and releases
    that stage. The last step of a tile is released after the final wait. The arrive is made
    by one thread, so a partition-wide thread barrier first makes sure every warp (with 8
    warps: both warpgroups) has seen its wgmma complete.
    """
    for ki in range(k_steps):
        stage = count % STAGES
        mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
        # B is stored [BN, BK] (K-major); the transposed view is the [BK, BN] operand.
        acc = warpgroup_mma(
            a_bufs.index(stage),
            b_bufs.index(stage).permute((1, 0)),
            acc,
            use_acc=ki > 0,
            is_async=True,
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        gl.thread_barrier()
        # Step count - 1 (same tile) is complete: hand its stage back to the loader.
        mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES), pred=ki > 0)
        count += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    gl.thread_barrier()
    mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
    return acc, count


@gluon.jit
def _mma_epilogue_partition(
    a_bufs,
    b_bufs,
    ready_bars,
    empty_bars,
    c_desc,
    c_smem,
    M,
    N,
    K,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer (default partition): async wgmma over the ring, then the bf16 TMA epilogue.

    One wgmma stays in flight: after issuing step ``count`` it waits until at most one wgmma
    is pending, which means step ``count - 1`` has finished reading its stage, and releases
    that stage. The last step of a tile is released after the final wait. The arrive is made
    by one thread, so a partition-wide thread barrier first makes sure every warp (with 8
    warps: both warpgroups, each owning BM / 2 rows) has seen its wgmma complete.
    """
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = _acc_layout(BM, BN, num_warps)
    num_pid_m, num_pid_n, num_tiles, k_steps = _tile_counts(M, N, K, BM, BN, BK)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc, count = _mma_tile(a_bufs, b_bufs, ready_bars, empty_bars, acc, k_steps, count, STAGES)

        # Epilogue: the previous tile's TMA store must have read c_smem before it is rewritten.
        out = acc.to(c_desc.dtype)
        tma.store_wait(pendings=0)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BM, pid_n * BN], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def ws_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Persistent warp-specialised C = A @ B^T (A [M, K], B [N, K], C [M, N], bf16).

    Allocates the STAGES-deep A / B ring, the C staging tile and two mbarriers per stage
    ("ready": the loads landed, tracked by bytes; "empty": the wgmma reading it finished, one
    arrive), then forks into the MMA / epilogue default partition (num_warps warps) and the
    TMA loader worker (1 warp).
    """
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs, b_bufs, ready_bars, empty_bars = _ring(a_desc, b_desc, STAGES)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)

    gl.warp_specialize(
        [
            (
                _mma_epilogue_partition,
                (
                    a_bufs,
                    b_bufs,
                    ready_bars,
                    empty_bars,
                    c_desc,
                    c_smem,
                    M,
                    N,
                    K,
                    NUM_SMS,
                    GROUP_M,
                    STAGES,
                    num_warps,
                ),
            ),
            (
                _loader_partition,
                (
                    a_desc,
                    b_desc,
                    a_bufs,
                    b_bufs,
                    ready_bars,
                    empty_bars,
                    M,
                    N,
                    K,
                    M,
                    M,
                    N,
                    BN,
                    NUM_SMS,
                    GROUP_M,
                    STAGES,
                    DENSE_TILES,
                ),
            ),
        ],
        [LOADER_WARPS],
        [LOADER_REGS],
    )

    _ring_free(ready_bars, empty_bars, STAGES)


# ------------------------------------------------------------------------------ MoE mode
@gluon.jit
def _moe_gemm1_consumer(
    a_bufs,
    b_bufs,
    ready_bars,
    empty_bars,
    c_desc,
    epi_smem,
    num_padded_ptr,
    N,
    K,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """GEMM1 consumer: wgmma of width 2 * BN (gate | up), then silu(gate) * up via TMA.

    Epilogue: the fp32 [BM, 2 * BN] tile goes to shared memory as bf16, the gate and up
    halves come back (column slices) in a blocked layout, silu(g) * u is computed in fp32,
    written over the gate half as bf16 and TMA-stored to inter[pid_m * BM, pid_n * BN]. The
    previous tile's store must have read the buffer before it is rewritten.
    """
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = _acc_layout(BM, 2 * BN, num_warps)  # gate and up columns
    TPW_N: gl.constexpr = BN // 8
    epi_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0]
    )
    m_rows = gl.load(num_padded_ptr)
    num_pid_m, num_pid_n, num_tiles, k_steps = _tile_counts(m_rows, N, K, BM, BN, BK)
    gate_smem = epi_smem.slice(0, BN, 1)
    up_smem = epi_smem.slice(BN, BN, 1)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros([BM, 2 * BN], gl.float32, acc_layout)
        acc, count = _mma_tile(a_bufs, b_bufs, ready_bars, empty_bars, acc, k_steps, count, STAGES)
        # The previous tile's TMA store (issued by one thread) has read the buffer.
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        epi_smem.store(acc.to(c_desc.dtype))
        gl.thread_barrier()
        g = gate_smem.load(epi_layout).to(gl.float32)
        u = up_smem.load(epi_layout).to(gl.float32)
        h = g / (1.0 + gl.exp(-g)) * u
        # Every warp has read its gate values before any overwrites them.
        gl.thread_barrier()
        gate_smem.store(h.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BM, pid_n * BN], gate_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _moe_gemm1_kernel(
    a_desc,
    b_desc,
    c_desc,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """MoE GEMM1: inter = silu(A Wg^T) * (A Wu^T) per BM-row block with that block's expert.

    a_desc: a_perm [max_pad, H] (rows in aligned order), box [BM, BK]; b_desc: the re-laid
    w13 [E * 2I, H] (per expert and BN block j: the BN gate rows of block j, then its BN up
    rows), box [2 * BN, BK]; c_desc: inter [max_pad, I], box [BM, BN]. N = I (a multiple of
    BN), K = H. Warp-specialised and persistent like ``ws_gemm_kernel``.
    """
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    a_bufs, b_bufs, ready_bars, empty_bars = _ring(a_desc, b_desc, STAGES)
    # Gate | up tile in bf16; its first BN columns then hold the output tile (same layout).
    epi_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, 2 * BN], c_desc.layout)

    gl.warp_specialize(
        [
            (
                _moe_gemm1_consumer,
                (
                    a_bufs,
                    b_bufs,
                    ready_bars,
                    empty_bars,
                    c_desc,
                    epi_smem,
                    num_padded_ptr,
                    N,
                    K,
                    NUM_SMS,
                    GROUP_M,
                    STAGES,
                    num_warps,
                ),
            ),
            (
                _loader_partition,
                (
                    a_desc,
                    b_desc,
                    a_bufs,
                    b_bufs,
                    ready_bars,
                    empty_bars,
                    N,
                    N,
                    K,
                    num_padded_ptr,
                    block_expert_ptr,
                    2 * N,
                    BN,
                    NUM_SMS,
                    GROUP_M,
                    STAGES,
                    GROUPED_TILES,
                ),
            ),
        ],
        [LOADER_WARPS],
        [LOADER_REGS],
    )

    _ring_free(ready_bars, empty_bars, STAGES)


@gluon.jit
def _moe_gemm2_consumer(
    a_bufs,
    b_bufs,
    ready_bars,
    empty_bars,
    epi_smem,
    y_ptr,
    sorted_rows_ptr,
    route_w_ptr,
    num_padded_ptr,
    num_rows,
    N,
    K,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """GEMM2 consumer: wgmma over the ring, then the weighted scatter of the tile's rows.

    Epilogue: row r of the tile (aligned position pos = pid_m * BM + r) belongs to the
    (token, slot) row sorted_rows[pos] (num_rows for padding); the fp32 row is scaled by
    route_w[row], converted to bf16, passed through shared memory into a blocked layout
    (16-byte vectors along H) and stored to y[row, pid_n * BN:] with a mask for padding
    rows and columns >= N.
    """
    BM: gl.constexpr = epi_smem.type.shape[0]
    BN: gl.constexpr = epi_smem.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = _acc_layout(BM, BN, num_warps)
    TPW_N: gl.constexpr = BN // 8
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
    m_rows = gl.load(num_padded_ptr)
    num_pid_m, num_pid_n, num_tiles, k_steps = _tile_counts(m_rows, N, K, BM, BN, BK)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc, count = _mma_tile(a_bufs, b_bufs, ready_bars, empty_bars, acc, k_steps, count, STAGES)
        pos = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        rows = gl.load(sorted_rows_ptr + pos)
        w = gl.load(route_w_ptr + rows, mask=rows < num_rows, other=0.0)
        out = (acc * gl.expand_dims(w, 1)).to(y_ptr.dtype.element_ty)
        # The previous tile's reads of epi_smem are done before it is rewritten.
        gl.thread_barrier()
        epi_smem.store(out)
        gl.thread_barrier()
        v = epi_smem.load(st_layout)
        pos_s = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, st_layout))
        rows_s = gl.load(sorted_rows_ptr + pos_s)
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, st_layout))
        ptrs = y_ptr + gl.expand_dims(rows_s.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(rows_s < num_rows, 1) & gl.expand_dims(cols < N, 0)
        gl.store(ptrs, v, mask=mask)


@gluon.jit
def _moe_gemm2_kernel(
    a_desc,
    b_desc,
    y_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    route_w_ptr,
    num_rows,
    N,
    K,
    BN: gl.constexpr,
    NUM_SMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """MoE GEMM2: y[sorted_rows[pos]] = route_w[row] * (inter[pos] @ W2[e]^T), scattered.

    a_desc: inter [max_pad, I], box [BM, BK]; b_desc: w2 viewed [E * H, I] (expert e's rows
    e * H ..), box [BN, BK]; y [num_rows, N] contiguous bf16, N = H, K = I. The last N block
    of an expert may read the next expert's rows (or TMA zero-fill): those columns are
    masked in the store.
    """
    BM: gl.constexpr = a_desc.block_type.shape[0]
    a_bufs, b_bufs, ready_bars, empty_bars = _ring(a_desc, b_desc, STAGES)
    epi_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    epi_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], epi_layout)

    gl.warp_specialize(
        [
            (
                _moe_gemm2_consumer,
                (
                    a_bufs,
                    b_bufs,
                    ready_bars,
                    empty_bars,
                    epi_smem,
                    y_ptr,
                    sorted_rows_ptr,
                    route_w_ptr,
                    num_padded_ptr,
                    num_rows,
                    N,
                    K,
                    NUM_SMS,
                    GROUP_M,
                    STAGES,
                    num_warps,
                ),
            ),
            (
                _loader_partition,
                (
                    a_desc,
                    b_desc,
                    a_bufs,
                    b_bufs,
                    ready_bars,
                    empty_bars,
                    N,
                    N,
                    K,
                    num_padded_ptr,
                    block_expert_ptr,
                    N,
                    BN,
                    NUM_SMS,
                    GROUP_M,
                    STAGES,
                    GROUPED_TILES,
                ),
            ),
        ],
        [LOADER_WARPS],
        [LOADER_REGS],
    )

    _ring_free(ready_bars, empty_bars, STAGES)


def _layouts(bm: int, bn: int, bk: int):
    """NVMMA shared layouts of the A, B and C tiles (128-byte swizzle where the rows allow)."""
    return (
        gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16),
        gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16),
        gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16),
    )


# Programs meant to be resident on one SM at a time (--programs-per-sm): the register cap
# below is shared between them and the persistent grid is this many times the SM count.
PROGRAMS_PER_SM = 1


def _maxnreg(warps: int) -> int | None:
    """Register cap per thread: 64K registers over the consumer and the padded loader group
    of each of the PROGRAMS_PER_SM programs.

    The compiler splits the cap with setmaxnreg: the loader warpgroup drops to LOADER_REGS
    and the consumer gets the rest. 4 consumer warps + 4 loader warps fit at 256 (no cap);
    with 8 consumer warps (384 threads) the cap is 168 and the consumer gets 232.
    """
    if warps <= 4 and PROGRAMS_PER_SM == 1:
        return None
    threads = (warps + 4) * 32 * PROGRAMS_PER_SM
    return min(255, (65536 // threads) // 8 * 8)


def smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Shared memory the kernel asks for: the A / B ring, the C tile and the mbarriers."""
    return stages * (bm + bn) * bk * 2 + bm * bn * 2 + 2 * stages * 8


def check_config(bm: int, bn: int, bk: int, stages: int, warps: int) -> list[str]:
    """Problems of a block configuration (empty when it is fine)."""
    problems = []
    if bm % (16 * warps):
        problems.append(f"BM={bm} is not a multiple of 16 * warps = {16 * warps}")
    if bn % 8 or not 8 <= bn <= 256:
        problems.append(f"BN={bn}: a multiple of 8 up to 256 (one wgmma spans BN)")
    if bk % 16:
        problems.append(f"BK={bk}: a multiple of 16")
    if stages < 2:
        problems.append("STAGES must be >= 2")
    if smem_bytes(bm, bn, bk, stages) > SMEM_LIMIT:
        problems.append(f"shared memory {smem_bytes(bm, bn, bk, stages)} B > {SMEM_LIMIT} B")
    acc_regs = bm * bn // (32 * warps)
    if acc_regs > 128:
        problems.append(
            f"{acc_regs} fp32 accumulator registers per thread (> 128 spills: "
            "use --warps 8 or a smaller tile)"
        )
    return problems


def ws_gemm(
    a,
    b,
    bm=128,
    bn=128,
    bk=64,
    stages=4,
    warps=4,
    group_m=8,
    num_sms=None,
    c=None,
    compile_only=False,
):
    """C = a @ b.T with the warp-specialised kernel; a [M, K], b [N, K], bf16, CUDA.

    ``compile_only`` compiles (and caches) the kernel for these arguments without launching.
    """
    import torch

    if not (a.dtype == b.dtype == torch.bfloat16 and a.shape[1] == b.shape[1]):
        raise ValueError(
            f"a and b must be bf16 [M, K] and [N, K], got {a.dtype} "
            f"{list(a.shape)} and {b.dtype} {list(b.shape)}"
        )
    M, K = a.shape
    N = b.shape[0]
    if K <= 0:
        raise ValueError("K must be positive")
    problems = check_config(bm, bn, bk, stages, warps)
    if problems:
        raise ValueError("; ".join(problems))
    if c is None:
        c = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    a_l, b_l, c_l = _layouts(bm, bn, bk)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], a_l)
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk], b_l)
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn], c_l)
    num_tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    grid = (max(1, min(num_sms, num_tiles)),)
    opts = {"num_warps": warps}
    if _maxnreg(warps) is not None:
        opts["maxnreg"] = _maxnreg(warps)
    args = (a_desc, b_desc, c_desc, M, N, K, num_sms, group_m, stages)
    if compile_only:
        ws_gemm_kernel.warmup(*args, grid=grid, **opts)
    else:
        ws_gemm_kernel[grid](*args, **opts)
    return c


def moe_smem_bytes(bm: int, bn: int, bk: int, stages: int, gated: bool) -> int:
    """Shared memory of a MoE GEMM: the ring (B box 2 * BN rows if gated), epilogue, barriers."""
    box_n = 2 * bn if gated else bn
    return stages * (bm + box_n) * bk * 2 + bm * box_n * 2 + 2 * stages * 8


def check_moe_config(bm: int, bn: int, bk: int, stages: int, warps: int, gated: bool) -> list[str]:
    """Problems of a MoE GEMM block configuration (BN: output columns; GEMM1's wgmma is 2 BN)."""
    box_n = 2 * bn if gated else bn
    problems = []
    if bm % (16 * warps):
        problems.append(f"BM={bm} is not a multiple of 16 * warps = {16 * warps}")
    if bn < 8 or bn & (bn - 1) or box_n > 256:
        problems.append(f"BN={bn}: a power of two >= 8 with {'2 * ' if gated else ''}BN <= 256")
    if bk % 16:
        problems.append(f"BK={bk}: a multiple of 16")
    if stages < 2:
        problems.append("STAGES must be >= 2")
    smem = moe_smem_bytes(bm, bn, bk, stages, gated)
    if smem > SMEM_LIMIT:
        problems.append(f"shared memory {smem} B > {SMEM_LIMIT} B")
    acc_regs = bm * box_n // (32 * warps)
    if acc_regs > 128:
        problems.append(f"{acc_regs} fp32 accumulator registers per thread (> 128 spills)")
    return problems


def relayout_w13(w13, bn: int):
    """w13 [E, 2I, H] (gate rows, then up rows) -> [E * 2I, H] with, per expert and BN block
    j, the BN gate rows of block j followed by its BN up rows (one [2 * BN, BK] TMA box)."""
    E, two_i, H = w13.shape
    inter = two_i // 2
    if inter % bn:
        raise ValueError(
            f"MoE GEMM1 needs I % BN1 == 0 (I={inter}, BN1={bn}); "
            "pick --bn1 dividing I (64 for I=2880)"
        )
    gate = w13[:, :inter].reshape(E, inter // bn, 1, bn, H)
    up = w13[:, inter:].reshape(E, inter // bn, 1, bn, H)
    import torch

    return torch.cat((gate, up), dim=2).reshape(E * two_i, H).contiguous()


def _launch_opts(warps: int) -> dict:
    opts = {"num_warps": warps}
    if _maxnreg(warps) is not None:
        opts["maxnreg"] = _maxnreg(warps)
    return opts


def moe_gemm1(
    a_perm,
    w13_t,
    inter,
    block_expert,
    num_padded,
    bm=128,
    bn=128,
    bk=64,
    stages=3,
    warps=8,
    group_m=8,
    num_sms=None,
    compile_only=False,
):
    """inter[pos] = silu(a_perm[pos] Wg[e]^T) * (a_perm[pos] Wu[e]^T), e = expert of pos's
    BM block; w13_t from ``relayout_w13(w13, bn)``; a_perm [max_pad, H], inter [max_pad, I].

    Grid = number of SMs; the programs read the number of row blocks in use from num_padded.
    """
    import torch

    I, H = inter.shape[1], a_perm.shape[1]
    problems = check_moe_config(bm, bn, bk, stages, warps, gated=True)
    if I % bn:
        problems.append(f"I={I} is not a multiple of BN1={bn}")
    if problems:
        raise ValueError("; ".join(problems))
    if w13_t.shape[1] != H or w13_t.shape[0] % (2 * I):
        raise ValueError(f"w13_t must be [E * 2I, H] = [E * {2 * I}, {H}], got {list(w13_t.shape)}")
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a_perm.device).multi_processor_count
    a_l, b_l, c_l = _layouts(bm, 2 * bn, bk)
    c_l = gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a_perm, [bm, bk], a_l)
    b_desc = TensorDescriptor.from_tensor(w13_t, [2 * bn, bk], b_l)
    c_desc = TensorDescriptor.from_tensor(inter, [bm, bn], c_l)
    args = (a_desc, b_desc, c_desc, block_expert, num_padded, I, H, num_sms, group_m, stages)
    if compile_only:
        _moe_gemm1_kernel.warmup(*args, grid=(num_sms,), **_launch_opts(warps))
    else:
        _moe_gemm1_kernel[(num_sms,)](*args, **_launch_opts(warps))
    return inter


def moe_gemm2(
    inter,
    w2_2d,
    y,
    sorted_rows,
    block_expert,
    num_padded,
    route_w,
    bm=128,
    bn=256,
    bk=64,
    stages=3,
    warps=8,
    group_m=8,
    num_sms=None,
    compile_only=False,
):
    """y[sorted_rows[pos]] = route_w[row] * (inter[pos] @ W2[e]^T) for the aligned rows in use
    (padding skipped); w2_2d = w2.reshape(E * H, I), y [num_rows, H] contiguous."""
    import torch

    num_rows, H = y.shape
    I = inter.shape[1]
    problems = check_moe_config(bm, bn, bk, stages, warps, gated=False)
    if problems:
        raise ValueError("; ".join(problems))
    if not y.is_contiguous() or w2_2d.shape[1] != I or w2_2d.shape[0] % H:
        raise ValueError(
            f"y must be contiguous and w2_2d [E * H, I] = [E * {H}, {I}], got {list(w2_2d.shape)}"
        )
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(inter.device).multi_processor_count
    a_l, b_l, _ = _layouts(bm, bn, bk)
    a_desc = TensorDescriptor.from_tensor(inter, [bm, bk], a_l)
    b_desc = TensorDescriptor.from_tensor(w2_2d, [bn, bk], b_l)
    args = (
        a_desc,
        b_desc,
        y,
        sorted_rows,
        block_expert,
        num_padded,
        route_w,
        num_rows,
        H,
        I,
        bn,
        num_sms,
        group_m,
        stages,
    )
    if compile_only:
        _moe_gemm2_kernel.warmup(*args, grid=(num_sms,), **_launch_opts(warps))
    else:
        _moe_gemm2_kernel[(num_sms,)](*args, **_launch_opts(warps))
    return y


def _compile_gluon(fn, sig, consts, warps, arch=90, divisible=()):
    """Compile Gluon kernel ``fn`` for sm_<arch>a without a GPU; ``divisible`` names the
    arguments to treat as multiples of 16 (as a launch specialises aligned pointers / ints)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = GluonASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=_launch_opts(warps))


def compile_offline(bm, bn, bk, stages, warps, group_m=8, num_sms=H200_SMS, arch=90):
    """Compile the kernel for sm_<arch>a without a GPU; returns the compiled kernel."""
    a_l, b_l, c_l = _layouts(bm, bn, bk)
    sig = {
        "a_desc": f"tensordesc<bf16[{bm},{bk}],{a_l!r}>",
        "b_desc": f"tensordesc<bf16[{bn},{bk}],{b_l!r}>",
        "c_desc": f"tensordesc<bf16[{bm},{bn}],{c_l!r}>",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "NUM_SMS": "constexpr",
        "GROUP_M": "constexpr",
        "STAGES": "constexpr",
        "num_warps": "constexpr",
    }
    consts = {"NUM_SMS": num_sms, "GROUP_M": group_m, "STAGES": stages, "num_warps": warps}
    return _compile_gluon(ws_gemm_kernel, sig, consts, warps, arch)


def compile_moe_offline(gemm, bm, bn, bk, stages, warps, group_m=8, num_sms=H200_SMS, arch=90):
    """Compile MoE GEMM ``gemm`` (1 or 2) for sm_<arch>a without a GPU (pointers and sizes
    taken as multiples of 16, as for the presets); returns the compiled kernel."""
    consts = {"NUM_SMS": num_sms, "GROUP_M": group_m, "STAGES": stages, "num_warps": warps}
    if gemm == 1:
        a_l, b_l, _ = _layouts(bm, 2 * bn, bk)
        c_l = gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16)
        sig = {
            "a_desc": f"tensordesc<bf16[{bm},{bk}],{a_l!r}>",
            "b_desc": f"tensordesc<bf16[{2 * bn},{bk}],{b_l!r}>",
            "c_desc": f"tensordesc<bf16[{bm},{bn}],{c_l!r}>",
            "block_expert_ptr": "*i32",
            "num_padded_ptr": "*i32",
            "N": "i32",
            "K": "i32",
        }
        fn, divisible = _moe_gemm1_kernel, ("block_expert_ptr", "num_padded_ptr", "N", "K")
    else:
        a_l, b_l, _ = _layouts(bm, bn, bk)
        sig = {
            "a_desc": f"tensordesc<bf16[{bm},{bk}],{a_l!r}>",
            "b_desc": f"tensordesc<bf16[{bn},{bk}],{b_l!r}>",
            "y_ptr": "*bf16",
            "sorted_rows_ptr": "*i32",
            "block_expert_ptr": "*i32",
            "num_padded_ptr": "*i32",
            "route_w_ptr": "*fp32",
            "num_rows": "i32",
            "N": "i32",
            "K": "i32",
            "BN": "constexpr",
        }
        consts["BN"] = bn
        fn = _moe_gemm2_kernel
        divisible = (
            "y_ptr",
            "sorted_rows_ptr",
            "block_expert_ptr",
            "num_padded_ptr",
            "route_w_ptr",
            "num_rows",
            "N",
            "K",
        )
    sig.update({k: "constexpr" for k in ("NUM_SMS", "GROUP_M", "STAGES", "num_warps")})
    return _compile_gluon(fn, sig, consts, warps, arch, divisible)


def _ptxas_info(ptx: str, arch: int = 90) -> str:
    """Registers and spills as ptxas reports them (Triton's own ptxas)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return "ptxas not found"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    if not regs or not spill:
        return "ptxas: " + res.stderr.strip().replace("\n", " | ")
    return f"regs {regs.group(1)}, spills {spill.group(1)}/{spill.group(2)} B"


def _describe_build(ck, label: str, warps: int, problems: list[str]) -> str:
    """One line describing a compiled kernel: shared memory, warps, registers, PTX counts."""
    ptx = ck.asm["ptx"]
    counts = {
        name: len(re.findall(re.escape(name), ptx))
        for name in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier")
    }
    m = re.search(r"\.reqntid\s+(\d+)", ptx)
    total_warps = int(m.group(1)) // 32 if m else ck.metadata.num_warps
    regs = sorted(
        {
            f"{op} {n}"
            for op, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
        }
    )
    return (
        f"gluon-ws compile sm_90a {label} w{warps}: "
        f"shared {ck.metadata.shared} B, num_warps {total_warps} "
        f"({warps} consumer + {LOADER_WARPS.value} loader, padded to a warpgroup), "
        f"maxnreg {_maxnreg(warps)}, setmaxnreg {{{', '.join(regs)}}}, "
        f"{_ptxas_info(ptx)}; PTX: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + ("; NOT RUNNABLE: " + "; ".join(problems) if problems else "")
    )


def _compile_report(bm, bn, bk, stages, warps, group_m, num_sms) -> str:
    """One line describing the sm_90a build of a configuration."""
    ck = compile_offline(bm, bn, bk, stages, warps, group_m, num_sms)
    return _describe_build(
        ck, f"bm{bm} bn{bn} bk{bk} s{stages}", warps, check_config(bm, bn, bk, stages, warps)
    )


def _moe_compile_report(preset, cfg, group_m, num_sms) -> list[str]:
    """Lines describing the sm_90a builds of both MoE GEMMs for a preset's configuration."""
    from moerunner.bench.presets import PRESETS

    p = PRESETS[preset]
    lines = []
    for gemm, bn, stages, n, gated in (
        (1, cfg.bn1, cfg.stages1, p.intermediate_size, True),
        (2, cfg.bn2, cfg.stages2, p.hidden_size, False),
    ):
        problems = check_moe_config(cfg.bm, bn, cfg.bk, stages, cfg.warps, gated)
        if gated and n % bn:
            problems.append(f"{preset}: I={n} is not a multiple of BN1={bn}")
        ck = compile_moe_offline(gemm, cfg.bm, bn, cfg.bk, stages, cfg.warps, group_m, num_sms)
        wgmma_n = 2 * bn if gated else bn
        label = f"moe gemm{gemm} {preset} bm{cfg.bm} bn{bn} (wgmma n{wgmma_n}) bk{cfg.bk} s{stages}"
        lines.append(_describe_build(ck, label, cfg.warps, problems))
    return lines


def _dense(M, N, K, bm, bn, bk, stages, warps, group_m, num_sms) -> str:
    import torch
    import triton.testing as tt

    if not torch.cuda.is_available():
        sys.exit("--dense needs a CUDA GPU (use --compile-only to build without one)")
    dev = torch.device("cuda")
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count * PROGRAMS_PER_SM
    torch.manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

    def run():
        ws_gemm(a, b, bm, bn, bk, stages, warps, group_m, num_sms, c)

    ws_gemm(a, b, bm, bn, bk, stages, warps, group_m, num_sms, c, compile_only=True)
    print(
        "compiled; first launch (a hang from here on is a synchronisation bug)",
        file=sys.stderr,
        flush=True,
    )
    run()
    torch.cuda.synchronize()
    print("first launch finished", file=sys.stderr, flush=True)
    ref = a.double().cpu() @ b.double().cpu().T
    err = (torch.linalg.norm(c.double().cpu() - ref) / torch.linalg.norm(ref)).item()
    ms = tt.do_bench(run, return_mode="median")
    ms_torch = tt.do_bench(lambda: torch.matmul(a, b.T), return_mode="median")
    tflops = 2.0 * M * N * K / (ms * 1e-3) / 1e12
    return (
        f"gluon-ws dense {M}x{N}x{K} bm{bm} bn{bn} bk{bk} s{stages} w{warps}: "
        f"{ms * 1e3:.1f} us {tflops:.1f} TFLOP/s, torch {ms_torch * 1e3:.1f} us, "
        f"err {err:.2e}"
    )


def _moe(preset, T, cfg, group_m, num_sms) -> str:
    """The --moe run on a GPU: check both GEMMs against the library's fused op, then time."""
    import torch
    import triton.testing as tt

    if not torch.cuda.is_available():
        sys.exit("--moe needs a CUDA GPU (use --compile-only to build without one)")
    import gpu_triton as G
    from gpu_ws_gemm import _gather_rows_kernel

    from moerunner.backends.triton import TritonBackend, TritonOptions
    from moerunner.backends.triton import experts as X
    from moerunner.backends.triton import workspaces as W
    from moerunner.bench.presets import PRESETS
    from moerunner.config import Activation
    from moerunner.weights import ExpertWeights

    p = PRESETS[preset]
    H, I, E, k = p.hidden_size, p.intermediate_size, p.num_experts, p.top_k
    problems = check_moe_config(cfg.bm, cfg.bn1, cfg.bk, cfg.stages1, cfg.warps, True)
    problems += check_moe_config(cfg.bm, cfg.bn2, cfg.bk, cfg.stages2, cfg.warps, False)
    if I % cfg.bn1:
        problems.append(f"{preset}: I={I} is not a multiple of BN1={cfg.bn1} (try --bn1 64)")
    if problems:
        sys.exit("; ".join(problems))
    dev = torch.device("cuda")
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count * PROGRAMS_PER_SM
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.int()
    wts = torch.softmax(torch.randn(T, k, device=dev), dim=1).float()
    num_rows = T * k

    bufs = W.alignment_workspace(num_rows, E, cfg.bm, dev)
    rows = X.layout_rows(ids.reshape(-1), k, E, cfg.bm, bufs, TritonOptions())
    max_pad = bufs["sorted_rows"].shape[0]
    a_perm = torch.zeros(max_pad, H, device=dev, dtype=torch.bfloat16)
    inter = torch.zeros(max_pad, I, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(num_rows, H, device=dev, dtype=torch.bfloat16)
    w13_t = relayout_w13(w13, cfg.bn1)
    w2_2d = w2.reshape(E * H, I)
    route_w = wts.reshape(-1).contiguous()

    def gather():
        _gather_rows_kernel[(triton.cdiv(max_pad, 64),)](
            x,
            a_perm,
            rows.sorted_rows,
            rows.num_padded,
            num_rows,
            k,
            H,
            BLOCK_R=64,
            BLOCK_H=128,
            num_warps=4,
        )

    kw1 = dict(
        bm=cfg.bm,
        bn=cfg.bn1,
        bk=cfg.bk,
        stages=cfg.stages1,
        warps=cfg.warps,
        group_m=group_m,
        num_sms=num_sms,
    )
    kw2 = dict(
        bm=cfg.bm,
        bn=cfg.bn2,
        bk=cfg.bk,
        stages=cfg.stages2,
        warps=cfg.warps,
        group_m=group_m,
        num_sms=num_sms,
    )

    def gemm1():
        moe_gemm1(a_perm, w13_t, inter, rows.block_expert, rows.num_padded, **kw1)

    def gemm2():
        moe_gemm2(
            inter, w2_2d, y, rows.sorted_rows, rows.block_expert, rows.num_padded, route_w, **kw2
        )

    print(f"moe {preset} T={T}: compiling", file=sys.stderr, flush=True)
    moe_gemm1(a_perm, w13_t, inter, rows.block_expert, rows.num_padded, compile_only=True, **kw1)
    moe_gemm2(
        inter,
        w2_2d,
        y,
        rows.sorted_rows,
        rows.block_expert,
        rows.num_padded,
        route_w,
        compile_only=True,
        **kw2,
    )
    print(
        "compiled; first launches (a hang from here on is a synchronisation bug)",
        file=sys.stderr,
        flush=True,
    )
    gather()
    torch.cuda.synchronize()
    gemm1()
    torch.cuda.synchronize()
    print("gemm1 finished", file=sys.stderr, flush=True)
    gemm2()
    torch.cuda.synchronize()
    print("gemm2 finished", file=sys.stderr, flush=True)

    spec = ExpertWeights(w13, w2).spec(Activation("silu"))
    prepared = TritonBackend().prepare_weights(ExpertWeights(w13, w2), spec)
    ref = X.fused_standard(x, wts, ids, prepared).double().cpu()
    out = y.view(T, k, H).float().sum(1).double().cpu()
    err = (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()

    def bench(fn):
        return tt.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3

    us_gather, us1, us2 = bench(gather), bench(gemm1), bench(gemm2)
    shipped = G.stage_breakdown(prepared, T, k)
    s1, s2 = shipped["gemm1"], shipped["gemm2"]
    tflops = 2.0 * num_rows * 3 * I * H / ((us1 + us2) * 1e-6) / 1e12
    return (
        f"gluon-ws moe {preset} T={T}: gather {us_gather:.1f} gemm1 {us1:.1f} "
        f"gemm2 {us2:.1f} | shipped gemm1 {s1:.1f} gemm2 {s2:.1f} | "
        f"gemms {(s1 + s2) / (us1 + us2):.2f}x | {tflops:.0f} TFLOP/s | err {err:.2e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="Warp-specialised persistent Gluon GEMM (Hopper).")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--dense", nargs=7, type=int, metavar=("M", "N", "K", "BM", "BN", "BK", "STAGES")
    )
    mode.add_argument(
        "--moe",
        nargs=2,
        metavar=("PRESET", "T"),
        help="the two expert GEMMs of a MoE layer (model preset, tokens)",
    )
    ap.add_argument(
        "--warps",
        type=int,
        default=None,
        choices=(4, 8),
        help="consumer warps: one or two warpgroups (default 4 dense, 8 moe)",
    )
    ap.add_argument("--group-m", type=int, default=8)
    ap.add_argument(
        "--num-sms",
        type=int,
        default=None,
        help="persistent programs (default: the GPU's SM count; 132 offline)",
    )
    ap.add_argument(
        "--programs-per-sm",
        type=int,
        default=1,
        help="--moe: persistent programs per SM (registers capped to fit them)",
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile for sm_90a without a GPU and report the build",
    )
    moe = ap.add_argument_group("--moe blocks")
    moe.add_argument("--bm", type=int, default=128)
    moe.add_argument("--bn1", type=int, default=128, help="GEMM1 output columns (wgmma 2x)")
    moe.add_argument("--bn2", type=int, default=256)
    moe.add_argument("--bk", type=int, default=64)
    moe.add_argument("--stages1", type=int, default=3)
    moe.add_argument("--stages2", type=int, default=3)
    args = ap.parse_args()
    if args.compile_only and os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: --compile-only compiles for the GPU")
    global PROGRAMS_PER_SM
    PROGRAMS_PER_SM = args.programs_per_sm
    if args.moe:
        args.warps = args.warps or 8
        preset, T = args.moe[0], int(args.moe[1])
        if args.compile_only:
            for line in _moe_compile_report(preset, args, args.group_m, args.num_sms or H200_SMS):
                print(line)
            return
        print(_moe(preset, T, args, args.group_m, args.num_sms), flush=True)
        return
    args.warps = args.warps or 4
    M, N, K, bm, bn, bk, stages = args.dense
    if args.compile_only:
        print(
            _compile_report(bm, bn, bk, stages, args.warps, args.group_m, args.num_sms or H200_SMS)
        )
        return
    print(_dense(M, N, K, bm, bn, bk, stages, args.warps, args.group_m, args.num_sms), flush=True)


if __name__ == "__main__":
    main()
