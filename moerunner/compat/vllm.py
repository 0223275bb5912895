"""vLLM's fused-MoE entry points, computed by moerunner.

``fused_experts`` and ``fused_moe`` take vLLM's argument names and meanings
(``vllm/model_executor/layers/fused_moe/fused_moe.py``): ``w1 [E, 2I, H]`` (gate rows then
up rows; ``activation="swigluoai"`` reads them interleaved, as vLLM's GPT-OSS path does),
``w2 [E, H, I]``, ``topk_weights`` / ``topk_ids``, ``inplace`` (the result is written into
``hidden_states``, which is returned), ``output`` (written and returned), ``expert_map`` with
``global_num_experts``, biases ``w1_bias`` / ``w2_bias`` and pre-quantized weights with their
scales and zero points, given either as vLLM's ``quant_config`` (a ``FusedMoEQuantConfig``,
read through its properties, its ``gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit``
parameterising the clamped SwiGLU where given) or as the flat ``use_*`` flags of older
releases.
``fused_topk`` and ``grouped_topk`` return vLLM's tuples. The extra keyword ``backend``
picks the moerunner backend.

Positional arguments follow vLLM's ``fused_experts`` in both of its recent orders:
``(hidden_states, w1, w2, topk_weights, topk_ids, activation,
apply_router_weight_on_input, global_num_experts, expert_map, quant_config)`` since vLLM
dropped ``inplace`` (mid-2026), and with ``inplace`` before ``activation`` in the releases
before (0.11 on); a bool in sixth place is ``inplace``, anything else ``activation``. vLLM
moved the rest between releases (0.10 put ``is_act_and_mul`` seventh, 0.9 the flat flags
eighth on), so here they are keyword-only: a call written for another order fails instead of
reading one argument as another.
``activation`` is a name or vLLM's ``MoEActivation`` (its ``value`` is read).

Differences that stay: dynamically quantized activations are quantized per token (fp8 per
tensor / channel, int8) or per token and K block (fp8 block), where vLLM quantizes fp8 per
tensor weights' inputs per tensor; slots are ordered by descending score; ids and weights
are int32 / float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace

import torch

from ..errors import MoeInputError
from ..routing import check_router_width, select_experts
from ._common import (
    ExpertsCall,
    QuantArgs,
    check_global_num_experts,
    check_router_input,
    global_to_local,
    peer_weights,
    run,
)

__all__ = ["ACTIVATIONS", "fused_experts", "fused_moe", "fused_topk", "grouped_topk"]

#: vLLM activation name -> moerunner's call (activation, w13 row order).
ACTIVATIONS = {
    "silu": ExpertsCall("silu"),
    "gelu": ExpertsCall("gelu"),
    "gelu_tanh": ExpertsCall("gelu_tanh"),
    "swigluoai": ExpertsCall("swiglu_oai", "interleaved"),
    # gate-then-up rows (MiniMax-M3); its clamp limit comes from the quant config
    "swigluoai_uninterleave": ExpertsCall("swiglu_oai"),
    "swiglustep": ExpertsCall("swiglu_step", swiglu_limit=7.0),
    # Kimi-K3's values: vLLM reads situ's betas from the layer's FusedMoEConfig, which
    # fused_experts is not given
    "situ": ExpertsCall("situ"),
    "relu2_no_mul": ExpertsCall("relu2"),
    "silu_no_mul": ExpertsCall("silu_no_mul"),
    "gelu_no_mul": ExpertsCall("gelu_no_mul"),
    "gelu_tanh_no_mul": ExpertsCall("gelu_tanh_no_mul"),
}


#: Other names vLLM reads as one of its activations (``MoEActivation.from_str``).
_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}

#: vLLM's gated activation -> its non-gated form (``is_act_and_mul=False``).
_WITHOUT_MUL = {
    "silu": "silu_no_mul",
    "gelu": "gelu_no_mul",
    "gelu_tanh": "gelu_tanh_no_mul",
    "relu2": "relu2_no_mul",
}


def _call(
    activation: object, is_act_and_mul: object = True, gemm1: dict | None = None
) -> ExpertsCall:
    """The experts call of vLLM's ``activation`` (a name or a ``MoEActivation``), with the
    quant config's ``gemm1_*`` activation parameters (``_GEMM1_PARAMS``) where given."""
    name = getattr(activation, "value", activation)  # vLLM's MoEActivation is a str Enum
    if not isinstance(is_act_and_mul, bool):
        raise TypeError(f"is_act_and_mul must be a bool, got {type(is_act_and_mul).__name__}")
    if isinstance(name, str):
        name = _ALIASES.get(name, name)
    if not is_act_and_mul and isinstance(name, str):
        if name in ACTIVATIONS and name not in _WITHOUT_MUL and not name.endswith("_no_mul"):
            raise MoeInputError(
                f"activation {name!r} with is_act_and_mul=False: it is gated only (vLLM "
                f"refuses it too); non-gated forms: {', '.join(sorted(_WITHOUT_MUL))}"
            )
        name = _WITHOUT_MUL.get(name, name)
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise MoeInputError(
            f"activation: got {activation!r}"
            + ("" if is_act_and_mul else " with is_act_and_mul=False")
            + f"; accepted: {', '.join(sorted(ACTIVATIONS))}"
        )
    return _with_gemm1(name, ACTIVATIONS[name], gemm1 or {})


