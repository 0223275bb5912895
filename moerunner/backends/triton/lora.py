# Stage "experts" of the triton backend: LoRA deltas as Triton kernels (public launcher).
#
# A standard-format call whose hooks are all ``moerunner.lora.LoraDelta`` records and whose
# rows are few per (adapter, expert) pair (decode) runs them inside the fused kernel sequence
# (``sequence_lora``): before each GEMM one row-block launch stores its delta
# scale * (x @ A^T) @ B^T into a float32 workspace, and the GEMM adds it to its accumulator
# before the activation (GEMM1) or the routing weight (GEMM2).
#
# Otherwise the hooked sequence (``hooked.py``) hands every such hook to ``apply_hook``
# here instead of calling its PyTorch form: the delta added to the float32 GEMM output, over
# one row layout per call (``lora_layout``) that both GEMMs' deltas share. With few rows per
# (adapter, expert) pair each row is its own block, finds its pair in the kernel and runs
# shrink and expand in one launch; with many, the rows are grouped by pair on the device
# (pair ids, then the experts' alignment step over pairs: ``_align.align_rows``), so each
# block reads one pair's factors once, in a shrink launch (into a float32 [rows, rank]
# workspace) and an expand launch. No host reads in either sequence: a call with LoRA stays
# CUDA-graph capturable. Kernel bodies: ``_lora_kernel``.
#
# Precision: each ``tl.dot`` multiplies in the factors' dtype where they are 16-bit (so the
# float32 rank values are rounded to it before the expand, as a 16-bit PEFT Linear rounds
# them), and in IEEE float32 otherwise (``_dot_dtype``); the torch backend's PyTorch form
# multiplies in float32 throughout. With 16-bit factors the two differ by about one 16-bit
# rounding of the delta (fp32 activations, fp16 factors: 1.3e-4 relative against 1.8e-7).

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ...errors import MoeInputError
from ...hooks import HookRows, MoeHooks
from ...lora import LoraDelta
from . import _launch
from ._launch import cdiv as _cdiv
from ._launch import next_power_of_2 as _pow2
from ._lora_kernel import (
    lora_expand_kernel,
    lora_rows_kernel,
    lora_shrink_kernel,
    pair_ids_kernel,
)
from .experts import _TL_DTYPES, aligned_rows
from .options import TritonOptions
from .workspaces import WORKSPACES, alignment_workspace

# Elements of one factor tile of the row-block kernel: [RANK, BLOCK_K] of A (16 K: few K
# steps, each a dependent round trip to memory, as one program reads all of A) and
# [BLOCK_N, RANK] of B (4 K: a decode call spreads B over many programs).
_ROW_A_TILE = 16384
_ROW_B_TILE = 4096
# Programs the row-block kernel aims at: each row's N blocks are split into groups (each
# recomputing the row's rank values) only until the grid has about this many programs, so
# few rows spread their factor reads wide and many rows read A about once each.
_ROW_PROGRAMS = 256


@dataclass(frozen=True)
class LoraLayout:
    """Where the LoRA kernels find the rows of each block and their (adapter, expert) pair.

    ``row_blocks``: block i is row i, its pair read in the kernel from ``expert[i]``,
    ``token[i]`` and ``adapter_T``; otherwise ``sorted_rows`` holds the rows of each
    ``block_m`` block (sentinel: the number of rows), ``block_pair`` its pair
    (adapter x E + expert) and ``num_padded`` the used length (``_align.align_rows``).
    ``num_experts``: the E the adapters cover (rows of experts past it have no pair)."""

    expert: torch.Tensor
    token: torch.Tensor
    adapter_T: torch.Tensor
    num_experts: int
    row_blocks: bool
    block_m: int
    sorted_rows: torch.Tensor
    block_pair: torch.Tensor
    num_padded: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """Blocks the grids cover (the kernels skip the unused ones)."""
        return self.block_pair.shape[0]


def groups_rows(num_rows: int, num_pairs: int, options: TritonOptions) -> bool:
    """Whether ``num_rows`` rows over ``num_pairs`` (adapter, expert) pairs are grouped by
    pair (``options.lora_group_min_rows_per_pair``) rather than taken one row per block."""
    return num_rows > 0 and num_rows >= options.lora_group_min_rows_per_pair * num_pairs


