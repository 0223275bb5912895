# Stage "experts" of the triton backend: validate, allocate, launch (public launcher).
#
# One kernel sequence serves every entry point (``run_kernel_sequence``):
#   align rows to BLOCK_M-padded expert segments (on device, no host sync; skipped for a
#   handful of rows, which the GEMMs then take one per block)
#   -> quantize GEMM1's input as the scheme says -> GEMM1 (+bias, activation fused)
#   -> quantize GEMM2's input (in GEMM1's epilogue where its tile holds whole groups)
#   -> GEMM2 (+bias, routing weight) into per-row outputs.
# ``fused_standard`` feeds it (token, slot) rows and reduces the k rows of each token;
# ``grouped_core`` feeds it the rows of the grouped ("permuted") layout as they are.
# Workspaces come from ``workspaces.WORKSPACES`` (kept per caller and shapes, or made per call
# where too large to keep). Switches come from the prepared weights' ``TritonOptions``
# (``prepared.options``), read per call.

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import triton

from ...config import ExpertSpec
from ...device_checks import ID_FLAGS
from ...errors import MoeInputError
from ...profiling import trace_range
from ...weights import PreparedWeights
from . import _activation as A
from . import _gemm_kernel as K
from . import _launch, _pdl, _plan, autotune
from . import _operands as OP
from . import _overlap as O
from . import _split_k as SK
from ._align import (
    SINGLE_PROGRAM_MAX_ROWS,
    align_rows,
    topk_sum,
)
from ._launch import cdiv as _cdiv
from ._prepare import FRAGMENT_K, FRAGMENT_ROWS, KernelWeight
from ._quant_kernel import quantize_rows
from ._weight_decode import e2m1_words
from .options import TritonOptions
from .tile_config import MoeTiles, TileConfig
from .workspaces import (
    WORKSPACES,
    alignment_buffers,
    intermediate_buffers,
    placeholder,
    split_k_workspace,
)

_ACT_IDS = {
    "silu": A.ACT_SILU,
    "gelu": A.ACT_GELU,
    "gelu_tanh": A.ACT_GELU_TANH,
    "swiglu_oai": A.ACT_SWIGLU_OAI,
    "swiglu_step": A.ACT_SWIGLU_STEP,
    "situ": A.ACT_SITU,  # (beta and linear beta in the alpha and limit slots)
    "relu2": A.ACT_RELU2,
    # non-gated forms: GEMM1's epilogue multiplies by 1 where a gated one has up
    "silu_no_mul": A.ACT_SILU,
    "gelu_no_mul": A.ACT_GELU,
    "gelu_tanh_no_mul": A.ACT_GELU_TANH,
}
# Activation formats the kernels feed to the MMA in the hidden dtype after fake-quantizing
# (exact for mxfp8 in bf16/fp32); the "qdot" ones are quantized (``_prepare``).
_EMULATED_ACT = ("mxfp8", "nvfp4")
_TL_DTYPES = {
    torch.bfloat16: triton.language.bfloat16,
    torch.float16: triton.language.float16,
    torch.float32: triton.language.float32,
}


def fuses_gemm2_input_quant(
    w2: KernelWeight, x: torch.Tensor, tile1: TileConfig, options: TritonOptions
) -> bool:
    """Whether GEMM1 stores GEMM2's fp8_group128 input itself (codes and scales) instead of
    the bf16 intermediate: its tile must hold whole 128-column groups. Saves a launch and a
    write and two reads of the intermediate. Off the GPU only with
    ``options.fuse_input_quant_off_gpu``."""
    return (
        w2.activation_format == "fp8_group128"
        and tile1.block_n % 128 == 0
        and (x.is_cuda or options.fuse_input_quant_off_gpu)
    )


def splits_blocks(
    block_m: int,
    consts: dict,
    rows_per_expert: float,
    row_blocks: bool = False,
    *,
    options: TritonOptions,
) -> bool:
    """Whether a GEMM launch with ``block_m``-row blocks, the weight constexprs ``consts`` and
    ``rows_per_expert`` rows per expert on average compiles the half-row tile
    (``options.split_min_block_m``, ``options.split_max_blocks_per_expert``): only where the
    weights reach the MMA as stored (plain, or fp8/int8 with a quantized A). A weight-only
    decode costs the same per weight at any row count, so half the rows would save little and
    add a second decode loop."""
    as_stored = consts["W_FORMAT"] == OP.WF_PLAIN or consts["QDOT"]
    min_block_m = options.split_min_block_m
    return (
        as_stored
        and not row_blocks
        and min_block_m is not None
        and block_m >= min_block_m
        and rows_per_expert <= options.split_max_blocks_per_expert * block_m
    )