#: ``FusedMoEQuantConfig`` properties of vLLM's releases since mid-2026 that parameterise
#: the activation (absent before, read as None): the clamped SwiGLU
#: ``gate * sigmoid(alpha * gate) * (up + beta)`` with gate clamped above and up on both
#: sides at the limit (``swigluoai``, ``swigluoai_uninterleave``), or SiLU with that clamp
#: (``silu`` with a limit; alpha 1 and beta 0, DeepSeek-V4's form).
_GEMM1_PARAMS = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")


def _with_gemm1(name: str, call: ExpertsCall, gemm1: dict) -> ExpertsCall:
    """``call`` with vLLM's ``gemm1_*`` parameters applied, or a ``MoeInputError`` where
    they mean nothing for the activation (vLLM applies them to the two SwiGLU-OAI forms and
    to a clamped SiLU only)."""
    alpha, beta, limit = (gemm1.get(n) for n in _GEMM1_PARAMS)
    where = "vllm.fused_experts: quant_config"
    if name == "swigluoai_uninterleave":
        missing = [n for n in _GEMM1_PARAMS if gemm1.get(n) is None]
        if missing:
            # (vLLM's Triton experts require the limit; where alpha or beta is unset its
            # releases and backends fall back to different values: GPT-OSS's or plain SiLU's)
            raise MoeInputError(
                f"{where}: activation 'swigluoai_uninterleave' needs gemm1_alpha, gemm1_beta "
                f"and gemm1_clamp_limit (MiniMax-M3: 1.702, 1.0 and its limit); "
                f"{', '.join(missing)} unset"
            )
        return replace(call, swiglu_alpha=alpha, swiglu_beta=beta, swiglu_limit=limit)
    if name == "swigluoai":
        # vLLM's Triton experts run GPT-OSS's values whatever the config says, its FlashInfer
        # experts the config's: other values are refused rather than given either meaning.
        gpt_oss = (1.702, 1.0, 7.0)
        for param, value, fixed in zip(_GEMM1_PARAMS, (alpha, beta, limit), gpt_oss, strict=True):
            if value is not None and value != fixed:
                raise MoeInputError(
                    f"{where}.{param}={value!r} with activation 'swigluoai': vLLM's backends "
                    f"disagree on it (its Triton experts keep GPT-OSS's {fixed}); for other "
                    "parameters use 'swigluoai_uninterleave' with gate-then-up rows, or "
                    "moerunner.fused_moe(activation='swiglu_oai', gate_up_interleaved=True, "
                    "swiglu_alpha=..., swiglu_beta=..., swiglu_limit=...)"
                )
        return call
    if name == "silu":
        for param, value, identity in (("gemm1_alpha", alpha, 1.0), ("gemm1_beta", beta, 0.0)):
            if value is not None and value != identity:
                raise MoeInputError(
                    f"{where}.{param}={value!r} with activation 'silu': vLLM takes alpha and "
                    "beta for 'swigluoai_uninterleave' only (with 'silu' they must be 1 and 0 "
                    "or unset)"
                )
        if limit is None:
            return call
        # silu(min(gate, L)) * clamp(up, -L, L) == swiglu_oai with alpha 1 and beta 0
        return ExpertsCall("swiglu_oai", "gate_up", 1.0, limit, 0.0)
    given = [n for n in _GEMM1_PARAMS if gemm1.get(n) is not None]
    if given:
        raise MoeInputError(
            f"{where}.{given[0]}={gemm1[given[0]]!r} with activation {name!r}: vLLM applies "
            "gemm1_alpha / gemm1_beta / gemm1_clamp_limit to 'swigluoai', "
            "'swigluoai_uninterleave' and (the limit) 'silu'"
        )
    return call


