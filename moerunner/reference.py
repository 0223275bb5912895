"""The float64 reference: slow, plainly correct, the yardstick for every backend.

It computes sum over slots of weight x expert(x) in float64 on dequantized weights, token by
expert with boolean masks, written out without any of the backends' helpers. For a quantized
scheme, GEMM inputs are first quantized exactly as the scheme says (the scheme's definition,
from ``moerunner.quant``) so that kernels can be held to tight tolerances. Intermediate values
are not rounded to a lower precision here, with one exception: GEMM2's input, where the
scheme quantizes it, is quantized from the intermediate rounded to the hidden dtype, as every
backend stores it before quantizing. Quantizing the float64 value instead rounds about 3 % of
the elements to another e4m3 code than the kernels do (bf16 keeps 8 significant bits, e4m3 4),
and at small K one such flip moved an output by more than its tolerance (fp8_block, bf16,
H = I = 64: up to 5.6e-2 of the output's max against the 3.5e-2 bound; 6e-3 with the rounding).
"""

from __future__ import annotations

import math

import torch

from .config import Activation
from .device_checks import check_ids_async
from .errors import INDEX_DTYPES_TEXT, MoeInputError, is_index_tensor
from .weights import ExpertWeights, is_quantized


def _param64(value, expert: int) -> float:
    """A swiglu_oai parameter of ``expert``: a float, or entry ``expert`` of an ``[E]`` tensor."""
    return float(value[expert]) if isinstance(value, torch.Tensor) else value


def _plain64(x: torch.Tensor, name: str) -> torch.Tensor:
    """The activation function itself, written out in float64."""
    if name == "silu":
        return x / (1.0 + torch.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * x * (1.0 + torch.tanh(inner))
    if name == "relu2":
        return torch.clamp(x, min=0.0) ** 2
    raise ValueError(f"reference: unknown activation {name!r}")


def _act64(h: torch.Tensor, act: Activation, order: str, expert: int) -> torch.Tensor:
    if not act.gated:
        return _plain64(h, act.name.removesuffix("_no_mul"))
    half = h.shape[1] // 2
    if order == "interleaved":
        gate, up = h[:, 0::2], h[:, 1::2]
    elif order == "up_gate":
        up, gate = h[:, :half], h[:, half:]
    else:
        gate, up = h[:, :half], h[:, half:]
    if act.name == "swiglu_step":
        limit = _param64(act.limit, expert)
        return torch.clamp(_plain64(gate, "silu"), max=limit) * torch.clamp(
            up, min=-limit, max=limit
        )
    if act.name == "situ":
        beta, linear_beta = act.alpha, act.limit  # limit 0.0: up unchanged
        gate_part = beta * torch.tanh(gate / beta) / (1.0 + torch.exp(-gate))
        if linear_beta:
            up = linear_beta * torch.tanh(up / linear_beta)
        return gate_part * up
    if act.name != "swiglu_oai":
        return _plain64(gate, act.name) * up
    if act.name == "swiglu_oai":
        alpha, beta, limit = (_param64(p, expert) for p in (act.alpha, act.beta, act.limit))
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
        return (up + beta) * gate / (1.0 + torch.exp(-alpha * gate))
    raise ValueError(f"reference: unknown activation {act.name!r}")


def _weight64(w) -> torch.Tensor:
    return (w.dequantize() if is_quantized(w) else w).to(torch.float64).cpu()


def _input64(x: torch.Tensor, w, expert: int) -> torch.Tensor:
    """GEMM input of ``expert`` as its kernel sees it (quantized per the scheme, if any)."""
    if is_quantized(w):
        from .quant import fake_quantize_activation

        scale = None if w.input_scale is None else w.input_scale[expert]
        x = fake_quantize_activation(x, w.scheme, input_scale=scale)
    return x.to(torch.float64).cpu()


def reference_moe(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation | str = "silu",
) -> torch.Tensor:
    """float64 ``[T, H]`` on the CPU: sum_k weight[t,k] * expert_{ids[t,k]}(x[t]); -1 skipped.

    w13's rows are read in ``weights.w13_order``; swiglu_oai parameters may be per expert.
    Ids outside ``[-1, E)`` are refused, as the runner's checked calls refuse them."""
    ids = _check_inputs(hidden_states, weights, topk_weights, topk_ids)
    act = Activation.of(activation)
    x = hidden_states.cpu()
    w13, w2 = _weight64(weights.w13), _weight64(weights.w2)
    b13 = None if weights.w13_bias is None else weights.w13_bias.to(torch.float64).cpu()
    b2 = None if weights.w2_bias is None else weights.w2_bias.to(torch.float64).cpu()
    slot_weights = topk_weights.to(torch.float64).cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)  # x: [T, H], on the CPU
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = _input64(x[token], weights.w13, e) @ w13[e].T
        if b13 is not None:
            h = h + b13[e]
        a = _act64(h, act, weights.w13_order, e)
        if is_quantized(weights.w2):
            # Quantized from the intermediate as the kernels store it: in the hidden dtype.
            a = _input64(a.to(x.dtype).to(torch.float32), weights.w2, e)
        y = a @ w2[e].T
        if b2 is not None:
            y = y + b2[e]
        out.index_add_(0, token, y * slot_weights[token, slot][:, None])
    return out


def _check_inputs(x, weights, topk_weights, topk_ids) -> torch.Tensor:
    """The reference's arguments, each named where it is not what the docstring says; the ids
    as int64 on the CPU."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(
            "reference_moe: weights must be an ExpertWeights (ExpertWeights(w13, w2)), got "
            f"{type(weights).__name__}"
        )
    for name, t in (("hidden_states", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"reference_moe: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.shape[1] != weights.hidden_size:
        raise MoeInputError(
            f"reference_moe: hidden_states must be [T, H] with H = {weights.hidden_size} "
            f"(the weights' hidden size), got {tuple(x.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise MoeInputError(
            f"reference_moe: topk_ids must be [T, k] with T = {x.shape[0]}, got "
            f"{tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise MoeInputError(
            f"reference_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must have one shape"
        )
    if not is_index_tensor(topk_ids):
        raise TypeError(
            f"reference_moe: topk_ids must be {INDEX_DTYPES_TEXT}, got {topk_ids.dtype}"
        )
    ids = topk_ids.cpu().long()
    check_ids_async(ids, weights.num_experts, "reference_moe")  # on the CPU: at once
    return ids
