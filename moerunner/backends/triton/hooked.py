# The triton backend with hooks (moerunner.hooks): the kernel sequence split where the hooks
# go. GEMM1 runs without its fused activation into a float32 [rows, 2I] buffer, the gate/up
# hook runs, the activation is applied in PyTorch; GEMM2 runs without the routing weight
# into a float32 [rows, H] buffer, the down hook runs, and each token's rows are weighted
# and summed in PyTorch. Slower than the fused sequence, but every step stays on the device
# (no host read), so a hooked call is CUDA-graph capturable as the fused one is. Calls
# without hooks never come here: ``experts.run_kernel_sequence`` is untouched by them.
#
# The GEMMs are the same launches as the fused sequence's (``experts._launch_gemm``) with
# the activation and the routing weight switched off; the row layout is the same
# (``experts.layout_rows``). A hook that is a LoRA record (``moerunner.lora.LoraDelta``)
# runs as the shrink and expand kernels of ``lora.py`` instead of its PyTorch form.

from __future__ import annotations

import torch

from ...activations import apply_activation
from ...hooks import HookRows, MoeHooks, RowHooks, expert_of_rows
from ...weights import PreparedWeights
from .experts import (
    WORKSPACES,
    _check_hidden,
    _launch_gemm,
    _on_device,
    _quantize_input,
    alignment_workspace,
    layout_rows,
)
from .lora import apply_hook


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
    tiles = t["tiles"].lookup(num_rows // a_row_div, a_row_div)
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
    act_RI = apply_activation(h_RN, spec).to(a_RH.dtype)
    a2, a2_scale = _quantize_input(act_RI, w2, options)
    y_RH = torch.empty(num_rows, spec.hidden_size, dtype=torch.float32, device=dev)
    _launch_gemm(
        a2, a2_scale, w2, t["w2_bias"], y_RH, layout, num_rows, 1, None,
        tiles.gemm2, spec.hidden_size, None, options=options,
    )  # fmt: skip
    return apply_hook(hooks, "down", y_RH, act_RI, 1, rows, options, layouts)


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
    valid_TK = (topk_ids >= 0) & (topk_ids < prepared.spec.num_experts)
    ids = torch.where(valid_TK, topk_ids, -1).to(torch.int32).reshape(-1)
    pair = torch.arange(num_tokens * top_k, device=hidden_TH.device)
    valid = valid_TK.reshape(-1)
    rows = HookRows(
        expert=ids,
        token=torch.where(valid, pair // top_k, -1),
        slot=torch.where(valid, pair % top_k, -1),
    )
    with _on_device(hidden_TH):
        y = hooked_sequence(hidden_TH.contiguous(), ids, top_k, prepared, hooks, rows)
    y_TKH = y.view(num_tokens, top_k, -1) * topk_weights.float()[:, :, None]
    summed = torch.where(valid_TK[:, :, None], y_TKH, 0.0).sum(dim=1)
    return out.copy_(summed)


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