#: The ``FusedMoEQuantConfig`` properties read for the flat arguments of ``fused_experts``.
_QUANT_CONFIG_READS = (
    "use_fp8_w8a8",
    "use_int8_w8a8",
    "use_int8_w8a16",
    "use_int4_w4a16",
    "per_act_token_quant",
    "w1_scale",
    "w2_scale",
    "w1_zp",
    "w2_zp",
    "a1_scale",
    "a2_scale",
    "block_shape",
    "w1_bias",
    "w2_bias",
)
#: Its formats that moerunner does not map (each a property that is truthy when in use).
_QUANT_CONFIG_UNMAPPED = (
    "use_fp8_w8a16",
    "use_nvfp4_w4a16",
    "use_mxfp4_w4a16",
    "use_mxfp4_w4a4",
    "use_nvfp4_w4a4",
    "use_mxfp4_w4a8",
    "ocp_mx_scheme",
)


def _read_quant_config(where: str, quant_config: object) -> tuple[QuantArgs, object, object, dict]:
    """``(QuantArgs, w1_bias, w2_bias, gemm1)`` of a vLLM ``FusedMoEQuantConfig``, read as
    vLLM's own ``fused_experts`` reads it (``per_channel_quant`` is its
    ``per_act_token_quant``); ``gemm1``: its activation parameters (``_GEMM1_PARAMS``), None
    where unset or absent (older releases)."""
    missing = [n for n in _QUANT_CONFIG_READS if not hasattr(quant_config, n)]
    if missing:
        raise MoeInputError(
            f"{where}: quant_config must be vLLM's FusedMoEQuantConfig (or an object with its "
            f"properties); {type(quant_config).__name__} has no {', '.join(missing)}"
        )
    for name in _QUANT_CONFIG_UNMAPPED:
        value = getattr(quant_config, name, None)
        if value:
            raise MoeInputError(
                f"{where}: quant_config uses {name}={value!r}, which has no moerunner mapping "
                "here; mapped: bf16 / fp16 weights, use_fp8_w8a8 (per tensor, per channel, "
                "block), use_int8_w8a8, use_int8_w8a16, use_int4_w4a16"
            )
    r = {n: getattr(quant_config, n) for n in _QUANT_CONFIG_READS}
    block = r["block_shape"]
    q = QuantArgs(
        bool(r["use_fp8_w8a8"]),
        bool(r["use_int8_w8a8"]),
        bool(r["use_int8_w8a16"]),
        bool(r["use_int4_w4a16"]),
        bool(r["per_act_token_quant"]),
        r["w1_scale"],
        r["w2_scale"],
        r["w1_zp"],
        r["w2_zp"],
        r["a1_scale"],
        r["a2_scale"],
        None if block is None else list(block),
    )
    gemm1 = {}
    for name in _GEMM1_PARAMS:
        value = getattr(quant_config, name, None)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"{where}: quant_config.{name} must be a float or None, got "
                    f"{type(value).__name__}"
                )
            gemm1[name] = float(value)
    return q, r["w1_bias"], r["w2_bias"], gemm1


#: ``fused_experts``' arguments after ``topk_ids`` that vLLM passes positionally, with their
#: defaults, in the order of the releases that had ``inplace`` (up to mid-2026); the releases
#: since drop ``inplace`` and keep the order of the rest.
_PEER_DEFAULTS = {
    "inplace": False,
    "activation": "silu",
    "apply_router_weight_on_input": False,
    "global_num_experts": -1,
    "expert_map": None,
    "quant_config": None,
}
_UNSET = object()


