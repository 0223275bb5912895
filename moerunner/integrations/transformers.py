"""moerunner as a HuggingFace transformers 5 experts implementation.

Stage: the edge. transformers 5 MoE models call their experts module as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` and
dispatch that call by the config's ``experts_implementation`` name through
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``. Importing this module registers the
name ``"moerunner"``; the registered function runs the experts with ``moerunner.fused_moe``'s path
on the module's weights, converted once to the canonical layout and cached on the module.

Choices enter here and travel as arguments: the backend comes from the model config's
``moerunner_backend`` attribute if set, else from the ``register(backend=...)`` that made
the name. A layer moerunner cannot run raises ``UnsupportedExpertsError`` naming the layer,
unless the config's ``moerunner_fallback`` (or ``register(fallback=...)``) is ``"eager"``:
then that layer runs transformers' own eager loop and the others run on moerunner.
Reading an experts module's layout and weights is ``_hf_experts``; quantizing them in place
(``quantize_experts``, ``load_gpt_oss_mxfp4``, exported here) is ``_quantized_experts``.
"""

from __future__ import annotations

import re
import warnings
import weakref

import torch

from ..api import run_experts
from ..config import ACTIVATIONS
from ..errors import INDEX_DTYPES_TEXT, MoeInputError, is_index_tensor, make_fx_tracing
from ..lora import MoeLoraWeights, lora_hooks, op_arguments
from ..ops import call_fused_experts
from ..runner import MoeRunner, default_registry
from ..shared import SharedExperts
from . import _relayout
from ._hf_experts import (
    STORED_ON_PURPOSE,
    UnsupportedExpertsError,
    describe,
    expert_weights,
    experts_implementation,
    experts_modules,
    float_weights,
    held_call_weights,
    held_weights,
    no_experts_error,
    quantized_weights,
    shared_mlp_matches,
    sources_key,
    traced_layout,
)
from ._hf_routers import RoutedForward, block_router, find_recipe
from ._quantized_experts import load_gpt_oss_mxfp4, quantize_experts, quantized_scheme

__all__ = [
    "IMPLEMENTATION_NAME",
    "UnsupportedExpertsError",
    "attach_lora",
    "check_model",
    "experts_modules",
    "fuse_routers",
    "fuse_shared_experts",
    "load_gpt_oss_mxfp4",
    "make_experts_forward",
    "quantize_experts",
    "quantized_scheme",
    "register",
    "relayout_experts",
    "set_adapter_ids",
    "use_moerunner",
]

IMPLEMENTATION_NAME = "moerunner"
FALLBACKS = ("error", "eager")
BACKEND_ATTR = "moerunner_backend"
FALLBACK_ATTR = "moerunner_fallback"
LORA_ATTR = "_moerunner_lora"  # on an experts module: its _LoraBinding (a plain attribute)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def make_experts_forward(backend: str = "auto", fallback: str = "error"):
    """The experts function transformers calls: ``fn(module, hidden_states, ids, weights)``.

    Args:
        backend: moerunner backend name or ``"auto"``; a model config attribute
            ``moerunner_backend`` overrides it per model.
        fallback: ``"error"`` (an unsupported layer raises ``UnsupportedExpertsError`` naming
            it) or ``"eager"`` (it runs transformers' eager loop); the config attribute
            ``moerunner_fallback`` overrides it per model.
    """
    _check_backend(backend)
    if fallback not in FALLBACKS:
        raise MoeInputError(f"fallback: got {fallback!r}; accepted: {FALLBACKS}")

    def moerunner_experts_forward(
        self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs
    ):
        ids = _routing_arg(top_k_index, kwargs, "router_indices", "top_k_index")
        weights = _routing_arg(top_k_weights, kwargs, "routing_weights", "top_k_weights")
        config = getattr(self, "config", None)
        lora = self.__dict__.get(LORA_ATTR)
        if torch.compiler.is_compiling() or make_fx_tracing():  # traced: the custom op
            return _traced_experts(self, hidden_states, ids, weights, backend, fallback, lora)
        try:
            expert_w, activation = expert_weights(self, _relayout.auto_relayout)
        except UnsupportedExpertsError:
            if (getattr(config, FALLBACK_ATTR, None) or fallback) != "eager":
                raise
            eager = getattr(type(self).forward, "__wrapped__", None)
            if eager is None:
                raise
            return eager(self, hidden_states, ids, weights)
        chosen = getattr(config, BACKEND_ATTR, None) or backend
        # transformers' MoE blocks pass [T, H], [T, k], [T, k] already: no reshape then (each
        # costs a dispatcher call per layer per step).
        x = _rows(hidden_states, (-1, hidden_states.shape[-1]))
        ids = _rows(ids, (x.shape[0], -1))
        if getattr(self, "_is_expert_parallel", False):
            # transformers marks tokens routed to other ranks with id == num_experts.
            ids = torch.where(ids >= expert_w.num_experts, -1, ids)
        hooks = None if lora is None else lora.hooks(x)
        out = _run_experts(x, ids, weights, expert_w, activation, chosen, hooks)
        return out if x is hidden_states else out.reshape(hidden_states.shape)

    moerunner_experts_forward.moerunner_backend = backend
    return moerunner_experts_forward


