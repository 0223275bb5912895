"""The functional entry point ``fused_moe``: validate, select a backend, run the experts.

``fused_moe`` is route-free: it takes top-k weights and ids computed elsewhere (pass-through
routing) and returns the combined ``[T, H]`` output. Input checks raise ``MoeInputError``
(a ``ValueError``) or ``TypeError`` naming the argument; T = 0 returns an empty result without
launching anything.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from . import call_steps
from .backends.base import MoeProblem
from .config import Activation, ExpertSpec, check_bool
from .device_checks import capturing, check_ids_async, checks_may_run
from .dispatch.formats import StandardDispatchOutput
from .errors import (
    INDEX_DTYPES_TEXT,
    MoeInputError,
    check_eager_inputs,
    check_forward_mode,
    compile_disabled,
    is_index_tensor,
    make_fx_tracing,
    refuse,
)
from .hooks import MoeHooks, check_hooks, in_graph_of
from .lora import op_arguments
from .registry import Registry
from .routing import TopK
from .runner import MoeRunner, check_activation, prepared_for
from .shared import SharedExperts, check_shared, own_slots, shared_order
from .weights import PLAIN_DTYPES, ExpertWeights, gate_up_first, is_quantized, weight_shape


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
    swiglu_alpha: float | torch.Tensor | None = None,
    swiglu_limit: float | torch.Tensor | None = None,
    backend: str = "auto",
    check_ids: bool = True,
    w13_order: str | None = None,
    swiglu_beta: float | torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    shared_experts: SharedExperts | None = None,
    hooks: MoeHooks | None = None,
    registry: Registry | None = None,
) -> torch.Tensor:
    """Run the experts of one MoE layer on pre-routed tokens.

    Args:
        hidden_states: ``[T, H]`` bf16/fp16/fp32.
        w13: ``[E, 2I, H]`` (rows in ``w13_order``: gate rows then up rows by default),
            ``[E, I, H]`` for the non-gated ones; a tensor of the hidden states' dtype or a
            quantized weight (``moerunner.quantize``).
        w2: ``[E, H, I]``, same kind as ``w13``.
        topk_weights: ``[T, k]`` floating routing weights.
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)`` or -1 (slot skipped). k may
            exceed E (an expert-parallel rank's shard holds fewer experts than a token's
            slots): slots naming the same expert each add its output.
        activation: ``silu``, ``gelu``, ``gelu_tanh``, ``swiglu_oai``, ``swiglu_step``,
            ``situ`` (gated: act(gate) * up; ``swiglu_*`` clamped, ``situ`` Kimi-K3's soft
            caps ``situ_beta * tanh(gate / situ_beta) * sigmoid(gate) * situ_linear_beta *
            tanh(up / situ_linear_beta)``, defaults 4.0 and 25.0, ``situ_linear_beta=None``:
            up as is; ``moerunner.Activation("situ", situ_beta=..., situ_linear_beta=...)``),
            ``relu2``, ``silu_no_mul``, ``gelu_no_mul``, ``gelu_tanh_no_mul`` (non-gated:
            act(x W1^T)).
        w13_bias, w2_bias: optional ``[E, 2I]`` (or ``[E, I]``) and ``[E, H]``.
        gate_up_interleaved: w13 rows alternate gate, up (GPT-OSS checkpoints); the same as
            ``w13_order="interleaved"``.
        swiglu_alpha, swiglu_limit, swiglu_beta: ``swiglu_oai`` parameters (defaults 1.702,
            7.0 and 1.0; ``swiglu_step`` takes ``swiglu_limit``, default 7.0): floats, or
            per-expert ``[E]`` tensors (``moerunner.Activation``). With ``situ``,
            ``swiglu_alpha`` / ``swiglu_limit`` are its stored form: floats ``situ_beta`` /
            ``situ_linear_beta`` (None: 4.0 / 25.0; ``swiglu_limit=0.0``: no linear cap).
        backend: a backend name or ``"auto"``.
        registry: the ``Registry`` the backend is chosen from (default
            ``moerunner.DEFAULT_REGISTRY``). Traced by torch.compile, the call runs through
            the custom op, which finds backends in the default registry only: one that serves
            ``backend`` with other objects is refused there by name. Calls that need
            gradients run moerunner's own differentiable PyTorch ops, refused where the
            registry's ``"torch"`` is another object.
        check_ids: verify ``-1 <= ids < E``: at once on CPU; on a GPU without waiting for it,
            raising at a later call (the triton kernels' check is read every 8th call) or at
            ``moerunner.check_errors()`` (``moerunner.device_checks``). Callers whose ids
            come from ``select_experts`` may pass False; every backend then skips ids
            outside ``[0, E)`` (no wrap-around), silently. Ids: int64, int32, int16,
            int8 or uint8 (``errors.INDEX_DTYPES``).
        w13_order: w13's row order: ``"gate_up"`` (default), ``"up_gate"`` (FlashInfer /
            TensorRT-LLM; swapped once where the weights are prepared, and the result is
            memoised on them like any preparation) or ``"interleaved"``.
        apply_router_weight_on_input: multiply each token's hidden state by its routing
            weight before GEMM1 and leave the output unweighted (Llama-4); top_k must be 1.
        shared_experts: optional ``SharedExperts`` (``moerunner.shared``): experts every
            token passes through, with weight 1 or their gate value, computed as a call of
            their own on the same runner and added to the routed experts' output.
        hooks: optional ``MoeHooks`` (``moerunner.hooks``): callables on GEMM1's output
            before the activation and on GEMM2's output before the routing weight, given
            each row's expert, token and slot (LoRA: ``moerunner.lora``). ``"auto"`` then
            picks a backend that runs hooks.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype (contiguous): sum over slots of weight x
        expert(x). ``top_k = 0`` or ``E = 0`` gives zeros, ``H = 0`` an empty ``[T, 0]``.

    Gradients: with grad mode on and a tensor argument that requires grad, the call runs the
    torch backend's differentiable path (``backend="auto"`` or ``"torch"``); other backends
    raise ``MoeInputError`` (use ``torch.no_grad()`` or ``backend="torch"``). Gradients reach
    the hidden states, routing weights, plain weights, biases, per-expert activation
    parameters and the tensors hooks read (LoRA factors), through hooks too, so stacked
    adapted layers train. Quantized weights are frozen: gradients pass through them (their
    input quantization straight through), their own tensors get none.

    torch.compile: traced, the call is the custom op ``moerunner::fused_experts`` (one node
    for any T; fullgraph works; the hooks of ``lora_hooks`` are its LoRA arguments); what
    its schema lacks runs eagerly (docs/transformers.md, "``fused_moe`` inside your own
    compiled function").
    """
    act = check_activation(activation, swiglu_alpha, swiglu_limit, swiglu_beta)
    check_bool("gate_up_interleaved", gate_up_interleaved)  # ("False" was read as True)
    check_bool("apply_router_weight_on_input", apply_router_weight_on_input)
    check_bool("check_ids", check_ids)
    weights = ExpertWeights(w13, w2, w13_bias, w2_bias, gate_up_interleaved, w13_order)
    if torch.compiler.is_compiling() or make_fx_tracing():  # traced: the custom op
        if registry is not None:
            _check_op_registry(registry, backend)
        lora = op_arguments(check_hooks(hooks))  # None: hooks the op does not take
        if shared_experts is not None or lora is None or not _op_takes(weights, act):
            if not torch.compiler.is_dynamo_compiling():  # (non-strict export: no eager way)
                _refuse_untraceable(shared_experts, lora, weights, act)
            return _eager_experts(
                backend, registry, weights, hidden_states, topk_weights, topk_ids, act,
                check_ids, apply_router_weight_on_input, shared=shared_experts, hooks=hooks,
            )  # fmt: skip
        if apply_router_weight_on_input:
            hidden_states, topk_weights = _weighted_rows(hidden_states, topk_weights, topk_ids)
        return _traced_call(
            weights, hidden_states, topk_weights, topk_ids, act, backend, check_ids, lora
        )
    check_eager_inputs(
        "fused_moe", hidden_states=hidden_states, w13=w13, w2=w2, topk_weights=topk_weights
    )
    return run_experts(
        MoeRunner(backend, registry=registry),
        weights,
        hidden_states,
        topk_weights,
        topk_ids,
        act,
        check_ids,
        weight_on_input=apply_router_weight_on_input,
        shared=shared_experts,
        hooks=hooks,
    )


def fused_moe_from_logits(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13,
    w2,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    group_score: str = "top2_sum",
    custom_routing_function=None,
    routing_backend: str = "auto",
    **experts,
) -> torch.Tensor:
    """Route, then run the experts: ``select_experts`` on ``router_logits`` ``[T, E]``
    followed by ``fused_moe`` on its weights and ids.

    The routing arguments are ``select_experts``' (its ``backend`` is ``routing_backend``;
    ``custom_routing_function`` is called with ``hidden_states``); every other keyword
    argument is ``fused_moe``'s (``activation``, biases, ``w13_order``,
    ``apply_router_weight_on_input``, ``backend`` ...). Ids come from the router, so they
    are not checked again. Returns ``[T, H]`` in the hidden dtype.
    """
    from .routing import check_router_width, select_experts

    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if isinstance(router_logits, torch.Tensor) and router_logits.dim() == 2:
        if router_logits.shape[0] != hidden_states.shape[0]:
            raise MoeInputError(
                f"router_logits has T={router_logits.shape[0]} rows but hidden_states has "
                f"T={hidden_states.shape[0]}"
            )
        if is_quantized(w13) or isinstance(w13, torch.Tensor) and w13.dim() == 3:
            check_router_width(router_logits, weight_shape(w13)[0], "fused_moe_from_logits")
    unknown = sorted(set(experts) - _FUSED_MOE_KEYWORDS)
    if unknown:
        raise TypeError(
            f"fused_moe_from_logits: unknown argument(s) {unknown}; routing arguments are "
            "select_experts', the others fused_moe's: "
            f"{', '.join(sorted(_FUSED_MOE_KEYWORDS))}"
        )
    topk = select_experts(
        router_logits,
        top_k,
        scoring_func=scoring_func,
        renormalize=renormalize,
        correction_bias=correction_bias,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        group_score=group_score,
        custom_routing_function=custom_routing_function,
        hidden_states=hidden_states,
        backend=routing_backend,
    )
    # Built-in routing gives ids in [0, E); a custom function's are checked.
    experts.setdefault("check_ids", custom_routing_function is not None)
    return fused_moe(hidden_states, w13, w2, topk.weights, topk.ids, **experts)


_FUSED_MOE_KEYWORDS = frozenset(
    {
        "activation",
        "w13_bias",
        "w2_bias",
        "gate_up_interleaved",
        "swiglu_alpha",
        "swiglu_limit",
        "swiglu_beta",
        "backend",
        "check_ids",
        "w13_order",
        "apply_router_weight_on_input",
        "shared_experts",
        "hooks",
        "registry",
    }
)


def _op_takes(weights: ExpertWeights, act: Activation) -> bool:
    """The custom op's schema carries these weights' row order and activation: gate-up or
    interleaved rows, scalar alpha and limit, beta 1."""
    return weights.w13_order != "up_gate" and not act.extended


def _traced_call(
    weights: ExpertWeights,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
    backend: str,
    check_ids: bool,
    lora: tuple = (),
) -> torch.Tensor:
    """``fused_moe`` inside a region torch.compile traces: the custom op
    (``moerunner.ops.call_fused_experts``), one opaque graph node whose fake gives the output's
    shape for any T, instead of the host work of an eager call (backend choice, memo lookups),
    which the tracer cannot follow. The op runs ``fused_moe`` eagerly (gradients: its
    registered backward). ``lora``: the hooks of ``lora_hooks`` as the op's arguments
    (``moerunner.lora.op_arguments``)."""
    from .ops import call_fused_experts

    return call_fused_experts(
        hidden_states,
        weights.w13,
        weights.w2,
        topk_weights,
        topk_ids,
        weights.w13_bias,
        weights.w2_bias,
        act.name,
        act.alpha,
        act.limit,
        weights.w13_order == "interleaved",
        backend,
        check_ids,
        lora,
    )


def _refuse_untraceable(shared, lora, weights: ExpertWeights, act: Activation) -> None:
    """Traced without dynamo (non-strict ``torch.export``), a call the custom op cannot take
    has no eager fallback (a graph break): name what keeps it out of the op."""
    if shared is not None:
        what = "shared_experts= (run them as a call of their own)"
    elif lora is None:
        what = "hooks other than lora_hooks' pair"
    elif weights.w13_order == "up_gate":
        what = "w13_order='up_gate' (swap the halves once, to 'gate_up')"
    else:
        what = f"activation {act.name!r} with per-expert parameters or swiglu_beta != 1"
    raise MoeInputError(
        f"fused_moe traced without dynamo (non-strict torch.export, make_fx): {what} has no "
        "place in the custom op moerunner::fused_experts, and the eager call it needs "
        "cannot be traced (it reads the routing on the host)"
    )


def _eager_experts(backend: str, registry: Registry | None, *args, **kwargs) -> torch.Tensor:
    """``run_experts(MoeRunner(backend, registry=registry), *args, **kwargs)`` outside the
    traced graph."""
    return run_experts(MoeRunner(backend, registry=registry), *args, **kwargs)


def _check_op_registry(registry: Registry, backend: str) -> None:
    """A traced call runs through the custom op, which finds ``backend`` in the default
    registry only: refused, by name, where ``registry`` serves it otherwise. The lookups are
    traced (a registry that passes keeps a fullgraph trace whole); the refusal is raised
    outside the graph, so it reaches the caller as it is."""
    from .ops import registry_note

    note = registry_note(registry, backend, "the registry given to fused_moe")
    if note is not None:
        refuse(note)


# What the custom op does not take runs eagerly: a graph break (an error under fullgraph).
_eager_experts = compile_disabled(
    _eager_experts,
    "moerunner: fused_moe with shared_experts, hooks other than those of lora_hooks, "
    "w13_order='up_gate', swiglu_beta or per-expert swiglu parameters runs eagerly (the "
    "custom op moerunner::fused_experts does not take them)",
)


def run_experts(
    runner: MoeRunner,
    weights: ExpertWeights,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
    check_ids: bool = True,
    weight_on_input: bool = False,
    *,
    shared: SharedExperts | None = None,
    hooks: MoeHooks | None = None,
) -> torch.Tensor:
    """``fused_moe`` with a runner the caller holds (the ``MoE`` layer's): validate, then run
    the standard format on weights prepared once per weight version. ``weight_on_input``:
    scale each token's input row by its (single) routing weight and run with unit weights.
    ``shared`` / ``hooks``: as ``fused_moe``'s (``_run_extended``)."""
    check_forward_mode(
        "the experts", {"hidden_states": hidden_states, "topk_weights": topk_weights}
    )
    if shared is not None or hooks is not None:
        return _run_extended(
            runner,
            weights,
            hidden_states,
            topk_weights,
            topk_ids,
            act,
            check_ids,
            weight_on_input,
            shared,
            hooks,
        )
    step_key = None
    if not weight_on_input and not _needs_grad(hidden_states, weights, topk_weights, act):
        step_key = call_steps.step_key(
            runner, weights, hidden_states, topk_weights, topk_ids, act, check_ids
        )
        if step_key is not None:
            out = call_steps.replay_step(step_key, weights, hidden_states, topk_weights, topk_ids)
            if out is not None:
                return out
    spec, problem = _checked_call(hidden_states, weights, topk_weights, topk_ids, act)
    if weight_on_input:
        hidden_states, topk_weights = _weighted_rows(hidden_states, topk_weights, topk_ids)
    if topk_ids.shape[1] == 0 or spec.num_experts == 0 or spec.hidden_size == 0:
        # Nothing to compute: a sum over no slots (or an empty row). No kernel runs.
        _routing_values(topk_ids, topk_weights, spec.num_experts, check_ids)
        return _zeros_in_graph(hidden_states, weights, topk_weights, act)
    if _needs_grad(hidden_states, weights, topk_weights, act):
        topk = _routing_values(topk_ids, topk_weights, spec.num_experts, check_ids)
        return _differentiable(
            runner, runner.requested, problem, hidden_states, weights, topk, spec
        )
    prepared = prepared_for(
        runner, weights, problem, spec, hidden_states.shape[0], topk_ids.shape[1]
    )
    fused = (
        None
        if runner.force_permute
        else runner.registry.fused_op(StandardDispatchOutput.format, prepared.backend)
    )
    # A fused op that checks ids inside its kernels (CUDA) saves the check's own launches;
    # one that reads the routing's dtypes as given saves the conversions' launches.
    on_device = check_ids and topk_ids.is_cuda and getattr(fused, "checks_ids_on_device", False)
    topk = _routing_values(
        topk_ids,
        topk_weights,
        spec.num_experts,
        check_ids and not on_device,
        on_device,
        getattr(fused, "routing_dtypes", None),
    )
    dispatch_output = StandardDispatchOutput(hidden_states, topk, check_ids=on_device)
    out = runner.run(dispatch_output, prepared)
    if step_key is not None and fused is not None and check_ids == on_device:
        if topk.ids is topk_ids and topk.weights is topk_weights:  # the routing as given
            call_steps.make_step(
                step_key, weights, fused, hidden_states, topk_weights, topk_ids, prepared, on_device
            )
    return out


def _run_extended(
    runner: MoeRunner,
    weights: ExpertWeights,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
    check_ids: bool,
    weight_on_input: bool,
    shared: SharedExperts | None,
    hooks: MoeHooks | None,
) -> torch.Tensor:
    """``run_experts`` with shared experts (a call of their own) or hooks."""
    topk = validate_call(hidden_states, weights, topk_weights, topk_ids, act, check_ids)
    hooks = check_hooks(hooks)
    if hooks is not None and hooks.num_experts not in (None, weights.num_experts):
        raise MoeInputError(
            f"hooks were made for {hooks.num_experts} experts (e.g. the factors of "
            f"lora_hooks), the weights have E={weights.num_experts}"
        )
    out = _run_extended_call(
        runner, weights, hidden_states, topk, act, weight_on_input, shared, hooks
    )
    # (trained hooks that no row reached: still in their graph, with zero gradients)
    return out if hooks is None else hooks.in_graph(out)


def _run_extended_call(runner, weights, hidden_states, topk, act, weight_on_input, shared, hooks):
    if shared is not None and check_shared(shared, weights, act, hidden_states):
        # The shared experts as a call of their own (prepared once like any weights), every
        # token to each of them with its gate value (``moerunner.shared``); the routed input
        # alone is scaled by its weight with ``apply_router_weight_on_input`` (Llama-4).
        routed = _run_extended_call(
            runner, weights, hidden_states, topk, act, weight_on_input, None, hooks
        )
        own = _run_extended_call(
            runner,
            ExpertWeights(shared.w13, shared.w2, w13_order=shared_order(weights)),
            hidden_states,
            own_slots(hidden_states, shared),
            act,
            False,
            None,
            None,
        )
        return (routed.float() + own.float()).to(hidden_states.dtype)
    if weight_on_input:
        hidden_states, topk = weighted_input(hidden_states, topk)
    spec = weights.spec(act)
    if topk.top_k == 0 or spec.num_experts == 0 or spec.hidden_size == 0:
        # Nothing to compute: a sum over no slots (or an empty row). No kernel runs.
        return _zeros_in_graph(hidden_states, weights, topk.weights, act)
    dispatch_output = StandardDispatchOutput(hidden_states=hidden_states, topk=topk)
    problem = MoeProblem.of(hidden_states, weights, spec, dispatch_output.format)
    hooks_train = False
    if check_hooks(hooks) is not None:
        problem = dataclasses.replace(problem, hooks=True)
        if hooks_train := hooks.needs_grad():  # e.g. LoRA factors being trained
            runner = _hooks_with_grad(runner)
    # (trained hooks alone run the differentiable path too: there a scheme's quantization of
    # a GEMM's input passes the gradient straight through, as everywhere in training)
    if hooks_train or _needs_grad(hidden_states, weights, topk.weights, act):
        return _differentiable(
            runner, runner.requested, problem, hidden_states, weights, topk, spec, hooks
        )
    prepared = prepared_for(
        runner, weights, problem, spec, hidden_states.shape[0], topk.ids.shape[1]
    )
    return runner.run(dispatch_output, prepared, hooks)


def _hooks_with_grad(runner: MoeRunner) -> MoeRunner:
    """The runner of a call whose hooks read tensors that require grad: the torch backend,
    whose PyTorch ops apply the hooks and carry their gradient (triton applies LoRA in its
    own kernels, which have none)."""
    from .backends import torch_native

    if runner.requested not in ("auto", torch_native.NAME):
        raise MoeInputError(
            f"backend {runner.requested!r} applies hooks without autograd, but a tensor the "
            "hooks read (e.g. a LoRA factor) requires grad and grad mode is on: pass "
            "backend='torch' (or 'auto') to train through the hooks, or run under "
            "torch.no_grad()"
        )
    if runner.requested == torch_native.NAME:
        return runner
    return MoeRunner(torch_native.NAME, registry=runner.registry)


def weighted_input(hidden_states: torch.Tensor, topk: TopK) -> tuple[torch.Tensor, TopK]:
    """``apply_router_weight_on_input``: rows multiplied by their routing weight (in float32,
    rounded once to the hidden dtype) and unit weights; only for top_k == 1 (with more slots
    the weight of one slot cannot be applied to an input every slot shares). No host read."""
    if topk.top_k != 1:
        raise MoeInputError(
            f"apply_router_weight_on_input=True needs top_k == 1 (one routing weight per "
            f"token to apply to its input), got top_k={topk.top_k}"
        )
    scaled = (hidden_states.float() * topk.weights).to(hidden_states.dtype)
    return scaled, TopK(weights=torch.ones_like(topk.weights), ids=topk.ids)


def _weighted_rows(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weighted_input`` on a call's routing tensors: the scaled rows and unit weights."""
    scaled, unit = weighted_input(hidden_states, TopK(weights=topk_weights.float(), ids=topk_ids))
    return scaled, unit.weights


def _needs_grad(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    act: Activation | None = None,
) -> bool:
    """Grad mode is on and some argument takes part in autograd (host metadata only): the
    tensors, and ``act``'s per-expert parameters (a trained swiglu alpha with frozen experts
    reached the inference kernels, whose ``out=`` GEMMs have no autograd)."""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in _grad_tensors(hidden_states, weights, topk_weights, act))


def _grad_tensors(hidden_states, weights: ExpertWeights, topk_weights, act) -> list:
    """The tensor arguments of a call that can take part in autograd (``_needs_grad``)."""
    tensors = [hidden_states, topk_weights, weights.w13_bias, weights.w2_bias]
    if act is not None:
        tensors += list(act.tensors().values())
    for w in (weights.w13, weights.w2):
        if is_quantized(w):  # its own tensors: the differentiable path refuses them by name
            from .quant.weight import TENSOR_FIELDS

            tensors += [getattr(w, name, None) for name in TENSOR_FIELDS]
        else:
            tensors.append(w)
    # (a non-tensor argument is refused by name by the checks that follow)
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _zeros_in_graph(hidden_states, weights: ExpertWeights, topk_weights, act) -> torch.Tensor:
    """Zeros of a call with nothing to compute, in grad mode in the graph of the arguments
    that require grad (zero gradients for them, not a loss without a graph)."""
    zeros = hidden_states.new_zeros(hidden_states.shape)
    return in_graph_of(zeros, _grad_tensors(hidden_states, weights, topk_weights, act))


def _differentiable(
    runner: MoeRunner,
    backend: str,
    problem: MoeProblem,
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk: TopK,
    spec,
    hooks: MoeHooks | None = None,
) -> torch.Tensor:
    """The torch backend's autograd-friendly path (with ``hooks``: the hooked sequence on
    it); a clear error where it cannot serve."""
    from .backends import torch_native
    from .backends.torch_autograd import check_frozen, differentiable_forward

    check_frozen(weights)
    hint = "wrap the call in torch.no_grad() (or pass detached tensors) for inference"
    if backend not in ("auto", torch_native.NAME):
        raise MoeInputError(
            f"backend {backend!r} has no backward: a tensor argument requires grad and grad "
            f"mode is on; {hint}, or pass backend='torch' to train through the experts"
        )
    served = runner.registry.backends.get(torch_native.NAME)
    if served is not None and type(served) is not torch_native.TorchBackend:
        raise MoeInputError(
            f"this call's registry serves backend 'torch' with {type(served).__name__}, not "
            "moerunner's: calls that need gradients run moerunner's own differentiable "
            f"PyTorch ops, which would bypass it; {hint}, or use a registry with moerunner's "
            "torch backend to train"
        )
    MoeRunner(torch_native.NAME, registry=runner.registry).select(problem)  # raises if unfit
    weights = gate_up_first(weights)  # differentiable: a concatenation of row slices
    options = getattr(served, "options", torch_native.DEFAULT_TORCH_OPTIONS)
    out, complete = differentiable_forward(hidden_states, weights, topk, spec, hooks, options)
    # (no row computed, e.g. every id -1: zero gradients rather than a loss without a graph;
    # forms that may miss arguments connect each of them)
    tensors = _grad_tensors(hidden_states, weights, topk.weights, None)
    return in_graph_of(out, tensors, each=not complete)


def validate_call(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
    check_ids: bool = True,
) -> TopK:
    """Check every argument of a call; return the routing as ``TopK`` (fp32 / int32)."""
    _validate_arguments(hidden_states, weights, topk_weights, topk_ids, act)
    return _routing_values(topk_ids, topk_weights, weights.num_experts, check_ids)


# What a call's checks and its problem depend on is its arguments' types, shapes, dtypes and
# devices (not their values): checked once per such signature, then looked up; the least
# recently used signature is dropped first.
_CHECKED_MAX = 256
_checked: OrderedDict = OrderedDict()


def _signature(*tensors) -> tuple | None:
    """Types, shapes, dtypes and devices of ``tensors`` (tensors, quantized weights or None),
    or None where one is something else (the full checks then name it)."""
    parts = []
    for t in tensors:
        if t is None:
            parts.append(None)
        elif isinstance(t, torch.Tensor):
            parts.append((t.shape, t.dtype, t.device))
        elif is_quantized(t):  # (a static input scale changes which backends serve it)
            parts.append((type(t), weight_shape(t), t.scheme, t.device, t.input_scale is None))
        else:
            return None
    return tuple(parts)


def _checked_call(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
) -> tuple[ExpertSpec, MoeProblem]:
    """Run the argument checks of a call (``validate_call`` without the value checks) and
    return its spec and problem, memoised on the arguments' signature (``_signature``)."""
    sig = _signature(
        hidden_states,
        topk_weights,
        topk_ids,
        weights.w13,
        weights.w2,
        weights.w13_bias,
        weights.w2_bias,
    )
    key = None if sig is None else (sig, act, weights.w13_order)
    if key is not None:
        found = _checked.get(key)
        if found is not None:
            try:
                _checked.move_to_end(key)  # least recently used goes first
            except KeyError:  # dropped meanwhile by another thread's call
                pass
            return found
    _validate_arguments(hidden_states, weights, topk_weights, topk_ids, act)
    spec = weights.spec(act)
    found = (spec, MoeProblem.of(hidden_states, weights, spec, StandardDispatchOutput.format))
    if key is not None:
        _checked[key] = found
        while len(_checked) > _CHECKED_MAX:
            _checked.popitem(last=False)
    return found


def _validate_arguments(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Activation,
) -> None:
    """The checks of a call that depend on its arguments' types, shapes, dtypes, devices."""
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
        autocast = torch.is_autocast_enabled(hidden_states.device.type)
        hint = "; torch.autocast does not cast the experts: cast the input" if autocast else ""
        raise TypeError(
            f"w13 dtype {weights.w13.dtype} must equal hidden_states dtype {hidden_states.dtype} "
            f"(or pass quantized weights){hint}"
        )
    if weights.device != hidden_states.device:
        raise MoeInputError(
            f"weights are on {weights.device} but hidden_states on {hidden_states.device}"
        )
    check_routing_shapes(hidden_states, topk_weights, topk_ids)
    if weights.intermediate_size(act) == 0 and weights.num_experts and weights.hidden_size:
        raise MoeInputError(
            "the intermediate size I must be >= 1: w13 has no rows and w2 no columns "
            f"(w13 {list(weights.w13.shape)}, w2 {list(weights.w2.shape)})"
        )


def check_routing_shapes(
    hidden_states: torch.Tensor, topk_weights: object, topk_ids: object
) -> None:
    """The routing of a call: tensors on the hidden states' device, integer ids and floating
    weights of one ``[T, k]`` shape, T the hidden states' rows (metadata only, no read)."""
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != hidden_states.device:
            raise MoeInputError(
                f"{name} is on {t.device} but hidden_states on {hidden_states.device}: "
                "every tensor of a call must be on one device"
            )
    if topk_ids.dim() != 2:
        raise MoeInputError(f"topk_ids must be 2-D [T, k], got shape {list(topk_ids.shape)}")
    if not is_index_tensor(topk_ids):
        raise TypeError(f"topk_ids must be {INDEX_DTYPES_TEXT}, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise MoeInputError(
            f"topk_weights shape {list(topk_weights.shape)} differs from topk_ids shape "
            f"{list(topk_ids.shape)}"
        )
    num_tokens = topk_ids.shape[0]
    if num_tokens != hidden_states.shape[0]:
        raise MoeInputError(
            f"topk_ids has T={num_tokens} rows but hidden_states has T={hidden_states.shape[0]}"
        )


def _routing_values(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    check_ids: bool,
    kernel_checks: bool = False,
    as_given: tuple | None = None,
) -> TopK:
    """The routing as ``TopK`` (fp32 weights, int32 ids), the ids' values checked
    (``check_ids``) or clamped so no id outside ``[0, E)`` reaches a kernel as one inside.
    ``kernel_checks``: a kernel checks the ids (``device_checks.IdFlags``); int64 ids are
    clamped to ``[-2, E]`` then, so a bad id stays bad in int32.
    ``as_given``: the fused op's ``routing_dtypes`` (ids, weights): dtypes it reads itself,
    ids compared in their own width; routing in them is passed on unconverted.
    top_k may exceed E: an expert-parallel rank's shard holds fewer experts than k."""
    checked = False
    if check_ids and topk_ids.numel():
        # CPU: checked here; GPU: checked on the device, raised later (no host sync).
        check_ids_async(topk_ids, num_experts, where="fused_moe")
        checked = topk_ids.device.type == "cpu" and checks_may_run(topk_ids.device)
    ids_dtypes, weights_dtypes = as_given if as_given is not None else ((), ())
    if topk_ids.dtype not in ids_dtypes:
        if not checked and topk_ids.dtype == torch.int64:
            # Unchecked (or not yet checked) ids: every backend skips ids outside [0, E);
            # clamped before the int32 cast, an int64 id outside int32 cannot wrap into
            # range (int32 and narrower ids need no extra op).
            topk_ids = topk_ids.clamp(min=-2 if kernel_checks else -1, max=num_experts)
        topk_ids = topk_ids.to(torch.int32)
    if topk_weights.dtype not in weights_dtypes:
        topk_weights = topk_weights.float()
    return TopK(weights=topk_weights, ids=topk_ids)


def _may_sync() -> bool:
    """Value checks need a host read: skip them while a CUDA graph is being captured or traced."""
    return not capturing()
