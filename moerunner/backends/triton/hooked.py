# The triton backend with hooks (moerunner.hooks): the kernel sequence split where the hooks
# go. One launch makes the rows' expert, token and slot; GEMM1 runs without its fused
# activation into a float32 [rows, 2I] buffer, the gate/up hook runs, one launch applies the
# activation; GEMM2 runs without the routing weight into a float32 [rows, H] buffer, the
# down hook runs, and each token's rows are weighted and summed in one launch. Slower than
# the fused sequence, but every step stays on the device (no host read), so a hooked call
# is CUDA-graph capturable as the fused one is. Calls without hooks never come here
# (``experts.run_kernel_sequence`` is untouched by them), nor standard-format calls whose
# hooks are all LoRA records at decode sizes (``lora.sequence_lora``: their deltas run inside
# the fused sequence).
#
# The GEMMs are the same launches as the fused sequence's (``experts._launch_gemm``) with
# the activation and the routing weight switched off; the row layout is the same
# (``experts.layout_rows``). A hook that is a LoRA record (``moerunner.lora.LoraDelta``)
# runs as the shrink and expand kernels of ``lora.py`` instead of its PyTorch form.

from __future__ import annotations

import torch

from ...config import ExpertSpec
from ...hooks import HookRows, MoeHooks, RowHooks, expert_of_rows
from ...weights import PreparedWeights
from . import _launch, autotune
from ._activation import activation_kernel
from ._align import hook_rows, topk_sum
from ._launch import cdiv, next_power_of_2
from .experts import (
    _ACT_IDS,
    _check_hidden,
    _launch_gemm,
    _on_device,
    _quantize_input,
    layout_rows,
)
from .lora import apply_hook
from .options import TritonOptions
from .workspaces import WORKSPACES, alignment_workspace


def hooked_sequence(
    a_RH: torch.Tensor,
    row_expert: torch.Tensor,
    a_row_div: int,
    prepared: PreparedWeights,
    hooks: MoeHooks,
    rows: HookRows,
) -> torch.Tensor:
    """Rows ``p``: expert ``row_expert[p]`` (-1: skipped) on ``a_RH[p // a_row_div]``, with
    the hooks; float32 ``[rows, H]``, unweighted (rows of id -1 undefined)."""
    spec, options, t = prepared.spec, prepared.options, prepared.tensors
    w13, w2 = t["w13"], t["w2"]
    num_rows, num_experts = row_expert.shape[0], spec.num_experts
    dev = a_RH.device
    tiles = autotune.tiles_for_call(prepared, num_rows // a_row_div, a_row_div, dev)
    bm = tiles.gemm1.block_m
    ws = WORKSPACES.get(
        (dev, "hooked_align", num_rows, num_experts, bm),
        lambda: alignment_workspace(num_rows, num_experts, bm, dev),
    )
    layout = layout_rows(row_expert, a_row_div, num_experts, bm, ws, options)
    n13 = w13.shape[1]
    h_RN = torch.empty(num_rows, n13, dtype=torch.float32, device=dev)
    a, a_scale = _quantize_input(a_RH, w13, options)
    # spec=None: no activation fused, all 2I columns stored as computed (bias added)
    _launch_gemm(
        a, a_scale, w13, t["w13_bias"], h_RN, layout, num_rows, a_row_div, None,
        tiles.gemm1, n13, None, options=options,
    )  # fmt: skip
    layouts: dict = {}  # LoRA row layouts, shared by both GEMMs' deltas
    h_RN = apply_hook(hooks, "gate_up", h_RN, a_RH, a_row_div, rows, options, layouts)
    act_RI = _activate(h_RN, spec, a_RH.dtype, options)
    a2, a2_scale = _quantize_input(act_RI, w2, options)
    y_RH = torch.empty(num_rows, spec.hidden_size, dtype=torch.float32, device=dev)
    _launch_gemm(
        a2, a2_scale, w2, t["w2_bias"], y_RH, layout, num_rows, 1, None,
        tiles.gemm2, spec.hidden_size, None, options=options, slot=1,
    )  # fmt: skip
    return apply_hook(hooks, "down", y_RH, act_RI, 1, rows, options, layouts)


def _activate(
    h_RN: torch.Tensor, spec: ExpertSpec, dtype: torch.dtype, options: TritonOptions
) -> torch.Tensor:
    """GEMM1's activation (``_activation.activation_kernel``, the fused epilogue's math) on
    its float32 output, as ``dtype`` ``[rows, I]``: one launch."""
    num_rows, inter = h_RN.shape[0], spec.intermediate_size
    act = spec.activation
    out = torch.empty(num_rows, inter, dtype=dtype, device=h_RN.device)
    block = min(1024, max(16, next_power_of_2(inter)))
    _launch.launch(
        activation_kernel,
        (num_rows, cdiv(inter, block)),
        h_RN,
        out,
        inter,
        float(act.alpha) if act.alpha is not None else 0.0,
        float(act.limit) if act.limit is not None else 0.0,
        h_RN.stride(0),
        out.stride(0),
        BLOCK=block,
        GATED=spec.gated,
        INTERLEAVED=spec.gated and spec.gate_up_interleaved,
        ACT=_ACT_IDS[act.name],
        num_warps=4,
        options=options,
    )
    return out


def hooked_standard(
    hidden_TH: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedWeights,
    hooks: MoeHooks,
) -> torch.Tensor:
    """Standard format with hooks: ``[T, H]`` weighted and summed over k in float32."""
    _check_hidden(hidden_TH, prepared, "hidden_states")
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(hidden_TH.shape, dtype=hidden_TH.dtype, device=hidden_TH.device)
    if num_tokens == 0:
        return out
    ids_TK = topk_ids.to(torch.int32).contiguous()
    options, num_experts = prepared.options, prepared.spec.num_experts
    with _on_device(hidden_TH):
        rows = HookRows(*hook_rows(ids_TK, num_experts, options=options))
        y = hooked_sequence(hidden_TH.contiguous(), rows.expert, top_k, prepared, hooks, rows)
        route_w = topk_weights.to(torch.float32).reshape(-1).contiguous()
        topk_sum(y, ids_TK, out, num_experts, options=options, route_w=route_w)
    return out


def hooked_core(
    x_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    prepared: PreparedWeights,
    hooks: RowHooks,
) -> torch.Tensor:
    """Grouped layout with hooks: rows ``offsets[e]:offsets[e+1]`` through expert ``e``."""
    _check_hidden(x_MH, prepared, "x_MH")
    y = torch.empty(x_MH.shape, dtype=x_MH.dtype, device=x_MH.device)
    if x_MH.shape[0] == 0:
        return y
    expert = expert_of_rows(expert_offsets.to(x_MH.device), x_MH.shape[0])
    row_expert = expert.to(torch.int32)
    with _on_device(x_MH):
        out = hooked_sequence(
            x_MH.contiguous(), row_expert, 1, prepared, hooks.hooks, hooks.rows(expert)
        )
    return y.copy_(out)
