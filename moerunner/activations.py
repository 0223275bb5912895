"""Expert activations in PyTorch, on GEMM1 output rows.

``apply_activation(h_MN, spec)`` takes GEMM1's output (``N = 2I`` for gated activations, gate
then up or interleaved; ``N = I`` otherwise) and returns ``[M, I]`` in float32. Math runs in
float32 whatever the input dtype, as the fused kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ExpertSpec


def split_gate_up(h_MN: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up halves of a gated GEMM1 output."""
    if interleaved:
        return h_MN[:, 0::2], h_MN[:, 1::2]
    half = h_MN.shape[-1] // 2
    return h_MN[:, :half], h_MN[:, half:]


def apply_activation(h_MN: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """act(gate) * up for gated activations, act(x) otherwise; float32 ``[M, I]``."""
    h = h_MN.float()
    act = spec.activation
    if not act.gated:  # relu2
        return torch.square(torch.relu(h))
    gate, up = split_gate_up(h, spec.gate_up_interleaved)
    if act.name == "silu":
        return F.silu(gate) * up
    if act.name == "gelu":
        return F.gelu(gate) * up
    if act.name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    # swiglu_oai: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1.0) * gate * torch.sigmoid(act.alpha * gate)