def lora_layout(rows: HookRows, delta: LoraDelta, options: TritonOptions) -> LoraLayout:
    """The row layout of ``delta``'s adapters over ``rows`` (see ``LoraLayout``)."""
    num_rows = rows.expert.shape[0]
    num_pairs = delta.lora.num_adapters * delta.lora.num_experts
    expert, token = rows.expert.contiguous(), rows.token.contiguous()
    adapter_T = delta.adapter_T.contiguous()
    common = (expert, token, adapter_T, delta.lora.num_experts)
    if not groups_rows(num_rows, num_pairs, options):
        return LoraLayout(*common, True, 16, expert, expert, expert)  # block_m unused
    dev = expert.device
    per_pair = num_rows / num_pairs
    block_m = 16 if per_pair <= 16 else 32 if per_pair <= 32 else 64
    ws = WORKSPACES.get(
        (dev, "lora_align", num_rows, num_pairs, block_m),
        lambda: {
            **alignment_workspace(num_rows, num_pairs, block_m, dev),
            "pair": torch.empty(num_rows, dtype=torch.int32, device=dev),
        },
    )
    block = 1024
    _launch.launch(
        pair_ids_kernel,
        (_cdiv(num_rows, block),),
        expert,
        token,
        adapter_T,
        ws["pair"],
        num_rows,
        delta.lora.num_experts,
        adapter_T.shape[0],
        BLOCK=block,
        num_warps=4,
        options=options,
    )
    grouped = aligned_rows(ws["pair"], num_pairs, block_m, ws, options)
    return LoraLayout(
        *common, False, block_m, grouped.sorted_rows, grouped.block_expert, grouped.num_padded
    )


def _dot_dtype(x: torch.dtype, w: torch.dtype) -> tuple:
    """(Triton type in which ``tl.dot`` multiplies, whether in IEEE float32): the shared
    16-bit type, else float32 without TF32."""
    if x == w and x in (torch.bfloat16, torch.float16):
        return _TL_DTYPES[x], False
    return tl.float32, True


def _scales(lora, dev: torch.device) -> tuple:
    """(float32 scales per adapter or None, the scale as a number when one for all); the
    per-adapter tensor is the one kept on the weights (``MoeLoraWeights.scale_per_adapter``)."""
    per_adapter = lora.scale_per_adapter
    if per_adapter is not None:
        return per_adapter.to(dev), 0.0
    return None, float(lora.scaling)


def rows_grid(num_rows: int, n: int, block_n: int, programs: int = _ROW_PROGRAMS) -> tuple:
    """(N groups per row, BLOCK_N blocks per group) of the row-block kernel: the row's
    ``cdiv(n, block_n)`` blocks split until the grid has about ``programs`` programs."""
    n_blocks = _cdiv(n, block_n)
    groups = min(n_blocks, max(1, _cdiv(programs, num_rows)))
    per_group = _cdiv(n_blocks, groups)
    return _cdiv(n_blocks, per_group), per_group


def _apply_rows(
    out_RN: torch.Tensor,
    x_XK: torch.Tensor,
    a_row_div: int,
    delta: LoraDelta,
    layout: LoraLayout,
    options: TritonOptions,
    programs: int,
) -> None:
    """Row blocks of the hooked sequence: each row's delta added to ``out_RN``."""
    _launch_rows(out_RN, x_XK, a_row_div, delta, layout.expert, layout.token, 0, options, programs)


