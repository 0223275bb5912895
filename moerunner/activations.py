"""Expert activations in PyTorch, on GEMM1 output rows.

``apply_activation(h_MN, spec)`` takes GEMM1's output (``N = 2I`` for gated activations, gate
then up or interleaved; ``N = I`` for the non-gated ``relu2`` and ``*_no_mul``) and returns
``[M, I]`` in float32. Math runs in float32 whatever the input dtype, as the fused kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import Activation, ExpertSpec


def split_gate_up(h_MN: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up halves of a gated GEMM1 output (views). As one unbind or split: in a
    backward they give one gradient of ``h_MN``'s size, where two slices gave two zero
    tensors of it, added."""
    if interleaved:
        gate, up = h_MN.unflatten(-1, (-1, 2)).unbind(-1)
        return gate, up
    gate, up = h_MN.split(h_MN.shape[-1] // 2, dim=-1)
    return gate, up


def _plain(x: torch.Tensor, name: str) -> torch.Tensor:
    """The activation function ``name`` itself (no gate times up)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":
        return torch.square(torch.relu(x))
    raise ValueError(f"activate: no activation function {name!r}")


def _finite_below(gate: torch.Tensor) -> torch.Tensor:
    """The gate (float32) with -inf raised to the lowest finite value. fp16 GEMM outputs
    below fp16's range round to -inf, where ``x * sigmoid(x)`` is NaN; every activation's
    gate gives 0 for any value that low (as for the float32 values the fused kernels keep),
    which the lowest finite value gives too. The up half keeps its infinities: they are the
    correctly rounded product."""
    return gate.clamp_min(torch.finfo(gate.dtype).min)


def _per_row(param, experts: torch.Tensor | int | None) -> torch.Tensor | float:
    """A swiglu_oai parameter for each row: a float as is; a per-expert tensor ``[E]``
    indexed by the rows' expert (an int for rows of one expert, or ``[M]`` ids) as float32
    ``[M, 1]`` (or a 0-d tensor)."""
    if not isinstance(param, torch.Tensor):
        return param
    if experts is None:
        raise ValueError("per-expert swiglu parameters need the expert of each row")
    if isinstance(experts, int):
        return param[experts].float()
    return param.float()[experts.long()][:, None]


def apply_activation(
    h_MN: torch.Tensor, spec: ExpertSpec, experts: torch.Tensor | int | None = None
) -> torch.Tensor:
    """act(gate) * up for gated activations, act(x) otherwise; float32 ``[M, I]``.

    ``experts``: the expert of the rows (an int) or of each row (``[M]``), needed where the
    activation has per-expert parameters (``Activation.per_expert``)."""
    return activate(h_MN, spec.activation, spec.gate_up_interleaved, experts)


def activate(
    h_MN: torch.Tensor,
    act: Activation,
    interleaved: bool,
    experts: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """``apply_activation`` of an activation and row order given apart (no ``ExpertSpec``
    made, so ``torch.compile`` traces it on every supported torch)."""
    h = h_MN.float()
    if not act.gated:  # relu2, silu_no_mul, ...: act(x)
        return _plain(_finite_below(h), act.name.removesuffix("_no_mul"))
    gate, up = split_gate_up(h, interleaved)
    gate = _finite_below(gate)
    if act.name == "swiglu_step":  # the clamp after the activation
        limit = _per_row(act.limit, experts)
        # (clamp, also with per-expert tensor limits: its gradient at a value equal to the
        # limit is the value's, as torch.clamp's; minimum / maximum would split it in two)
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    if act.name == "situ":  # soft caps: beta tanh(gate / beta) sigmoid(gate) * L tanh(up / L)
        beta, linear_beta = act.alpha, act.limit  # (scalars; limit 0.0: no linear cap)
        soft_gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        return soft_gate * (linear_beta * torch.tanh(up / linear_beta) if linear_beta else up)
    if act.name != "swiglu_oai":
        activated = _plain(gate, act.name)
        product = activated * up
        if h_MN.dtype == torch.float16:
            # An fp16 GEMM output past fp16's range is inf, where the fused kernels keep a
            # finite float32 value: act(gate) = 0 times that is 0 there, not 0 * inf = NaN.
            product = torch.where((activated == 0) & up.isinf(), 0.0, product)
        return product
    # swiglu_oai: clamp, then (up + beta) * gate * sigmoid(alpha * gate)
    alpha, beta, limit = (_per_row(p, experts) for p in (act.alpha, act.beta, act.limit))
    gate = gate.clamp(max=limit)  # (the clamp's gradient convention whatever limit is)
    up = up.clamp(min=-limit, max=limit)
    return (up + beta) * (gate * torch.sigmoid(alpha * gate))  # (gate first: -> 0, not inf)
