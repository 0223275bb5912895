# Stage "experts" of the triton backend: the grouped GEMM kernel body (private).
#
# One kernel serves GEMM1 (w13, optional bias, fused gated/non-gated activation) and GEMM2
# (w2, optional bias, routing weight) for every scheme. Rows come from the alignment step:
# ``sorted_rows`` holds, per BLOCK_M-padded expert segment, the output row ids (sentinel
# ``num_rows`` for padding) and ``block_expert`` the expert of each M-block; with very few
# rows (ROW_BLOCKS) each row is its own block and its expert id is read directly. The A row
# of an output row is ``row // a_row_div`` (top_k for GEMM1 of the standard format, 1
# otherwise).
#
# Weight tiles are read straight from the quantized layouts of docs/architecture.md and either
# fed to the MMA in their own type (fp8 / int8 with a quantized A, "qdot") or dequantized in
# registers to A's dtype (weight-only schemes: int8, int4, mxfp4, nvfp4, mxfp8; the decoding
# is in ``_weight_decode``).
# All launch-time decisions are constexpr; the launcher (``experts.py``) validates inputs.

from __future__ import annotations

import triton
import triton.language as tl

from . import _pdl
from ._activation import activate
from ._overlap import (
    _EARLY_FROM_IDS,
    _EARLY_NONE,
    _STREAM_CONSUME,
    _STREAM_PUBLISH,
    await_block,
    block_expert_from_ids,
)
from ._quant_kernel import quant_groups_e4m3
from ._weight_decode import (
    _a_tile,
    _channel_scale,
    _column,
    _fragment_prefetch,
    _fragment_tile,
    _half_group_codes,
    _plain_tile,
    _split_halves,
    _step_scale_codes,
    _weight_tile,
)

# The constexpr ids of W_FORMAT, SCALE_FMT and A_SCALE are ``_operands``' WF_*, SF_*, AS_*.