@dataclass(frozen=True)
class RowLayout:
    """Where each GEMM block finds its rows and expert (see ``_gemm_kernel``)."""

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    row_blocks: bool

    @property
    def num_blocks(self) -> int:
        """M-blocks the GEMM grid covers (the kernel skips the unused ones)."""
        return self.block_expert.shape[0]


def layout_rows(
    row_expert: torch.Tensor,
    rows_per_token: int,
    num_experts: int,
    block_m: int,
    ws: dict[str, torch.Tensor],
    options: TritonOptions,
) -> RowLayout:
    """The row layout of one call: the row ids as blocks for at most
    ``options.row_blocks_max_tokens`` tokens (of ``rows_per_token`` rows each), else the
    device-side alignment into ``ws`` (from ``alignment_workspace``)."""
    if _row_blocks(row_expert.shape[0], rows_per_token, options):
        return RowLayout(row_expert, row_expert, row_expert, True)
    return aligned_rows(row_expert, num_experts, block_m, ws, options)


def _row_blocks(num_rows: int, rows_per_token: int, options: TritonOptions) -> bool:
    return num_rows <= options.row_blocks_max_tokens * rows_per_token


def aligns_in_one_program(num_rows: int, rows_per_token: int, options: TritonOptions) -> bool:
    """Whether a kernel sequence call of ``num_rows`` rows (``rows_per_token`` per token)
    aligns its rows, and in the alignment's one-program form (``align_rows``)."""
    return (
        not _row_blocks(num_rows, rows_per_token, options) and num_rows <= SINGLE_PROGRAM_MAX_ROWS
    )


def aligned_rows(
    row_group: torch.Tensor,
    num_groups: int,
    block_m: int,
    ws: dict[str, torch.Tensor],
    options: TritonOptions,
) -> RowLayout:
    """Rows grouped by ``row_group`` (an expert, or any id in ``[0, num_groups)``; -1
    skipped) and padded to ``block_m``-row blocks on the device, into ``ws`` (from
    ``alignment_workspace``)."""
    align_rows(
        row_group,
        num_groups,
        block_m,
        ws["sorted_rows"],
        ws["block_expert"],
        ws["num_padded"],
        ws["align_scratch"],
        options=options,
    )
    return RowLayout(ws["sorted_rows"], ws["block_expert"], ws["num_padded"], False)


