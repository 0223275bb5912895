"""Backend ``torch``: portable PyTorch experts for any device, every scheme (emulated).

Core on the grouped layout: one GEMM1 -> activation -> GEMM2 per non-empty expert segment
(one host read of the E+1 offsets per call; never a per-token loop), or, for plain weights
with 16-byte aligned rows (on CPU, and on CUDA for bf16), PyTorch's grouped GEMM over all
segments at once with no host sync (on CPU, fp32 decode batches run each expert's GEMM as
W @ x^T, and the activation runs in cache-sized row blocks).

Quantized weights are dequantized once to float32 in ``prepare_weights``; at run time GEMM
inputs are quantized exactly as the scheme's kernels quantize them (dynamic per-token fp8,
per-128-group fp8, MX blocks...) and multiplied in float32, so the result equals what a real
kernel computes up to accumulation order. The GEMM1 output and the activation are stored in
the input dtype between GEMMs, as the fused kernels store them.
"""

from __future__ import annotations

import torch

from ..activations import apply_activation
from ..config import ACTIVATIONS, ExpertSpec
from ..runner import DEFAULT_REGISTRY
from ..weights import ExpertWeights, PreparedWeights, is_quantized
from .base import Backend, Capabilities

NAME = "torch"
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def _quant_schemes() -> frozenset[str]:
    try:
        from ..quant import SCHEME_NAMES
    except ImportError:
        return frozenset()
    return frozenset(SCHEME_NAMES)


class TorchBackend(Backend):
    """Plain PyTorch; runs wherever torch runs."""

    name = NAME

    def __init__(self) -> None:
        self.capabilities = Capabilities(
            devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
            dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
            schemes=frozenset({"bf16", "fp16", "fp32"}) | _quant_schemes(),
            activations=frozenset(ACTIVATIONS),
        )

    def prepare_weights(self, weights: ExpertWeights, spec: ExpertSpec) -> PreparedWeights:
        """Plain weights are used as they are; quantized ones are dequantized once to fp32."""
        prepared = PreparedWeights(backend=self.name, source=weights, spec=spec)
        tensors = prepared.tensors
        if is_quantized(weights.w13):
            tensors["w13"] = weights.w13.dequantize()
            tensors["w2"] = weights.w2.dequantize()
            tensors["scheme"] = weights.w13.scheme
            tensors["scheme2"] = weights.w2.scheme
            tensors["input_scale"] = weights.w13.input_scale  # [E] or None (dynamic)
            tensors["input_scale2"] = weights.w2.input_scale
            prepared.notes.append("dequantized w13/w2 to float32 once")
        else:
            tensors["w13"], tensors["w2"] = weights.w13, weights.w2
        tensors["w13_bias"], tensors["w2_bias"] = weights.w13_bias, weights.w2_bias
        return prepared


def _gemm_input(x: torch.Tensor, scheme, input_scale: torch.Tensor | None) -> torch.Tensor:
    """What a kernel multiplies: the quantized-dequantized activation (fp32) or x itself."""
    if scheme is None:
        return x
    from ..quant import fake_quantize_activation

    return fake_quantize_activation(x, scheme, input_scale=input_scale)


