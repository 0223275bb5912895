"""One transformers experts module seen as moerunner expert weights (private helper).

Stage: the edge between a transformers 5 experts module (a class decorated with
``@use_experts_implementation``) and moerunner's canonical ``ExpertWeights``. Contract:

- ``describe(module)`` reads the decorator's layout flags (``has_gate``, ``is_transposed``,
  ``is_concatenated``, ``has_bias``, ``has_post_expert_norm``) and finds the moerunner
  activation whose math equals the module's own gating (checked numerically on a probe, so a
  family whose gate differs is refused instead of silently computed wrong). It raises
  ``UnsupportedExpertsError`` with the reason when moerunner cannot run the module.
- ``expert_weights(module)`` returns the module's weights in the canonical shape
  (``w13 [E, 2I, H]``, ``w2 [E, H, I]``; views of transposed parameters, no copy: strided,
  or contiguous where ``relayout_experts`` re-laid the parameters' memory),
  made once and cached on the module, keyed on
  the parameter objects, their storage, dtype and in-place version: a forward call after the
  first reuses the same tensors (so backends' prepared weights are cached as well).
- ``set_quantized(module, weights, hold=...)`` sets quantized ``ExpertWeights`` that take
  precedence: pinned as a plain attribute, or (``hold=True``) held as buffers of a child
  module ``moerunner_quantized`` (``QuantizedExperts``), so the model's ``state_dict`` saves
  them and ``load_state_dict`` restores them (``moerunner.held_quantized``). Biases stay the
  experts module's own parameters.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..activations import apply_activation
from ..config import Activation, ExpertSpec
from ..errors import MoeInputError
from ..held_quantized import HoldsQuantized, check_kept_floats, float_leaves
from ..memo import forget_memo, tensor_key
from ..ops import adopt_quantized, canonical_from_transposed
from ..weights import ExpertWeights, is_quantized

# Attributes kept on the experts module (plain attributes: never parameters or buffers).
_DESCRIPTION = "_moerunner_description"
_CACHE = "_moerunner_weights"
_QUANTIZED = "_moerunner_quantized"
_HELD_CACHE = "_moerunner_held_weights"
#: (scheme, float sources' key) of pinned weights that follow the float parameters.
_FOLLOWS = "_moerunner_follows_float"
_HOOKED = "_moerunner_load_hook"
#: Set where the caller chose the stored layout of transposed experts (no strided-read warning).
STORED_ON_PURPOSE = "_moerunner_stored_on_purpose"
#: The child module that holds quantized weights as buffers (part of state_dict keys).
HOLDER = "moerunner_quantized"
LAYER_NAME = "_moerunner_layer_name"

# Tried in this order when matching the module's gating numerically. "swiglu_clamp" is the
# clamped SwiGLU of DeepSeek-V4, HY-V4 and GLM-5-Next, silu(min(gate, L)) * clamp(up, -L, L):
# moerunner's swiglu_oai with alpha 1 and beta 0 (``_candidate``).
_GATED_CANDIDATES = ("silu", "gelu", "gelu_tanh", "swiglu_oai", "swiglu_clamp", "swiglu_step")
_PLAIN_CANDIDATES = ("relu2", "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul")
_PROBE_WIDTH = 32  # gate/up probe columns (any even width works for every gating)
_PROBE_RTOL = 1e-5  # fp32 math of the same formula agrees to a few ulps
# Probe values past [-10, 10], so a clamp at any of them (GPT-OSS's 7, the clamped SwiGLUs
# of DeepSeek-V4 and others at 10) shows on the probe instead of matching an unclamped
# activation.
_PROBE_LADDER = (12.0, 16.0, 24.0, 48.0, 100.0, 1e3, 1e4)
# The module attributes a gating's SwiGLU parameters go by, in the order read.
_ALPHA_NAMES = ("alpha", "swiglu_alpha")
_LIMIT_NAMES = ("limit", "swiglu_limit")


def _probe(rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` gate / up inputs: [-10, 10] densely and the ladder, both signs, in
    a fixed shuffled order."""
    ladder = torch.tensor(_PROBE_LADDER)
    dense = torch.linspace(-10.0, 10.0, rows * width - 2 * len(_PROBE_LADDER))
    values = torch.cat([dense, ladder, -ladder])
    order = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))
    return values[order].reshape(rows, width)


