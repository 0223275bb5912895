# GEMM-input quantization of the triton backend on the GPU (private).
#
# One launch quantizes an activation [M, K] to e4m3 or int8 with fp32 scales per row
# (fp8_token, int8_token: a program per row, two passes over it) or per row and 128 along K
# (fp8_group128: a program per tile of rows x several groups, read once; the GEMM1 epilogue
# applies the same ``quant_groups_e4m3`` when its tile holds whole groups), by the same rule as
# moerunner.quant.quantize_activation: scale = amax / qmax (1.0 where that is 0), q = x / scale
# rounded to nearest even (saturating at +-448 for e4m3, clamped to [-128, 127] for int8).
# The launcher uses the quant package's PyTorch implementation off the GPU, where the Triton
# interpreter rounds fp8 differently.

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch, _pdl
from ._launch import cdiv as _cdiv
from ._launch import next_power_of_2 as _pow2
from .options import TritonOptions

# Adding then subtracting 1.5 * 2^23 rounds a float32 of magnitude < 2^22 to the nearest
# integer, ties to even (the hardware's rounding of the add).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    QMAX: tl.constexpr,
    TO_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program per row: amax over the row in NUM_CHUNKS chunks of GROUP, scale, quantize."""
    _pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    amax = 0.0
    for c in tl.static_range(NUM_CHUNKS):
        offs = c * GROUP + tl.arange(0, GROUP)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    scale = amax / QMAX
    scale = tl.where(scale == 0.0, 1.0, scale)
    for c in tl.static_range(NUM_CHUNKS):
        offs = c * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, scale)
        if TO_FP8:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(q_ptr + row * stride_qm + offs, y.to(tl.float8e4nv), mask=mask)
        else:
            y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
            y = tl.minimum(tl.maximum(y, -128.0), 127.0)
            tl.store(q_ptr + row * stride_qm + offs, y.to(tl.int8), mask=mask)
    tl.store(s_ptr + row * stride_sm, scale)


@triton.jit
def _on_e4m3_grid(y):
    """float32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still in
    float32: 3 mantissa bits from 2^-6 up, steps of 2^-9 below. Casting that to e4m3 is exact,
    which Triton's interpreter needs: its own cast drops the carry into the next binade
    (31.7 -> 16)."""
    bits = y.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits
    subnormal = ((y * 512.0 + _ROUND_MAGIC) - _ROUND_MAGIC) / 512.0
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal.to(tl.float32, bitcast=True))


@triton.jit
def quant_groups_e4m3(x, ROUND_FIRST: tl.constexpr):
    """[ROWS, GROUPS, GROUP] float32 -> (e4m3 codes of that shape, [ROWS, GROUPS] fp32 scales):
    scale = amax / 448 (1 for an all-zero group), code = x / scale rounded to nearest even.
    Used by the standalone kernel below and by the GEMM1 epilogue that quantizes GEMM2's
    input in place, so both give the same bits. ``ROUND_FIRST`` (the interpreter) rounds in
    float32 before the cast; the GPU's cast rounds correctly by itself."""
    scale = tl.max(tl.abs(x), axis=2) / 448.0
    scale = tl.where(scale == 0.0, 1.0, scale)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, :, None]), -448.0), 448.0)
    if ROUND_FIRST:
        y = _on_e4m3_grid(y)
    return y.to(tl.float8e4nv), scale


@triton.jit
def _quant_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row block, group block): ROWS rows x GROUPS groups of GROUP along K to e4m3,
    one fp32 scale per row and group. The tile is loaded once and stays in registers."""
    _pdl.enter(PDL)
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_k = tl.program_id(1) * (GROUPS * GROUP) + tl.arange(0, GROUPS * GROUP)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    q, scale = quant_groups_e4m3(tl.reshape(x.to(tl.float32), (ROWS, GROUPS, GROUP)), False)
    tl.store(
        q_ptr + rows * stride_qm + offs_k[None, :], tl.reshape(q, (ROWS, GROUPS * GROUP)), mask=mask
    )
    g_mask = (offs_m[:, None] < M) & (offs_g[None, :] < (K + GROUP - 1) // GROUP)
    tl.store(s_ptr + rows * stride_sm + offs_g[None, :], scale, mask=g_mask)


def quantize_rows(
    x: torch.Tensor,
    fmt: str,
    q_out: torch.Tensor,
    s_out: torch.Tensor,
    group: int = 128,
    *,
    options: TritonOptions,
) -> None:
    """Fill ``q_out`` ([M, K] e4m3 or int8) and ``s_out`` ([M] or [M, ceil(K/group)] fp32;
    ``group``: K per scale of fp8_group128 (128) and fp8_group (the weight's K block, a
    power of two)); ``options``: the backend's (launches)."""
    rows, k = x.shape
    if fmt in ("fp8_group128", "fp8_group"):
        # 4 rows x up to 8 groups (4096 elements, 32 per thread) per program: enough bytes in
        # flight per program without a grid of millions of one-warp programs.
        groups = min(8 * 128 // group, _pow2(_cdiv(k, group)))
        grid = (_cdiv(rows, 4), _cdiv(k, groups * group))
        _launch.launch(
            _quant_groups_kernel,
            grid,
            x,
            q_out,
            s_out,
            rows,
            k,
            x.stride(0),
            q_out.stride(0),
            s_out.stride(0),
            ROWS=4,
            GROUPS=groups,
            GROUP=group,
            num_warps=4,
            options=options,
        )
        return
    group = min(1024, _pow2(k))
    chunks = _cdiv(k, group)
    to_fp8 = fmt != "int8_token"
    _launch.launch(
        _quant_rows_kernel,
        (rows, 1),
        x,
        q_out,
        s_out,
        k,
        x.stride(0),
        q_out.stride(0),
        s_out.stride(0),
        GROUP=group,
        NUM_CHUNKS=chunks,
        QMAX=448.0 if to_fp8 else 127.0,
        TO_FP8=to_fp8,
        num_warps=4 if group >= 512 else 1,
        options=options,
    )
