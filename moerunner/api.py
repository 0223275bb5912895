"""The functional entry point ``fused_moe``: validate, select a backend, run the experts.

``fused_moe`` is route-free: it takes top-k weights and ids computed elsewhere (pass-through
routing) and returns the combined ``[T, H]`` output. Input checks raise ``MoeInputError``
(a ``ValueError``) or ``TypeError`` naming the argument; T = 0 returns an empty result without
launching anything.
"""

from __future__ import annotations

import torch

from .backends.base import MoeProblem
from .config import Activation
from .device_checks import check_ids_async
from .dispatch.formats import StandardDispatchOutput
from .errors import MoeInputError
from .routing import TopK
from .runner import MoeRunner, check_activation, prepared_for
from .weights import PLAIN_DTYPES, ExpertWeights, is_quantized


def fused_moe(
    hidden_states: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str | Activation = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    backend: str = "auto",
    check_ids: bool = True,
) -> torch.Tensor:
    """Run the experts of one MoE layer on pre-routed tokens.

    Args:
        hidden_states: ``[T, H]`` bf16/fp16/fp32.
        w13: ``[E, 2I, H]`` (gate rows then up rows; alternating with
            ``gate_up_interleaved``), ``[E, I, H]`` for ``relu2``; a tensor of the hidden
            states' dtype or a quantized weight (``moerunner.quantize``).
        w2: ``[E, H, I]``, same kind as ``w13``.
        topk_weights: ``[T, k]`` floating routing weights.
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)`` or -1 (slot skipped).
        activation: ``silu``, ``gelu``, ``gelu_tanh``, ``swiglu_oai`` (gated) or ``relu2``.
        w13_bias, w2_bias: optional ``[E, 2I]`` (or ``[E, I]``) and ``[E, H]``.
        gate_up_interleaved: w13 rows alternate gate, up (GPT-OSS checkpoints).
        swiglu_alpha, swiglu_limit: ``swiglu_oai`` parameters (defaults 1.702 and 7.0).
        backend: a backend name or ``"auto"``.
        check_ids: verify ``-1 <= ids < E``: at once on CPU; on a GPU without waiting for it,
            raising at a later call or at ``moerunner.check_errors()``
            (``moerunner.device_checks``). Callers whose ids come from ``select_experts`` may
            pass False; kernels then still skip ids outside ``[0, E)``, but silently.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype: sum over slots of weight x expert(x).
    """
    act = check_activation(activation, swiglu_alpha, swiglu_limit)
    weights = ExpertWeights(w13, w2, w13_bias, w2_bias, bool(gate_up_interleaved))
    topk = validate_call(hidden_states, weights, topk_weights, topk_ids, act, check_ids)
    runner = MoeRunner(backend)
    spec = weights.spec(act)
    dispatch_output = StandardDispatchOutput(hidden_states=hidden_states, topk=topk)
    problem = MoeProblem.of(hidden_states, weights, spec, dispatch_output.format)
    prepared = prepared_for(runner, weights, problem, spec)
    return runner.run(dispatch_output, prepared)


def validate_call(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
    check_ids: bool = True,
) -> TopK:
    """Check every argument of a call; return the routing as ``TopK`` (fp32 / int32)."""
    weights.validate(act)
    for name, t in (
        ("hidden_states", hidden_states),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden_states.dim() != 2:
        raise MoeInputError(
            f"hidden_states must be 2-D [T, H], got shape {list(hidden_states.shape)}"
        )
    if hidden_states.dtype not in PLAIN_DTYPES:
        raise TypeError(
            f"hidden_states dtype {hidden_states.dtype} not accepted: bf16, fp16 or fp32"
        )
    if hidden_states.shape[1] != weights.hidden_size:
        raise MoeInputError(
            f"hidden_states has H={hidden_states.shape[1]} but w13 expects H={weights.hidden_size}"
        )
    if not is_quantized(weights.w13) and weights.w13.dtype != hidden_states.dtype:
        raise TypeError(
            f"w13 dtype {weights.w13.dtype} must equal hidden_states dtype {hidden_states.dtype} "
            "(or pass quantized weights)"
        )
    if weights.device != hidden_states.device:
        raise MoeInputError(
            f"weights are on {weights.device} but hidden_states on {hidden_states.device}"
        )
    if topk_ids.dim() != 2:
        raise MoeInputError(f"topk_ids must be 2-D [T, k], got shape {list(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool or topk_ids.is_complex():
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise MoeInputError(
            f"topk_weights shape {list(topk_weights.shape)} differs from topk_ids shape "
            f"{list(topk_ids.shape)}"
        )
    num_tokens, top_k = topk_ids.shape
    if num_tokens != hidden_states.shape[0]:
        raise MoeInputError(
            f"topk_ids has T={num_tokens} rows but hidden_states has T={hidden_states.shape[0]}"
        )
    if top_k > weights.num_experts:
        raise MoeInputError(f"top_k={top_k} exceeds the number of experts E={weights.num_experts}")
    if check_ids and num_tokens:
        check_ids_async(topk_ids, weights.num_experts, where="fused_moe")  # no host sync
    return TopK(weights=topk_weights.float(), ids=topk_ids.to(torch.int32))


def _may_sync() -> bool:
    """Value checks need a host read: skip them while a CUDA graph is being captured or traced."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
