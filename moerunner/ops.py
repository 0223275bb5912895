"""``torch.library`` custom ops so MoE layers compile with ``torch.compile(fullgraph=True)``.

- ``moerunner::fused_experts``: ``fused_moe`` on plain (unquantized) weights;
- ``moerunner::fused_experts_quantized``: on quantized weights, passed as their component
  tensors, scheme names and shapes (the ``QuantizedWeight`` is rebuilt once, not per call);
- ``moerunner::fused_experts_transposed``: on plain weights stored ``[E, in, out]`` (GPT-OSS),
  read through canonical-shaped views (no copy).

Each forward op takes LoRA last (``moerunner.lora.OP_ARGUMENTS``: the factors, the per-token
adapter ids, the scaling; all None without LoRA), so a call with ``lora_hooks``' hooks stays
one graph node too.

Each fake implementation only describes the output (``[T, H]`` in the hidden dtype), so the
compiler never traces into the backends' data-dependent code (host reads of expert offsets,
Triton launches). ``call_fused_experts`` picks the op for a pair of weights. The plain ops
have a backward (``moerunner::fused_experts_backward``, "gradients" below), so a compiled
training step differentiates through them.
"""

from __future__ import annotations

import inspect

import torch

from .api import fused_moe
from .errors import MoeInputError, check_op_inputs
from .lora import OP_ARGUMENTS, hooks_of_op_arguments
from .memo import memoised, seed_memo, view_key


def _op_body(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    w13_bias,
    w2_bias,
    activation,
    swiglu_alpha,
    swiglu_limit,
    gate_up_interleaved,
    backend,
    check_ids,
    lora: tuple = (None,) * 7,
    grad: bool = False,
) -> torch.Tensor:
    """What every moerunner op computes once its weights are objects ``fused_moe`` takes:
    ``fused_moe`` with the op's arguments, with grad mode off (an op's forward runs the chosen
    backend's kernels; gradients come from the backward registered below; ``grad``: on, for
    that backward's recomputation); an empty result is a new tensor (an op's output may not
    alias its input). ``lora``: the op's LoRA arguments (``moerunner.lora.OP_ARGUMENTS``; no
    factors: none)."""
    with torch.set_grad_enabled(grad):
        hooks = hooks_of_op_arguments(*lora, check_ids)
        out = fused_moe(
            hidden_states,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation=activation,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            gate_up_interleaved=gate_up_interleaved,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
            backend=backend,
            check_ids=check_ids,
            hooks=hooks,
        )
    return out if out.numel() else out.clone()


@torch.library.custom_op("moerunner::fused_experts", mutates_args=())
def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    backend: str,
    check_ids: bool = True,
    lora_w13_a: torch.Tensor | None = None,
    lora_w13_b: torch.Tensor | None = None,
    lora_w2_a: torch.Tensor | None = None,
    lora_w2_b: torch.Tensor | None = None,
    lora_adapter_ids: torch.Tensor | None = None,
    lora_scaling: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """``fused_moe`` as an opaque graph node (same arguments, positional)."""
    lora = _named(locals(), OP_ARGUMENTS)
    return _op_body(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        w13_bias,
        w2_bias,
        activation,
        swiglu_alpha,
        swiglu_limit,
        gate_up_interleaved,
        backend,
        check_ids,
        lora,
    )


@fused_experts.register_fake
def _fused_experts_fake(hidden_states, *args, **kwargs):
    return hidden_states.new_empty(hidden_states.shape)  # row-major, as every backend returns


# -- quantized weights --------------------------------------------------------------------
#
# A custom op's schema takes tensors, not Python objects, so a ``QuantizedWeight`` crosses
# the graph boundary as its component tensors, scheme name and logical shape. Inside, the
# object is rebuilt once per set of source tensors and memoised on the data tensor: the
# runner memoises prepared weights on that object, so a replayed step neither rebuilds nor
# re-prepares. ``adopt_quantized`` seeds the memo with the caller's own object, so compiled
# and eager calls share one set of prepared weights.

#: Order of a quantized weight's component tensors in the ops' ``Tensor?[]`` arguments.
QUANTIZED_FIELDS = ("data", "scale", "global_scale", "zero_point", "input_scale")


def quantized_tensors(weight) -> list[torch.Tensor | None]:
    """A ``QuantizedWeight``'s component tensors in ``QUANTIZED_FIELDS`` order (None if unset)."""
    return [getattr(weight, f) for f in QUANTIZED_FIELDS]


