"""The torch backend's differentiable path: the experts as PyTorch ops that autograd
differentiates, for calls in grad mode where an argument requires grad (``fused_moe``'s
Gradients; the custom ops' backward recomputes through it too).

Gradients reach the hidden states, the routing weights, plain weights, biases, per-expert
activation parameters and, with hooks, what the hooks read (LoRA factors), passing through
the hooks to the hidden states. Quantized weights are frozen (``_FrozenExpertGemm``). The
forms, by what the call has:

- no hooks, a (device, dtype) pair of ``TorchOptions.grouped_mm`` (CUDA bf16) or a device
  of ``grouped_training`` (CPU, CUDA), and plain weights it can read: two grouped GEMMs
  (``_grouped_differentiable``; no host read on a GPU);
- no hooks otherwise: one GEMM pair per expert hit (one host read of the expert offsets);
- hooks: the torch backend's hooked sequence (``torch_native._hooked_standard``) on the
  call's own weights, its GEMMs grouped where the form without hooks would be (LoRA
  training without a launch per expert, nor a host read on a GPU), else per expert hit.

Every form rounds where the inference paths do (GEMM outputs in the input dtype unless
biased or quantized, the activation in fp32, the weighted sum in fp32).
"""

from __future__ import annotations

import torch

from ..activations import apply_activation
from ..config import ExpertSpec
from ..dispatch.formats import StandardDispatchOutput
from ..dispatch.permute import group_pairs, valid_rows
from ..errors import MoeInputError
from ..hooks import MoeHooks
from ..weights import ExpertWeights, is_quantized
from .torch_native import (
    DEFAULT_TORCH_OPTIONS,
    ExpertGemm,
    GroupedMm,
    TorchOptions,
    _aligned16,
    _float32_gemm,
    _grouped_rows,
    _hooked_standard,
    _linear,
    grouped_experts,
    grouped_mm,
)

__all__ = ["check_frozen", "differentiable_forward"]


def differentiable_forward(
    hidden_TH: torch.Tensor,
    weights: ExpertWeights,
    topk,
    spec: ExpertSpec,
    hooks: MoeHooks | None = None,
    options: TorchOptions = DEFAULT_TORCH_OPTIONS,
) -> tuple[torch.Tensor, bool]:
    """The experts with autograd, and whether the output's graph reaches every argument
    that requires grad (the grouped GEMMs do, even with no row; the per-expert form once it
    computes a row; the hooked per-expert form may not). The caller connects the others
    (``hooks.in_graph_of``), whose backward makes a zero gradient of each tensor's size and
    adds it to the real one: done for every argument, that was 3.5 of 15 ms of a CPU fp32
    training step. The experts: out-of-place PyTorch ops only (no ``out=``, no cached
    views), so gradients reach the hidden states, the routing weights, plain weights, the
    biases and per-expert activation parameters. Quantized weights are frozen (their codes
    and scales get none; ``_FrozenExpertGemm``; the caller refuses tensors of theirs that
    require grad: ``check_frozen``). With ``hooks``, the hooked sequence on the
    same ops: gradients also reach what the hooks read (LoRA factors) and pass through them
    to the hidden states, so adapted layers train stacked. Computes in the fast paths'
    precision (fp32 activation and sum); one host read of the expert offsets, none where
    ``options.grouped_mm`` has the call's (device, dtype) (``_grouped_differentiable``).
    Used by ``fused_moe`` when grad mode is on and an argument requires grad."""
    grouped = _grouped_trains(hidden_TH, weights, spec, options)
    device, dtype = hidden_TH.device.type, hidden_TH.dtype
    mm = _float32_mm(
        device == "cpu" and dtype in options.cpu_float32_gemms,
        (device, dtype) in options.fp32_backward,
    )
    if hooks is None and grouped:
        return _grouped_differentiable(hidden_TH, weights, topk, spec, mm), True
    gemm = _autograd_gemm(weights, options)
    if hooks is not None:
        w = weights
        plain = (w.w13, w.w2, w.w13_bias, w.w2_bias) if grouped else None
        dispatched = StandardDispatchOutput(hidden_TH, topk)
        return _hooked_standard(dispatched, spec, gemm, hooks, plain, mm), grouped
    return _per_expert_differentiable(hidden_TH, topk, spec, gemm)


def _per_expert_differentiable(
    hidden_TH, topk, spec: ExpertSpec, gemm
) -> tuple[torch.Tensor, bool]:
    """``differentiable_forward`` as one GEMM pair per expert hit (one host read of the
    expert offsets), and whether it reached every argument: it does once a row is computed
    (the weights' ``unbind`` views give every expert a gradient, zero where not hit; the
    rows' gather and the routing weights' index reach all of theirs), not without one."""
    order, token, offsets, weight_TK = group_pairs(topk, spec.num_experts)
    bounds = offsets.tolist()
    rows = bounds[spec.num_experts]  # the valid pairs; the others sort past them
    x_MH = hidden_TH[token[:rows]]  # one gather (its backward: one scatter-add)
    # The experts' rows as one split (its backward concatenates their gradients; a slice per
    # expert made a zero gradient of all the rows per expert hit).
    sizes = [bounds[e + 1] - bounds[e] for e in range(spec.num_experts)]
    ys = []
    for e, x_RH in enumerate(x_MH.split(sizes)):
        if x_RH.shape[0]:
            h = gemm("w13", e, x_RH)
            ys.append(gemm("w2", e, apply_activation(h, spec, e).to(hidden_TH.dtype)))
    out = torch.zeros(hidden_TH.shape, dtype=torch.float32, device=hidden_TH.device)
    if ys:  # one weighted sum of every row (not one [T, H] copy per expert)
        weight = weight_TK.reshape(-1)[order[:rows]]
        out = out.index_add(0, token[:rows], torch.cat(ys) * weight[:, None])
    return out.to(hidden_TH.dtype), bool(ys)


