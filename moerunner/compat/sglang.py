"""SGLang's MoE entry points, computed by moerunner.

Routing: ``select_experts(hidden_states, router_logits, topk_config)`` with a ``TopKConfig``
(or the ``TopK`` module SGLang's models build and call: ``TopK(top_k, ...)(hidden_states,
router_logits)``) returns a ``StandardTopKOutput(topk_weights, topk_ids, router_logits)``
(``.format``: ``TopKOutputFormat.STANDARD``), as SGLang's
(``python/sglang/srt/layers/moe/topk.py``): grouped top-k ranks groups by their best score,
or with ``correction_bias`` by the sum of their two best biased scores;
grouped top-k with ``correction_bias`` scores with sigmoid whatever ``scoring_func`` says
(SGLang's ``biased_grouped_topk``); ``routed_scaling_factor`` multiplies the weights only with
``apply_routed_scaling_factor_on_output=True`` (otherwise SGLang applies it to the experts'
output, ``MoeRunnerConfig.routed_scaling_factor``).

Experts: ``fused_experts(hidden_states, w1, w2, topk_output, moe_runner_config, b1, b2,
use_* flags, scales ...)`` (``fused_moe`` is the same call) with a ``MoeRunnerConfig``
(``activation``, ``is_gated``, ``apply_router_weight_on_input``, ``inplace`` (SGLang's
default True: the result is written into ``hidden_states``), ``routed_scaling_factor``,
``gemm1_alpha`` / ``gemm1_clamp_limit``: SGLang's GPT-OSS SwiGLU, moerunner's
``swiglu_oai``, on interleaved gate/up rows or with ``gate_up_interleaved=False`` on halves;
SGLang releases differ on one of the two alone, so both are required; ``swiglu_limit``:
DeepSeek-V4's clamped SwiGLU, ``swiglu_oai`` with alpha 1 and beta 0). The extra keyword
``backend`` picks the moerunner backend.
Quantized arguments map as in ``moerunner.compat.vllm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, fields
from enum import Enum, auto
from typing import NamedTuple

import torch

from ..errors import MoeInputError
from ..routing import select_experts as _select_experts
from ._common import ExpertsCall, QuantArgs, check_router_input, peer_weights, run

__all__ = [
    "MoeRunnerConfig",
    "StandardTopKOutput",
    "TopK",
    "TopKConfig",
    "TopKOutputFormat",
    "fused_experts",
    "fused_moe",
    "select_experts",
]


class TopKOutputFormat(Enum):
    """SGLang's routing result formats; this module returns the standard one."""

    STANDARD = auto()
    TRITON_KERNEL = auto()
    BYPASSED = auto()

    def is_standard(self) -> bool:
        return self is TopKOutputFormat.STANDARD

    def is_triton_kernel(self) -> bool:
        return self is TopKOutputFormat.TRITON_KERNEL

    def is_bypassed(self) -> bool:
        return self is TopKOutputFormat.BYPASSED