def _rows(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``t`` as 2-D ``shape`` (-1: inferred): itself where it is 2-D already."""
    return t if t.dim() == 2 else t.reshape(shape)


def _run_experts(x, ids, weights, expert_w, activation, backend, hooks, shared=None):
    """``fused_moe``'s ``run_experts`` on an experts module's canonical weights and activation
    (``expert_weights``: made once, kept on the module) with the router's ids unchecked,
    through one runner per backend name: ``fused_moe`` would check the activation and build
    the weights and a runner again on every call."""
    if weights.shape != ids.shape and weights.numel() != ids.numel():
        raise MoeInputError(
            f"experts call: top_k_weights of shape {list(weights.shape)} do not fit "
            f"top_k_index of shape {list(ids.shape)} (one weight per routed slot)"
        )
    return run_experts(
        _runner(backend),
        expert_w,
        x,
        weights if weights.shape == ids.shape else weights.reshape(ids.shape),
        ids,
        activation,
        False,  # ids come from the model's own router
        shared=shared,
        hooks=hooks,
    )


_RUNNERS: dict[str, MoeRunner] = {}


def _runner(backend: str) -> MoeRunner:
    """The runner of ``backend`` (a name or "auto"; checked where it is first made)."""
    runner = _RUNNERS.get(backend)
    if runner is None:
        runner = _RUNNERS[backend] = MoeRunner(backend)
    return runner


def _traced_experts(module, hidden_states, ids, weights, backend: str, fallback: str, lora):
    """The experts call while ``torch.compile`` traces: the weights enter the graph as the
    module's own tensors and run in one moerunner custom op; layout conversion and the
    backend's weight preparation happen inside the op, once (no graph break). ``lora``: the
    layer's adapters (``_LoraBinding``) or None; their factors and the batch's adapter ids
    enter the op as its LoRA arguments."""
    config = getattr(module, "config", None)
    layout = traced_layout(module)
    if len(layout) == 1:  # moerunner cannot run this layer
        if (getattr(config, FALLBACK_ATTR, None) or fallback) != "eager":
            raise UnsupportedExpertsError(layout[0])
        return type(module).forward.__wrapped__(module, hidden_states, ids, weights)
    act, alpha, limit, transposed, interleaved, has_bias = layout
    chosen = getattr(config, BACKEND_ATTR, None) or backend
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    gated = ACTIVATIONS[act]
    b13 = getattr(module, "gate_up_proj_bias" if gated else "up_proj_bias", None)
    b2 = getattr(module, "down_proj_bias", None)
    if not has_bias:
        b13 = b2 = None
    held = held_weights(module)  # biases: the module's own (above)
    quantized = held if held is not None else quantized_weights(module)
    if quantized is not None:
        w13, w2 = (quantized.w13, quantized.w2) if held is None else held_call_weights(module)
        if held is None:
            b13, b2 = quantized.w13_bias, quantized.w2_bias
        interleaved, num_experts = quantized.gate_up_interleaved, quantized.w13.shape[0]
    else:
        w13 = getattr(module, "gate_up_proj" if gated else "up_proj")
        w2 = module.down_proj
        num_experts = w13.shape[0]
    ids = ids.reshape(x.shape[0], -1)
    if getattr(module, "_is_expert_parallel", False):
        ids = torch.where(ids >= num_experts, -1, ids)
    lora_args = () if lora is None else op_arguments(lora.hooks(x))
    # The module's own tensors (not aliases made per call): the runner's prepared weights
    # are memoised on them, and with grad mode on the ops' backward gives them gradients
    # (quantized experts are frozen: theirs passes the gradient on).
    args = (ids, b13, b2, act, alpha, limit, interleaved, chosen, False)
    if quantized is None and transposed:
        out = torch.ops.moerunner.fused_experts_transposed(
            x, w13, w2, weights.reshape(ids.shape), *args, *lora_args
        )
    else:
        topk_weights = weights.reshape(ids.shape)
        out = call_fused_experts(x, w13, w2, topk_weights, *args, lora_args)
    return out.reshape(hidden_states.shape)


def _routing_arg(value, kwargs: dict, *names: str) -> torch.Tensor:
    for name in names:
        if value is None:
            value = kwargs.get(name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"experts call: {names[-1]} must be a torch.Tensor, got {type(value)}")
    return value


def _check_choice(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str, got {value!r}")


def _check_backend(backend: object) -> None:
    """A backend name the integration's runners (on the default registry) can look up."""
    _check_choice("backend", backend)
    default_registry().check_name(backend)


def register(
    name: str = IMPLEMENTATION_NAME, *, backend: str = "auto", fallback: str = "error"
) -> str:
    """Register moerunner under ``name`` in transformers' experts functions; return ``name``.

    ``register()`` is done on import. ``register("moerunner_triton", backend="triton")``
    adds a name bound to one backend, for ``experts_implementation="moerunner_triton"``.
    """
    _check_choice("name", name)
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, make_experts_forward(backend, fallback))
    return name