class UnsupportedExpertsError(MoeInputError):
    """A transformers experts module that moerunner cannot run; the message says why."""


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores its weights and which activation it computes."""

    activation: Activation
    transposed: bool  # weights stored [E, in, out] (GPT-OSS) instead of [E, out, in]
    interleaved: bool  # gate/up rows alternate (GPT-OSS) instead of gate block, up block
    has_bias: bool


def layer_name(module: torch.nn.Module) -> str:
    """The module's path in its model when known (set by the model helpers: ``use_moerunner``,
    ``check_model``), else its class and where to find the path."""
    name = getattr(module, LAYER_NAME, None)
    if name:
        return f"{name} ({type(module).__name__})"
    return (
        f"{type(module).__name__} (its path in the model: "
        "moerunner.integrations.transformers.check_model(model) names every layer)"
    )


def describe(module: torch.nn.Module) -> ExpertsLayout:
    """The module's layout and activation; ``UnsupportedExpertsError`` if unsupported. What
    its structure decides is worked out once and cached; its weights' dtypes, which
    ``.to()`` changes, are checked on every call (a cached refusal of float64 experts stayed
    after ``.float()``, and a cached "runnable" let them reach the kernels after
    ``.double()``, past ``fallback="eager"``)."""
    cached = module.__dict__.get(_DESCRIPTION)
    if cached is None:
        try:
            cached = _describe(module)
        except UnsupportedExpertsError as exc:
            cached = exc
        module.__dict__[_DESCRIPTION] = cached
    if isinstance(cached, UnsupportedExpertsError):
        raise cached
    _check_dtypes(module)
    return cached


def _refusal(module: torch.nn.Module, reason: str) -> UnsupportedExpertsError:
    return UnsupportedExpertsError(
        f"experts layer {layer_name(module)} cannot run on moerunner: {reason}"
    )


def _weight_names(module: torch.nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _check_dtypes(module: torch.nn.Module) -> None:
    for name in _weight_names(module):
        dtype = getattr(module, name).dtype
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise _refusal(
                module,
                f"{name} has dtype {dtype}; moerunner reads bf16/fp16/fp32 experts here "
                "(quantized checkpoints: see quantize_experts / load_gpt_oss_mxfp4)",
            )


def _describe(module: torch.nn.Module) -> ExpertsLayout:
    """What the module's structure decides (``describe``): refused, or its layout."""

    def refuse(reason: str) -> UnsupportedExpertsError:
        return _refusal(module, reason)

    if not is_experts_module(module):
        raise refuse("not an experts class decorated with @use_experts_implementation")
    if getattr(module, "has_post_expert_norm", False):
        raise refuse("a norm after each expert (has_post_expert_norm) is not supported")
    gated = bool(module.has_gate)
    for name in _weight_names(module):
        weight = getattr(module, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise refuse(f"expected a 3-D tensor {name}, found {type(weight).__name__}")
    interleaved = gated and not getattr(module, "is_concatenated", True)
    candidates = _GATED_CANDIDATES if gated else _PLAIN_CANDIDATES
    activation = _match_activation(module, candidates, gated, interleaved)
    if activation is None:
        what = "gating (_apply_gate)" if gated else "activation (act_fn)"
        limit = _float_attr(module, *_LIMIT_NAMES)
        clamp = (
            ""
            if limit is None
            else f"; it clamps at {limit:g}, but not as moerunner's clamped SwiGLUs do (the gate "
            "clamped before or after silu, up clamped to [-limit, limit])"
        )
        raise refuse(
            f"its {what} matches none of moerunner's activations {list(candidates)} "
            f"(act_fn: {type(getattr(module, 'act_fn', None)).__name__}{clamp})"
        )
    return ExpertsLayout(
        activation=activation,
        transposed=bool(module.is_transposed),
        interleaved=interleaved,
        has_bias=bool(getattr(module, "has_bias", False)),
    )


def _match_activation(
    module: torch.nn.Module, candidates: tuple[str, ...], gated: bool, interleaved: bool
) -> Activation | None:
    """The first candidate whose math equals the module's on the probe (``_probe``)."""
    width = _PROBE_WIDTH if gated else _PROBE_WIDTH // 2
    probe = _probe(8, width)
    try:
        with torch.no_grad():
            theirs = module._apply_gate(probe) if gated else module.act_fn(probe)
    except Exception:  # noqa: BLE001  (any failure means: not a gating we understand)
        return None
    if not isinstance(theirs, torch.Tensor) or tuple(theirs.shape) != (8, _PROBE_WIDTH // 2):
        return None
    for name in candidates:
        act = _candidate(module, name)
        if act is None:
            continue
        spec = ExpertSpec(1, 1, _PROBE_WIDTH // 2, act, interleaved)
        ours = apply_activation(probe, spec)
        if torch.allclose(ours, theirs.float(), rtol=_PROBE_RTOL, atol=_PROBE_RTOL):
            return act
    return None


def _candidate(module: torch.nn.Module, name: str) -> Activation | None:
    """The activation a candidate name stands for, with the module's parameters; None where
    the module lacks what it needs."""
    limit = _float_attr(module, *_LIMIT_NAMES)
    if name == "swiglu_oai":
        return Activation(name, _float_attr(module, *_ALPHA_NAMES), limit)
    if name == "swiglu_clamp":
        if limit is None or limit <= 0:
            return None
        return Activation("swiglu_oai", alpha=1.0, limit=limit, beta=0.0)
    if name == "swiglu_step":  # the clamp after the activation (Step-3.7, Bailing-hybrid)
        if limit is None or limit <= 0:
            return None
        return Activation("swiglu_step", limit=limit)
    return Activation(name)


def shared_mlp_matches(mlp: torch.nn.Module, activation: Activation) -> bool:
    """Whether a shared-expert MLP's ``act_fn(gate) * up`` is ``activation``'s gating (the
    shared experts run with the routed activation)."""
    if not activation.gated or activation.name in ("swiglu_oai", "swiglu_step"):
        return False
    probe = _probe(8, _PROBE_WIDTH)
    up = torch.randn(8, _PROBE_WIDTH, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            theirs = mlp.act_fn(probe) * up
    except Exception:  # noqa: BLE001  (any failure means: not a gating we understand)
        return False
    spec = ExpertSpec(1, 1, _PROBE_WIDTH, activation, False)
    ours = apply_activation(torch.cat([probe, up], dim=1), spec)
    return isinstance(theirs, torch.Tensor) and torch.allclose(
        ours, theirs.float(), rtol=_PROBE_RTOL, atol=_PROBE_RTOL
    )


def _float_attr(module: torch.nn.Module, *names: str) -> float | None:
    """The first of ``names`` the module has as a number (or a one-value tensor)."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


#: The expert weight parameters of transformers' experts modules (gated or not).
EXPERT_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")


def _sources(module: torch.nn.Module, layout: ExpertsLayout) -> list[torch.Tensor | None]:
    gated = layout.activation.gated
    names = ["gate_up_proj" if gated else "up_proj", "down_proj"]
    if layout.has_bias:
        names += ["gate_up_proj_bias" if gated else "up_proj_bias", "down_proj_bias"]
    return [getattr(module, n, None) for n in names] + [None] * (4 - len(names))


def sources_key(tensors: list[torch.Tensor | None]) -> tuple:
    """A cache key of source tensors (``memo.tensor_key`` of each)."""
    return tuple(tensor_key(t) for t in tensors)


def expert_weights(
    module: torch.nn.Module, relay: Callable[[torch.nn.Module], bool] | None = None
) -> tuple[ExpertWeights, Activation]:
    """The module's weights in the canonical layout and its activation (converted once).
    ``relay(module)``: asked, when transposed weights are converted, to re-lay them (True
    when it did), before any view of them is made."""
    layout = describe(module)
    quantized = quantized_weights(module)
    if quantized is not None:
        return quantized, layout.activation
    sources = _sources(module, layout)
    key = sources_key(sources)
    per_mode = module.__dict__.setdefault(_CACHE, {})  # per grad mode (canonical_weights)
    grad = torch.is_grad_enabled()
    cached = per_mode.get(grad)
    if cached is not None and cached[0] == key:
        return cached[1], layout.activation
    for stale in [mode for mode, (made_of, _) in per_mode.items() if made_of != key]:
        del per_mode[stale]  # views of weights since replaced (either grad mode's)
    if relay is not None and layout.transposed and relay(module):
        sources = _sources(module, layout)
        key = sources_key(sources)
        per_mode = module.__dict__.setdefault(_CACHE, {})  # the re-lay dropped the old one
    weights = canonical_weights(sources, layout)
    weights.validate(layout.activation)
    per_mode[grad] = (key, weights)
    if layout.transposed and not weights.w13.is_contiguous():
        _note_strided(module)
    return weights, layout.activation


_STRIDED_WARNED = [False]


def _note_strided(module: torch.nn.Module) -> None:
    """Warn once per process that a transposed experts layer is read through strided views,
    unless its caller chose that layout (``use_moerunner(model, relayout=False)``,
    ``relayout_experts(model, "stored")``)."""
    if _STRIDED_WARNED[0] or module.__dict__.get(STORED_ON_PURPOSE):
        return
    _STRIDED_WARNED[0] = True
    warnings.warn(
        f"moerunner: experts layer {layer_name(module)} stores its experts transposed "
        "(GPT-OSS), so the kernels read them through strided views, which took up to 1.4x the "
        "GPU time of the contiguous layout (H200, 2026-11-28); it was not re-laid in place "
        "(that is done on a call with grad mode off, where no other tensor holds the memory, "
        "to a layer no grad-mode call has trained and no optimizer holds state for). "
        "moerunner.integrations.transformers.use_moerunner(model) (or relayout_experts(model)) "
        "re-lays them once, keeping their shapes, state dict and checkpoints; "
        "use_moerunner(model, relayout=False) keeps them as stored without this warning",
        RuntimeWarning,
        stacklevel=4,
    )


def forget_weights(module: torch.nn.Module) -> None:
    """Drop the module's cached canonical weights and the views memoised on its parameters
    (before their data is replaced, so the old memory is freed at once)."""
    module.__dict__.pop(_CACHE, None)
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        param = module._parameters.get(name)
        if param is not None:
            forget_memo(param)


def canonical_weights(sources: list[torch.Tensor | None], layout: ExpertsLayout) -> ExpertWeights:
    """w13/w2 (+ biases) in moerunner's ``[E, N, K]`` shape, without a copy: the parameters
    themselves (as the compiled ops get them, so eager and compiled calls find one set of
    prepared weights memoised on them).

    A transposed layout (GPT-OSS) becomes strided views. With grad mode off they are
    detached and memoised on the source parameter (``canonical_from_transposed``), so the
    experts live once (in the model's parameters) and eager calls and the compiled
    ``moerunner::fused_experts_transposed`` op given the parameter share the views (and the
    backend's prepared weights). With grad mode on they are plain views, through which
    ``fused_moe``'s differentiable path (the torch backend) gives the parameters their
    gradients."""
    w13, w2, b13, b2 = sources
    if layout.transposed:  # [E, in, out] -> [E, out, in]
        if torch.is_grad_enabled():
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        else:
            w13, w2 = canonical_from_transposed(w13, w2)
    return ExpertWeights(w13, w2, b13, b2, layout.interleaved)


def float_weights(module: torch.nn.Module) -> ExpertWeights:
    """Canonical float weights of the module, ignoring any pinned quantized weights."""
    layout = describe(module)
    return canonical_weights(_sources(module, layout), layout)


class QuantizedExperts(HoldsQuantized):
    """The quantized w13 / w2 of one transformers experts module, held as buffers (the
    module's child ``moerunner_quantized``); the biases are the experts module's own."""

    _held_owner = "model"
    _held_quantize_call = "quantize_experts(model, {scheme})"

    def __init__(self, weights: ExpertWeights):
        super().__init__()
        self._interleaved = weights.gate_up_interleaved
        self.quantized = ExpertWeights(weights.w13, weights.w2, None, None, self._interleaved)
        self._hold_quantized()

    def _held_interleaved(self) -> bool:
        return self._interleaved

    # The experts module's float weights are not in this child's part of a state dict: the
    # module's load pre-hook (``_note_float_state``) notes them here before the child loads.
    _float_seen: frozenset = frozenset()

    def _float_in_state(self, state_dict, prefix: str, w: str) -> bool:
        return w in self._float_seen


def _note_float_state(module, state_dict, prefix, *rest) -> None:
    """Load pre-hook of an experts module holding quantized weights: which float weights (with
    values, not the released empty ones) the state gives it, for its holder's checks."""
    holder = module._modules.get(HOLDER)
    if holder is None:
        return
    names = {"w13": ("gate_up_proj", "up_proj"), "w2": ("down_proj",)}
    holder._float_seen = frozenset(
        w
        for w, keys in names.items()
        if any(
            isinstance(t, torch.Tensor) and t.numel() > 0
            for t in (state_dict.get(prefix + k) for k in keys)
        )
    )


def set_quantized(
    module: torch.nn.Module, weights: ExpertWeights | None, *, hold: bool = False
) -> None:
    """Quantized weights for the module (None: back to its float parameters): pinned, or with
    ``hold`` held as buffers of its child ``moerunner_quantized`` (saved by ``state_dict``;
    the weights' biases must be the module's bias parameters, which stay where they are)."""
    if weights is not None:
        weights.validate(describe(module).activation)
        if is_quantized(weights.w13):  # compiled calls reuse these objects' prepared weights
            adopt_quantized(weights.w13)
            adopt_quantized(weights.w2)
    if HOLDER in module._modules:
        delattr(module, HOLDER)
    for key in (_QUANTIZED, _CACHE, _HELD_CACHE, _FOLLOWS):
        module.__dict__.pop(key, None)
    if weights is not None and hold:
        if not is_quantized(weights.w13):
            raise TypeError("set_quantized(hold=True): the weights must be quantized")
        module.add_module(HOLDER, QuantizedExperts(weights))
        if _HOOKED not in module.__dict__:  # the hook does nothing once the holder is gone
            module.__dict__[_HOOKED] = module.register_load_state_dict_pre_hook(_note_float_state)
    else:
        module.__dict__[_QUANTIZED] = weights


def pin_following(module: torch.nn.Module, scheme) -> None:
    """Quantize the module's float experts in ``scheme`` and pin the result beside them, to
    follow them: an eager call quantizes again when one of those parameters was edited in
    place, replaced or loaded into since (``keep_float_weights``; as ``MoE.quantize_``).
    Traced calls do not check (quantize again after edits there)."""
    # The sources' key before they are read: an edit meanwhile is quantized next call.
    key = sources_key(_sources(module, describe(module)))
    set_quantized(module, quantized_float_weights(module, scheme))
    module.__dict__[_FOLLOWS] = (scheme, key)
    for t in float_leaves(module, EXPERT_WEIGHT_NAMES).values():  # calls give them no grad
        t.requires_grad_(False)


def quantized_float_weights(module: torch.nn.Module, scheme) -> ExpertWeights:
    """The module's float experts quantized in ``scheme`` (biases stay in floating point)."""
    from ..quant import quantize

    source = float_weights(module)
    with torch.no_grad():
        return ExpertWeights(
            quantize(source.w13, scheme),
            quantize(source.w2, scheme),
            source.w13_bias,
            source.w2_bias,
            source.gate_up_interleaved,
        )


def _follow_float_weights(module: torch.nn.Module, scheme, key: tuple) -> None:
    if sources_key(_sources(module, describe(module))) != key:
        pin_following(module, scheme)


def held_weights(module: torch.nn.Module) -> ExpertWeights | None:
    """The quantized w13 / w2 held as buffers (biases None: they are the module's), if any;
    rebuilt where a buffer was assigned anew or substituted (``functional_call``)."""
    holder = module._modules.get(HOLDER)
    if holder is None:
        return None
    holder._held_current()
    return holder.quantized


def held_call_weights(module: torch.nn.Module) -> tuple:
    """The held quantized ``w13`` and ``w2`` as a call runs them (``_held_call_weights``:
    while tracing, the holder's buffers themselves), or None where none are held."""
    holder = module._modules.get(HOLDER)
    return None if holder is None else holder._held_call_weights()


def quantized_weights(module: torch.nn.Module) -> ExpertWeights | None:
    """The quantized weights the module runs, if any: pinned ones, or held ones with the
    module's current bias parameters (one object while neither changes)."""
    held = held_weights(module)
    if held is None:
        follows = module.__dict__.get(_FOLLOWS)
        if follows is not None and not torch.compiler.is_compiling():
            check_kept_floats("model", float_leaves(module, EXPERT_WEIGHT_NAMES))
            _follow_float_weights(module, *follows)
        return module.__dict__.get(_QUANTIZED)
    params = _sources(module, describe(module))[2:]
    key = sources_key(params)
    cached = module.__dict__.get(_HELD_CACHE)
    if cached is not None and cached[0] is held and cached[1] == key:  # `is`: ids get reused
        return cached[2]
    # The bias parameters themselves (leaves: no graph is held), so a training step gives
    # them their gradients as the compiled path and kept float weights do.
    weights = ExpertWeights(held.w13, held.w2, *params, held.gate_up_interleaved)
    module.__dict__[_HELD_CACHE] = (held, key, weights)
    return weights


def _layout_constants(module: torch.nn.Module, cache: bool = True) -> tuple:
    """``(activation, alpha, limit, transposed, interleaved, has_bias)``, or ``(reason,)`` when
    moerunner cannot run the module: the layout as plain constants for a traced caller.
    ``cache=False``: a module not yet described is described without caching it."""
    try:
        cached = cache or _DESCRIPTION in module.__dict__
        layout = describe(module) if cached else _describe(module)
    except UnsupportedExpertsError as exc:
        return (str(exc),)
    return _constants(module, layout)


def _constants(module: torch.nn.Module, layout: ExpertsLayout) -> tuple:
    """The traced form of ``layout`` (see ``_layout_constants``). The compiled op carries
    scalar alpha and limit with beta 1: another beta (the clamped SwiGLU) runs eagerly only."""
    act = layout.activation
    if act.extended:
        return (
            f"experts layer {layer_name(module)} runs eagerly only: its activation "
            f"(swiglu_oai with beta {act.beta}) is not in the compiled op's form (beta 1)",
        )
    return (act.name, act.alpha, act.limit, layout.transposed, layout.interleaved, layout.has_bias)


# A module not described by an eager call yet is described while torch.compile traces, outside
# the graph (the description runs a numeric probe the compiler cannot trace), by a function whose
# result the compiler takes as a constant. Such a function must take constants: torch 2.11 does
# not pass it a module (the trace fails with "UnspecializedNNModuleVariable is not a constant"),
# but it passes the module's ``id``, so the function finds the module by its id among the live
# experts modules (a scan of the garbage collector's objects, which registers every experts
# module alive in one pass; later misses scan again).
_BY_ID: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _module_of_id(key: int) -> torch.nn.Module | None:
    module = _BY_ID.get(key)
    if module is None:
        for obj in gc.get_objects():
            if is_experts_module(obj):
                _BY_ID[id(obj)] = obj
        module = _BY_ID.get(key)
    return module


@torch._dynamo.assume_constant_result
def _layout_of_id(key: int) -> tuple:
    module = _module_of_id(key)
    if module is None:  # the module being traced is alive: not expected
        return ("the experts module being traced was not found among the live modules",)
    # Not cached while tracing: a cache filled then would send a restarted analysis of the
    # same frame down the other branch of ``traced_layout``.
    return _layout_constants(module, cache=False)


def no_experts_error(model: torch.nn.Module) -> MoeInputError:
    """The error of a model with no experts module moerunner can drive, naming the model's
    own MoE blocks where it has some (their experts are computed inside the block, not
    through transformers' experts interface, so setting ``experts_implementation`` on such
    a model changes nothing either)."""
    blocks = sorted({type(m).__name__ for m in model.modules() if _holds_experts(m)})
    message = f"model {type(model).__name__} has no transformers experts module"
    if blocks:
        message += (
            f": its MoE blocks ({', '.join(blocks[:4])}) compute their experts themselves "
            "instead of through transformers' experts interface (@use_experts_implementation), "
            "so moerunner cannot run them (nor does experts_implementation='moerunner' change "
            "them); moerunner.MoE or fused_moe can replace such a block by hand"
        )
    else:
        message += ": none of its layers has experts (a configuration whose layers are all dense?)"
    return MoeInputError(message)


def _holds_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an MoE block: a direct child named or typed as experts or as a
    router (its attention, decoder layer and model hold such a block further down, and a
    dense MLP holds neither)."""
    words = ("expert", "router")
    return any(
        any(w in name.lower() or w in type(child).__name__.lower() for w in words)
        for name, child in module.named_children()
    )


def is_experts_module(obj: object) -> bool:
    """An experts module of transformers 5 (a class decorated with
    ``@use_experts_implementation``)."""
    return (
        # by type: the garbage collector's objects include weak proxies of dead objects,
        # which raise on isinstance
        issubclass(type(obj), torch.nn.Module)
        and hasattr(obj, "has_gate")
        and hasattr(obj, "is_transposed")
    )


def traced_layout(module: torch.nn.Module) -> tuple:
    """``_layout_constants(module)`` in a form ``torch.compile`` traces without a graph break:
    the cached description is read in the graph; a module not yet described is described
    once at trace time."""
    cached = module.__dict__.get(_DESCRIPTION)
    if isinstance(cached, ExpertsLayout):
        return _constants(module, cached)
    return _layout_of_id(id(module))


def experts_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(path, module) of every experts module of ``model`` (``@use_experts_implementation``)."""
    for path, module in model.named_modules():
        if is_experts_module(module):
            setattr(module, LAYER_NAME, path)
            yield path, module


def experts_implementation(experts: torch.nn.Module):
    """The name of the experts implementation ``experts`` runs with (its config's) and its
    function where it is one of moerunner's (``make_experts_forward``), else None."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    function = ALL_EXPERTS_FUNCTIONS.get(name)
    return name, function if hasattr(function, "moerunner_backend") else None