def _quantized_key(scheme: str, shape, tensors) -> tuple:
    return (scheme, tuple(shape), tuple(view_key(t) for t in tensors))


def adopt_quantized(weight) -> None:
    """Let ``fused_experts_quantized`` use ``weight`` itself (and the prepared weights the
    runner memoised on it) when it is called with ``weight``'s tensors, instead of an
    equivalent rebuilt object; and mark those tensors as static inputs for CUDA graphs
    (``torch.compile(mode="reduce-overhead")`` then does not copy them per replay). Call it
    outside the compiled region, once per weight (``MoE.quantize_`` and the transformers
    integration do)."""
    tensors = quantized_tensors(weight)
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    key = _quantized_key(weight.scheme.name, weight.shape, tensors)
    if not seed_memo(tensors[0], key, weight):
        return
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            torch._dynamo.mark_static_address(t)


def _rebuilt(scheme: str, shape, tensors):
    from .quant import QuantizedWeight

    fields = dict(zip(QUANTIZED_FIELDS, tensors, strict=True))
    fields["data"] = fields["data"].detach()  # not the memo's anchor itself (``memoised``)
    return QuantizedWeight(scheme, [int(v) for v in shape], **fields)


def _check_quantized_args(name: str, tensors, shape) -> None:
    if len(tensors) != len(QUANTIZED_FIELDS):
        raise ValueError(
            f"{name}: expected {len(QUANTIZED_FIELDS)} tensors in the order {QUANTIZED_FIELDS}"
            f" (None where unset), got {len(tensors)}"
        )
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"{name}: the data tensor (first entry) must be a torch.Tensor")
    if len(shape) != 3:
        raise ValueError(f"{name}_shape must be (E, N, K), got {list(shape)}")


def quantized_weight(scheme: str, shape, tensors):
    """The ``QuantizedWeight`` of these component tensors, rebuilt once per source tensors
    (memoised on the data tensor; any change of a component's identity, memory or in-place
    version rebuilds it)."""
    key = _quantized_key(scheme, shape, tensors)
    return memoised(tensors[0], key, lambda: _rebuilt(scheme, shape, tensors))