def check_model(model: torch.nn.Module) -> dict[str, str | None]:
    """For each experts module of ``model``: None if moerunner runs it, else the reason."""
    verdicts: dict[str, str | None] = {}
    for path, module in experts_modules(model):
        try:
            describe(module)
            verdicts[path] = None
        except UnsupportedExpertsError as exc:
            verdicts[path] = str(exc)
    return verdicts


def use_moerunner(
    model,
    *,
    backend: str | None = None,
    fallback: str = "error",
    name: str = IMPLEMENTATION_NAME,
    lora=None,
    shared_experts: bool = False,
    relayout: bool = True,
    routers: bool = False,
):
    """Switch a loaded transformers model's experts to moerunner; return the model.

    Checks every experts layer first: with ``fallback="error"`` an unsupported layer raises
    ``UnsupportedExpertsError`` naming it (and nothing is switched); with ``"eager"`` those
    layers keep transformers' eager loop. ``backend`` (if given) is stored in the config as
    ``moerunner_backend``. ``lora`` (a ``moerunner.lora_checkpoints.MoeLoraSet``) attaches
    LoRA adapters to the experts (``attach_lora``); ``set_adapter_ids`` then selects them.
    ``shared_experts=True`` runs the shared expert of Qwen2-MoE / DeepSeek-V3 MoE blocks in
    the experts' ``fused_moe`` call (``fuse_shared_experts``). ``relayout`` (default)
    re-stores GPT-OSS's transposed experts over contiguous canonical memory where that is safe
    (``relayout_experts``); ``False`` keeps them as stored (read through strided views).
    ``routers=True`` also runs the MoE blocks' routers on moerunner's routing kernel
    (``fuse_routers``; a router it cannot reproduce keeps its own forward, with a warning
    naming it and why).
    """
    if fallback not in FALLBACKS:
        raise MoeInputError(f"fallback: got {fallback!r}; accepted: {FALLBACKS}")
    if backend is not None:
        _check_backend(backend)
    for arg, flag in (("relayout", relayout), ("routers", routers)):
        if not isinstance(flag, bool):
            raise TypeError(f"{arg} must be True or False, got {flag!r}")
    verdicts = check_model(model)
    if not verdicts:
        raise no_experts_error(model)
    refused = [reason for reason in verdicts.values() if reason is not None]
    if refused and fallback == "error":
        raise UnsupportedExpertsError(
            f"{len(refused)} of {len(verdicts)} experts layers cannot run on moerunner "
            "(pass fallback='eager' to keep them on transformers' loop):\n  " + "\n  ".join(refused)
        )
    blocks = _shared_blocks(model, check=True) if shared_experts else []  # checked first
    if lora is not None:
        attach_lora(model, lora, _verdicts=verdicts)
    _install_shared(blocks, enable=True)
    if relayout:
        relayout_experts(model)
    else:
        for _, module in experts_modules(model):
            module.__dict__[STORED_ON_PURPOSE] = True
    for config in _configs(model):
        setattr(config, FALLBACK_ATTR, fallback)
        if backend is not None:
            setattr(config, BACKEND_ATTR, backend)
    model.set_experts_implementation(name)
    for _, module in experts_modules(model):
        # An experts layer built from a copy of its config (per-layer configs: Dots3-Note's
        # vision tower) is out of set_experts_implementation's reach: switch it by its own.
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_experts_implementation", None) != name:
            config._experts_implementation = name
    if routers:
        kept = {path: why for path, why in fuse_routers(model).items() if why is not None}
        if kept:
            warnings.warn(
                f"use_moerunner(routers=True): {len(kept)} router(s) keep their own forward:\n  "
                + "\n  ".join(f"{path}: {why}" for path, why in kept.items()),
                stacklevel=2,
            )
    return model


