"""``MoE``: an ``nn.Module`` holding one layer's expert weights, routing settings and runner.

``forward(hidden_states, router_logits)`` runs route -> dispatch -> experts -> combine. With
plain weights the expert step is the ``moerunner::fused_experts`` custom op, so the layer
compiles with ``torch.compile(fullgraph=True)``. The layer is for inference: no gradients flow
through the experts. ``quantize_(scheme)`` swaps the weights for
quantized ones (done once); the backend then runs that scheme. The quantized copy follows
the float parameters: after an in-place edit, ``load_state_dict`` or ``.data`` assignment of
``w13`` / ``w2`` the next forward quantizes them again (a host-side check, no device sync).
"""

from __future__ import annotations

import torch
from torch import nn

from .api import fused_moe
from .config import MoeConfig
from .errors import MoeInputError
from .routing import select_experts
from .weights import ExpertWeights


class MoE(nn.Module):
    """One MoE layer.

    Args:
        config: shapes, activation, biases and routing (``MoeConfig``).
        backend: backend name or ``"auto"``.
        dtype, device: of the parameters (random-initialised; load real ones with
            ``load_state_dict`` or assign ``w13`` / ``w2``).
    """

    def __init__(
        self,
        config: MoeConfig,
        *,
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.config = config
        self.backend = backend
        kw = {"dtype": dtype, "device": device}
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.w13 = nn.Parameter(torch.randn(e, config.w13_rows, h, **kw) * h**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, h, i, **kw) * i**-0.5)
        self.w13_bias = nn.Parameter(torch.zeros(e, config.w13_rows, **kw)) if config.bias else None
        self.w2_bias = nn.Parameter(torch.zeros(e, h, **kw)) if config.bias else None
        self.correction_bias = (
            nn.Buffer(torch.zeros(e, dtype=torch.float32, device=device))
            if config.routing.correction_bias
            else None
        )
        if self.correction_bias is not None:  # checked where it is set, not per forward
            self.register_load_state_dict_post_hook(_check_loaded_correction_bias)
        self.quantized: ExpertWeights | None = None
        self._quantized_from: tuple | None = None  # (scheme, state of w13 / w2 when quantized)

    def quantize_(self, scheme) -> MoE:
        """Replace the expert weights by quantized ones in ``scheme`` (name or value)."""
        from .quant import quantize

        with torch.no_grad():
            self.quantized = ExpertWeights(
                quantize(self.w13.detach(), scheme),
                quantize(self.w2.detach(), scheme),
                self.w13_bias,
                self.w2_bias,
                self.config.gate_up_interleaved,
            )
        self._quantized_from = (scheme, self._float_state())
        return self

    def _float_state(self) -> tuple:
        return tuple(
            (p.data_ptr(), p.dtype, tuple(p.shape), p._version) for p in (self.w13, self.w2)
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., H]``, ``router_logits [..., E]`` -> ``[..., H]``."""
        cfg = self.config
        if hidden_states.shape[-1] != cfg.hidden_size:
            raise MoeInputError(
                f"hidden_states last dim must be H={cfg.hidden_size}, got {hidden_states.shape[-1]}"
            )
        if router_logits.shape[:-1] != hidden_states.shape[:-1]:
            raise MoeInputError(
                f"router_logits leading shape {list(router_logits.shape[:-1])} differs from "
                f"hidden_states' {list(hidden_states.shape[:-1])}"
            )
        if router_logits.shape[-1] != cfg.num_experts:
            raise MoeInputError(
                f"router_logits last dim must be num_experts E={cfg.num_experts}, "
                f"got {router_logits.shape[-1]}"
            )
        if self._quantized_from is not None and self._quantized_from[1] != self._float_state():
            self.quantize_(self._quantized_from[0])  # w13 / w2 changed since quantize_
        x = hidden_states.reshape(-1, cfg.hidden_size)
        r = cfg.routing
        topk = select_experts(
            router_logits.reshape(x.shape[0], router_logits.shape[-1]),
            cfg.top_k,
            scoring_func=r.scoring_func,
            renormalize=r.renormalize,
            correction_bias=self.correction_bias,
            num_expert_group=r.num_expert_group,
            topk_group=r.topk_group,
            routed_scaling_factor=r.routed_scaling_factor,
        )
        act = cfg.activation
        if self.quantized is not None:
            q = self.quantized
            out = fused_moe(
                x,
                q.w13,
                q.w2,
                topk.weights,
                topk.ids,
                activation=act,
                w13_bias=q.w13_bias,
                w2_bias=q.w2_bias,
                gate_up_interleaved=q.gate_up_interleaved,
                backend=self.backend,
            )
        else:
            # Inference only: the op has no backward, so weights enter detached.
            b13, b2 = (None if b is None else b.detach() for b in (self.w13_bias, self.w2_bias))
            out = torch.ops.moerunner.fused_experts(
                x.detach(),
                self.w13.detach(),
                self.w2.detach(),
                topk.weights,
                topk.ids,
                b13,
                b2,
                act.name,
                act.alpha,
                act.limit,
                cfg.gate_up_interleaved,
                self.backend,
            )
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"config={self.config!r}, backend={self.backend!r}"


def _check_loaded_correction_bias(module: MoE, incompatible_keys) -> None:
    """A NaN correction bias routes every token to its expert: rejected at load time (one
    read of E values), since checking a GPU bias per forward would synchronise."""
    from .routing import check_correction_bias_values

    check_correction_bias_values(module.correction_bias)