def _peer_arguments(where: str, args: tuple, named: dict) -> dict:
    """``fused_experts``' arguments after ``topk_ids``: ``args`` (positional) by name in the
    order of the release the call was written for (a bool sixth is the older releases'
    ``inplace``, anything else their successors' ``activation``: a name or ``MoEActivation``,
    never a bool), then ``named`` (keywords; ``_UNSET`` where not passed), then defaults."""
    order = tuple(_PEER_DEFAULTS)
    if args and not isinstance(args[0], bool):
        order = order[1:]
    if len(args) > len(order):
        raise TypeError(
            f"{where}: takes at most {5 + len(order)} positional arguments in this form "
            f"(... topk_ids, {', '.join(order)}), got {5 + len(args)}"
        )
    out = dict(zip(order, args, strict=False))
    twice = [n for n in out if named[n] is not _UNSET]
    if twice:
        raise TypeError(f"{where}: got multiple values for argument {twice[0]!r}")
    for name, default in _PEER_DEFAULTS.items():
        if name not in out:
            out[name] = default if named[name] is _UNSET else named[name]
    check_global_num_experts(where, out["global_num_experts"])
    return out


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *args: object,
    inplace: object = _UNSET,
    activation: object = _UNSET,
    apply_router_weight_on_input: object = _UNSET,
    global_num_experts: object = _UNSET,
    expert_map: object = _UNSET,
    quant_config: object = _UNSET,
    is_act_and_mul: bool = True,
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
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    allow_deep_gemm: bool = False,
    output: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """vLLM's ``fused_experts`` (module docstring): after ``topk_ids`` come, positionally or
    by name, ``inplace`` (default False), ``activation`` ("silu"),
    ``apply_router_weight_on_input`` (False), ``global_num_experts`` (-1), ``expert_map``
    (None) and ``quant_config`` (None); positionally ``inplace`` is there only in the order
    of the releases that had it. ``allow_deep_gemm`` picks a vLLM kernel and changes no
    result: accepted and ignored. ``quant_config`` (vLLM's ``FusedMoEQuantConfig``) or the
    flat flags, not both."""
    where = "vllm.fused_experts"
    peer = _peer_arguments(
        where,
        args,
        {
            "inplace": inplace,
            "activation": activation,
            "apply_router_weight_on_input": apply_router_weight_on_input,
            "global_num_experts": global_num_experts,
            "expert_map": expert_map,
            "quant_config": quant_config,
        },
    )
    inplace, activation, quant_config = peer["inplace"], peer["activation"], peer["quant_config"]
    gemm1: dict = {}
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
    if quant_config is not None:
        flat = [getattr(q, f.name) for f in fields(q)] + [w1_bias, w2_bias]
        if any(v is not None and v is not False for v in flat):
            raise MoeInputError(
                f"{where}: quant_config and the flat quantization / bias arguments both "
                "describe the weights; pass one"
            )
        q, w1_bias, w2_bias, gemm1 = _read_quant_config(where, quant_config)
    call = _call(activation, is_act_and_mul, gemm1)
    w13, w2q = peer_weights(where, w1, w2, q)
    num_local = w13.shape[0] if hasattr(w13, "shape") else 0
    ids = global_to_local(
        where, topk_ids, num_local, peer["global_num_experts"], peer["expert_map"]
    )
    return run(
        where,
        hidden_states,
        w13,
        w2q,
        topk_weights,
        ids,
        call,
        w13_bias=w1_bias,
        w2_bias=w2_bias,
        apply_router_weight_on_input=peer["apply_router_weight_on_input"],
        inplace=inplace,
        output=output,
        backend=backend,
    )


def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    indices_type: torch.dtype | None = None,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_topk``: softmax (or ``scoring_func="sigmoid"``) -> top-k (->
    renormalize).

    Returns ``(topk_weights fp32 [T, k], topk_ids int32 (or indices_type) [T, k],
    token_expert_indices int32 [T, k])`` where ``token_expert_indices[t, j] = j * T + t``
    (the row of slot j of token t in vLLM's slot-major layout)."""
    check_router_input("vllm.fused_topk", hidden_states, gating_output, "gating_output")
    _check_scoring(scoring_func)
    if indices_type is not None and (
        not isinstance(indices_type, torch.dtype)
        or indices_type.is_floating_point
        or indices_type.is_complex
        or indices_type == torch.bool
    ):
        raise TypeError(
            f"vllm.fused_topk: indices_type must be None or an integer torch.dtype, got "
            f"{indices_type!r}"
        )
    topk_result = select_experts(
        gating_output, topk, scoring_func=scoring_func, renormalize=renormalize
    )
    ids = topk_result.ids if indices_type is None else topk_result.ids.to(indices_type)
    num_tokens = gating_output.shape[0]
    slots = torch.arange(topk, dtype=torch.int32, device=gating_output.device)
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=gating_output.device)
    token_expert_indices = slots[None, :] * num_tokens + tokens[:, None]
    return topk_result.weights, ids, token_expert_indices