def fuse_routers(model, enable: bool = True) -> dict[str, str | None]:
    """Run each MoE block's router on moerunner's routing kernel; ``enable=False`` restores
    the routers' own forwards. Returns {router path: None where it runs on moerunner, else
    why it keeps its own forward}.

    The router's linear layer stays as it computes it; softmax / sigmoid scoring, correction
    bias, grouped top-k, renormalisation and scaling become one ``select_experts`` call: one
    launch of the routing kernel for CUDA inputs (a graph node under ``torch.compile``, so it
    is captured with the decode step), the torch path elsewhere. Which routing a router
    computes is read from its attributes and checked on a probe against its own forward
    (``_hf_routers``); outputs keep the router's dtypes (int64 ids, bf16 weights for Qwen3-MoE
    and GPT-OSS). Numerics: ``select_experts``' (scores rounded once from float64); the chosen
    experts are those of the router's own forward except where two scores are within a
    rounding of each other, and slots may come in another order. Where gradients are needed
    (a router weight or input that requires grad, grad mode on) the router's own forward
    runs, and so it does for a call with arguments besides the hidden states. The recipe is read
    once: call this again after changing a router's settings (its weights, bias and top_k are
    read at each call; its outputs follow the input dtype, as the router's own do). A router
    whose forward is already replaced on the instance (an accelerate hook: offloaded or
    device-mapped models) or whose weights are on the meta device keeps its own forward.
    Independent of the experts implementation (works with transformers' own experts too).
    """
    if not isinstance(enable, bool):
        raise TypeError(f"fuse_routers: enable must be a bool, got {type(enable).__name__}")
    verdicts: dict[str, str | None] = {}
    for path, block in _shared_blocks(model, check=False):
        found = block_router(block)
        if found is None:
            verdicts[path] = "the block has no router module ('gate' or 'router')"
            continue
        name, router = found
        where = f"{path}.{name}" if path else name
        if isinstance(router.__dict__.get("forward"), RoutedForward):
            del router.__dict__["forward"]  # (only ours: a hook's forward stays)
        recipe = find_recipe(router) if enable else None
        if isinstance(recipe, str):
            verdicts[where] = recipe
            continue
        if recipe is not None:
            router.forward = RoutedForward(router, recipe)
        verdicts[where] = None
    return verdicts