def _linear(
    x: torch.Tensor,
    w_NK: torch.Tensor,
    bias: torch.Tensor | None,
    scheme,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ w.T (+ bias) with the scheme's activation quantization; fp32 result if biased."""
    out = _gemm_input(x, scheme, input_scale) @ w_NK.transpose(-2, -1).to(
        torch.float32 if scheme is not None else x.dtype
    )
    if bias is not None:
        out = out.float() + bias.float()
    return out


def _expert_forward(
    x_MH: torch.Tensor, e: int, prepared: PreparedWeights, out_MH: torch.Tensor
) -> None:
    """One expert on its rows, written into ``out_MH`` (a row slice of the core's output)."""
    t = prepared.tensors
    scheme, scheme2 = t.get("scheme"), t.get("scheme2")
    b13 = None if t["w13_bias"] is None else t["w13_bias"][e]
    b2 = None if t["w2_bias"] is None else t["w2_bias"][e]
    s13, s2 = (None if t.get(k) is None else t[k][e] for k in ("input_scale", "input_scale2"))
    h = _linear(x_MH, t["w13"][e], b13, scheme, s13).to(x_MH.dtype)
    a = apply_activation(h, prepared.spec).to(x_MH.dtype)
    if scheme2 is None and b2 is None:  # plain weights: GEMM2 straight into the output rows
        torch.mm(a, t["w2"][e].transpose(0, 1), out=out_MH)
    else:
        out_MH.copy_(_linear(a, t["w2"][e], b2, scheme2, s2))


def _use_grouped_mm(x_MH: torch.Tensor, prepared: PreparedWeights) -> bool:
    """Grouped GEMM for plain weights whose rows are 16-byte aligned (its kernels need it):
    on CPU (measured faster than the per-expert loop for Qwen3-30B-A3B shapes at T = 32 and
    512, fp32 and bf16) and on CUDA for bf16; otherwise the per-expert loop."""
    t, spec = prepared.tensors, prepared.spec
    if _GROUPED_MM is None or "scheme" in t or t["w13"].dtype != x_MH.dtype:
        return False
    width = x_MH.element_size()
    if (spec.hidden_size * width) % 16 or (spec.intermediate_size * width) % 16:
        return False
    return x_MH.device.type == "cpu" or (x_MH.is_cuda and x_MH.dtype == torch.bfloat16)


# Rows per activation block on CPU: float32 temporaries of [block, I] stay ~1 MiB (in cache),
# instead of float32 copies of all [M, 2I] GEMM1 rows.
_ACT_BLOCK_ELEMENTS = 1 << 18

# CPU, fp32: with few rows per expert (on average from 1/4 to 8: decode batches beyond one
# token), each expert's GEMMs run as W @ x^T (weights as the left operand) instead of
# x @ W^T: measured 1.1-2x faster per grouped GEMM on an x86 CPU at the Qwen3-30B-A3B shape,
# equal at 8 rows per expert and slower beyond. bf16 was up to 2x slower that way.
_TRANSPOSED_ROWS_PER_EXPERT = {torch.float32: (0.25, 8.0)}


def _transposed(x_MH: torch.Tensor, num_experts: int) -> bool:
    low, high = _TRANSPOSED_ROWS_PER_EXPERT.get(x_MH.dtype, (0.0, 0.0))
    rows = x_MH.shape[0]
    return x_MH.device.type == "cpu" and low * num_experts <= rows < high * num_experts


def _grouped_forward(
    x_MH: torch.Tensor, offsets: torch.Tensor, prepared: PreparedWeights
) -> torch.Tensor:
    """All segments in two grouped GEMMs; no host synchronisation."""
    t, spec = prepared.tensors, prepared.spec
    ends = offsets[1:].to(torch.int32)
    rows = x_MH.shape[0]
    transposed = _transposed(x_MH, spec.num_experts)
    if transposed:  # h^T = W13 @ x^T per expert: h_MN is a column-major view
        h_MN = _GROUPED_MM(t["w13"], x_MH.transpose(0, 1), offs=ends).transpose(0, 1)
    else:
        h_MN = _GROUPED_MM(x_MH, t["w13"].transpose(-2, -1), offs=ends)
    expert_of_row = None
    if t["w13_bias"] is not None or t["w2_bias"] is not None:
        row_ids = torch.arange(rows, device=x_MH.device)
        expert_of_row = torch.searchsorted(offsets[1:], row_ids, right=True).clamp(
            max=spec.num_experts - 1
        )
    # Activation in fp32 (as the fused kernels do), rounded once into the GEMM2 input.
    a_MI = torch.empty((rows, spec.intermediate_size), dtype=x_MH.dtype, device=x_MH.device)
    block = rows
    if x_MH.device.type == "cpu":
        block = max(1, _ACT_BLOCK_ELEMENTS // h_MN.shape[1])
    for start in range(0, rows, block):
        h = h_MN[start : start + block]
        if t["w13_bias"] is not None:
            h = h.float() + t["w13_bias"][expert_of_row[start : start + block]].float()
        a_MI[start : start + block] = apply_activation(h, spec)
    if transposed:  # y^T = W2 @ a^T; rows are few here, so the row-major copy is cheap
        y_MH = _GROUPED_MM(t["w2"], a_MI.transpose(0, 1), offs=ends).transpose(0, 1).contiguous()
    else:
        y_MH = _GROUPED_MM(a_MI, t["w2"].transpose(-2, -1), offs=ends)
    if t["w2_bias"] is not None:
        y_MH = (y_MH.float() + t["w2_bias"][expert_of_row].float()).to(x_MH.dtype)
    return y_MH


@DEFAULT_REGISTRY.register_core(NAME)
def torch_core(
    x_MH: torch.Tensor, expert_offsets: torch.Tensor, prepared: PreparedWeights
) -> torch.Tensor:
    """Experts on the grouped layout: rows ``offsets[e]:offsets[e+1]`` go to expert ``e``."""
    if _use_grouped_mm(x_MH, prepared):
        return _grouped_forward(x_MH, expert_offsets, prepared)
    y_MH = torch.empty(
        (x_MH.shape[0], prepared.spec.hidden_size), dtype=x_MH.dtype, device=x_MH.device
    )
    bounds = expert_offsets.tolist()
    for e in range(prepared.spec.num_experts):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            _expert_forward(x_MH[start:end], e, prepared, y_MH[start:end])
    return y_MH


DEFAULT_REGISTRY.register_backend(TorchBackend())
