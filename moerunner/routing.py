"""Stage 1, route: pick each token's top-k experts and their weights from router logits.

``select_experts`` covers the routers of the major MoE families:

- softmax -> top-k (optionally renormalized): Mixtral, Qwen2/3-MoE, GPT-OSS (top-k of logits
  then softmax over the k equals softmax -> top-k -> renormalize);
- sigmoid -> (+ correction bias, used only to choose) -> grouped top-k: DeepSeek-V3. A group's
  score is the sum of its two best biased scores; only ``topk_group`` groups stay eligible.
  Weights come from the unbiased scores, renormalized with +1e-20, times the scaling factor.

Output: ``TopK(weights [T, k] float32, ids [T, k] int32)``. T = 0 gives empty tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import MoeInputError

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class TopK:
    """Routing decision. ``ids`` are expert ids (or -1: slot contributes nothing)."""

    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int32

    @property
    def top_k(self) -> int:
        """Slots per token."""
        return self.ids.shape[1]


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> TopK:
    """Choose ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]`` floating tensor of raw router outputs.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide the k weights by their sum (sigmoid adds 1e-20 to the sum).
        correction_bias: ``[E]`` bias added to the scores for choosing only (DeepSeek-V3).
        num_expert_group, topk_group: grouped top-k; both or neither.
        routed_scaling_factor: multiplies the final weights.

    Returns:
        ``TopK`` with float32 weights and int32 ids, both ``[T, top_k]``.
    """
    _check_routing_args(
        router_logits, top_k, scoring_func, correction_bias, num_expert_group, topk_group
    )
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)

    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_tokens > 0:
        group_size = num_experts // num_expert_group
        grouped = choice.view(num_tokens, num_expert_group, group_size)
        best_two = min(2, group_size)
        group_scores = grouped.topk(best_two, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, -1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))

    if correction_bias is None and num_expert_group is None:
        weights, ids = torch.topk(scores, k=top_k, dim=-1)
    else:
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)

    if renormalize:
        denominator = weights.sum(dim=-1, keepdim=True)
        if scoring_func == "sigmoid":
            denominator = denominator + 1e-20
        weights = weights / denominator
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return TopK(weights=weights.float().contiguous(), ids=ids.to(torch.int32).contiguous())


def _check_routing_args(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    correction_bias: torch.Tensor | None,
    num_expert_group: int | None,
    topk_group: int | None,
) -> None:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise MoeInputError(
            f"router_logits must be 2-D [T, E], got shape {tuple(router_logits.shape)}"
        )
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating tensor, got {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise MoeInputError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    if scoring_func not in SCORING_FUNCS:
        raise MoeInputError(f"scoring_func: got {scoring_func!r}; accepted: {SCORING_FUNCS}")
    if correction_bias is not None:
        _check_correction_bias(correction_bias, num_experts, router_logits.device)
    if (num_expert_group is None) != (topk_group is None):
        raise MoeInputError("num_expert_group and topk_group must be given together")
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise MoeInputError(f"num_expert_group={num_expert_group} must divide E={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise MoeInputError(
                f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}"
            )
        if top_k > topk_group * (num_experts // num_expert_group):
            raise MoeInputError(
                f"top_k={top_k} exceeds the experts in the {topk_group} kept groups "
                f"({topk_group * (num_experts // num_expert_group)})"
            )


def _check_correction_bias(bias: object, num_experts: int, device: torch.device) -> None:
    """Type, shape and device always; NaN values only where that needs no device sync.

    A NaN bias entry would win every comparison of the top-k (every token routed to it, with
    finite weights), so a CPU bias with NaN is rejected here. On a GPU reading the values
    would synchronise every call: validate the bias where it is set
    (``check_correction_bias_values``)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(
            f"correction_bias must be a torch.Tensor [E={num_experts}] or None, "
            f"got {type(bias).__name__}"
        )
    if tuple(bias.shape) != (num_experts,):
        raise MoeInputError(
            f"correction_bias must have shape [E={num_experts}], got {tuple(bias.shape)}"
        )
    if not bias.is_floating_point():
        raise TypeError(f"correction_bias must be a floating tensor, got {bias.dtype}")
    if bias.device != device:
        raise MoeInputError(f"correction_bias is on {bias.device} but router_logits on {device}")
    if bias.device.type == "cpu":
        check_correction_bias_values(bias)


def check_correction_bias_values(bias: torch.Tensor) -> None:
    """Raise ``MoeInputError`` if ``bias`` has a NaN entry (reads values: on a GPU this
    synchronises; call it where the bias is set, not per forward)."""
    if bool(torch.isnan(bias).any()):
        bad = torch.nonzero(torch.isnan(bias)).flatten().tolist()
        raise MoeInputError(
            f"correction_bias has NaN at experts {bad[:8]}: a NaN bias would route every token "
            "to that expert; use finite values"
        )