def _grouped_trains(
    x_TH: torch.Tensor, weights: ExpertWeights, spec: ExpertSpec, options: TorchOptions
) -> bool:
    """The grouped GEMM serves a differentiable call on a (device, dtype) pair of
    ``options.grouped_mm`` or a device of ``options.grouped_training`` (CPU, CUDA), for plain
    weights of that dtype whose rows it can read."""
    w13, w2, device = weights.w13, weights.w2, x_TH.device.type
    # (the grouped GEMM's fake-tensor rule takes bf16 alone: traced, other dtypes run per
    # expert)
    traceable = x_TH.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return (
        ((device, x_TH.dtype) in options.grouped_mm or device in options.grouped_training)
        and traceable
        and _grouped_rows(w13, spec)
        and w13.dtype == x_TH.dtype
        and _readable(w13)
        and _readable(w2)
    )


def _readable(w: torch.Tensor) -> bool:
    """``_aligned16``, False for a tensor without storage to check (the custom ops' backward
    differentiates through ``torch.func``, whose wrapped tensors have none): such calls run
    per expert."""
    try:
        return _aligned16(w)
    except RuntimeError:
        return False


def _grouped_differentiable(
    hidden_TH: torch.Tensor,
    weights: ExpertWeights,
    topk,
    spec: ExpertSpec,
    mm=None,
    host_rows: bool | None = None,
) -> torch.Tensor:
    """``differentiable_forward`` as the inference path's two grouped GEMMs
    (``torch_native.grouped_experts``, which PyTorch differentiates): no per-expert
    launches. ``host_rows`` (default: on the CPU, where a host read is free): rows of skipped
    slots are dropped after one host read of their number; else (a GPU: no host read) they
    are selected out where their undefined values could spread (``grouped_experts``)."""
    order, token, offsets, weight_TK = group_pairs(topk, spec.num_experts)
    valid = None
    if hidden_TH.device.type == "cpu" if host_rows is None else host_rows:
        rows = int(offsets[-1])
        order, token = order[:rows], token[:rows]
    else:
        valid = valid_rows(offsets, order.shape[0])[:, None]
    w = weights
    y_MH = grouped_experts(
        hidden_TH[token], offsets, spec, w.w13, w.w2, w.w13_bias, w.w2_bias, valid, mm
    )
    weight = weight_TK.reshape(-1)[order]
    out = torch.zeros(hidden_TH.shape, dtype=torch.float32, device=hidden_TH.device)
    # (y's dtype times float32 promotes: one float32 product, no float32 copy of y first)
    return out.index_add(0, token, y_MH * weight[:, None]).to(hidden_TH.dtype)


def check_frozen(weights: ExpertWeights) -> None:
    """Quantized weights train nothing of their own: refuse tensors of theirs that require
    grad, which would get no gradient silently."""
    from ..quant.weight import TENSOR_FIELDS

    trained = [
        f"{name}.{field}"
        for name, w in (("w13", weights.w13), ("w2", weights.w2))
        if is_quantized(w)
        for field in TENSOR_FIELDS
        if isinstance(getattr(w, field, None), torch.Tensor) and getattr(w, field).requires_grad
    ]
    if trained:
        raise MoeInputError(
            f"quantized weights ({weights.scheme}) are frozen, but {', '.join(trained)} "
            "requires grad: their codes and scales get no gradients (the hidden states, "
            "routing weights, biases and hooks' tensors do); call requires_grad_(False) on "
            "them, or train plain bf16/fp16/fp32 weights"
        )


def _autograd_gemm(weights: ExpertWeights, options: TorchOptions) -> ExpertGemm:
    """Expert GEMMs on a call's own weights that autograd differentiates: plain weights
    per expert (views of the tensors that require grad; in float32 where ``_float32_gemm``
    says), quantized ones through ``_FrozenExpertGemm``. Nothing outlives the call: each
    call's graph is its own.

    The views come from one ``unbind`` per tensor and call, whose backward stacks the
    experts' gradients into one tensor (zeros for the experts not hit). Indexing ``w[e]``
    per expert made, in the backward, a zero tensor of the whole weight per expert hit and
    added them up: 128 experts' worth of weight-sized fills and adds per tensor."""
    views: dict[str, tuple] = {}

    def expert(name: str, tensor: torch.Tensor, e: int) -> torch.Tensor:
        if name not in views:
            views[name] = tensor.unbind(0)
        return views[name][e]

    def gemm(which: str, e: int, x_RK: torch.Tensor) -> torch.Tensor:
        w = weights.w13 if which == "w13" else weights.w2
        bias = weights.w13_bias if which == "w13" else weights.w2_bias
        bias = None if bias is None else expert(which + "_bias", bias, e)
        if is_quantized(w):
            return _FrozenExpertGemm.apply(x_RK, bias, w, e)
        w_e = expert(which, w, e)
        return _linear(x_RK, w_e, bias, None, None, _float32_gemm(x_RK, options)).float()

    return gemm