class StandardTopKOutput(NamedTuple):
    """SGLang's routing result: ``topk_weights`` fp32 / ``topk_ids`` int32 ``[T, k]`` and the
    logits they came from; ``format`` as SGLang's (its layers branch on it)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor

    @property
    def format(self) -> TopKOutputFormat:
        return TopKOutputFormat.STANDARD


# The two configurations are plain (mutable) dataclasses, as SGLang's: its layers assign
# fields after building them (``moe_runner_config.inplace = False``, ``topk_config.
# torch_native = True``). Each call reads them afresh.
@dataclass
class TopKConfig:
    """SGLang's routing parameters (those with a moerunner meaning; the rest must keep
    their defaults)."""

    top_k: int
    # The rest by keyword only: SGLang's own field order differs between releases (and from
    # this one), so a positional value would land in another field.
    _: KW_ONLY
    use_grouped_topk: bool = False
    topk_group: int | None = None
    num_expert_group: int | None = None
    renormalize: bool = True
    num_fused_shared_experts: int = 0
    custom_routing_function: Callable | None = None
    correction_bias: torch.Tensor | None = None
    torch_native: bool = False
    routed_scaling_factor: float | None = None
    apply_routed_scaling_factor_on_output: bool = False
    scoring_func: str = "softmax"
    output_format: object = None
    fused_shared_experts_scaling_factor: float | None = None  # with num_fused_shared_experts
    allow_routed_experts_capture: bool = True  # SGLang's capture buffer: no meaning here


@dataclass
class MoeRunnerConfig:
    """SGLang's experts parameters (shape fields, ``routing_method_type``, ``layer`` and
    ``use_tp_all_gather_activation`` are informational here)."""

    num_experts: int | None = None
    num_local_experts: int | None = None
    hidden_size: int | None = None
    intermediate_size_per_partition: int | None = None
    layer_id: int | None = None
    top_k: int | None = None
    num_fused_shared_experts: int | None = None
    params_dtype: torch.dtype | None = None
    routing_method_type: object = None
    activation: str = "silu"
    is_gated: bool = True
    apply_router_weight_on_input: bool = False
    inplace: bool = True
    no_combine: bool = False
    routed_scaling_factor: float | None = None
    gemm1_alpha: float | None = None
    gemm1_beta: float | None = None
    gemm1_clamp_limit: float | None = None
    swiglu_limit: float | None = None
    gate_up_interleaved: bool = True
    layer: object = None
    use_tp_all_gather_activation: bool = False


class TopK(torch.nn.Module):
    """SGLang's ``TopK`` module, as its MoE models build and call it:
    ``TopK(top_k, use_grouped_topk=..., renormalize=..., correction_bias=..., ...)`` makes
    ``self.topk_config`` (a ``TopKConfig``; a keyword it lacks is a TypeError naming it), and
    ``topk(hidden_states, router_logits)`` is ``select_experts`` with it. ``quant_config``
    and ``layer_id`` are accepted (SGLang's kernel choice and capture buffers)."""

    def __init__(self, top_k: int, *, quant_config: object = None, layer_id=None, **config):
        super().__init__()
        self.topk_config = TopKConfig(top_k, **config)
        self.layer_id = layer_id

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        *,
        num_token_non_padded: torch.Tensor | None = None,
        expert_location_dispatch_info: object = None,
    ) -> StandardTopKOutput:
        return select_experts(
            hidden_states,
            router_logits,
            self.topk_config,
            layer_id=self.layer_id,
            num_token_non_padded=num_token_non_padded,
            expert_location_dispatch_info=expert_location_dispatch_info,
        )

    def extra_repr(self) -> str:  # (tensors by shape: a correction bias has E values)
        return ", ".join(
            f"{f.name}=" + (f"tensor{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v))
            for f in fields(self.topk_config)
            for v in (getattr(self.topk_config, f.name),)
        )


def select_experts(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    topk_config: TopKConfig,
    *,
    layer_id: int | None = None,
    num_token_non_padded: torch.Tensor | None = None,
    expert_location_dispatch_info: object = None,
) -> StandardTopKOutput:
    """SGLang's ``select_experts`` (module docstring). ``num_token_non_padded`` (a 0-d
    tensor): ids of the rows at or past it are set to -1, without a host read.
    ``torch_native`` picks an SGLang implementation, ``layer_id`` and
    ``allow_routed_experts_capture`` serve SGLang's routed-experts capture: all ignored."""
    where = "sglang.select_experts"
    if not isinstance(topk_config, TopKConfig):
        raise TypeError(f"{where}: topk_config must be a TopKConfig, got {type(topk_config)}")
    c = topk_config
    if c.num_fused_shared_experts:
        raise MoeInputError(
            f"{where}: num_fused_shared_experts={c.num_fused_shared_experts} has no mapping; "
            "append shared-expert slots with moerunner.dispatch.expert_map.append_shared_slots"
        )
    if expert_location_dispatch_info is not None:
        raise MoeInputError(f"{where}: expert_location_dispatch_info has no moerunner mapping")
    if _format_name(c.output_format) not in (None, "standard"):
        raise MoeInputError(
            f"{where}: output_format {c.output_format!r}; accepted: None, 'standard' or "
            "TopKOutputFormat.STANDARD"
        )
    check_router_input(where, hidden_states, router_logits, "router_logits")
    factor = c.routed_scaling_factor if c.apply_routed_scaling_factor_on_output else None
    if c.custom_routing_function is not None:
        if c.use_grouped_topk or c.correction_bias is not None or factor is not None:
            raise MoeInputError(
                f"{where}: custom_routing_function replaces the routing; use_grouped_topk, "
                "correction_bias and an applied routed_scaling_factor must be unset with it"
            )
        topk = _select_experts(
            router_logits,
            c.top_k,
            renormalize=c.renormalize,
            custom_routing_function=_keywords(c.custom_routing_function),
            hidden_states=hidden_states,
        )
    else:
        grouped = c.use_grouped_topk
        if grouped and (c.num_expert_group is None or c.topk_group is None):
            raise MoeInputError(
                f"{where}: use_grouped_topk=True needs num_expert_group, topk_group"
            )
        # SGLang's grouped top-k scores with sigmoid where it has a correction bias (DeepSeek-V3's
        # routing) and with softmax where it has none (DeepSeek-V2's), whatever scoring_func
        # says; its releases differ on that for sigmoid without a bias, so that one is refused.
        biased_grouped = grouped and c.correction_bias is not None
        if grouped and not biased_grouped and c.scoring_func != "softmax":
            raise MoeInputError(
                f"{where}: use_grouped_topk=True without correction_bias and scoring_func="
                f"{c.scoring_func!r}: SGLang's unbiased grouped top-k scores with softmax in "
                "the releases that ignore scoring_func there; pass scoring_func='softmax', or "
                "call moerunner.select_experts for grouped sigmoid scores"
            )
        topk = _select_experts(
            router_logits,
            c.top_k,
            scoring_func="sigmoid" if biased_grouped else c.scoring_func,
            renormalize=c.renormalize,
            correction_bias=c.correction_bias,
            num_expert_group=c.num_expert_group if grouped else None,
            topk_group=c.topk_group if grouped else None,
            routed_scaling_factor=1.0 if factor is None else float(factor),
            group_score="top2_sum" if c.correction_bias is not None else "max",
        )
    ids = topk.ids
    if num_token_non_padded is not None:
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        limit = torch.as_tensor(num_token_non_padded, device=ids.device)
        ids = torch.where(rows < limit, ids, torch.full_like(ids, -1))
    return StandardTopKOutput(topk.weights, ids, router_logits)


def _format_name(output_format: object) -> object:
    """``TopKConfig.output_format`` as a lower-case name: SGLang passes its
    ``TopKOutputFormat`` enum (``.STANDARD``), this module also takes the string."""
    name = getattr(output_format, "name", output_format)
    return name.lower() if isinstance(name, str) else name


def _keywords(fn: Callable) -> Callable:
    """SGLang calls a custom routing function with keywords (``hidden_states``,
    ``gating_output``, ``topk``, ``renormalize``)."""

    def call(hidden_states, router_logits, top_k, renormalize):
        return fn(
            hidden_states=hidden_states,
            gating_output=router_logits,
            topk=top_k,
            renormalize=renormalize,
        )

    return call


def _call(cfg: MoeRunnerConfig, fuse_swiglu_interleaved: bool = False) -> ExpertsCall:
    """The experts call of SGLang's Triton runner for ``cfg``: its activation branches
    (``fused_moe_triton``'s ``fused_experts_impl``), each mapped or refused."""
    name = cfg.activation
    swiglu = {
        "gemm1_alpha": cfg.gemm1_alpha,
        "gemm1_clamp_limit": cfg.gemm1_clamp_limit,
        "swiglu_limit": cfg.swiglu_limit,
    }
    given = [k for k, v in swiglu.items() if v is not None]
    if cfg.gemm1_beta not in (None, 1.0):
        raise MoeInputError(
            f"gemm1_beta={cfg.gemm1_beta}: SGLang's Triton runner adds 1 to the up half "
            "whatever gemm1_beta says, its FlashInfer runners add gemm1_beta; pass None or "
            "1.0, or call moerunner.fused_moe with swiglu_beta"
        )
    if name == "situ" and cfg.is_gated and not fuse_swiglu_interleaved:
        # Kimi-K3's soft caps on gate-then-up halves (whatever gate_up_interleaved says), as
        # SGLang's Triton runner computes them: beta gemm1_alpha (unset: 4.0), linear beta
        # gemm1_clamp_limit (unset: none, up as is)
        if cfg.swiglu_limit is not None:
            raise MoeInputError(
                "swiglu_limit applies to the gated 'silu' activation, got activation 'situ' "
                "(its parameters: gemm1_alpha, gemm1_clamp_limit)"
            )
        limit = 0.0 if cfg.gemm1_clamp_limit is None else cfg.gemm1_clamp_limit
        return ExpertsCall("situ", "gate_up", swiglu_alpha=cfg.gemm1_alpha, swiglu_limit=limit)
    if given and (name != "silu" or not cfg.is_gated):
        raise MoeInputError(
            f"{', '.join(given)} apply to the gated 'silu' activation, got activation "
            f"{name!r}, is_gated={cfg.is_gated}"
        )
    if fuse_swiglu_interleaved:
        if given or name != "silu" or not cfg.is_gated:
            raise MoeInputError(
                "fuse_swiglu_interleaved=True: w1's rows interleaved for the plain gated silu; "
                f"got activation {name!r}, is_gated={cfg.is_gated}"
                + (f" with {', '.join(given)}" if given else "")
            )
        return ExpertsCall("silu", "interleaved")
    if cfg.swiglu_limit is not None:
        if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None:
            raise MoeInputError(
                "swiglu_limit (DeepSeek-V4's clamp) together with gemm1_alpha / "
                "gemm1_clamp_limit: SGLang applies one of them; pass one"
            )
        # silu(min(gate, L)) * clamp(up, -L, L) on gate-then-up halves
        return ExpertsCall(
            "swiglu_oai", "gate_up", swiglu_alpha=1.0, swiglu_limit=cfg.swiglu_limit,
            swiglu_beta=0.0,
        )  # fmt: skip
    if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None:
        if cfg.gemm1_alpha is None or cfg.gemm1_clamp_limit is None:
            names = ("gemm1_alpha", "gemm1_clamp_limit")
            given, absent = names if cfg.gemm1_alpha is not None else names[::-1]
            raise MoeInputError(
                f"{given} without {absent}: "
                "SGLang releases differ on one of the two alone (ignored, refused, or a clamp "
                "of the plain SwiGLU); pass both for GPT-OSS's SwiGLU (moerunner's swiglu_oai); "
                "for min(silu(gate), L) * clamp(up, -L, L) call moerunner.fused_moe with "
                "activation='swiglu_step', swiglu_limit=L"
            )
        order = "interleaved" if cfg.gate_up_interleaved else "gate_up"
        return ExpertsCall("swiglu_oai", order, cfg.gemm1_alpha, cfg.gemm1_clamp_limit)
    gated = {"silu": "silu", "gelu": "gelu"}
    plain = {"relu2": "relu2", "silu": "silu_no_mul", "gelu": "gelu_no_mul"}
    table = gated if cfg.is_gated else plain
    if name not in table:
        raise MoeInputError(
            f"activation: got {name!r} with is_gated={cfg.is_gated}; accepted: "
            f"{', '.join(sorted(table))}"
        )
    return ExpertsCall(table[name])


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_output: StandardTopKOutput | tuple,
    moe_runner_config: MoeRunnerConfig | None = None,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    use_fp8_w8a8: bool = False,
    use_int8_w8a8: bool = False,
    use_int8_w8a16: bool = False,
    use_int4_w4a16: bool = False,
    per_channel_quant: bool = False,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w1_zp: torch.Tensor | None = None,
    w2_zp: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None,
    a1_q: torch.Tensor | None = None,
    fuse_swiglu_interleaved: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """SGLang's ``fused_experts`` (module docstring). ``topk_output`` is a
    ``StandardTopKOutput`` or any ``(topk_weights, topk_ids, ...)`` tuple.
    ``fuse_swiglu_interleaved=True``: w1's gate and up rows alternate (plain gated silu);
    ``a1_q`` (activations quantized by the caller) has no mapping and is refused."""
    where = "sglang.fused_experts"
    cfg = (
        MoeRunnerConfig() if moe_runner_config is None else moe_runner_config
    )  # (SGLang's default)
    if not isinstance(cfg, MoeRunnerConfig):
        raise TypeError(f"{where}: moe_runner_config must be a MoeRunnerConfig, got {type(cfg)}")
    if cfg.no_combine:
        raise MoeInputError(f"{where}: no_combine=True (per-slot outputs) has no moerunner mapping")
    if not isinstance(topk_output, tuple) or len(topk_output) < 2:
        raise TypeError(f"{where}: topk_output must be a StandardTopKOutput")
    if a1_q is not None:
        raise MoeInputError(
            f"{where}: a1_q (activations quantized by the caller) has no moerunner mapping; "
            "pass hidden_states and the weights' scales"
        )
    if not isinstance(fuse_swiglu_interleaved, bool):
        raise TypeError(f"{where}: fuse_swiglu_interleaved must be a bool")
    call = _call(cfg, fuse_swiglu_interleaved)
    bf16 = getattr(hidden_states, "dtype", None) == torch.bfloat16
    if fuse_swiglu_interleaved and (b1 is not None or use_fp8_w8a8 or use_int8_w8a8
                                    or use_int8_w8a16 or use_int4_w4a16
                                    or cfg.apply_router_weight_on_input or not bf16):  # fmt: skip
        raise MoeInputError(
            f"{where}: fuse_swiglu_interleaved=True takes bf16 hidden states and unquantized "
            "weights without b1 or apply_router_weight_on_input (SGLang refuses the rest)"
        )
    q = QuantArgs(
        use_fp8_w8a8,
        use_int8_w8a8,
        use_int8_w8a16,
        use_int4_w4a16,
        per_channel_quant,
        w1_scale,
        w2_scale,
        w1_zp,
        w2_zp,
        a1_scale,
        a2_scale,
        block_shape,
    )
    w13, w2q = peer_weights(where, w1, w2, q)
    factor = cfg.routed_scaling_factor
    return run(
        where,
        hidden_states,
        w13,
        w2q,
        topk_output[0],
        topk_output[1],
        call,
        w13_bias=b1,
        w2_bias=b2,
        apply_router_weight_on_input=cfg.apply_router_weight_on_input,
        inplace=cfg.inplace,
        output=None,
        backend=backend,
        scale=None if factor is None or factor == 1.0 else float(factor),
    )


#: SGLang's ``fused_moe`` takes the same arguments as its ``fused_experts``.
fused_moe = fused_experts