@triton.jit
def _mma(a, b, acc, IS_INT: tl.constexpr, IEEE: tl.constexpr):
    """acc += a @ b with the accumulator type of the operands (int32 for int8)."""
    if IS_INT:
        acc += tl.dot(a, b, out_dtype=tl.int32)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gemm_block(
    rows_out,
    expert,
    pid_n,
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    w_zp_ptr,
    w_gscale_ptr,
    bias_ptr,
    out_ptr,
    out_scale_ptr,
    route_w_ptr,
    delta_ptr,
    N_OUT,
    K,
    num_rows,
    a_row_div,
    alpha,
    limit,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ze,
    stride_zn,
    stride_zk,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    stride_osm,
    stride_osg,
    stride_dm,
    stride_dn,
    k_lo,
    k_hi,
    split_part_ptr,
    split_count_ptr,
    pid_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE_W: tl.constexpr,
    W_FORMAT: tl.constexpr,
    QDOT: tl.constexpr,
    A_SCALE: tl.constexpr,
    SCALE_FMT: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_ROW_BLOCK: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
    IEEE: tl.constexpr,
    BF16_FP4: tl.constexpr,
    HALF: tl.constexpr,
    MERGED_SCALE: tl.constexpr,
    E2M1_WORDS: tl.constexpr,
    UNIFORM_WS: tl.constexpr,
    OUT_QUANT: tl.constexpr,
    INTER_DTYPE: tl.constexpr,
    FP8_ROUND_FIRST: tl.constexpr,
    S_PREFETCH: tl.constexpr,
    S_TILE: tl.constexpr,
    FRAG: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One output tile: rows ``rows_out`` (BLOCK_M of them; ``num_rows`` marks padding) of
    expert ``expert`` times weight columns block ``pid_n``, K loop and epilogue (see
    ``moe_gemm_kernel`` for the parameters)."""
    row_mask = rows_out < num_rows
    a_rows = tl.where(row_mask, rows_out // a_row_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    # Weight rows of this tile. Gated: the gate and the up row of each output column side by
    # side (tile column 2j gate, 2j + 1 up), so one MMA of 2 * BLOCK_N columns covers both and
    # the accumulator splits into the two halves in registers after the K loop. Wide MMAs
    # matter on Hopper: a wgmma of 64 columns reading A from shared memory is bound by
    # shared-memory bandwidth, one of 128-256 is not. Masked columns read an in-bounds row and
    # are not stored.
    WIDTH: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    offs_w = tl.arange(0, WIDTH)
    if GATED:
        col = (pid_n * BLOCK_N + offs_w // 2) % N_OUT
        if INTERLEAVED:
            rows_w = 2 * col + offs_w % 2
        else:
            rows_w = col + (offs_w % 2) * N_OUT
    else:
        rows_w = offs_n % N_OUT
    # First gate and up weight row of the tile (UNIFORM_WS block scales).
    if INTERLEAVED:
        row_g0 = 2 * pid_n * BLOCK_N
        row_u0 = row_g0 + 1
    else:
        row_g0 = pid_n * BLOCK_N
        row_u0 = row_g0 + N_OUT
    is_gate_col = offs_w % 2 == 0

    COMPUTE: tl.constexpr = a_ptr.dtype.element_ty
    IS_INT: tl.constexpr = QDOT and W_FORMAT == 2
    if IS_INT:
        acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)

    w_base = w_ptr + expert * stride_we
    s_base = w_scale_ptr + expert * stride_se
    z_base = w_zp_ptr + expert * stride_ze
    IN_LOOP_QSCALE: tl.constexpr = QDOT and GROUP_K > 0  # fp8_block
    DEQ_GROUP: tl.constexpr = (not QDOT) and GROUP_K > 0  # weight-only group scales
    if DEQ_GROUP:
        sg_stride_n = stride_sn
    else:
        sg_stride_n = 0
    a_row_ptrs = a_ptr + a_rows[:, None] * stride_am
    PACKED: tl.constexpr = (W_FORMAT == 3 or W_FORMAT == 4) and HALF > 0  # split layout
    # S_PREFETCH with one chunk per K step: the step's scale codes were loaded by the step
    # before, so they are not a global load the step waits on. (Triton does not pipeline
    # these loads: one byte per thread is below its asynchronous-copy width.)
    PREFETCH: tl.constexpr = S_PREFETCH and PACKED and BLOCK_K == 2 * HALF
    # S_TILE with two or four chunks per K step (one scale group per half): the step's scale
    # codes are one [WIDTH, G_STEP] tile, pipelined with the weights.
    G_STEP: tl.constexpr = BLOCK_K // HALF if PACKED else 1
    STILE: tl.constexpr = S_TILE and PACKED and HALF == GROUP_K and (G_STEP == 4 or G_STEP == 8)
    s_lo_n = 0
    s_hi_n = 0
    if PREFETCH:
        s_lo_n, s_hi_n = _half_group_codes(
            s_base, rows_w, k_lo, K, stride_sn, stride_sk, GROUP_K, HALF
        )
    if FRAG:
        # Weights as the MMA's left operand, decoded in registers: acc^T = W @ A^T.
        acc_t = tl.zeros((WIDTH, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if FRAG:
            w_t = _fragment_tile(
                w_base,
                s_base,
                pid_n * WIDTH,
                k0,
                stride_wn,
                stride_sn,
                stride_sk,
                COMPUTE,
                WIDTH,
                GROUP_K,
                SCALE_FMT,
                BF16_FP4,
                MERGED_SCALE,
                E2M1_WORDS,
            )
            a = _a_tile(a_row_ptrs, k0, K, stride_ak, row_mask, BLOCK_K, EVEN_K, MASK_ROWS)
            acc_t = _mma(w_t, tl.trans(a), acc_t, False, IEEE)
        elif PACKED:
            s_lo_c = s_lo_n
            s_hi_c = s_hi_n
            if STILE:
                s_step = _step_scale_codes(
                    s_base, rows_w, k0, stride_sn, stride_sk, GROUP_K, G_STEP
                )
            if PREFETCH:
                s_lo_n, s_hi_n = _half_group_codes(
                    s_base, rows_w, k0 + BLOCK_K, K, stride_sn, stride_sk, GROUP_K, HALF
                )
            # Split layout, BLOCK_K // (2 * HALF) chunks per step: A's two contiguous halves of
            # each chunk meet its low and high nibbles.
            for c in tl.static_range(BLOCK_K // (2 * HALF)):
                kc = k0 + c * 2 * HALF
                # The chunk's scale codes: from the step's tile, loaded by the step before
                # (PREFETCH), or loaded here.
                if STILE:
                    s_lo_c = _column(s_step, 2 * c, G_STEP)
                    s_hi_c = _column(s_step, 2 * c + 1, G_STEP)
                elif not PREFETCH:
                    s_lo_c, s_hi_c = _half_group_codes(
                        s_base, rows_w, kc, K, stride_sn, stride_sk, GROUP_K, HALF
                    )
                offs_h = kc + tl.arange(0, HALF)
                rows_in = row_mask[:, None] | (not MASK_ROWS)
                a_lo = tl.load(
                    a_row_ptrs + offs_h[None, :] * stride_ak,
                    mask=rows_in & (offs_h[None, :] < K),
                    other=0,
                )
                a_hi = tl.load(
                    a_row_ptrs + (offs_h + HALF)[None, :] * stride_ak,
                    mask=rows_in & ((offs_h + HALF)[None, :] < K),
                    other=0,
                )
                w_lo, w_hi = _split_halves(
                    w_base,
                    s_lo_c,
                    s_hi_c,
                    z_base,
                    rows_w,
                    kc,
                    K,
                    stride_wn,
                    stride_wk,
                    stride_zn,
                    stride_zk,
                    COMPUTE,
                    W_FORMAT,
                    GROUP_K,
                    SCALE_FMT,
                    HAS_ZP,
                    HALF,
                    BF16_FP4,
                    MERGED_SCALE,
                    c > 0,
                )
                acc = _mma(a_lo, w_lo, acc, False, IEEE)
                acc = _mma(a_hi, w_hi, acc, False, IEEE)
        elif IN_LOOP_QSCALE:
            # Block scales change every GROUP_K along K: promote each group's product to the
            # float32 accumulator with its A-row and weight-block scales. A step of several
            # groups issues one MMA per group, so the promotion of one group overlaps the MMA
            # of the next (Triton waits for a non-accumulating MMA before its first use).
            SUB_K: tl.constexpr = BLOCK_K if BLOCK_K < GROUP_K else GROUP_K
            for sub in tl.static_range(BLOCK_K // SUB_K):
                kq = k0 + sub * SUB_K
                a = _a_tile(a_row_ptrs, kq, K, stride_ak, row_mask, SUB_K, EVEN_K, MASK_ROWS)
                b = _plain_tile(w_base, rows_w, kq, K, stride_wn, stride_wk, SUB_K, EVEN_K)
                # A group past K (last step of an uneven K) has no scales: they load as 0,
                # against a product of masked zeros.
                q_in = (kq < K) | EVEN_K
                a_s = tl.load(
                    a_scale_ptr + a_rows * stride_asm + (kq // GROUP_K) * stride_ask,
                    mask=q_in,
                    other=0.0,
                )
                s_k = s_base + (kq // GROUP_K) * stride_sk
                if UNIFORM_WS:
                    # The tile's gate rows share one scale block and so do its up rows: a
                    # scale per A row (and gate/up column), not an outer product per element.
                    w_g = tl.load(
                        s_k + (row_g0 // SCALE_ROW_BLOCK) * stride_sn, mask=q_in, other=0.0
                    )
                    s_g = a_s * w_g
                    if GATED:
                        w_u = tl.load(
                            s_k + (row_u0 // SCALE_ROW_BLOCK) * stride_sn, mask=q_in, other=0.0
                        )
                        s_u = a_s * w_u
                        scale = tl.where(is_gate_col[None, :], s_g[:, None], s_u[:, None])
                    else:
                        scale = s_g[:, None]
                else:
                    w_s = tl.load(
                        s_k + (rows_w // SCALE_ROW_BLOCK) * stride_sn, mask=q_in, other=0.0
                    )
                    scale = a_s[:, None] * w_s[None, :]
                acc += tl.dot(a, b) * scale
        else:
            a = _a_tile(a_row_ptrs, k0, K, stride_ak, row_mask, BLOCK_K, EVEN_K, MASK_ROWS)
            b = _weight_tile(
                w_base,
                s_base,
                z_base,
                rows_w,
                k0,
                K,
                stride_wn,
                stride_wk,
                sg_stride_n,
                stride_sk,
                stride_zn,
                stride_zk,
                COMPUTE,
                W_FORMAT,
                QDOT,
                GROUP_K if DEQ_GROUP else 0,
                SCALE_FMT,
                HAS_ZP,
                BLOCK_K,
                EVEN_K,
            )
            acc = _mma(a, b, acc, IS_INT, IEEE)

    if FRAG:
        acc = tl.trans(acc_t)
    if SPLIT_K > 1:
        # Split K: each of the SPLIT_K programs of this tile stores its partial sum in its
        # slot of the tile's region and counts itself in; the last to arrive sums the slots
        # in slot order (the same result whichever arrives last) and runs the epilogue.
        # The stores come before the count (a CTA barrier, then a release at GPU scope); the
        # last program's acquire comes before its loads, which bypass L1.
        slots = tl.arange(0, BLOCK_M)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
        if IS_INT:
            bits = acc.to(tl.float32, bitcast=True)
        else:
            bits = acc
        tl.store(split_part_ptr + pid_k * (BLOCK_M * WIDTH) + slots, bits, mask=row_mask[:, None])
        tl.debug_barrier()
        if tl.atomic_add(split_count_ptr, 1, sem="acq_rel") < SPLIT_K - 1:
            if LATE_WAIT:
                tl.extra.cuda.gdc_wait()  # as the epilogue would (``moe_gemm_kernel``)
            return
        tl.debug_barrier()
        total = tl.zeros((BLOCK_M, WIDTH), dtype=acc.dtype)
        for p in tl.static_range(SPLIT_K):
            part = tl.load(
                split_part_ptr + p * (BLOCK_M * WIDTH) + slots,
                mask=row_mask[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            if IS_INT:
                part = part.to(tl.int32, bitcast=True)
            total += part
        acc = total
        tl.atomic_xchg(split_count_ptr, 0, sem="relaxed")  # for the next call
    acc = acc.to(tl.float32)
    # Scales that are constant along K are applied once, after the loop.
    if A_SCALE == 1:
        acc = acc * tl.load(a_scale_ptr + a_rows * stride_asm)[:, None]
    if (not IN_LOOP_QSCALE) and (not DEQ_GROUP) and SCALE_FMT != 0:
        if SCALE_ROW_BLOCK == 0:
            ch_stride = 0
        else:
            ch_stride = stride_sn
        acc = acc * _channel_scale(s_base, rows_w, ch_stride, SCALE_FMT)[None, :]
    if HAS_GSCALE:
        acc = acc * tl.load(w_gscale_ptr + expert)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + expert * stride_be + rows_w * stride_bn)[None, :].to(
            tl.float32
        )
    if HAS_DELTA:
        # Per-row float32 additions in the weight's row order (w13 or w2 rows), before the
        # activation and the routing weight: LoRA computed by the launch before this one.
        if LATE_WAIT:  # that launch may still run: wait for it here (``moe_gemm_kernel``)
            tl.extra.cuda.gdc_wait()
        d_ptrs = (
            delta_ptr + rows_out.to(tl.int64)[:, None] * stride_dm + rows_w[None, :] * stride_dn
        )
        acc = acc + tl.load(d_ptrs, mask=row_mask[:, None], other=0.0)
    if GATED:
        g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        g = acc
        u = tl.full((BLOCK_M, BLOCK_N), 1.0, dtype=tl.float32)
    out = activate(g, u, alpha, limit, ACT)
    if MUL_ROUTE_W:
        rw = tl.load(route_w_ptr + rows_out, mask=row_mask, other=0.0).to(tl.float32)
        out = out * rw[:, None]
    out_ptrs = out_ptr + rows_out.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = row_mask[:, None] & n_mask[None, :]
    if OUT_QUANT:
        GROUPS: tl.constexpr = BLOCK_N // 128
        v = tl.where(n_mask[None, :], out.to(INTER_DTYPE).to(tl.float32), 0.0)
        q, scale = quant_groups_e4m3(tl.reshape(v, (BLOCK_M, GROUPS, 128)), FP8_ROUND_FIRST)
        tl.store(out_ptrs, tl.reshape(q, (BLOCK_M, BLOCK_N)), mask=out_mask)
        groups = pid_n * GROUPS + tl.arange(0, GROUPS)
        tl.store(
            out_scale_ptr
            + rows_out.to(tl.int64)[:, None] * stride_osm
            + groups[None, :] * stride_osg,
            scale,
            mask=row_mask[:, None] & (groups[None, :] < tl.cdiv(N_OUT, 128)),
        )
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    w_zp_ptr,
    w_gscale_ptr,
    bias_ptr,
    out_ptr,
    out_scale_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    route_w_ptr,
    delta_ptr,
    ids_ptr,
    block_done_ptr,
    split_part_ptr,
    split_count_ptr,
    N_OUT,
    K,
    num_rows,
    num_m_blocks,
    num_experts,
    early_programs,
    stream_producers,
    a_row_div,
    alpha,
    limit,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ze,
    stride_zn,
    stride_zk,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    stride_osm,
    stride_osg,
    stride_dm,
    stride_dn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE_W: tl.constexpr,
    W_FORMAT: tl.constexpr,
    QDOT: tl.constexpr,
    A_SCALE: tl.constexpr,
    SCALE_FMT: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_ROW_BLOCK: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
    IEEE: tl.constexpr,
    BF16_FP4: tl.constexpr,
    HALF: tl.constexpr,
    MERGED_SCALE: tl.constexpr,
    E2M1_WORDS: tl.constexpr,
    UNIFORM_WS: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    OUT_QUANT: tl.constexpr,
    INTER_DTYPE: tl.constexpr,
    FP8_ROUND_FIRST: tl.constexpr,
    PDL: tl.constexpr,
    S_PREFETCH: tl.constexpr,
    S_TILE: tl.constexpr,
    SPLIT_M: tl.constexpr,
    FRAG: tl.constexpr,
    K_NONEMPTY: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    EARLY: tl.constexpr,
    EARLY_STEPS: tl.constexpr,
    IDS_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    STREAM: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out[row, n] = epilogue(sum_k A[row // a_row_div, k] * W[expert, n, k]) on the MMA.

    GATED: two accumulators over w13 rows (gate, up), activation fused, N_OUT = I.
    SCALE_ROW_BLOCK: rows sharing one weight scale (1 per channel, 128 for fp8_block,
    0 for one scale per expert). GROUP_K: K elements sharing one scale (0: none along K).
    UNIFORM_WS: block-scaled fp8 whose tile's gate rows lie in one scale block and up rows in
    one (the launcher checks the alignment), so the scale is per row, not per element.
    ROW_BLOCKS: one block per row, experts read from the row ids (no alignment step).
    OUT_QUANT: GEMM1 only, BLOCK_N a multiple of 128: store e4m3 codes and per-(row, 128
    columns) scales of the output rounded to INTER_DTYPE, i.e. GEMM2's fp8_group128 input as
    the standalone quantization would make it from the stored intermediate
    (FP8_ROUND_FIRST: under the interpreter, see ``quant_groups_e4m3``).
    PDL: launched with programmatic dependent launch (``_pdl``).
    S_PREFETCH: packed weights with one chunk per K step load the scale codes a step ahead.
    S_TILE: packed weights with one scale group per half and 2 or 4 chunks per K step load the
    step's scale codes as one tile (scales padded by the launcher, see ``_step_scale_codes``).
    SPLIT_M: blocks of aligned rows whose second half is padding run a BLOCK_M // 2-row
    tile (an expert's last block: with ~BLOCK_M rows per expert about a third of all blocks).
    HALF: packed 4-bit weights in the split layout with chunks of 2 * HALF along K (0: not
    packed). MERGED_SCALE: e8m0 scales small enough to carry the fp4 decode's 2^126.
    E2M1_WORDS: how the fragment layout's words are stored and decoded
    (``_weight_decode.WORDS_*``).
    FRAG: e2m1 weights in the fragment layout (``_prepare.fragment_packed``; BLOCK_K 128): the
    tile's weight rows are rows pid_n * WIDTH on of that layout (w13 as gate/up row pairs),
    decoded in registers as the MMA's left operand against the transposed A tile.
    HAS_DELTA: ``delta_ptr`` holds float32 [rows, weight rows] added to the accumulator after
    the bias, before the activation and the routing weight (not with FRAG, whose tile
    columns are not weight rows in order). With PDL the kernel waits for the launch before
    it (the delta's) only before that addition, not on entry.
    K_NONEMPTY: K > 0, so the K loop runs at least once. The compiler then drops the loop's
    zero-trip path, which sets the accumulator outside the loop; with that path in place
    ptxas serializes every wgmma whose left operand comes from registers (its advisory
    C7515): the fragment layout's K loop waited for each 16-deep MMA before the next.
    MASK_ROWS: the A tile's padding rows are zero-filled instead of read (they would all read
    row 0): an expert with few rows fills most of its block with padding, so unmasked they
    move as many A bytes from L2 as real rows do.
    EARLY (with PDL and FRAG): programs below ``early_programs`` ask L2 for their tile's first
    EARLY_STEPS K steps before waiting for the launch before this one, so a launch that
    starts while its predecessor drains streams weights meanwhile. The tile's expert comes
    from ``block_expert`` (EARLY_FROM_BLOCKS: the launcher guarantees that the rows were
    laid out at least two launches back, so they are complete) or is computed from the row
    ids in ``ids_ptr`` (EARLY_FROM_IDS: the alignment is the launch before; the ids, written
    before it, are complete; IDS_POW2 >= num_rows, E_POW2 >= num_experts). Only a hint: the
    tile reads everything again after the wait.
    STREAM (with PDL; the launcher pairs the two GEMMs of one sequence, nothing between
    them): GEMM1 (STREAM_PUBLISH) counts each finished tile in ``block_done[pid_m]``;
    GEMM2 (STREAM_CONSUME) does not wait for GEMM1 to finish but, per block, for that
    block's count to reach ``stream_producers`` (GEMM1's tiles per block), so its blocks
    start while GEMM1's last ones still run. The last GEMM2 tile of a block resets the
    count to 0 for the next call; GEMM2 waits for GEMM1's end before it exits, so a finished
    GEMM2 still means a finished GEMM1 (``_pdl``). Every program of a split tile counts (so
    SPLIT_K per tile on either side).
    SPLIT_K: each output tile is SPLIT_K adjacent programs, each over its share of whole K
    steps (the launcher leaves none empty): for calls with too few tiles to fill the GPU.
    ``split_part_ptr`` holds float32 [tiles, SPLIT_K, BLOCK_M, WIDTH] partial sums (the
    int32 bits for the int8 MMA), ``split_count_ptr`` int32 [tiles] zeros; the last program
    of a tile to finish its share sums the partials in order, runs the epilogue and leaves
    the count at 0.
    """
    if K_NONEMPTY:
        tl.assume(K > 0)
    pid = tl.program_id(0)
    # Split K: a tile's SPLIT_K programs are adjacent.
    pid_k = pid % SPLIT_K
    tile = pid // SPLIT_K
    pid = tile
    if SPLIT_K > 1:
        k_share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * k_share
        k_hi = tl.minimum(K, k_lo + k_share)
        if K_NONEMPTY:
            tl.assume(k_hi > k_lo)
    else:
        k_lo = 0
        k_hi = K
    num_n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    WIDTH: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N  # weight rows of a tile
    # Grouped launch order: GROUP_M M-blocks share each weight tile while it is in L2.
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    CONSUME: tl.constexpr = PDL and STREAM == _STREAM_CONSUME and not HAS_DELTA
    PUBLISH: tl.constexpr = PDL and STREAM == _STREAM_PUBLISH and not HAS_DELTA
    if HAS_DELTA and PDL:
        # The launch before this one computes the delta from inputs that this kernel does
        # not write, and it started only once its own predecessor had finished (``_pdl``):
        # everything else this kernel reads is complete. So it streams its weights while
        # the delta is computed and waits for that launch only where the epilogue reads it.
        tl.extra.cuda.gdc_launch_dependents()
    else:
        if PDL and FRAG and EARLY != _EARLY_NONE:
            if pid < early_programs:
                if EARLY == _EARLY_FROM_IDS:
                    guess = block_expert_from_ids(
                        ids_ptr, num_rows, num_experts, pid_m, BLOCK_M, IDS_POW2, E_POW2
                    )
                elif ROW_BLOCKS:
                    guess = tl.load(block_expert_ptr + pid_m)
                else:
                    guess = tl.where(
                        pid_m * BLOCK_M < tl.load(num_padded_ptr),
                        tl.load(block_expert_ptr + pid_m),
                        -1,
                    )
                if (guess >= 0) & (guess < num_experts):
                    _fragment_prefetch(
                        w_ptr + guess.to(tl.int64) * stride_we,
                        pid_n * WIDTH,
                        k_lo // BLOCK_K,
                        stride_wn,
                        WIDTH,
                        EARLY_STEPS,
                    )
        if CONSUME:
            tl.extra.cuda.gdc_launch_dependents()
        else:
            _pdl.enter(PDL)

    if ROW_BLOCKS:
        # Few rows (decode): block pid_m is row pid_m alone and ``block_expert_ptr`` holds
        # each row's expert id, so no alignment launch precedes this one. A row whose id is
        # -1 (or out of range) has nothing to compute.
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if (expert < 0) | (expert >= num_experts):
            if CONSUME:
                tl.extra.cuda.gdc_wait()
            return
        first = sorted_rows_ptr
        short = False
    else:
        num_padded = tl.load(num_padded_ptr)
        if pid_m * BLOCK_M >= num_padded:
            if CONSUME:
                tl.extra.cuda.gdc_wait()
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        first = sorted_rows_ptr + pid_m * BLOCK_M
        short = False
        if SPLIT_M:
            # An expert's padding rows end its segment, so a block whose middle row is
            # padding has all its rows in the first half.
            short = tl.load(first + BLOCK_M // 2) >= num_rows
    if CONSUME:
        await_block(block_done_ptr + pid_m, stream_producers, num_n_blocks * SPLIT_K)
    # One instance of the tile per row count: BLOCK_M, and BLOCK_M // 2 for short blocks.
    for half in tl.static_range(1 + SPLIT_M):
        if short == (half == 1):
            BM: tl.constexpr = BLOCK_M >> half
            if ROW_BLOCKS:
                rows_out = tl.where(tl.arange(0, BM) == 0, pid_m, num_rows)
            else:
                rows_out = tl.load(first + tl.arange(0, BM))
            _gemm_block(
                rows_out,
                expert,
                pid_n,
                a_ptr,
                a_scale_ptr,
                w_ptr,
                w_scale_ptr,
                w_zp_ptr,
                w_gscale_ptr,
                bias_ptr,
                out_ptr,
                out_scale_ptr,
                route_w_ptr,
                delta_ptr,
                N_OUT,
                K,
                num_rows,
                a_row_div,
                alpha,
                limit,
                stride_am,
                stride_ak,
                stride_asm,
                stride_ask,
                stride_we,
                stride_wn,
                stride_wk,
                stride_se,
                stride_sn,
                stride_sk,
                stride_ze,
                stride_zn,
                stride_zk,
                stride_be,
                stride_bn,
                stride_om,
                stride_on,
                stride_osm,
                stride_osg,
                stride_dm,
                stride_dn,
                k_lo,
                k_hi,
                split_part_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * WIDTH),
                split_count_ptr + tile,
                pid_k,
                BM,
                BLOCK_N,
                BLOCK_K,
                EVEN_K,
                GATED,
                INTERLEAVED,
                ACT,
                HAS_BIAS,
                MUL_ROUTE_W,
                W_FORMAT,
                QDOT,
                A_SCALE,
                SCALE_FMT,
                GROUP_K,
                SCALE_ROW_BLOCK,
                HAS_ZP,
                HAS_GSCALE,
                IEEE,
                BF16_FP4,
                HALF,
                MERGED_SCALE,
                E2M1_WORDS,
                UNIFORM_WS,
                OUT_QUANT,
                INTER_DTYPE,
                FP8_ROUND_FIRST,
                S_PREFETCH,
                S_TILE,
                FRAG,
                HAS_DELTA,
                HAS_DELTA and PDL,
                MASK_ROWS,
                SPLIT_K,
            )
    if PUBLISH:
        # Every thread's stores of the tile come before the count (a CTA barrier, then one
        # release at GPU scope).
        tl.debug_barrier()
        tl.atomic_add(block_done_ptr + pid_m, 1, sem="release")
    if CONSUME:
        tl.extra.cuda.gdc_wait()
