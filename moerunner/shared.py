"""Shared experts: MLPs every token passes through, beside the routed experts.

DeepSeek-V2/V3, Qwen2-MoE, Qwen3-Next, Llama-4 and GLM-4-MoE add to the routed experts'
output one or more *shared* experts that every token passes through (Qwen2-MoE and
Qwen3-Next scale it by a per-token gate ``sigmoid(hidden @ shared_gate.T)``). Here they run
as a call of their own on the same runner: ``S`` experts, every token routed to each of
them with weight 1 or its gate value (``own_slots``), prepared once like any weights, and
the two outputs summed in float32, rounded once.

Why not extra slots of the routed call (one expert table of the routed experts followed by
the shared ones, split into chunks of the routed I): that table is a second copy of every
routed weight, and it was not faster. Measured on an H100 (CUDA-graph replay, record
nvidia-h100-shared-experts-2026-12-06), the own call took 0.99-1.01x the table's time at
DeepSeek-V3's shape and 0.87-1.03x at Qwen1.5-MoE's (I_s = 4I, gated), at T = 1-4096.

Shared weights may have any intermediate size ``I_s`` and be quantized in any scheme (or
stay float beside quantized routed experts, as a model keeps its shared MLP when only its
experts are quantized); float ones have the hidden states' dtype. Eager and compiled calls
compute them the same way, and they train where their weights require grad.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import Activation
from .errors import MoeInputError
from .routing import TopK
from .weights import PLAIN_DTYPES, ExpertWeights, is_quantized, weight_shape

__all__ = ["SharedExperts", "own_slots", "shared_dense"]


@dataclass(frozen=True)
class SharedExperts:
    """Shared experts: every token passes through each of them.

    ``w13``: ``[S, 2I_s, H]`` (gate rows then up rows, or alternating like the routed
    weights when the call has ``gate_up_interleaved``), ``[S, I_s, H]`` for a non-gated
    activation; ``w2``: ``[S, H, I_s]``. Plain tensors (of the hidden states' dtype), or
    quantized weights in any scheme. ``gate``: optional ``[S, H]``; each token's output of
    shared expert ``s`` is multiplied by ``sigmoid(hidden @ gate[s])`` (Qwen2-MoE's
    ``shared_expert_gate``; computed in float32).
    """

    w13: Any
    w2: Any
    gate: torch.Tensor | None = None

    @property
    def num_shared(self) -> int:
        """S."""
        return weight_shape(self.w13)[0]

    def intermediate_size(self, activation: Activation) -> int:
        """I_s."""
        return weight_shape(self.w2)[2]

    def validate(self, routed: ExpertWeights, activation: Activation) -> None:
        """Shapes, kinds and devices against the routed weights; raises naming the field."""
        for name, w in (("shared w13", self.w13), ("shared w2", self.w2)):
            if not (isinstance(w, torch.Tensor) or is_quantized(w)):
                raise TypeError(
                    f"{name} must be a torch.Tensor or a quantized weight, got {type(w).__name__}"
                )
            if len(weight_shape(w)) != 3:
                raise MoeInputError(f"{name} must be 3-D, got shape {list(weight_shape(w))}")
            if isinstance(w, torch.Tensor) and w.dtype not in PLAIN_DTYPES:
                raise TypeError(f"{name} dtype {w.dtype} is not accepted: bf16, fp16 or fp32")
            if w.device != routed.device:
                raise MoeInputError(
                    f"{name} is on {w.device} but the routed weights on {routed.device}"
                )
        s13, rows, h13 = weight_shape(self.w13)
        s2, h2, inter = weight_shape(self.w2)
        hidden = routed.hidden_size
        if s13 != s2:
            raise MoeInputError(f"shared w13 has S={s13} experts but shared w2 has S={s2}")
        if h13 != hidden or h2 != hidden:
            raise MoeInputError(
                f"shared w13 {list(weight_shape(self.w13))} and w2 {list(weight_shape(self.w2))} "
                f"must have the routed experts' hidden size H={hidden}"
            )
        want = 2 * inter if activation.gated else inter
        if rows != want:
            raise MoeInputError(
                f"shared w13 has {rows} rows but activation {activation.name!r} with shared "
                f"w2's I_s={inter} needs {want}"
            )
        if inter == 0 and s13:
            raise MoeInputError("shared experts need an intermediate size I_s >= 1")
        if is_quantized(self.w13) != is_quantized(self.w2):
            raise TypeError("shared w13 and w2 must both be plain tensors or both be quantized")
        if not is_quantized(self.w13) and self.w13.dtype != self.w2.dtype:
            raise TypeError(f"shared w13/w2 dtypes {self.w13.dtype}/{self.w2.dtype} must be equal")
        if self.gate is not None:
            if not isinstance(self.gate, torch.Tensor):
                raise TypeError(f"shared gate must be a torch.Tensor, got {type(self.gate)}")
            if tuple(self.gate.shape) != (s13, hidden):
                raise MoeInputError(
                    f"shared gate must be [S={s13}, H={hidden}], got {list(self.gate.shape)}"
                )
            if not self.gate.is_floating_point():
                raise TypeError(f"shared gate must be floating, got {self.gate.dtype}")
            if self.gate.device != routed.device:
                raise MoeInputError(
                    f"shared gate is on {self.gate.device} but the routed weights on "
                    f"{routed.device}"
                )


def shared_weights_TS(hidden_TH: torch.Tensor, shared: SharedExperts) -> torch.Tensor:
    """Per token and shared expert: the gate value ``sigmoid(x @ gate[s])`` (float32), or 1."""
    tokens, count = hidden_TH.shape[0], shared.num_shared
    if shared.gate is None:
        return torch.ones(tokens, count, dtype=torch.float32, device=hidden_TH.device)
    return torch.sigmoid(hidden_TH.float() @ shared.gate.float().T)


def own_slots(hidden_TH: torch.Tensor, shared: SharedExperts) -> TopK:
    """The routing of the shared experts run as a call of their own (``S`` experts, every
    token to each with its gate value): ``S`` slots per token, ids ``0..S-1``."""
    count = shared.num_shared
    ids = torch.arange(count, dtype=torch.int32, device=hidden_TH.device)
    return TopK(shared_weights_TS(hidden_TH, shared), ids.expand(hidden_TH.shape[0], count))


def shared_dense(
    hidden_TH: torch.Tensor, shared: SharedExperts, act: Activation, interleaved: bool = False
) -> torch.Tensor:
    """The shared experts as separate dense MLPs in PyTorch (float32 ``[T, H]``, gate
    applied): what a model computes beside its routed call; the benchmarks' baseline."""
    from .activations import activate

    w13 = shared.w13.dequantize() if is_quantized(shared.w13) else shared.w13
    w2 = shared.w2.dequantize() if is_quantized(shared.w2) else shared.w2
    x = hidden_TH if w13.dtype == hidden_TH.dtype else hidden_TH.float()
    gate_TS = shared_weights_TS(hidden_TH, shared)
    out = torch.zeros(hidden_TH.shape, dtype=torch.float32, device=hidden_TH.device)
    for s in range(shared.num_shared):
        a = activate(x @ w13[s].to(x.dtype).T, act, interleaved).to(x.dtype)
        out = out + (a @ w2[s].to(x.dtype).T).float() * gate_TS[:, s : s + 1]
    return out


def shared_order(weights: ExpertWeights) -> str:
    """The row order of shared experts beside these routed weights: alternating with
    interleaved ones, else gate then up (``SharedExperts``)."""
    return "interleaved" if weights.w13_order == "interleaved" else "gate_up"


def check_shared(
    shared: object, weights: ExpertWeights, act: Activation, hidden_states: torch.Tensor
) -> bool:
    """Shared experts a call of ``hidden_states`` can run beside these routed weights; False
    when there are none (S = 0)."""
    if not isinstance(shared, SharedExperts):
        raise TypeError(f"shared_experts must be a SharedExperts, got {type(shared).__name__}")
    shared.validate(weights, act)
    if isinstance(shared.w13, torch.Tensor) and shared.w13.dtype != hidden_states.dtype:
        raise TypeError(
            f"shared w13/w2 dtype {shared.w13.dtype} must equal hidden_states dtype "
            f"{hidden_states.dtype} (or pass quantized shared experts)"
        )
    if act.per_expert and shared.num_shared:
        raise MoeInputError(
            f"shared_experts with per-expert activation parameters "
            f"({', '.join(act.tensors())} of shape [E]) are not supported: the shared experts "
            "would need values of their own; pass scalar parameters"
        )
    return shared.num_shared > 0
