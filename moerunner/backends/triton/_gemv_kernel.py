# Stage "experts" of the triton backend: the few-rows (decode) kernel (private).
#
# For a handful of (token, slot) rows, the alignment step and the top-k reduction cost as much
# as the weight streaming itself. This kernel needs neither: a program takes one row (GEMM1) or
# one token with its TOP_K slots (GEMM2, reduction fused), reads the expert id straight from
# the routing, and multiplies on the CUDA cores (no MMA: M is 1). Weight tiles come from the
# same loaders as the grouped GEMM (``_gemm_kernel``), so every scheme is read identically;
# the epilogue (scales, bias, activation, routing weight) follows the same order.

from __future__ import annotations

import triton
import triton.language as tl

from ._gemm_kernel import _activate, _channel_scale, _packed_halves, _weight_tile


@triton.jit
def moe_gemv_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_zp_ptr, w_gscale_ptr, bias_ptr, out_ptr,
    ids_ptr, route_w_ptr,
    N_OUT, K, num_experts, a_row_div, alpha, limit,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_ze, stride_zn, stride_zk,
    stride_be, stride_bn, stride_om, stride_on,
    ROWS_PER_PROGRAM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, MUL_ROUTE_W: tl.constexpr,
    W_FORMAT: tl.constexpr, QDOT: tl.constexpr, A_FP8: tl.constexpr,
    A_SCALE: tl.constexpr, SCALE_FMT: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_ROW_BLOCK: tl.constexpr, HAS_ZP: tl.constexpr, HAS_GSCALE: tl.constexpr,
    SCALE_GATHER: tl.constexpr, BF16_FP4: tl.constexpr,
):
    """out[program row] = sum over its ROWS_PER_PROGRAM rows p with ids[p] >= 0 of
    (route_w[p] *) epilogue(A[p // a_row_div] @ W[ids[p]].T)."""
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    offs_n_safe = offs_n % N_OUT
    if GATED:
        if INTERLEAVED:
            rows_g = 2 * offs_n_safe
            rows_u = 2 * offs_n_safe + 1
        else:
            rows_g = offs_n_safe
            rows_u = offs_n_safe + N_OUT
    else:
        rows_g = offs_n_safe
        rows_u = offs_n_safe
    COMPUTE: tl.constexpr = a_ptr.dtype.element_ty
    PACKED: tl.constexpr = W_FORMAT == 3 or W_FORMAT == 4
    IN_LOOP_QSCALE: tl.constexpr = QDOT and GROUP_K > 0
    DEQ_GROUP: tl.constexpr = (not QDOT) and GROUP_K > 0
    if DEQ_GROUP:
        sg_stride_n = stride_sn
    else:
        sg_stride_n = 0
    if SCALE_ROW_BLOCK == 0:
        ch_stride = 0
    else:
        ch_stride = stride_sn
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(ROWS_PER_PROGRAM):
        p = (pid_r * ROWS_PER_PROGRAM + j).to(tl.int64)
        expert = tl.load(ids_ptr + p).to(tl.int64)
        if (expert >= 0) & (expert < num_experts):
            a_row = p // a_row_div
            a_base = a_ptr + a_row * stride_am
            w_base = w_ptr + expert * stride_we
            s_base = w_scale_ptr + expert * stride_se
            z_base = w_zp_ptr + expert * stride_ze
            acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if PACKED:
                    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    a_ev = tl.load(a_base + (2 * offs_j) * stride_ak,
                                   mask=2 * offs_j < K, other=0).to(tl.float32)
                    a_od = tl.load(a_base + (2 * offs_j + 1) * stride_ak,
                                   mask=2 * offs_j + 1 < K, other=0).to(tl.float32)
                    lo, hi = _packed_halves(w_base, s_base, z_base, rows_g, k0, K, stride_wn,
                                            stride_wk, stride_sn, stride_sk, stride_zn,
                                            stride_zk, COMPUTE, W_FORMAT, GROUP_K, SCALE_FMT,
                                            HAS_ZP, BLOCK_K, EVEN_K, SCALE_GATHER, BF16_FP4)
                    acc_g += tl.sum(a_ev[:, None] * lo.to(tl.float32), axis=0)
                    acc_g += tl.sum(a_od[:, None] * hi.to(tl.float32), axis=0)
                    if GATED:
                        lo, hi = _packed_halves(w_base, s_base, z_base, rows_u, k0, K,
                                                stride_wn, stride_wk, stride_sn, stride_sk,
                                                stride_zn, stride_zk, COMPUTE, W_FORMAT,
                                                GROUP_K, SCALE_FMT, HAS_ZP, BLOCK_K, EVEN_K,
                                                SCALE_GATHER, BF16_FP4)
                        acc_u += tl.sum(a_ev[:, None] * lo.to(tl.float32), axis=0)
                        acc_u += tl.sum(a_od[:, None] * hi.to(tl.float32), axis=0)
                else:
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    a = tl.load(a_base + offs_k * stride_ak, mask=offs_k < K, other=0)
                    if A_FP8:
                        a = a.to(tl.float8e4nv, bitcast=True)
                    a = a.to(tl.float32)
                    if IN_LOOP_QSCALE:
                        k_scale = tl.load(a_scale_ptr + a_row * stride_asm
                                          + (k0 // GROUP_K) * stride_ask)
                    b = _weight_tile(w_base, s_base, z_base, rows_g, k0, K, stride_wn,
                                     stride_wk, sg_stride_n, stride_sk,
                                     stride_zn, stride_zk, COMPUTE, W_FORMAT, QDOT,
                                     GROUP_K if DEQ_GROUP else 0, SCALE_FMT, HAS_ZP, BLOCK_K,
                                     EVEN_K)
                    part = tl.sum(a[:, None] * b.to(tl.float32), axis=0)
                    if IN_LOOP_QSCALE:
                        part = part * k_scale * tl.load(
                            s_base + (rows_g // SCALE_ROW_BLOCK) * stride_sn
                            + (k0 // GROUP_K) * stride_sk)
                    acc_g += part
                    if GATED:
                        b = _weight_tile(w_base, s_base, z_base, rows_u, k0, K, stride_wn,
                                         stride_wk, sg_stride_n, stride_sk,
                                         stride_zn, stride_zk, COMPUTE, W_FORMAT, QDOT,
                                         GROUP_K if DEQ_GROUP else 0, SCALE_FMT, HAS_ZP,
                                         BLOCK_K, EVEN_K)
                        part = tl.sum(a[:, None] * b.to(tl.float32), axis=0)
                        if IN_LOOP_QSCALE:
                            part = part * k_scale * tl.load(
                                s_base + (rows_u // SCALE_ROW_BLOCK) * stride_sn
                                + (k0 // GROUP_K) * stride_sk)
                        acc_u += part
            g = acc_g
            if GATED:
                u = acc_u
            else:
                u = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
            if A_SCALE == 1:
                a_s = tl.load(a_scale_ptr + a_row * stride_asm)
                g = g * a_s
                u = u * a_s
            if (not IN_LOOP_QSCALE) and (not DEQ_GROUP) and SCALE_FMT != 0:
                g = g * _channel_scale(s_base, rows_g, ch_stride, SCALE_FMT)
                if GATED:
                    u = u * _channel_scale(s_base, rows_u, ch_stride, SCALE_FMT)
            if HAS_GSCALE:
                gs = tl.load(w_gscale_ptr + expert)
                g = g * gs
                u = u * gs
            if HAS_BIAS:
                g = g + tl.load(bias_ptr + expert * stride_be + rows_g * stride_bn)
                if GATED:
                    u = u + tl.load(bias_ptr + expert * stride_be + rows_u * stride_bn)
            val = _activate(g, u, alpha, limit, ACT)
            if MUL_ROUTE_W:
                val = val * tl.load(route_w_ptr + p)
            total += val
            if ROWS_PER_PROGRAM == 1:
                tl.store(out_ptr + p * stride_om + offs_n * stride_on,
                         total.to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS_PER_PROGRAM > 1:
        tl.store(out_ptr + pid_r.to(tl.int64) * stride_om + offs_n * stride_on,
                 total.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv_block_n(num_programs_rows: int, n_out: int, target_programs: int = 264) -> int:
    """Widest of 64/32/16 columns per program that still gives about two programs per SM."""
    bn = 64
    while bn > 16 and num_programs_rows * triton.cdiv(n_out, bn) < target_programs:
        bn //= 2
    return bn