class _Function(torch.autograd.Function):
    """``torch.autograd.Function`` without its per-call binding of the arguments to
    ``forward``'s signature outside torch.func transforms: a Function with ``setup_context``
    (the form transforms need) has ``apply`` build an ``inspect.signature`` on every call,
    25-30 us of host time each on a CPU; called with every argument positionally (as here),
    the binding changes nothing. Inside a transform, ``apply`` as PyTorch defines it."""

    @classmethod
    def apply(cls, *args):
        if _unwrap_dead_wrappers is None or torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        # (the autograd.Function base's own apply: PyTorch's, after its binding step)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))


def _private_unwrap():
    """PyTorch's step of ``Function.apply`` that ``_Function`` keeps, where this torch has
    it and the transforms' check (private names: else ``apply`` as PyTorch defines it)."""
    try:
        from torch._functorch.utils import unwrap_dead_wrappers
    except ImportError:
        return None
    return unwrap_dead_wrappers if hasattr(torch._C, "_are_functorch_transforms_active") else None


_unwrap_dead_wrappers = _private_unwrap()


class _FrozenExpertGemm(_Function):
    """Expert ``e`` of a quantized weight on rows ``x``: float32 ``[R, N]``, bias added, as
    ``_linear`` computes it. The weight is frozen (its codes and scales get no gradient); the
    gradient reaches ``x`` and the bias. The backward dequantizes the expert's weight again
    instead of keeping it from the forward: kept, a layer's experts would hold their whole
    float32 form until the backward (QLoRA-style training keeps the weights quantized). The
    scheme's input quantization passes the gradient straight through (``d round(x) / dx``
    taken as 1, as quantization-aware training does), so ``dx = grad @ W``."""

    @staticmethod
    def forward(x_RK, bias, weight, e):
        scale = weight.input_scale
        w_NK = weight.dequantize_experts(e)[0]
        scale = None if scale is None else scale[e]
        return _linear(x_RK, w_NK, bias, weight.scheme, scale).float()

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form also serves torch.func transforms)
        x_RK, bias, weight, e = inputs
        ctx.weight, ctx.e, ctx.x_dtype = weight, e, x_RK.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad_RN):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w_NK = ctx.weight.dequantize_experts(ctx.e)[0]
            grad_x = (grad_RN.float() @ w_NK).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_bias = grad_RN.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_bias, None, None


class _Float32GroupedMm(_Function):
    """PyTorch's grouped GEMM computed from float32 copies of its inputs in the forward
    (``TorchOptions.cpu_float32_gemms``), the backward (``fp32_backward``) or both, each
    result rounded to the inputs' dtype. Only the inputs themselves are saved for the
    backward, which makes its float32 copies again: autograd through ``a.float()`` would
    hold a float32 copy of every layer's weights from its forward to its backward. The
    backward's input gradient is ``grad @ b^T`` and weight gradient ``a^T @ grad`` per group
    (PyTorch's CPU bf16 matmul with a row-major right operand ran 50-150x slower than these
    in float32)."""

    @staticmethod
    def forward(a, b, ends, forward32, backward32):
        return _grouped_mm_in(a, b, ends, forward32)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form also serves torch.func transforms)
        a, b, ends, _, backward32 = inputs
        ctx.save_for_backward(a, b, ends)
        ctx.backward32 = backward32

    @staticmethod
    def backward(ctx, grad_MN):
        a, b, ends = ctx.saved_tensors
        compute = torch.float32 if ctx.backward32 else a.dtype
        grad = grad_MN.to(compute)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = grouped_mm(grad, b.to(compute).transpose(-2, -1), ends).to(a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = grouped_mm(a.to(compute).T, grad, ends).to(b.dtype)
        return grad_a, grad_b, None, None, None


def _float32_mm(forward32: bool, backward32: bool) -> GroupedMm | None:
    """The grouped GEMM for a differentiable call whose forward and / or backward compute
    in float32 (``_Float32GroupedMm``); None (PyTorch's own) for neither."""
    if not (forward32 or backward32):
        return None

    def mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return _Float32GroupedMm.apply(a, b, ends, forward32, backward32)
        return _grouped_mm_in(a, b, ends, forward32)

    return mm


def _grouped_mm_in(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, float32: bool):
    """``grouped_mm``, from float32 copies of ``a`` and ``b`` rounded to ``a``'s dtype where
    ``float32`` says, else as given."""
    if float32:
        return grouped_mm(a.float(), b.float(), ends).to(a.dtype)
    return grouped_mm(a, b, ends)