@torch.library.custom_op("moerunner::fused_experts_quantized", mutates_args=())
def fused_experts_quantized(
    hidden_states: torch.Tensor,
    w13: list[torch.Tensor | None],
    w2: list[torch.Tensor | None],
    w13_scheme: str,
    w13_shape: list[int],
    w2_scheme: str,
    w2_shape: list[int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    backend: str,
    check_ids: bool = True,
    lora_w13_a: torch.Tensor | None = None,
    lora_w13_b: torch.Tensor | None = None,
    lora_w2_a: torch.Tensor | None = None,
    lora_w2_b: torch.Tensor | None = None,
    lora_adapter_ids: torch.Tensor | None = None,
    lora_scaling: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """``fused_moe`` on quantized weights as an opaque graph node.

    ``w13`` / ``w2``: a ``QuantizedWeight``'s tensors in ``QUANTIZED_FIELDS`` order
    (``quantized_tensors(weight)``), with its scheme name and logical shape ``(E, N, K)``.
    """
    lora = _named(locals(), OP_ARGUMENTS)
    _check_quantized_args("w13", w13, w13_shape)
    _check_quantized_args("w2", w2, w2_shape)
    return _op_body(
        hidden_states,
        quantized_weight(w13_scheme, w13_shape, w13),
        quantized_weight(w2_scheme, w2_shape, w2),
        topk_weights,
        topk_ids,
        w13_bias,
        w2_bias,
        activation,
        swiglu_alpha,
        swiglu_limit,
        gate_up_interleaved,
        backend,
        check_ids,
        lora,
    )


@fused_experts_quantized.register_fake
def _fused_experts_quantized_fake(hidden_states, *args, **kwargs):
    return hidden_states.new_empty(hidden_states.shape)


def op_tensor(t):
    """A weight or bias of an inference call of the ``MoE`` layer as an op argument: the
    tensor itself where grad mode is off or it requires no grad, so the op gets the caller's
    own object on every call and finds what is memoised on it (the runner's prepared weights,
    keyed on the objects; layers sharing a parameter share them too); a detached alias where
    grad mode is on and it requires grad (no gradient for it). An alias made per call is a
    new object per compiled step, and the weights were prepared again on every one. Anything
    but a tensor passes as it is."""
    if not isinstance(t, torch.Tensor) or not torch.is_grad_enabled() or not t.requires_grad:
        return t
    return t.detach()


def call_fused_experts(
    hidden_states: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    backend: str,
    check_ids: bool = True,
    lora: tuple = (),
) -> torch.Tensor:
    """The custom op that runs these weights (plain tensors or ``QuantizedWeight``s), called
    with their tensors: what a traced caller uses in place of ``fused_moe``. ``lora``: the
    LoRA arguments (``moerunner.lora.op_arguments``) or ``()``."""
    check_op_inputs(
        "the experts' custom op",
        hidden_states=hidden_states,
        topk_weights=topk_weights,
        w13=w13,
        w2=w2,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )
    settings = (activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, backend, check_ids)
    routing = (topk_weights, topk_ids, w13_bias, w2_bias)
    if isinstance(w13, torch.Tensor):
        return torch.ops.moerunner.fused_experts(hidden_states, w13, w2, *routing, *settings, *lora)
    weights = (quantized_tensors(w13), quantized_tensors(w2))
    shapes = (w13.scheme.name, list(w13.shape), w2.scheme.name, list(w2.shape))
    return torch.ops.moerunner.fused_experts_quantized(
        hidden_states, *weights, *shapes, *routing, *settings, *lora
    )


# -- weights stored transposed ------------------------------------------------------------


def canonical_from_transposed(
    w13_t: torch.Tensor, w2_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, N, H]`` and ``w2 [E, H, I]`` from weights stored ``[E, H, N]`` / ``[E, I, H]``
    (GPT-OSS): detached views with the dims swapped, no copy (both backends read plain
    weights through their strides), so the experts live once, in the model's parameters.
    Memoised on the ``w13_t`` tensor object (a change of either source's memory or in-place
    version makes new views), so the runner's prepared weights, memoised on the views, are
    reused for as long as that object lives. Not on its storage: the views reference the
    storage, and a memo there would keep it alive for ever."""
    key = ("transposed", view_key(w13_t), view_key(w2_t))

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        return w13_t.detach().transpose(1, 2), w2_t.detach().transpose(1, 2)

    return memoised(w13_t, key, build)


@torch.library.custom_op("moerunner::fused_experts_transposed", mutates_args=())
def fused_experts_transposed(
    hidden_states: torch.Tensor,
    w13_t: torch.Tensor,
    w2_t: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    backend: str,
    check_ids: bool = True,
    lora_w13_a: torch.Tensor | None = None,
    lora_w13_b: torch.Tensor | None = None,
    lora_w2_a: torch.Tensor | None = None,
    lora_w2_b: torch.Tensor | None = None,
    lora_adapter_ids: torch.Tensor | None = None,
    lora_scaling: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """``fused_experts`` on weights stored transposed (``w13_t [E, H, N]``, ``w2_t [E, I, H]``,
    as GPT-OSS checkpoints do), run through views in the canonical shape
    (``canonical_from_transposed``): no copy of the experts."""
    lora = _named(locals(), OP_ARGUMENTS)
    for name, t in (("w13_t", w13_t), ("w2_t", w2_t)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [E, in, out], got shape {list(t.shape)}")
    w13, w2 = canonical_from_transposed(w13_t, w2_t)
    return _op_body(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        w13_bias,
        w2_bias,
        activation,
        swiglu_alpha,
        swiglu_limit,
        gate_up_interleaved,
        backend,
        check_ids,
        lora,
    )


@fused_experts_transposed.register_fake
def _fused_experts_transposed_fake(hidden_states, *args, **kwargs):
    return hidden_states.new_empty(hidden_states.shape)


# -- gradients ----------------------------------------------------------------------------
#
# The plain ops (``fused_experts``, ``fused_experts_transposed``) have a backward, so a
# compiled training step differentiates through them: the forward runs the chosen backend's
# kernels, and the backward recomputes the experts on the torch backend's differentiable
# path (``fused_moe`` with grad mode on) and differentiates that, inside one more opaque op
# (its Python is not traced: the path reads expert offsets on the host). The quantized op's
# backward does the same with its weights frozen: gradients reach the hidden states, the
# routing weights and the biases. Both give the LoRA factors and a LoRA scaling tensor
# theirs the same way.

#: The arguments of the backward ops that the gradients are for, by name, in the order of
#: their results (the LoRA factors and scaling tensor last in both).
_LORA_GRADS = tuple(n for n in OP_ARGUMENTS if n not in ("lora_adapter_ids", "lora_scale"))
_PLAIN_GRADS = ("hidden_states", "w13", "w2", "topk_weights", "w13_bias", "w2_bias", *_LORA_GRADS)
_QUANTIZED_GRADS = ("hidden_states", "topk_weights", "w13_bias", "w2_bias", *_LORA_GRADS)

#: Argument positions of the plain ops that can take a gradient: hidden states, w13, w2,
#: topk weights, w13 bias, w2 bias, the four LoRA factors and the LoRA scaling tensor.
_GRAD_ARGS = (0, 1, 2, 3, 5, 6, 13, 14, 15, 16, 18)
#: The same for ``fused_experts_quantized`` (its quantized weights are frozen): hidden
#: states, topk weights, w13 bias, w2 bias, the LoRA factors and scaling tensor.
_QUANTIZED_GRAD_ARGS = (0, 7, 9, 10, 17, 18, 19, 20, 22)


def _fused_experts_backward(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    transposed: bool,
    needs: list[bool],
    lora_w13_a: torch.Tensor | None = None,
    lora_w13_b: torch.Tensor | None = None,
    lora_w2_a: torch.Tensor | None = None,
    lora_w2_b: torch.Tensor | None = None,
    lora_adapter_ids: torch.Tensor | None = None,
    lora_scaling: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Gradients of ``fused_experts`` (``transposed``: of ``fused_experts_transposed``) for the
    arguments at ``_GRAD_ARGS`` whose entry in ``needs`` is set (an empty tensor for the
    others): the experts recomputed on ``fused_moe``'s differentiable path and differentiated
    against ``grad_out``."""
    inputs = _named(locals(), _PLAIN_GRADS)
    settings = (activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, "torch", False)

    def experts(x, a, b, weights, b13, b2, *lora):
        if transposed:
            a, b = a.transpose(1, 2), b.transpose(1, 2)
        lora = (*lora[:4], lora_adapter_ids, lora[4], lora_scale)
        return _op_body(x, a, b, weights, topk_ids, b13, b2, *settings, lora, grad=True)

    return _differentiated(experts, inputs, needs, grad_out)


fused_experts_backward = torch.library.custom_op(
    "moerunner::fused_experts_backward", mutates_args=()
)(_fused_experts_backward)
fused_experts_backward.register_fake(
    lambda *a, **k: _fake_grads(_fused_experts_backward, _PLAIN_GRADS, a, k)
)


def _no_double_backward(ctx, *grads):
    raise MoeInputError(
        "a backward through the backward of moerunner's custom op (create_graph=True: a "
        "gradient penalty, a Hessian-vector product): its gradients are computed, not "
        "differentiable again; run the experts eagerly on backend='torch' (fused_moe, or "
        "MoE(..., backend='torch')), whose differentiable path takes double backward"
    )


def _differentiated(fn, inputs: tuple, needs: list[bool], grad_out: torch.Tensor) -> list:
    """The gradients of ``fn(*inputs)`` against ``grad_out`` for the inputs whose entry in
    ``needs`` is set (an empty tensor for the others and for inputs that are None). A
    shorter ``needs`` leaves the last inputs out: a backward graph that an earlier version
    compiled and PyTorch's compile caches kept (their keys do not cover the op's code) calls
    the op as it was, without the LoRA entries, and reads only the gradients it knew."""
    needs = [*needs, *[False] * (len(inputs) - len(needs))]
    wanted = [i for i, t in enumerate(inputs) if needs[i] and t is not None]

    def call(*differentiated):
        args = list(inputs)
        for i, t in zip(wanted, differentiated, strict=True):
            args[i] = t
        return fn(*args)

    got = dict(zip(wanted, _vjp(call, [inputs[i] for i in wanted], grad_out), strict=True))
    return [got[i] if i in got else grad_out.new_empty(0) for i in range(len(inputs))]


def _named(arguments: dict, names: tuple) -> tuple:
    return tuple(arguments[n] for n in names)


def _fake_grads(impl, names: tuple, args: tuple, kwargs: dict) -> list:
    """A backward op's fake: the shapes of ``impl``'s results, from its arguments bound by
    name (``names``: those the gradients are for)."""
    bound = inspect.signature(impl).bind(*args, **kwargs)
    bound.apply_defaults()
    inputs, grad_out = _named(bound.arguments, names), bound.arguments["grad_out"]
    needs = bound.arguments["needs"]
    needs = [*needs, *[False] * (len(inputs) - len(needs))]  # (as ``_differentiated``)
    return [
        torch.empty_like(t) if need and t is not None else grad_out.new_empty(0)
        for t, need in zip(inputs, needs, strict=True)
    ]


def _vjp(fn, primals: list[torch.Tensor], cotangent: torch.Tensor) -> tuple:
    """The gradients of ``fn(*primals)`` against ``cotangent``, computed inside a custom op's
    implementation. That runs below the dispatcher's autograd keys, so plain autograd records
    nothing there, even under ``torch.enable_grad()``; ``torch.func.vjp`` differentiates through
    its own transform level. It runs on the calling thread: in a CUDA backward that is the
    autograd engine's device thread, which serves a nested differentiation itself (a thread of
    our own, as before, queued its CUDA work to that thread while the thread waited for it; a
    GPU test of a compiled training step ran past 200 s)."""
    if not primals:
        return ()
    with torch.enable_grad(), _transforms_reachable():
        _, pull = torch.func.vjp(fn, *primals)
        return pull(cotangent)


#: The dispatch keys ``torch.func``'s transforms run through. Under a Python dispatch mode
#: (``FlopCounterMode``, a memory tracker, ``SchemaCheckMode`` in ``opcheck``) an op's
#: implementation runs with every key above the Python key excluded, these too, so the
#: transform's wrapped tensors reached the CPU kernels ("Cannot access storage of
#: TensorWrapper").
_TRANSFORM_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in (
        "FuncTorchDynamicLayerFrontMode",
        "FuncTorchDynamicLayerBackMode",
        "FuncTorchGradWrapper",
        "ADInplaceOrView",
    )
)


def _transforms_reachable():
    """A guard that takes ``_TRANSFORM_KEYS`` off the thread's excluded dispatch keys (and
    changes nothing where none is excluded: outside a dispatch mode)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _TRANSFORM_KEYS:
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


# An op's trailing arguments left at their defaults may not reach its autograd functions
# (the dispatcher drops them): ``_filled`` puts them back for ``setup_context``, and a
# backward returns one entry per argument that came (``ctx.needs_input_grad``), since an op
# with list arguments refuses any other count.
_LORA_DEFAULTS = (None,) * 6 + (1.0,)


def _filled(inputs, count: int) -> tuple:
    """An op's ``count`` arguments: ``inputs`` and the LoRA defaults of those left out."""
    missing = count - len(inputs)
    return (*inputs, *_LORA_DEFAULTS[len(_LORA_DEFAULTS) - missing :])


def _needs(ctx, positions: tuple) -> list[bool]:
    came = len(ctx.needs_input_grad)
    return [i < came and bool(ctx.needs_input_grad[i]) for i in positions]


def _placed(ctx, grads: list, needs: list[bool], positions: tuple) -> tuple:
    """An op's backward result: an entry per argument that came, each gradient at its
    argument's position."""
    result: list = [None] * len(ctx.needs_input_grad)
    for i, need, g in zip(positions, needs, grads, strict=True):
        if need:
            result[i] = g
    return tuple(result)


def _saving(ctx, inputs, output) -> None:
    inputs = _filled(inputs, 20)
    ctx.save_for_backward(*(inputs[i] for i in _GRAD_ARGS), inputs[4], inputs[17])
    ctx.settings = inputs[7:11]  # activation, swiglu alpha and limit, interleaved
    ctx.lora_scale = inputs[19]


def _backward(transposed: bool):
    def backward(ctx, grad_out):
        x, w13, w2, weights, b13, b2, *lora, topk_ids, adapter_ids = ctx.saved_tensors
        needs = _needs(ctx, _GRAD_ARGS)
        grads = torch.ops.moerunner.fused_experts_backward(
            grad_out.contiguous(),
            *(x, w13, w2, weights, topk_ids, b13, b2),
            *ctx.settings,
            transposed,
            needs,
            *(*lora[:4], adapter_ids, lora[4], ctx.lora_scale),
        )
        return _placed(ctx, grads, needs, _GRAD_ARGS)

    return backward


fused_experts.register_autograd(_backward(False), setup_context=_saving)
fused_experts_transposed.register_autograd(_backward(True), setup_context=_saving)


def _fused_experts_quantized_backward(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    w13: list[torch.Tensor | None],
    w2: list[torch.Tensor | None],
    w13_scheme: str,
    w13_shape: list[int],
    w2_scheme: str,
    w2_shape: list[int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float | None,
    swiglu_limit: float | None,
    gate_up_interleaved: bool,
    needs: list[bool],
    lora_w13_a: torch.Tensor | None = None,
    lora_w13_b: torch.Tensor | None = None,
    lora_w2_a: torch.Tensor | None = None,
    lora_w2_b: torch.Tensor | None = None,
    lora_adapter_ids: torch.Tensor | None = None,
    lora_scaling: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Gradients of ``fused_experts_quantized`` for the arguments at ``_QUANTIZED_GRAD_ARGS``
    whose entry in ``needs`` is set (an empty tensor for the others), as
    ``fused_experts_backward``: recomputed on ``fused_moe``'s differentiable path, where the
    frozen quantized experts pass the gradient on."""
    inputs = _named(locals(), _QUANTIZED_GRADS)
    q13 = quantized_weight(w13_scheme, w13_shape, w13)
    q2 = quantized_weight(w2_scheme, w2_shape, w2)
    settings = (activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, "torch", False)

    def experts(x, weights, b13, b2, *lora):
        lora = (*lora[:4], lora_adapter_ids, lora[4], lora_scale)
        return _op_body(x, q13, q2, weights, topk_ids, b13, b2, *settings, lora, grad=True)

    return _differentiated(experts, inputs, needs, grad_out)


fused_experts_quantized_backward = torch.library.custom_op(
    "moerunner::fused_experts_quantized_backward", mutates_args=()
)(_fused_experts_quantized_backward)
fused_experts_quantized_backward.register_fake(
    lambda *a, **k: _fake_grads(_fused_experts_quantized_backward, _QUANTIZED_GRADS, a, k)
)


def _saving_quantized(ctx, inputs, output) -> None:
    inputs = _filled(inputs, 24)
    ctx.save_for_backward(*(inputs[i] for i in _QUANTIZED_GRAD_ARGS), inputs[8], inputs[21])
    ctx.weights = inputs[1:7]  # the two weights' tensors, schemes and shapes
    ctx.settings = inputs[11:15]  # activation, swiglu alpha and limit, interleaved
    ctx.lora_scale = inputs[23]


def _backward_quantized(ctx, grad_out):
    x, weights, b13, b2, *lora, ids, adapter_ids = ctx.saved_tensors
    needs = _needs(ctx, _QUANTIZED_GRAD_ARGS)
    grads = torch.ops.moerunner.fused_experts_quantized_backward(
        grad_out.contiguous(),
        *(x, *ctx.weights, weights, ids, b13, b2),
        *ctx.settings,
        needs,
        *(*lora[:4], adapter_ids, lora[4], ctx.lora_scale),
    )
    return _placed(ctx, grads, needs, _QUANTIZED_GRAD_ARGS)


fused_experts_quantized.register_autograd(_backward_quantized, setup_context=_saving_quantized)
for _op in (fused_experts_backward, fused_experts_quantized_backward):
    _op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def registry_note(registry, backend: str, whose: str = "this layer's registry") -> str | None:
    """Why calls with this ``registry`` cannot run through the custom ops (a layer's compiled
    and training calls, a traced ``fused_moe``), or None. The ops' schema takes tensors and
    names, so they look ``backend`` up in the default registry: a registry that serves it
    with other objects would run another backend there, or none."""
    from .registry import DEFAULT_REGISTRY

    if registry is DEFAULT_REGISTRY:
        return None
    names = sorted(registry.backends) if backend == "auto" else [backend]
    differ = [n for n in names if registry.backends.get(n) is not DEFAULT_REGISTRY.backends.get(n)]
    if not differ:
        return None
    return (
        f"{whose} serves backend(s) {differ} with other objects than the default "
        "registry; torch.compile (and a layer's grad-mode calls) run through moerunner's custom "
        "op, which finds backends in the default registry only: register them there "
        "(moerunner.DEFAULT_REGISTRY.register_backend) to compile or train, or run eagerly "
        "(a layer under torch.no_grad())"
    )