def grouped_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int = 0,
    topk_group: int = 0,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``grouped_topk``: groups ranked by their best score (DeepSeek-V2), or with
    ``e_score_correction_bias`` by the sum of their two best biased scores (DeepSeek-V3).
    Returns ``(topk_weights fp32, topk_ids int32)``, ``[T, topk]`` each."""
    check_router_input("vllm.grouped_topk", hidden_states, gating_output, "gating_output")
    _check_scoring(scoring_func)
    topk_result = select_experts(
        gating_output,
        topk,
        scoring_func=scoring_func,
        renormalize=renormalize,
        correction_bias=e_score_correction_bias,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        group_score="top2_sum" if e_score_correction_bias is not None else "max",
    )
    return topk_result.weights, topk_result.ids


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    inplace: bool = False,
    activation: object = "silu",
    *,
    is_act_and_mul: bool = True,
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    custom_routing_function: Callable | None = None,
    use_fp8_w8a8: bool = False,
    use_int8_w8a8: bool = False,
    use_int8_w8a16: bool = False,
    use_int4_w4a16: bool = False,
    per_channel_quant: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w1_zp: torch.Tensor | None = None,
    w2_zp: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """vLLM's ``fused_moe`` (releases up to 0.10; later ones route inside the layer): route
    ``gating_output`` (``grouped_topk`` when ``use_grouped_topk``, else
    ``custom_routing_function(hidden_states, gating_output, topk, renormalize)`` if given,
    else ``fused_topk``), then ``fused_experts``."""
    if isinstance(gating_output, torch.Tensor) and isinstance(w1, torch.Tensor) and w1.dim() == 3:
        # The router scores the global experts: w1's, or those expert_map / global_num_experts
        # name (a mismatch is checked against w1 there).
        total = w1.shape[0]
        if isinstance(global_num_experts, int) and global_num_experts > 0:
            total = global_num_experts
        elif isinstance(expert_map, torch.Tensor):
            total = expert_map.numel()
        check_router_width(gating_output, total, "vllm.fused_moe", "gating_output")
    if use_grouped_topk:
        if num_expert_group is None or topk_group is None:
            raise MoeInputError(
                "vllm.fused_moe: use_grouped_topk=True needs num_expert_group and topk_group"
            )
        weights, ids = grouped_topk(
            hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group
        )
    elif custom_routing_function is not None:
        check_router_input("vllm.fused_moe", hidden_states, gating_output, "gating_output")
        routed = select_experts(
            gating_output,
            topk,
            renormalize=renormalize,
            custom_routing_function=custom_routing_function,
            hidden_states=hidden_states,
        )
        weights, ids = routed.weights, routed.ids
    else:
        weights, ids, _ = fused_topk(hidden_states, gating_output, topk, renormalize)
    return fused_experts(
        hidden_states,
        w1,
        w2,
        weights,
        ids,
        inplace=inplace,
        activation=activation,
        is_act_and_mul=is_act_and_mul,
        use_fp8_w8a8=use_fp8_w8a8,
        use_int8_w8a8=use_int8_w8a8,
        use_int8_w8a16=use_int8_w8a16,
        use_int4_w4a16=use_int4_w4a16,
        per_channel_quant=per_channel_quant,
        global_num_experts=global_num_experts,
        expert_map=expert_map,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        w1_zp=w1_zp,
        w2_zp=w2_zp,
        a1_scale=a1_scale,
        a2_scale=a2_scale,
        block_shape=block_shape,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
        backend=backend,
    )


def _check_scoring(scoring_func: object) -> None:
    if scoring_func not in ("softmax", "sigmoid"):
        raise MoeInputError(f"scoring_func: got {scoring_func!r}; accepted: 'softmax', 'sigmoid'")