def _launch_rows(
    out_RN: torch.Tensor,
    x_XK: torch.Tensor,
    a_row_div: int,
    delta: LoraDelta,
    expert_R: torch.Tensor,
    token_R: torch.Tensor | None,
    rows_per_token: int,
    options: TritonOptions,
    programs: int = _ROW_PROGRAMS,
) -> None:
    """Shrink and expand of every row in one launch (``lora_rows_kernel``): row r's token is
    ``token_R[r]``, or with ``token_R`` None ``r // rows_per_token``, and its delta is added
    to ``out_RN`` (``token_R`` given: the hooked sequence) or stored into it (None: the fused
    sequence's delta buffers, 0 for rows without a pair)."""
    a, b = delta.a, delta.b
    num_rows, n = out_RN.shape
    k, rank = a.shape[3], a.shape[2]
    rank_p = max(16, _pow2(rank))
    block_k = min(max(16, _ROW_A_TILE // rank_p), max(16, _pow2(k)))
    block_n = min(max(16, _ROW_B_TILE // rank_p), max(16, _pow2(n)))
    groups, per_group = rows_grid(num_rows, n, block_n, programs)
    scales, scale_value = _scales(delta.lora, out_RN.device)
    adapter_T = delta.adapter_T.contiguous()
    _launch.launch(
        lora_rows_kernel,
        (num_rows, groups),
        x_XK,
        a,
        b,
        out_RN,
        scales if scales is not None else out_RN,
        scale_value,
        expert_R,
        token_R if token_R is not None else expert_R,
        adapter_T,
        k,
        n,
        rank,
        delta.lora.num_experts,
        adapter_T.shape[0],
        a_row_div,
        max(1, rows_per_token),
        per_group,
        x_XK.stride(0),
        x_XK.stride(1),
        *a.stride(),
        *b.stride(),
        out_RN.stride(0),
        out_RN.stride(1),
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        RANK=rank_p,
        HAS_SCALES=scales is not None,
        ROW_TOKENS=token_R is None,
        ACCUMULATE=token_R is not None,
        num_warps=8 if block_k * rank_p > 8192 else 4,
        options=options,
    )


def apply_lora(
    out_RN: torch.Tensor,
    x_XK: torch.Tensor,
    a_row_div: int,
    delta: LoraDelta,
    layout: LoraLayout,
    options: TritonOptions,
    programs: int = _ROW_PROGRAMS,
) -> torch.Tensor:
    """``out_RN`` (float32 ``[R, N]``) += each row's delta in place; row r's input is
    ``x_XK[r // a_row_div]``. Returns ``out_RN``. ``programs``: the row-block kernel's
    grid target (``rows_grid``)."""
    a, b = delta.a, delta.b
    num_rows, n = out_RN.shape
    k, rank = a.shape[3], a.shape[2]
    if num_rows == 0 or rank == 0 or n == 0:
        return out_RN
    if layout.row_blocks:
        _apply_rows(out_RN, x_XK, a_row_div, delta, layout, options, programs)
        return out_RN
    rank_p = max(16, _pow2(rank))
    dev = out_RN.device
    block_k, block_n = 64, 64
    t = WORKSPACES.get(
        (dev, "lora_t", num_rows, rank_p),
        lambda: {"t": torch.empty(num_rows, rank_p, dtype=torch.float32, device=dev)},
    )["t"]
    rows_args = (layout.sorted_rows, layout.block_pair, layout.num_padded)
    blocks = layout.num_blocks
    dot1, ieee1 = _dot_dtype(x_XK.dtype, a.dtype)
    _launch.launch(
        lora_shrink_kernel,
        (blocks,),
        x_XK,
        a,
        t,
        *rows_args,
        k,
        rank,
        num_rows,
        layout.num_experts,
        a_row_div,
        x_XK.stride(0),
        x_XK.stride(1),
        *a.stride(),
        t.stride(0),
        BLOCK_M=layout.block_m,
        BLOCK_K=block_k,
        RANK=rank_p,
        DOT_DTYPE=dot1,
        IEEE=ieee1,
        num_warps=4,
        options=options,
    )
    scales, scale_value = _scales(delta.lora, dev)
    dot2, ieee2 = _dot_dtype(b.dtype, b.dtype)
    _launch.launch(
        lora_expand_kernel,
        (blocks, _cdiv(n, block_n)),
        t,
        b,
        out_RN,
        scales if scales is not None else t,
        scale_value,
        *rows_args,
        n,
        rank,
        num_rows,
        layout.num_experts,
        t.stride(0),
        *b.stride(),
        out_RN.stride(0),
        out_RN.stride(1),
        BLOCK_M=layout.block_m,
        BLOCK_N=block_n,
        RANK=rank_p,
        HAS_SCALES=scales is not None,
        DOT_DTYPE=dot2,
        IEEE=ieee2,
        num_warps=4,
        options=options,
    )
    return out_RN


@dataclass(frozen=True)
class SequenceLora:
    """The LoRA of a standard-format call run inside the fused kernel sequence
    (``experts.run_kernel_sequence``'s ``deltas``): rows are the call's (token, slot) pairs
    in order (row p is token ``p // top_k``), so each delta is one row-block launch that
    stores it into a float32 workspace, and the GEMM after it adds it.
    ``gate_up_lora`` / ``down_lora``: the hooks' LoRA records (either may be None)."""

    gate_up_lora: LoraDelta | None
    down_lora: LoraDelta | None
    top_k: int
    options: TritonOptions

    def gate_up(
        self, x_TH: torch.Tensor, expert_R: torch.Tensor, w13_rows: int
    ) -> torch.Tensor | None:
        """float32 [rows, w13_rows]: GEMM1's delta of every row (input ``x_TH[p // k]``)."""
        return self._delta(self.gate_up_lora, x_TH, self.top_k, expert_R, w13_rows)

    def down(
        self, inter_RI: torch.Tensor, expert_R: torch.Tensor, hidden: int
    ) -> torch.Tensor | None:
        """float32 [rows, hidden]: GEMM2's delta of every row (input ``inter_RI[p]``)."""
        return self._delta(self.down_lora, inter_RI, 1, expert_R, hidden)

    def _delta(self, delta, x_XK, a_row_div, expert_R, n: int):
        """The delta into a workspace of the GEMM's own output width ``n``, which the factors
        are checked against (B's rows must be the GEMM's output columns)."""
        if delta is None:
            return None
        num_rows, dev = expert_R.shape[0], expert_R.device
        out = WORKSPACES.get(
            (dev, "lora_delta", delta.gemm, num_rows, n),
            lambda: {"d": torch.empty(num_rows, n, dtype=torch.float32, device=dev)},
        )["d"]
        delta.check(out, x_XK)
        if delta.a.shape[2] == 0:  # rank 0: nothing to add
            return None
        _launch_rows(out, x_XK, a_row_div, delta, expert_R, None, self.top_k, self.options)
        return out


def sequence_lora(hooks: MoeHooks, num_rows: int, top_k: int, options: TritonOptions):
    """``SequenceLora`` of ``hooks`` for a standard-format call of ``num_rows`` (token, slot)
    rows, or None where the hooked sequence runs them: ``options.lora_in_sequence`` is off,
    a hook is not a LoRA record, or its rows would be grouped by pair (``groups_rows``)."""
    fns = (hooks.gate_up, hooks.down)
    if not options.lora_in_sequence or any(
        fn is not None
        and (
            not isinstance(fn, LoraDelta)
            or groups_rows(num_rows, fn.lora.num_adapters * fn.lora.num_experts, options)
        )
        for fn in fns
    ):
        return None
    return SequenceLora(hooks.gate_up, hooks.down, top_k, options)


def apply_hook(
    hooks: MoeHooks,
    which: str,
    out: torch.Tensor,
    x_XK: torch.Tensor,
    a_row_div: int,
    rows: HookRows,
    options: TritonOptions,
    layouts: dict,
) -> torch.Tensor:
    """Hook ``which`` of ``hooks`` on ``out``: a ``LoraDelta`` through the kernels (its row
    layout made once per call in ``layouts``, keyed by its adapter ids), any other hook
    called on the rows' inputs ``x_XK`` repeated ``a_row_div`` times."""
    fn = getattr(hooks, which)
    if not isinstance(fn, LoraDelta):
        x_RK = x_XK if a_row_div == 1 else x_XK.repeat_interleave(a_row_div, dim=0)
        got = hooks.apply(which, out, x_RK, rows)
        if got.requires_grad and torch.is_grad_enabled():  # (the kernels would drop it)
            raise MoeInputError(
                f"hooks: {which} returned a tensor that requires grad, but backend 'triton' "
                "applies hooks without autograd: give the hook a tensors() method listing the "
                "tensors it trains (MoeHooks.needs_grad: such calls run on the torch backend), "
                "pass backend='torch', or run under torch.no_grad()"
            )
        return got
    fn.check(out, x_XK)
    key = (id(fn.adapter_T), fn.lora.num_adapters, fn.lora.num_experts)
    layout = layouts.get(key)
    if layout is None:
        layout = layouts[key] = lora_layout(rows, fn, options)
    return apply_lora(out, x_XK, a_row_div, fn, layout, options)