def relayout_experts(model, layout: str = "canonical") -> dict[str, str | None]:
    """Hold each transposed (GPT-OSS) experts layer's float weights in ``layout``; return
    ``{layer path: None if its weights are in that layout, else why they were left}``.

    ``"canonical"``: each parameter's memory becomes the contiguous ``[E, out, in]`` tensor
    the kernels read fastest, and the parameter a transposed view of it (same object, name,
    shape and values: ``state_dict``, ``load_state_dict``, ``save_pretrained``, ``.to()``
    and transformers' own experts implementations work unchanged). ``"stored"``: contiguous
    as the checkpoint stores them again, kept so (no automatic re-lay). ``"auto"``: as
    stored, with the choice left to moerunner as for a freshly loaded model: each layer is
    re-laid in place at its first eager inference call where that costs no copy (cached
    views of the weights are dropped here for that). One copy of the experts either way;
    the re-lay is done in each parameter's memory through a 64 MiB buffer, or, where
    another tensor references that memory, by a copy (one parameter of transient memory).
    Left as stored (moerunner reads them through strided views): layers moerunner cannot run
    or that run quantized weights, offloaded or meta weights, tensor subclasses (e.g.
    DTensor), and weights sharing memory with another tensor of the model. Layers stored
    canonical already are not touched.
    """
    choices = (*_relayout.LAYOUTS, "auto")
    if layout not in choices:
        raise MoeInputError(f"layout: got {layout!r}; accepted: {choices}")
    owners = _relayout.storage_owners(model)
    verdicts: dict[str, str | None] = {}
    for path, module in experts_modules(model):
        reason = _relayout.blocker(model, path, module, owners)
        if reason is None:
            _relayout.relayout(module, "stored" if layout == "auto" else layout)
        module.__dict__[STORED_ON_PURPOSE] = layout == "stored"
        if layout == "auto":
            _relayout.undecided(module)
        verdicts[path] = reason
    if not verdicts:
        raise no_experts_error(model)
    return verdicts


class _AdapterIds:
    """The adapter ids of a model's current batch, shared by its experts layers."""

    def __init__(self, num_adapters: int, device: torch.device):
        self.num_adapters = num_adapters
        self.device = device
        self.ids: torch.Tensor | None = None


