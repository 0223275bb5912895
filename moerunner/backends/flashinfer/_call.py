# Stage "experts" of the flashinfer backend (private): one ``cutlass_fused_moe`` call for the
# standard dispatch format. FlashInfer permutes the rows, runs both grouped GEMMs with the
# activation fused, and sums each token's k rows weighted by its routing weights; ids outside
# [0, E) (-1: not on this rank) are skipped by its expert-range check. Every launch stays on
# the device, so a call is CUDA-graph capturable once the module is loaded.

from __future__ import annotations

import functools

import torch

from ...weights import PreparedWeights


@functools.cache
def _flashinfer():
    """The imported ``flashinfer.fused_moe`` module and its ``ActivationType``."""
    from flashinfer import fused_moe
    from flashinfer.fused_moe import ActivationType

    return fused_moe, ActivationType


def _call_kwargs(prepared: PreparedWeights) -> dict:
    """The call's constant keyword arguments, built at the first call and kept with the
    prepared weights (nothing per call but the tensors of the batch)."""
    t = prepared.tensors
    cached = t.get("call")
    if cached is not None:
        return cached
    _, activation_type = _flashinfer()
    kwargs = {
        "fc1_expert_weights": t["w13"],
        "fc2_expert_weights": t["w2"],
        "output_dtype": t["out_dtype"],
        "quant_scales": t["quant_scales"],
        "fc1_expert_biases": t["w13_bias"],
        "fc2_expert_biases": t["w2_bias"],
        "swiglu_alpha": t.get("swiglu_alpha"),
        "swiglu_beta": t.get("swiglu_beta"),
        "swiglu_limit": t.get("swiglu_limit"),
        "use_deepseek_fp8_block_scale": t["mode"] == "fp8_block",
        "use_w4_group_scaling": t["mode"] == "w4a16",
        "activation_type": getattr(activation_type, t["activation_type"]),
    }
    t["call"] = kwargs
    return kwargs


def fused_standard(dispatch_output, prepared: PreparedWeights) -> torch.Tensor:
    """Standard format: ``[T, H]`` in the hidden dtype, routing weights applied."""
    x = dispatch_output.hidden_states
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    topk = dispatch_output.topk
    fused_moe, _ = _flashinfer()
    fused_moe.cutlass_fused_moe(
        x.contiguous(),
        topk.ids.to(torch.int32).contiguous(),
        topk.weights.to(torch.float32).contiguous(),
        output=out,
        **_call_kwargs(prepared),
    )
    return out