def _quantize_input(
    x: torch.Tensor, w: KernelWeight, options: TritonOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM input in the form the kernel reads: (data, scale or None)."""
    fmt = w.activation_format
    if fmt == "none":
        return x, None
    from ...quant import fake_quantize_activation, quantize_activation

    if fmt in _EMULATED_ACT:
        return fake_quantize_activation(x, w.scheme).to(x.dtype), None
    if x.is_cuda:  # one launch; the interpreter rounds fp8 unlike torch, so not off the GPU
        rows, k = x.shape
        group = w.scheme.activation_group_size  # None: one scale per row
        qdtype = torch.int8 if fmt == "int8_token" else torch.float8_e4m3fn
        dev = x.device  # (a make function must not hold the call's tensors: plans keep it)
        bufs = WORKSPACES.get(
            (dev, "act_quant", fmt, group, rows, k),
            lambda: {
                "q": torch.empty(rows, k, dtype=qdtype, device=dev),
                "s": torch.empty(
                    (rows, _cdiv(k, group)) if group else (rows,),
                    dtype=torch.float32,
                    device=dev,
                ),
            },
        )
        quantize_rows(x, fmt, bufs["q"], bufs["s"], group or 128, options=options)
        return bufs["q"], bufs["s"]
    qx = quantize_activation(x, w.scheme)
    return qx.data.contiguous(), qx.scale.float().contiguous()


def launch_tile(tile: TileConfig, consts: dict, gated: bool) -> TileConfig:
    """The tile one GEMM launch runs for ``tile`` on a weight with kernel constexprs
    ``consts`` (``KernelWeight.constexprs``; ``gated``: GEMM1 of a gated activation): BLOCK_K
    rounded to whole chunks of a packed layout, or MoeInputError naming the constraint the
    tile breaks (K blocks of block-scaled fp8, scale groups, fragment-layout tile rows)."""
    group_k = consts["GROUP_K"]
    if consts["QDOT"] and group_k > 0 and group_k % tile.block_k and tile.block_k % group_k:
        raise MoeInputError(
            f"block_k {tile.block_k} must divide the K block {group_k} or be a multiple of it "
            "for block-scaled fp8"
        )
    half = consts["HALF"]
    if half:  # packed 4-bit: whole chunks of the split layout per K step
        chunk = 2 * half
        tile = dataclasses.replace(tile, block_k=max(chunk, tile.block_k // chunk * chunk))
    if consts["FRAG"]:  # one chunk of the fragment layout per K step
        tile = dataclasses.replace(tile, block_k=FRAGMENT_K)
        width = 2 * tile.block_n if gated else tile.block_n
        if width % 16 or FRAGMENT_ROWS % width:
            raise MoeInputError(
                f"e2m1 weights in the fragment layout need tiles of 16 to {FRAGMENT_ROWS} "
                f"weight rows, a power of two; got block_n {tile.block_n} "
                f"({width} rows{' with gate and up' if gated else ''})"
            )
    if (
        group_k
        and not consts["QDOT"]
        and not half
        and (tile.block_k % group_k and group_k % tile.block_k)
    ):
        raise MoeInputError(
            f"block_k {tile.block_k} and scale group {group_k} must divide one another"
        )
    return tile


def _launch_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: KernelWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    rows: RowLayout,
    num_rows: int,
    a_row_div: int,
    route_w: torch.Tensor | None,
    tile,
    n_out: int,
    spec: ExpertSpec | None,
    out_scale: torch.Tensor | None = None,
    inter_dtype: torch.dtype | None = None,
    *,
    options: TritonOptions,
    delta: torch.Tensor | None = None,
    early: int = O.EARLY_NONE,
    row_ids: torch.Tensor | None = None,
    stream: int = O.STREAM_NONE,
    block_done: torch.Tensor | None = None,
    stream_producers: int = 0,
    slot: int = 0,
) -> int:
    """One grouped GEMM launch; ``spec`` given means GEMM1 (gated activation fused).
    Returns the programs it ran per block of rows (column tiles times split-K programs per
    tile): the count a streaming GEMM1 leaves per block for GEMM2 to wait for.

    ``out_scale`` given (GEMM1 only, see ``fuses_gemm2_input_quant``): ``out`` is e4m3 and
    takes the codes, ``out_scale`` [rows, ceil(N / 128)] the scales of the output as rounded
    to ``inter_dtype``. ``options``: the prepared weights' (``prepared.options``).
    ``delta``: float32 [rows, w's rows] added to the product before the activation and the
    routing weight (``lora.SequenceLora``). ``early``: where the launch's early L2 prefetch
    may find its tiles' experts (``_overlap.EARLY_*``; the caller vouches for it, see
    ``moe_gemm_kernel``), with ``row_ids`` the rows' expert ids for ``EARLY_FROM_IDS``.
    ``stream``: this GEMM's side of GEMM1 -> GEMM2 streaming (``_overlap.STREAM_*``),
    counting in ``block_done``; GEMM2 waits per block for ``stream_producers`` GEMM1 tiles.
    ``slot``: which split-K workspace the launch uses (``split_k_workspace``): launches that
    may overlap under PDL take different ones."""
    dev = a.device
    dummy = placeholder(dev)
    k = w.shape[2]
    consts = dict(w.constexprs)
    gated = spec is not None and spec.gated
    tile = launch_tile(tile, consts, gated)
    scale = w.scale if w.scale is not None else dummy
    zp = w.zero_point if w.zero_point is not None else dummy
    gs = w.global_scale if w.global_scale is not None else dummy
    s_strides = _scale_strides(w)
    z_strides = (
        (zp.stride(0), zp.stride(1), zp.stride(2)) if w.zero_point is not None else (0, 0, 0)
    )
    b = bias if bias is not None else dummy
    b_strides = (b.stride(0), b.stride(1)) if bias is not None else (0, 0)
    interleaved = gated and spec.gate_up_interleaved
    num_m_blocks = rows.num_blocks
    k_steps = _cdiv(k, tile.block_k)
    n_blocks = _cdiv(n_out, tile.block_n)
    num_tiles = num_m_blocks * n_blocks
    sms = _launch.multiprocessors(dev) if w.data.is_cuda else None
    split = SK.split_k_for(tile, consts, num_tiles, k_steps, sms, options, spec is not None)
    grid = (num_tiles * split,)
    act = spec.activation if spec is not None else None
    a_s = a_scale if a_scale is not None else dummy
    a_s_strides = (a_s.stride(0), a_s.stride(1) if a_s.dim() > 1 else 0)
    if out_scale is not None and (tile.block_n % 128 or inter_dtype not in _TL_DTYPES):
        raise MoeInputError(
            f"quantizing in the epilogue needs block_n a multiple of 128 and a bf16/fp16/fp32 "
            f"intermediate, got block_n {tile.block_n} and {inter_dtype}"
        )
    o_s = out_scale if out_scale is not None else dummy
    o_s_strides = (o_s.stride(0), o_s.stride(1)) if out_scale is not None else (0, 0)
    if delta is not None and consts["FRAG"]:
        raise MoeInputError(
            "a per-row delta needs the GEMM's columns in weight row order; e2m1 weights in "
            "the fragment layout store gate/up row pairs"
        )
    d_strides = (delta.stride(0), delta.stride(1)) if delta is not None else (0, 0)
    # fp4 -> bf16 through packed integer ops (inline PTX: compiled GPU code only).
    bf16_fp4 = (
        consts["W_FORMAT"] == OP.WF_E2M1
        and a.dtype == torch.bfloat16
        and a.is_cuda
        and consts["SCALE_FMT"] in (OP.SF_E8M0, OP.SF_E4M3)
    )
    width = 2 * tile.block_n if gated else tile.block_n
    if not (consts["FRAG"] and w.data.is_cuda):  # the prefetch is inline PTX
        early = O.EARLY_NONE
    early, early_steps, ids_pow2, e_pow2 = O.early_prefetch(
        early,
        min(SK.last_share(split, k_steps), w.data.shape[2] // FRAGMENT_K),
        w.shape[0],
        num_rows,
        options,
    )
    if split > 1:
        split_ws = split_k_workspace(dev, slot, num_tiles, split, tile.block_m, width)
    else:
        split_ws = {"part": dummy, "count": dummy}
    _launch.launch(
        K.moe_gemm_kernel,
        grid,
        a,
        a_s,
        w.data,
        scale,
        zp,
        gs,
        b,
        out,
        o_s,
        rows.sorted_rows,
        rows.block_expert,
        rows.num_padded,
        route_w if route_w is not None else dummy,
        delta if delta is not None else dummy,
        row_ids if early == O.EARLY_FROM_IDS else dummy,
        block_done if stream != O.STREAM_NONE else dummy,
        split_ws["part"],
        split_ws["count"],
        n_out,
        k,
        num_rows,
        num_m_blocks,
        w.shape[0],
        O.early_programs(dev) if early != O.EARLY_NONE else 0,
        stream_producers,
        a_row_div,
        float(act.alpha) if act is not None and act.alpha is not None else 0.0,
        float(act.limit) if act is not None and act.limit is not None else 0.0,
        a.stride(0),
        a.stride(1),
        *a_s_strides,
        w.data.stride(0),
        w.data.stride(1),
        w.data.stride(2),
        *s_strides,
        *z_strides,
        *b_strides,
        out.stride(0),
        out.stride(1),
        *o_s_strides,
        *d_strides,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m if rows.row_blocks else max(tile.group_m, options.min_group_m),
        EVEN_K=k % tile.block_k == 0,
        GATED=gated,
        INTERLEAVED=interleaved,
        ACT=_ACT_IDS[act.name] if act is not None else A.ACT_NONE,
        HAS_BIAS=bias is not None,
        MUL_ROUTE_W=route_w is not None,
        IEEE=a.dtype == torch.float32,
        BF16_FP4=bf16_fp4,
        E2M1_WORDS=e2m1_words(w.layout.placed_words, bf16_fp4, width, tile.num_warps),
        UNIFORM_WS=_uniform_block_scale(consts, tile.block_n, n_out, gated, interleaved),
        ROW_BLOCKS=rows.row_blocks,
        OUT_QUANT=out_scale is not None,
        INTER_DTYPE=_TL_DTYPES[inter_dtype] if out_scale is not None else None,
        FP8_ROUND_FIRST=out_scale is not None and not a.is_cuda,
        S_PREFETCH=options.scale_prefetch,
        S_TILE=options.scale_tiles and w.scale_tiles,
        SPLIT_M=splits_blocks(
            tile.block_m, consts, num_rows / w.shape[0], rows.row_blocks, options=options
        ),
        K_NONEMPTY=consts["FRAG"] and options.fragment_async_mma and k > 0,
        HAS_DELTA=delta is not None,
        MASK_ROWS=options.mask_padding_rows,
        EARLY=early,
        EARLY_STEPS=early_steps,
        IDS_POW2=ids_pow2,
        E_POW2=e_pow2,
        STREAM=stream,
        SPLIT_K=split,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        options=options,
        **consts,
    )
    return n_blocks * split


def _uniform_block_scale(
    consts: dict, block_n: int, n_out: int, gated: bool, interleaved: bool
) -> bool:
    """True when every tile's gate rows lie in one weight-scale block and so do its up rows
    (block-scaled fp8 only): the K loop then scales per row instead of per element.

    A tile covers output columns [j * block_n, (j + 1) * block_n): weight rows of that range
    (non-gated), the same range and the range shifted by ``n_out`` (gate then up), or twice
    the range (interleaved gate/up)."""
    row_block = consts["SCALE_ROW_BLOCK"]
    if not (consts["QDOT"] and consts["GROUP_K"] > 0 and row_block > 0):
        return False
    span = 2 * block_n if interleaved else block_n
    return row_block % span == 0 and (not gated or interleaved or n_out % row_block == 0)


def _scale_strides(w: KernelWeight) -> tuple[int, int, int]:
    s = w.scale
    if s is None:
        return (0, 0, 0)
    if s.dim() == 1:  # per tensor [E]
        return (s.stride(0), 0, 0)
    if s.dim() == 2:  # per channel [E, N]
        return (s.stride(0), s.stride(1), 0)
    return (s.stride(0), s.stride(1), s.stride(2))


def sequence_workspace(
    a_RH: torch.Tensor,
    num_rows: int,
    a_row_div: int,
    prepared: PreparedWeights,
    tiles: MoeTiles | None = None,
    deltas=None,
) -> tuple[MoeTiles, dict[str, torch.Tensor], bool]:
    """(tiles, workspace, whether GEMM1 quantizes GEMM2's input) of a ``run_kernel_sequence``
    call of ``num_rows`` rows on ``a_RH``: its alignment and intermediate buffers. With
    ``deltas`` GEMM2's input stays in the hidden dtype (their ``down`` reads it)."""
    spec = prepared.spec
    num_experts, inter = spec.num_experts, spec.intermediate_size
    dev = a_RH.device
    if tiles is None:
        tiles = autotune.tiles_for_call(prepared, num_rows // a_row_div, a_row_div, dev)
    bm = tiles.gemm1.block_m
    fuse = deltas is None and fuses_gemm2_input_quant(
        prepared.tensors["w2"], a_RH, tiles.gemm1, prepared.options
    )
    # Two keys: a prefill's intermediate buffer may be large enough to be made per call
    # (``workspaces.Workspaces``), the alignment's small buffers then stay kept.
    aligned = WORKSPACES.get(
        (dev, "aligned", num_rows, num_experts, bm),
        lambda: alignment_buffers(num_rows, num_experts, bm, dev),
    )
    dtype = a_RH.dtype
    between = WORKSPACES.get(
        (dev, "inter", num_rows, inter, dtype, fuse),
        lambda: intermediate_buffers(num_rows, inter, dtype, fuse, dev),
    )
    return tiles, {**aligned, **between}, fuse


def run_kernel_sequence(
    a_RH: torch.Tensor,
    row_expert: torch.Tensor,
    a_row_div: int,
    route_w: torch.Tensor | None,
    prepared: PreparedWeights,
    out_PH: torch.Tensor,
    tiles: MoeTiles | None = None,
    prealigned: bool = False,
    deltas=None,
) -> None:
    """The one kernel sequence: rows ``p`` of ``out_PH`` get expert ``row_expert[p]`` applied
    to ``a_RH[p // a_row_div]`` (times ``route_w[p]`` when given); rows with id -1 are left
    unwritten. ``tiles``: None for the prepared weights' tuned or heuristic ones.
    ``prealigned``: the caller wrote the alignment of ``row_expert`` into the call's
    workspace (``sequence_workspace``) with ``tiles.gemm1.block_m``; no alignment runs.

    ``deltas``: None, or per-row additions to both GEMMs (``lora.SequenceLora``): its
    ``gate_up(a_RH, row_expert)`` launches before GEMM1 and its ``down(inter_RI,
    row_expert)`` before GEMM2, each returning float32 [rows, w's rows] (or None: nothing
    to add), which GEMM1 adds before its activation and GEMM2 before the routing weight.
    GEMM2's input then stays in the hidden dtype (``down`` reads it).
    """
    spec = prepared.spec
    options = prepared.options
    t = prepared.tensors
    w13, w2 = t["w13"], t["w2"]
    num_rows = row_expert.shape[0]
    num_experts, inter, hidden = spec.num_experts, spec.intermediate_size, spec.hidden_size
    tiles, ws, fuse = sequence_workspace(a_RH, num_rows, a_row_div, prepared, tiles, deltas)
    bm = tiles.gemm1.block_m
    if prealigned:
        rows = RowLayout(ws["sorted_rows"], ws["block_expert"], ws["num_padded"], False)
    else:
        rows = layout_rows(row_expert, a_row_div, num_experts, bm, ws, options)
    # GEMM2 starts each block once GEMM1 has finished its rows: only where GEMM2 follows
    # GEMM1 directly (no quantization or delta launch between) under PDL, over aligned rows
    # (row blocks: a token's few experts leave nothing to overlap; measured 0.99x at T = 1).
    overlap = num_rows // a_row_div <= options.overlap_max_tokens
    stream = (
        options.stream_gemms
        and overlap
        and not rows.row_blocks
        and deltas is None
        and (fuse or w2.activation_format == "none")
        and options.pdl
        and _pdl.supported(a_RH)
    )
    # A delta's launch comes right before its GEMM, which with PDL waits for it only in
    # its epilogue (``_gemm_kernel.moe_gemm_kernel``): nothing the GEMM's K loop reads may
    # be written by that launch, so the input's quantization goes first.
    with trace_range("gemm1"):
        a, a_scale = _quantize_input(a_RH, w13, options)
        w13_rows = 2 * inter if spec.gated else inter
        delta = deltas.gate_up(a_RH, row_expert, w13_rows) if deltas is not None else None
        gemm1_programs = _launch_gemm(
            a,
            a_scale,
            w13,
            t["w13_bias"],
            ws["inter"],
            rows,
            num_rows,
            a_row_div,
            None,
            tiles.gemm1,
            inter,
            spec,
            ws.get("inter_scale"),
            a_RH.dtype,
            options=options,
            delta=delta,
            early=O.gemm1_early(prealigned, rows.row_blocks, a is not a_RH, deltas)
            if overlap
            else O.EARLY_NONE,
            row_ids=row_expert,
            stream=O.STREAM_PUBLISH if stream else O.STREAM_NONE,
            block_done=ws["block_done"],
        )
    with trace_range("gemm2"):
        if fuse:
            a2, a2_scale = ws["inter"], ws["inter_scale"]
        else:
            a2, a2_scale = _quantize_input(ws["inter"], w2, options)
        delta = deltas.down(ws["inter"], row_expert, hidden) if deltas is not None else None
        try:
            _launch_gemm(
                a2,
                a2_scale,
                w2,
                t["w2_bias"],
                out_PH,
                rows,
                num_rows,
                1,
                route_w,
                tiles.gemm2,
                hidden,
                None,
                options=options,
                delta=delta,
                # The rows were laid out before GEMM1 (and a delta's GEMM waits late anyway).
                early=O.EARLY_FROM_BLOCKS if delta is None and overlap else O.EARLY_NONE,
                stream=O.STREAM_CONSUME if stream else O.STREAM_NONE,
                block_done=ws["block_done"],
                stream_producers=gemm1_programs if stream else 0,
                slot=1,
            )
        except BaseException:
            # GEMM1 counted its blocks done and no GEMM2 will reset the counts.
            if stream:
                ws["block_done"].zero_()
            raise


def _check_hidden(hidden: torch.Tensor, prepared: PreparedWeights, name: str) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() != 2 or hidden.shape[1] != prepared.spec.hidden_size:
        raise MoeInputError(
            f"{name} must be [rows, H={prepared.spec.hidden_size}], got {list(hidden.shape)}"
        )
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} dtype must be bf16/fp16/fp32, got {hidden.dtype}")
    w13 = prepared.tensors["w13"]
    if w13.scheme is None and w13.data.dtype != hidden.dtype:
        raise TypeError(f"{name} dtype {hidden.dtype} differs from the weights' {w13.data.dtype}")


def _on_device(x: torch.Tensor):
    """Context that makes ``x``'s GPU the current device for the launches: Triton compiles
    for and launches on the current device, and a model spread over GPUs (transformers'
    ``device_map``) calls each layer without switching it."""
    if x.is_cuda and x.device.index is not None and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


# The routing dtypes the kernels read as they are: (ids, weights).
ROUTING_DTYPES = (
    frozenset({torch.int32, torch.int64}),
    frozenset({torch.float32, torch.bfloat16, torch.float16}),
)


def fused_standard(
    hidden_TH: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedWeights,
    tiles: MoeTiles | None = None,
    check_ids: bool = False,
    deltas=None,
) -> torch.Tensor:
    """Standard format whole: ``[T, H]`` routed, weighted, reduced over k; -1 ids skipped.
    ``check_ids`` (CUDA): the top-k reduction also checks the ids (``device_checks.IdFlags``:
    a bad id raises from a later call or ``moerunner.check_errors()``). ``deltas``: per-row
    additions to the GEMMs (``run_kernel_sequence``); such a call neither records nor
    replays a launch plan, whose key does not name the deltas' tensors."""
    _check_hidden(hidden_TH, prepared, "hidden_states")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_TH.shape[0]:
        raise MoeInputError(
            f"topk ids must be [T={hidden_TH.shape[0]}, k], got {list(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise MoeInputError(
            f"topk weights {list(topk_weights.shape)} and ids "
            f"{list(topk_ids.shape)} must have one shape"
        )
    num_tokens, top_k = topk_ids.shape
    # Row-major whatever the input's strides: the top-k reduction stores row t at
    # t * stride(0) + column (a transposed input's empty_like would be column-major).
    out = torch.empty(hidden_TH.shape, dtype=hidden_TH.dtype, device=hidden_TH.device)
    if num_tokens == 0:
        return out
    hidden_TH = hidden_TH.contiguous()
    # The kernels read int32 or int64 ids (compared in their own width: no id outside
    # [0, E) can wrap into it) and fp32/bf16/fp16 weights (widened to fp32 exactly where
    # read): a caller's routing in those dtypes takes no conversion launch. Deltas (LoRA)
    # index their own tables with int32 row experts.
    wide = deltas is None and topk_ids.dtype in ROUTING_DTYPES[0]
    ids = topk_ids if wide else topk_ids.to(torch.int32)
    ids = ids.contiguous()
    w = topk_weights if topk_weights.dtype in ROUTING_DTYPES[1] else topk_weights.float()
    route_w = w.reshape(-1).contiguous()
    dev = hidden_TH.device
    with _on_device(hidden_TH):
        # One eager call's launches, replayed from a plan where one exists (``_plan``).
        roles = (hidden_TH, ids, route_w, out)
        id_flags = ID_FLAGS.buffer(dev) if check_ids and dev.type == "cuda" else None
        if tiles is None and prepared.options.autotune != "off":
            # A new token bucket is tuned before a plan records this call's launches.
            autotune.tiles_for_call(prepared, num_tokens, top_k, dev)
        planned = tiles is None and deltas is None and _plan.enabled(prepared.options, dev)
        if planned:
            plans = _plan.plans_of(prepared)
            plan_key = _standard_plan_key(roles, prepared, id_flags is not None)
            if _plan.replay(plans, plan_key, roles):
                if id_flags is not None:
                    ID_FLAGS.poll(dev)
                return out
        with _plan.recorded(plans, plan_key, roles) if planned else contextlib.nullcontext():
            standard_sequence(
                hidden_TH, ids, route_w, out, prepared, tiles, id_flags, deltas=deltas
            )
        if id_flags is not None:
            ID_FLAGS.poll(dev)
    return out


def standard_sequence(
    hidden_TH: torch.Tensor,
    ids: torch.Tensor,
    route_w: torch.Tensor,
    out: torch.Tensor,
    prepared: PreparedWeights,
    tiles: MoeTiles | None = None,
    id_flags: torch.Tensor | None = None,
    prealigned: bool = False,
    deltas=None,
) -> None:
    """The launches of a ``fused_standard`` call on checked, contiguous inputs (T >= 1):
    ``ids`` [T, k] int32 or int64, ``route_w`` [T * k] fp32, bf16 or fp16
    (``ROUTING_DTYPES``), into ``out`` [T, H].
    ``prealigned``, ``deltas``: as ``run_kernel_sequence``'s, for the rows ``ids.view(-1)``."""
    num_rows = ids.numel()
    hidden, dev = prepared.spec.hidden_size, hidden_TH.device
    dtype = hidden_TH.dtype
    cache = WORKSPACES.get(
        (dev, "per_slot", num_rows, hidden, dtype),
        lambda: {"y": torch.empty(num_rows, hidden, dtype=dtype, device=dev)},
    )
    top_k = ids.shape[1]
    run_kernel_sequence(
        hidden_TH, ids.view(-1), top_k, route_w, prepared, cache["y"], tiles, prealigned, deltas
    )
    with trace_range("combine"):
        topk_sum(
            cache["y"],
            ids,
            out,
            prepared.spec.num_experts,
            options=prepared.options,
            id_flags=id_flags,
        )


def _standard_plan_key(roles: tuple, prepared: PreparedWeights, checks_ids: bool) -> tuple:
    """The plan key of a ``fused_standard`` call whose roles are ``(hidden [T, H], ids
    [T, k], routing weights [T * k], out [T, H])`` (their dtypes are part of the key)."""
    return _plan.key(roles, prepared.options, checks_ids)


def standard_plan(
    roles: tuple, prepared: PreparedWeights, checks_ids: bool = False
) -> _plan.LaunchPlan | None:
    """The plan that ``fused_standard`` recorded for calls whose roles are like ``roles``
    (``_standard_plan_key``; same shapes, dtypes and alignments), with the id check on the
    device or without it (``checks_ids``), if it made one and it is alive; None otherwise."""
    plan = _plan.plans_of(prepared).get(_standard_plan_key(roles, prepared, checks_ids))
    return plan if isinstance(plan, _plan.LaunchPlan) and plan.alive() else None


def grouped_core(
    x_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    prepared: PreparedWeights,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """Grouped layout: rows ``offsets[e]:offsets[e+1]`` through expert ``e``, unweighted.

    Rows at or past ``offsets[E]`` are padding and are left unwritten.
    """
    _check_hidden(x_MH, prepared, "x_MH")
    num_experts = prepared.spec.num_experts
    if expert_offsets.dim() != 1 or expert_offsets.shape[0] != num_experts + 1:
        raise MoeInputError(
            f"expert_offsets must be [E+1={num_experts + 1}], got {list(expert_offsets.shape)}"
        )
    rows = x_MH.shape[0]
    y = torch.empty(x_MH.shape, dtype=x_MH.dtype, device=x_MH.device)  # row-major
    if rows == 0:
        return y
    row_ids = torch.arange(rows, device=x_MH.device)
    ends = expert_offsets[1:].to(device=x_MH.device, dtype=torch.int64)
    row_expert = torch.searchsorted(ends, row_ids, right=True)
    row_expert = torch.where(row_expert < num_experts, row_expert, -1).to(torch.int32)
    with _on_device(x_MH):
        run_kernel_sequence(x_MH.contiguous(), row_expert, 1, None, prepared, y, tiles)
    return y