class _LoraBinding:
    """One experts layer's LoRA factors and the model's current adapter ids."""

    def __init__(self, weights: MoeLoraWeights, state: _AdapterIds, layer: str):
        self.weights = weights
        self.state = state
        self.layer = layer

    def hooks(self, x: torch.Tensor):
        """The LoRA hooks of a call on hidden states ``x`` (``[T, H]``): None without ids.
        In grad mode they train like the experts (``moerunner.lora``'s Gradients)."""
        ids = self.state.ids
        if ids is None:  # no ids set: every token runs the base experts
            return None
        num_tokens = x.shape[0]
        if ids.numel() == num_tokens:
            per_token = ids.reshape(-1)
        elif ids.dim() == 1 and ids.numel() and num_tokens % ids.numel() == 0:
            per_token = ids.repeat_interleave(num_tokens // ids.numel())
        else:
            raise MoeInputError(
                f"adapter ids {list(ids.shape)} fit neither the {num_tokens} tokens of layer "
                f"{self.layer}'s call per token nor per sequence ([B] with the call's T = B * S)"
            )
        return lora_hooks(self.weights, per_token)


def attach_lora(model, lora, *, _verdicts: dict | None = None):
    """Attach LoRA adapters (a ``MoeLoraSet``, ``moerunner.lora_checkpoints``) to a
    transformers model's experts layers, or detach them (``None``); return the model.

    Layer ``i`` of the set goes to the experts module under ``layers.{i}.``; its factors must
    fit that module's experts and lie on its device. Tokens use the adapters named by
    ``set_adapter_ids`` (none until then). Only layers running on moerunner apply adapters:
    a set covering a layer moerunner cannot run raises.
    """
    from ..lora_checkpoints import MoeLoraSet

    modules = dict(experts_modules(model))
    if lora is None:
        for module in modules.values():
            module.__dict__.pop(LORA_ATTR, None)
        model.__dict__.pop(LORA_ATTR, None)
        return model
    if not isinstance(lora, MoeLoraSet):
        raise TypeError(f"lora must be a MoeLoraSet or None, got {type(lora).__name__}")
    verdicts = check_model(model) if _verdicts is None else _verdicts
    by_layer = {}
    for path, module in modules.items():
        found = _LAYER_INDEX.search("." + path)
        if found is not None:
            by_layer[int(found.group(1))] = (path, module)
    missing = sorted(set(lora.layers) - set(by_layer))
    if missing:
        raise MoeInputError(
            f"lora: the adapters cover layers {missing}, which have no experts module in "
            f"{type(model).__name__} (experts layers: {sorted(by_layer)})"
        )
    bindings = {}
    devices = set()
    for index, weights in lora.layers.items():
        path, module = by_layer[index]
        if verdicts.get(path) is not None:
            raise UnsupportedExpertsError(
                f"lora: layer {index} cannot take adapters: {verdicts[path]}"
            )
        _check_lora_fits(module, weights, path)
        devices.add(weights.w13_a.device)
        bindings[path] = weights
    if len(devices) > 1:
        raise MoeInputError(
            f"lora: the layers' factors lie on several devices {sorted(map(str, devices))}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    state = _AdapterIds(lora.num_adapters, device)
    for path, module in modules.items():
        module.__dict__.pop(LORA_ATTR, None)
        if path in bindings:
            module.__dict__[LORA_ATTR] = _LoraBinding(bindings[path], state, path)
    model.__dict__[LORA_ATTR] = state
    return model


def _check_lora_fits(module, weights: MoeLoraWeights, path: str) -> None:
    expert_w = (
        float_weights(module) if quantized_weights(module) is None else quantized_weights(module)
    )
    e, n13, h = expert_w.w13.shape
    i = expert_w.w2.shape[2]
    if weights.num_experts != e:
        raise MoeInputError(
            f"lora: layer {path} has {e} experts, its adapters' factors {weights.num_experts}"
        )
    weights.validate()
    try:
        weights.check_against(n13, h, i)
    except MoeInputError as exc:
        raise MoeInputError(f"lora: layer {path}: {exc}") from None
    device = expert_w.w2.device
    if weights.w13_a.device != device:
        raise MoeInputError(
            f"lora: layer {path}'s experts are on {device}, its adapters' factors on "
            f"{weights.w13_a.device} (load them with device=)"
        )
    if getattr(module, "_is_expert_parallel", False):
        raise MoeInputError(
            f"lora: layer {path} is expert-parallel; LoRA runs on whole layers only"
        )


def set_adapter_ids(model, adapter_ids) -> None:
    """Select the adapters of the next forward calls of a model with ``attach_lora`` /
    ``use_moerunner(lora=)``: an int tensor (or list) of ids in ``[-1, L)`` (-1: no adapter),
    ``[B]`` per sequence (it serves a prefill and every decode step of ``generate``) or
    ``[B, S]`` per token of one call; ``None``: every token runs the base experts."""
    state = model.__dict__.get(LORA_ATTR)
    if not isinstance(state, _AdapterIds):
        raise MoeInputError(
            f"set_adapter_ids: {type(model).__name__} has no LoRA adapters attached "
            "(use_moerunner(model, lora=...) or attach_lora)"
        )
    if adapter_ids is None:
        state.ids = None
        return
    if isinstance(adapter_ids, (list, tuple)):
        adapter_ids = torch.tensor(adapter_ids, dtype=torch.long)
    if not isinstance(adapter_ids, torch.Tensor):
        raise TypeError(f"adapter_ids must be a tensor, a list or None, got {type(adapter_ids)}")
    if not is_index_tensor(adapter_ids) or adapter_ids.dim() > 2:
        raise MoeInputError(
            f"adapter_ids must be a [B] or [B, S] tensor of {INDEX_DTYPES_TEXT}, got "
            f"{adapter_ids.dtype} {list(adapter_ids.shape)}"
        )
    if adapter_ids.device.type == "cpu" and adapter_ids.numel():
        low, high = int(adapter_ids.min()), int(adapter_ids.max())
        if low < -1 or high >= state.num_adapters:
            raise MoeInputError(
                f"adapter_ids must lie in [-1, {state.num_adapters}), got [{low}, {high}]"
            )
    state.ids = adapter_ids.to(state.device)


# MoE blocks whose forward is ``routed(x) + [sigmoid(x @ shared_expert_gate)] * shared(x)``
# with the router's own top-k (read in transformers 5): block class -> shared MLP attribute.
SHARED_BLOCKS = {"Qwen2MoeSparseMoeBlock": "shared_expert", "DeepseekV3MoE": "shared_experts"}
_SHARED_CACHE = "_moerunner_shared"


def fuse_shared_experts(model, enable: bool = True) -> list[str]:
    """Run the shared expert of each Qwen2-MoE / DeepSeek-V3 MoE block in the experts'
    ``fused_moe`` call (``moerunner.shared``: the shared MLP on moerunner's kernels) instead
    of transformers' separate MLP; ``enable=False`` restores the blocks. Returns the blocks.

    The block's forward is replaced on the instance: it calls the block's own router, then
    one ``fused_moe`` with ``SharedExperts(cat(gate_proj, up_proj), down_proj,
    shared_expert_gate)``. While the model's experts implementation is not moerunner's,
    under ``torch.compile``, or for a layer moerunner cannot run, the block runs its own
    forward. A block of another class, a shared MLP with biases, or a gating other than the
    routed experts' raises ``UnsupportedExpertsError`` (nothing is changed).
    """
    if not isinstance(enable, bool):
        raise TypeError(f"fuse_shared_experts: enable must be a bool, got {type(enable).__name__}")
    blocks = _shared_blocks(model, check=enable)
    _install_shared(blocks, enable)
    return [path for path, _ in blocks]


def _shared_blocks(model, check: bool) -> list[tuple[str, torch.nn.Module]]:
    """(path, block) of every module holding an experts module (checked if ``check``)."""
    experts = {id(module) for _, module in experts_modules(model)}
    blocks = []
    for path, block in model.named_modules():
        if id(getattr(block, "experts", None)) not in experts:
            continue
        if check:
            _check_shared_block(block, path)
        blocks.append((path, block))
    if not blocks:
        raise no_experts_error(model)
    return blocks


def _install_shared(blocks, enable: bool) -> None:
    for _, block in blocks:
        block.__dict__.pop(_SHARED_CACHE, None)
        if enable:
            block.forward = _FusedForward(block)
        else:
            block.__dict__.pop("forward", None)


def _check_shared_block(block, path: str) -> None:
    def refuse(reason: str) -> UnsupportedExpertsError:
        return UnsupportedExpertsError(f"shared experts: block {path} ({cls}): {reason}")

    cls = type(block).__name__
    if cls not in SHARED_BLOCKS:
        raise refuse(f"its forward is not one moerunner fuses ({sorted(SHARED_BLOCKS)})")
    mlp = getattr(block, SHARED_BLOCKS[cls])
    gate = getattr(block, "shared_expert_gate", None)
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not isinstance(getattr(mlp, name, None), torch.nn.Linear):
            raise refuse(f"the shared MLP has no nn.Linear {name}")
    if any(
        lin is not None and lin.bias is not None
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, gate)
    ):
        raise refuse("a shared MLP or gate with a bias")
    try:
        layout = describe(block.experts)
    except UnsupportedExpertsError as exc:
        raise refuse(str(exc)) from None
    if layout.interleaved or not shared_mlp_matches(mlp, layout.activation):
        raise refuse(f"the shared MLP's gating is not the routed experts' {layout.activation.name}")


def _shared_sources(block) -> list:
    """The shared MLP's gate, up and down weights and the shared gate's (or None)."""
    mlp = getattr(block, SHARED_BLOCKS[type(block).__name__])
    gate = getattr(block, "shared_expert_gate", None)
    sources = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    sources.append(None if gate is None else gate.weight)
    return sources


def _shared_experts(block) -> SharedExperts:
    """The block's shared MLP as ``SharedExperts`` (made once per weight version: moerunner
    memoises the prepared weights on its tensors)."""
    sources = _shared_sources(block)
    key = sources_key(sources)
    cached = block.__dict__.get(_SHARED_CACHE)
    if cached is not None and cached[0] == key:
        return cached[1]
    g, u, d, gw = (None if t is None else t.detach() for t in sources)
    shared = SharedExperts(torch.cat([g, u])[None], d[None], None if gw is None else gw)
    block.__dict__[_SHARED_CACHE] = (key, shared)
    return shared


class _FusedForward:
    """``_fused_block_forward`` bound to a block weakly: a bound method kept in the block's
    ``__dict__`` would refer back to the block, a cycle that keeps a dropped model's experts
    alive until the collector runs."""

    __slots__ = ("block",)

    def __init__(self, block: torch.nn.Module) -> None:
        self.block = weakref.ref(block)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _fused_block_forward(self.block(), hidden_states)

    def __deepcopy__(self, memo: dict) -> _FusedForward:
        """Bound to the copy of its block (``copy.deepcopy`` of a model copies the block
        first): a copied weak reference would still name the original block, whose weights
        the copy would then run."""
        block = self.block()
        return _FusedForward(memo.get(id(block), block))

    def __reduce__(self):
        """Pickled (``torch.save`` of a model) as a rebinding to its block."""
        return (_FusedForward, (self.block(),))


def _fused_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A shared-expert MoE block's forward with its shared MLP in the experts' call."""
    experts = self.experts
    config = getattr(experts, "config", None)
    function = experts_implementation(experts)[1]
    own = type(self).forward
    if (
        torch.compiler.is_compiling()
        or function is None
        or getattr(experts, "_is_expert_parallel", False)
    ):
        return own(self, hidden_states)
    try:
        expert_w, activation = expert_weights(experts)
    except UnsupportedExpertsError:
        return own(self, hidden_states)  # the experts call raises or falls back itself
    if torch.is_grad_enabled() and any(
        p.requires_grad for p in _shared_sources(self) if p is not None
    ):
        # The fused call takes the shared MLP as detached weights (made once per weight
        # version): training runs the block's own forward, whose shared MLP carries its
        # gradients (the routed experts still run on moerunner).
        return own(self, hidden_states)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    routed = self.gate(x)
    if not (isinstance(routed, tuple) and len(routed) == 3):
        raise UnsupportedExpertsError(
            f"shared experts: the router of {type(self).__name__} returned "
            f"{type(routed).__name__}, not (logits, weights, ids); fuse_shared_experts(model, "
            "enable=False) restores the block"
        )
    _, weights, ids = routed
    lora = experts.__dict__.get(LORA_ATTR)
    hooks = None if lora is None else lora.hooks(x)
    chosen = getattr(config, BACKEND_ATTR, None) or function.moerunner_backend
    shared = _shared_experts(self)
    out = _run_experts(x, ids, weights, expert_w, activation, chosen, hooks, shared)
    return out.reshape(hidden_states.shape)


def _configs(model) -> list:
    seen: dict[int, object] = {}
    for _, module in experts_modules(model):
        config = getattr(module, "config", None)
        if config is not None:
            seen[id(config)] = config
    seen[id(model.config)] = model.config
    return list(seen.values())


register()
