# Stage "prepare" of the flashinfer backend (private): the canonical weights (already padded to
# the backend's alignment by the runner) converted once into what ``cutlass_fused_moe`` reads.
# Runs on any device; nothing here imports flashinfer.

from __future__ import annotations

import torch

from ...config import ExpertSpec
from ...errors import MoeInputError
from ...weights import ExpertWeights, PreparedWeights, is_quantized
from ._call import FlashInferOptions
from .layout import E2m1Sm90Layout, up_gate_rows

# moerunner activation -> FlashInfer ``ActivationType`` member name (resolved at the first call,
# where flashinfer is imported). swiglu_oai is Swiglu with per-expert alpha, beta and limit.
ACTIVATION_TYPES = {
    "silu": "Swiglu",
    "swiglu_oai": "Swiglu",
    "gelu": "Geglu",
    "gelu_tanh": "GegluTanh",
    "relu2": "Relu2",
}

#: How the fused call runs each weight family: "plain" (bf16/fp16 x same), "fp8_block"
#: (DeepSeek-V3 128x128 block scales, bf16 inputs), "w4a16" (mxfp4 weights, bf16 inputs).
MODES = {"plain": "plain", "fp8": "fp8_block", "mx": "w4a16"}


def _family(w) -> str:
    return w.scheme.family if is_quantized(w) else "plain"


def _swiglu_params(spec: ExpertSpec, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-expert float32 ``[E]`` alpha, beta and limit (FlashInfer takes tensors only)."""
    act = spec.activation
    out = {}
    for key, value in (("swiglu_alpha", act.alpha), ("swiglu_beta", act.beta)):
        out[key] = _per_expert(value, spec.num_experts, device)
    out["swiglu_limit"] = _per_expert(act.limit, spec.num_experts, device)
    return out


def _per_expert(value, num_experts: int, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.shape != (num_experts,):
            raise MoeInputError(
                f"per-expert swiglu parameters must have shape [{num_experts}], "
                f"got {list(value.shape)}"
            )
        return value.to(device=device, dtype=torch.float32).contiguous()
    return torch.full((num_experts,), float(value), dtype=torch.float32, device=device)


def _bias(bias: torch.Tensor | None, rows: int, spec: ExpertSpec, dtype, device):
    """A bias in the output dtype, or zeros where only the other GEMM has one (the kernels
    take both or neither; adding zeros is exact)."""
    if bias is None:
        return torch.zeros(spec.num_experts, rows, dtype=dtype, device=device)
    return bias.to(dtype=dtype).contiguous()


def prepare(
    weights: ExpertWeights,
    spec: ExpertSpec,
    backend: str,
    options: FlashInferOptions | None = None,
) -> PreparedWeights:
    """``PreparedWeights`` whose ``tensors`` hold the fused call's weights, scales, biases and
    activation parameters, ``notes`` what was re-laid and ``options`` the backend's options."""
    families = {_family(weights.w13), _family(weights.w2)}
    if len(families) != 1:
        raise MoeInputError(
            f"the flashinfer backend computes both GEMMs in one format, got w13 "
            f"{_family(weights.w13)} and w2 {_family(weights.w2)}"
        )
    family = families.pop()
    if family not in MODES:
        raise MoeInputError(f"the flashinfer backend does not compute {family} weights")
    mode = MODES[family]
    gated, interleaved = spec.gated, spec.gate_up_interleaved
    w13 = up_gate_rows(weights.w13, interleaved) if gated else weights.w13
    b13 = up_gate_rows(weights.w13_bias, interleaved) if gated else weights.w13_bias
    w2 = weights.w2
    device = weights.device
    notes = ["w13 rows up-then-gate"] if gated else []
    tensors: dict = {"mode": mode, "activation_type": ACTIVATION_TYPES[spec.activation.name]}
    if mode == "plain":
        out_dtype = w13.dtype
        tensors["w13"], tensors["w2"] = w13.contiguous(), w2.contiguous()
        tensors["quant_scales"] = None
    elif mode == "fp8_block":
        out_dtype = torch.bfloat16
        tensors["w13"], tensors["w2"] = w13.data.contiguous(), w2.data.contiguous()
        tensors["quant_scales"] = [w13.scale.contiguous(), w2.scale.contiguous()]
    else:
        out_dtype = torch.bfloat16
        layout = E2m1Sm90Layout()
        d13, s13 = layout.apply(w13.data, w13.scale)
        d2, s2 = layout.apply(w2.data, w2.scale)
        tensors["w13"], tensors["w2"] = d13, d2
        tensors["quant_scales"] = [s13, s2]
        tensors["layout"] = layout
        notes.append("mxfp4 interleaved for the SM90 mixed-input GEMM, e8m0 scales folded")
    if b13 is not None or weights.w2_bias is not None:
        rows13 = 2 * spec.intermediate_size if gated else spec.intermediate_size
        tensors["w13_bias"] = _bias(b13, rows13, spec, out_dtype, device)
        tensors["w2_bias"] = _bias(weights.w2_bias, spec.hidden_size, spec, out_dtype, device)
    else:
        tensors["w13_bias"] = tensors["w2_bias"] = None
    if spec.activation.name == "swiglu_oai":
        tensors.update(_swiglu_params(spec, device))
    tensors["out_dtype"] = out_dtype
    return PreparedWeights(
        backend=backend, source=None, spec=spec, tensors=tensors, notes=notes, options=options
    )
