"""``MoE``: one ``nn.Module`` for all four stages of a MoE layer.

``forward(hidden_states, router_logits)`` routes (``select_experts``), dispatches (a
dispatcher from the registry), runs the experts (a ``MoeRunner`` the layer holds, on weights
prepared once per weight version) and combines. One process with the ``standard`` dispatcher
is the plain layer; expert parallelism is the same module with another dispatcher and a
placement (``MoE(config, dispatcher="all_to_all", placement=..., group=...)`` holds only this
rank's experts). Pre-routed calls pass ``topk=`` instead of router logits.

On one process, the expert step is a custom op while ``torch.compile`` traces
(``moerunner::fused_experts`` for plain weights, ``moerunner::fused_experts_quantized`` for
quantized ones), so the layer compiles with ``fullgraph=True``; eager calls go straight to
the held runner. With grad mode on and a parameter, the input or the routing weights
requiring grad, the layer trains: eagerly on the torch backend's differentiable path
(backend "auto" or "torch", as ``fused_moe``), else through the custom op (the backend's
forward, a backward recomputed on the torch backend, as ``torch.compile`` runs it);
quantized experts are frozen and pass gradients on (to the input, the routing weights and
anything before them).
``quantize_(scheme)`` swaps the weights for quantized ones (done once); the backend then
runs that scheme. By default it frees the float ``w13`` /
``w2`` (they become None) and holds the quantized tensors as buffers (``w13_qdata``,
``w13_scale``, ``w13_zero_point``, ``w13_global_scale``, ``w13_input_scale`` where the
scheme has them, the same for ``w2``, and ``w13_scheme`` / ``w2_scheme``: the scheme's
fields as JSON bytes), so ``state_dict()`` saves the quantized layer (``torch.save`` or
safetensors) and ``load_state_dict`` restores it into a layer quantized to the same scheme;
loading into a float layer or another scheme raises ``MoeInputError``. ``quantize_(scheme,
keep_float_weights=True)`` keeps the float parameters instead (and the state dict holds only
them); the quantized copy then follows them: after an in-place edit, ``load_state_dict`` or
``.data`` assignment of ``w13`` / ``w2`` the next eager forward quantizes them again (a
host-side check, no device sync; a compiled layer does not check: call ``quantize_`` again
after such edits). Shared experts run as a call of their own beside the routed one, eagerly
and compiled alike (``moerunner.shared``); float ones beside quantized routed experts stay in
floating point (``quantize_`` leaves them so).

Caches of what is derived from the parameters (prepared weights, the shared experts' views,
the quantized copy of ``keep_float_weights``) follow PyTorch's in-place version counter,
without a device sync. Optimizer steps, ``load_state_dict``, ``.data`` assignment and
in-place ops on the parameters count (fused optimizer steps, which PyTorch does not count,
through a post-step hook moerunner registers: ``memo._count_fused_steps``). Writes through
``.data`` (``p.data.mul_(2)``) are not counted: call ``weights_changed()`` after them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .api import check_routing_shapes, run_experts, validate_call
from .backends.base import MoeProblem
from .config import Activation, MoeConfig
from .dispatch.expert_map import ExpertPlacement, append_shared_slots
from .dispatched_layer import DispatchedForward
from .errors import MoeInputError, check_eager_inputs, refuse
from .held_quantized import HoldsQuantized
from .layer_steps import EagerSteps
from .memo import StepCache, forget_memo, tensor_key
from .memo import weights_changed as memo_weights_changed
from .ops import adopt_quantized, call_fused_experts, op_tensor
from .registry import Registry
from .routing import TopK, check_loaded_correction_bias, check_router_width, select_experts
from .runner import (
    forget_prepared,
    form_bytes,
    prepare_forms,
    prepared_for,
    tensor_state,
)
from .shared import SharedExperts, own_slots
from .weights import ExpertWeights, as_parameter, gate_up_first, is_quantized

__all__ = ["MoE"]


class MoE(HoldsQuantized, DispatchedForward, EagerSteps):
    """One MoE layer: route -> dispatch -> experts -> combine.

    Quantized weights held as buffers after ``quantize_``: ``moerunner.held_quantized``; the
    dispatcher and the expert-parallel forward: ``moerunner.dispatched_layer``.

    Args:
        config: shapes, activation, biases and routing (``MoeConfig``); ``num_experts`` is the
            number of routed experts of the whole layer.
        backend: backend name or ``"auto"``.
        dtype, device: of the parameters (random-initialised; load real ones with
            ``load_state_dict`` or assign ``w13`` / ``w2``).
        dispatcher: a dispatcher registered in ``registry`` (``"standard"``, ``"all_to_all"``,
            ``"masked"``).
        placement: expert ownership over the ranks of ``group`` (``ExpertPlacement``); the
            layer then holds ``placement.num_local(rank)`` experts (its routed ones, then
            the placement's ``num_shared`` shared ones, which every token reaches with
            weight 1: the layer appends their slots to its own routing). ``None``: every
            expert.
        group: the ``torch.distributed`` process group (``None`` with a placement: the
            default group; ``None`` without one: a single process).
        capacity, on_overflow: the ``masked`` dispatcher's capacity and overflow policy.
        combine_dtype: the ``all_to_all`` dispatcher's return precision: ``None`` (the hidden
            dtype: each rank's partial sum of a token is rounded once more) or
            ``torch.float32`` (twice the return traffic, one rounding).
        registry: where backends and dispatchers are looked up (default: the global one).
        backend_forms: with ``backend="auto"`` and a measured backend table naming several
            backends for this layer's shape, at most this many serve it, each holding its
            own prepared weights (None: every backend the table names; 1: the one winning
            the most token-count buckets serves every T). See ``MoeRunner``.
    """

    _float32_buffers = ("correction_bias",)  # (created float32 whatever ``dtype``)

    def __init__(
        self,
        config: MoeConfig,
        *,
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        dispatcher: str = "standard",
        placement: ExpertPlacement | None = None,
        group: Any = None,
        capacity: int | None = None,
        on_overflow: str = "raise",
        combine_dtype: torch.dtype | None = None,
        registry: Registry | None = None,
        backend_forms: int | None = None,
    ):
        super().__init__()
        if not isinstance(config, MoeConfig):
            raise TypeError(f"config must be a MoeConfig, got {type(config).__name__}")
        self.config = config
        self.backend = backend
        error = self._checked_locally(
            placement,
            group,
            lambda: self._check_arguments(dtype, on_overflow, backend, registry, backend_forms),
        )
        num_local = self._setup_dispatch(
            dispatcher,
            placement,
            group,
            capacity,
            on_overflow,
            config.num_experts,
            config,
            combine_dtype=combine_dtype,
            error=error,
        )
        kw = {"dtype": dtype, "device": device}
        e, h, i = num_local, config.hidden_size, config.intermediate_size
        self.w13 = nn.Parameter(torch.randn(e, config.w13_rows, h, **kw) * h**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, h, i, **kw) * i**-0.5)
        self.w13_bias = nn.Parameter(torch.zeros(e, config.w13_rows, **kw)) if config.bias else None
        self.w2_bias = nn.Parameter(torch.zeros(e, h, **kw)) if config.bias else None
        self._init_shared(config, kw)
        if config.shared_experts is not None:
            self._check_shared_single_process()
        self.correction_bias = (
            nn.Buffer(torch.zeros(config.num_experts, dtype=torch.float32, device=device))
            if config.routing.correction_bias
            else None
        )
        self.routes = True
        if self.correction_bias is not None:  # checked where it is set, not per forward
            self.register_load_state_dict_pre_hook(check_loaded_correction_bias)
        self.register_load_state_dict_post_hook(MoE._forget_after_load)
        self.quantized: ExpertWeights | None = None
        # (quantize_'s arguments, state of w13 / w2 when quantized) of keep_float_weights
        self._quantized_from: tuple | None = None
        self._held_bias_keys: tuple | None = None  # the biases quantize_ gave ``quantized``
        self._steps = StepCache()  # eager calls' joined launch plans (``_step``)

    # -- construction ----------------------------------------------------------------------

    def _init_shared(self, config: MoeConfig, kw: dict) -> None:
        """Shared-expert parameters ``shared_w13 [S, 2I_s, H]``, ``shared_w2 [S, H, I_s]``
        and ``shared_gate [S, H]`` (with a gate), or None."""
        shared = config.shared_experts
        self.shared_w13 = self.shared_w2 = self.shared_gate = None
        self._shared_key: tuple | None = None
        self._shared_view: SharedExperts | None = None
        self._given_shared: SharedExperts | None = None
        if shared is None:
            return
        s, h = shared.num_experts, config.hidden_size
        i_s = shared.intermediate_size or config.intermediate_size
        rows = 2 * i_s if config.activation.gated else i_s
        self.shared_w13 = nn.Parameter(torch.randn(s, rows, h, **kw) * h**-0.5)
        self.shared_w2 = nn.Parameter(torch.randn(s, h, i_s, **kw) * i_s**-0.5)
        if shared.gate:
            self.shared_gate = nn.Parameter(torch.randn(s, h, **kw) * h**-0.5)

    @classmethod
    def from_weights(
        cls,
        weights: ExpertWeights,
        *,
        activation: Activation | str = "silu",
        num_experts: int | None = None,
        backend: str = "auto",
        dispatcher: str = "standard",
        placement: ExpertPlacement | None = None,
        group: Any = None,
        capacity: int | None = None,
        on_overflow: str = "raise",
        combine_dtype: torch.dtype | None = None,
        registry: Registry | None = None,
        shared_experts: SharedExperts | None = None,
        backend_forms: int | None = None,
    ) -> MoE:
        """A layer over given (this rank's) expert weights, plain or quantized, that takes
        pre-routed calls (``forward(hidden_states, topk=...)``).

        ``num_experts``: routed experts of the whole layer (default: the placement's, or the
        weights' count). ``shared_experts``: shared experts run with the routed ones (one
        process, standard dispatcher; plain ones become the parameters ``shared_w13`` /
        ``shared_w2`` / ``shared_gate``, quantized ones run as given). ``backend_forms``,
        ``combine_dtype``: as in ``MoE``.

        The weights become the layer's state (``state_dict``, ``.to`` / ``.half()``), as in a
        layer built from a config: plain ones the parameters ``w13`` / ``w2`` (sharing the
        given tensors' storage), quantized ones ``quantize_``'s buffers.
        """
        layer = cls.__new__(cls)
        layer._init_from_weights(
            weights,
            activation=activation,
            num_experts=num_experts,
            backend=backend,
            dispatcher=dispatcher,
            placement=placement,
            group=group,
            capacity=capacity,
            on_overflow=on_overflow,
            combine_dtype=combine_dtype,
            registry=registry,
            backend_forms=backend_forms,
        )
        if shared_experts is not None:
            if not isinstance(shared_experts, SharedExperts):
                raise TypeError(
                    f"shared_experts must be a SharedExperts, got {type(shared_experts).__name__}"
                )
            shared_experts.validate(weights, layer.config.activation)
            layer._check_shared_single_process()
            if is_quantized(shared_experts.w13) or is_quantized(shared_experts.w2):
                layer._given_shared = shared_experts  # run as given (not module state)
            else:  # the layer's parameters, as a layer built from a config holds them
                for name in ("w13", "w2", "gate"):
                    setattr(layer, f"shared_{name}", as_parameter(getattr(shared_experts, name)))
        return layer

    def _init_from_weights(
        self,
        weights: ExpertWeights,
        *,
        activation: Activation | str,
        num_experts: int | None,
        backend: str,
        dispatcher: str,
        placement: ExpertPlacement | None,
        group: Any,
        capacity: int | None,
        on_overflow: str,
        registry: Registry | None,
        backend_forms: int | None = None,
        combine_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.backend = backend
        self.config = None

        def checks() -> None:
            if not isinstance(weights, ExpertWeights):
                raise TypeError(f"weights must be ExpertWeights, got {type(weights).__name__}")
            act = Activation.of(activation)
            weights.validate(act)
            total = num_experts
            if total is None:
                total = placement.num_experts if placement is not None else weights.num_experts
            self.config = MoeConfig(
                num_experts=total,
                hidden_size=weights.hidden_size,
                intermediate_size=weights.intermediate_size(act),
                top_k=1,  # unused: a layer built from weights does not route
                activation=act,
                bias=weights.w13_bias is not None or weights.w2_bias is not None,
                gate_up_interleaved=weights.gate_up_interleaved,
            )
            self._check_arguments(None, on_overflow, backend, registry, backend_forms)

        error = self._checked_locally(placement, group, checks)
        config = self.config
        self._setup_dispatch(
            dispatcher,
            placement,
            group,
            capacity,
            on_overflow,
            -1 if config is None else config.num_experts,
            config,
            num_local=None if error is not None else weights.num_experts,
            combine_dtype=combine_dtype,
            error=error,
        )
        self.correction_bias = None
        self.routes = False
        self._quantized_from = None  # given weights: nothing to re-quantize from
        self._steps = StepCache()
        self._init_shared(config, {})
        self._hold_given(weights)

    def _hold_given(self, weights: ExpertWeights) -> None:
        """The given experts as this module's own state, as ``MoE(config)`` holds its own
        (``state_dict``, ``load_state_dict``, ``.to`` / ``.half()``): plain weights as the
        parameters ``w13`` / ``w2`` (the given tensors' storage, not copies; gradients as the
        tensors require them), quantized ones as buffers (``quantize_``'s form), biases as
        parameters. Up-then-gate rows are swapped to gate-then-up once here, so the state
        has the row order of every other layer's."""
        weights = gate_up_first(weights)
        quantized = is_quantized(weights.w13)
        # (quantized experts are frozen, their biases too: grad-mode calls run the fast path)
        self.w13_bias, self.w2_bias = (
            as_parameter(b, not quantized) for b in (weights.w13_bias, weights.w2_bias)
        )
        if not quantized:
            self.w13, self.w2 = as_parameter(weights.w13), as_parameter(weights.w2)
            self.quantized = None
            self._held_bias_keys = None
            return
        self.w13 = self.w2 = None
        self.quantized = ExpertWeights(
            weights.w13, weights.w2, *self._detached_biases(), weights.gate_up_interleaved
        )
        self._held_bias_keys = (tensor_key(self.w13_bias), tensor_key(self.w2_bias))
        adopt_quantized(weights.w13)
        adopt_quantized(weights.w2)
        self._hold_quantized()

    def quantize_(
        self,
        scheme,
        *,
        keep_float_weights: bool = False,
        w13_input_scale: torch.Tensor | float | None = None,
        w2_input_scale: torch.Tensor | float | None = None,
    ) -> MoE:
        """Replace the expert weights by quantized ones in ``scheme`` (name or value).

        ``keep_float_weights=False`` (default) frees the float ``w13`` / ``w2`` and holds the
        quantized tensors as buffers (saved by ``state_dict``); ``True`` keeps the float
        parameters, which the quantized copy then follows (see the module docstring).

        ``w13_input_scale`` / ``w2_input_scale``: static activation scales (a scalar or fp32
        ``[E]``) of the GEMMs' inputs, the hidden states and the activations: required by the
        static schemes (``fp8_tensor_static``, ``int8_static``, ``nvfp4_a4_static``), accepted
        by schemes whose inputs are quantized (``quantize``'s ``input_scale``).

        Quantized experts are frozen: the parameters the quantized call still reads (the
        biases, the shared experts') stop requiring grad, so calls in grad mode run without
        an autograd graph; a call whose input or routing weights require grad passes the
        gradients on (``fused_moe``'s Gradients; compiled or on another backend, through the
        custom op's backward).
        """
        from .quant import get_scheme, quantize

        if not isinstance(keep_float_weights, bool):
            raise TypeError(
                f"keep_float_weights must be a bool, got {type(keep_float_weights).__name__}"
            )
        if self.w13 is None:
            raise MoeInputError(
                "quantize_: this layer holds no float w13 / w2 (freed by an earlier quantize_, "
                "or built from quantized weights); build a float layer, or pass "
                "keep_float_weights=True to quantize_ to quantize again later"
            )
        scales = {"w13_input_scale": w13_input_scale, "w2_input_scale": w2_input_scale}
        resolved = get_scheme(scheme)
        missing = [name for name, value in scales.items() if value is None]
        if resolved.activation_scales == "static" and missing:
            raise MoeInputError(
                f"quantize_: scheme {resolved.name!r} quantizes the GEMMs' inputs with static "
                f"scales: pass {' and '.join(missing)} (a scalar or fp32 [E])"
            )
        source_state = self._float_state()  # (before reading: an edit meanwhile is seen later)
        with torch.no_grad():
            self.quantized = ExpertWeights(
                quantize(self.w13.detach(), scheme, input_scale=w13_input_scale),
                quantize(self.w2.detach(), scheme, input_scale=w2_input_scale),
                *self._detached_biases(),
                self.config.gate_up_interleaved,
            )
        self._held_bias_keys = (tensor_key(self.w13_bias), tensor_key(self.w2_bias))
        self._frozen(self.w13_bias, self.w2_bias, self.shared_w13, self.shared_w2, self.shared_gate)
        adopt_quantized(self.quantized.w13)
        adopt_quantized(self.quantized.w2)
        if keep_float_weights:
            self._quantized_from = ({"scheme": scheme, **scales}, source_state)
            self._frozen(*self._kept_floats().values())  # calls give the copy's source no grad
        else:
            self._quantized_from = None
            self.w13 = self.w2 = None
            self._hold_quantized()
        # (what earlier calls kept of the float weights, views and steps, would keep them alive)
        self._weights_views.clear()
        self._steps.clear()
        return self

    # -- quantized weights as buffers (state_dict) -----------------------------------------

    def _detached_biases(self) -> tuple:
        """The bias parameters as views without grad (quantized experts are frozen)."""
        return tuple(None if b is None else b.detach() for b in (self.w13_bias, self.w2_bias))

    _held_owner = "layer"
    _held_float_names = ("w13", "w2")
    _held_quantize_call = "layer.quantize_({scheme})"

    def _held_biases(self) -> tuple:
        return self._detached_biases()

    def _held_interleaved(self) -> bool:
        return self.config.gate_up_interleaved

    def _float_in_state(self, state_dict, prefix: str, w: str) -> bool:
        return f"{prefix}{w}" in state_dict

    def _float_state(self) -> tuple:
        return tensor_state(self.w13) + tensor_state(self.w2)

    def weights_changed(self) -> None:
        """Count an edit PyTorch's version counter does not count (writes through ``.data``, to
        the parameters or to held quantized buffers): what derives from them (prepared
        weights, shared experts' views, ``keep_float_weights``' copy, eager steps) is made
        again by the next call."""
        memo_weights_changed(*(p for p in self._derived_params() if p is not None))
        self._forget_derived()
        if self._quantized_from is not None:
            self.quantize_(**self._quantized_from[0], keep_float_weights=True)
        elif self.quantized is not None:  # what the runner prepared from the held tensors
            memo_weights_changed(self.quantized.w13, self.quantized.w2)

    def _forget_derived(self) -> None:
        """``weights_changed`` but the quantized copy: what derives from the parameters, which
        kept their old memory alive until the next call after a cast, move or assigning load."""
        for p in self._derived_params():
            if p is not None:
                forget_memo(p)
                forget_prepared(p)
        self._weights_views.clear()
        self._shared_key = self._shared_view = None
        self._steps.clear()

    def _apply(self, fn, recurse=True):
        before = [tensor_key(p) for p in self._derived_params()]
        super()._apply(fn, recurse)
        if [tensor_key(p) for p in self._derived_params()] != before:  # (else: no-op move)
            self._forget_derived()
        return self

    def _derived_params(self) -> tuple:
        """The parameters ``_forget_derived`` forgets what was derived from."""
        params = (self.w13, self.w2, self.w13_bias, self.w2_bias)
        return (*params, self.shared_w13, self.shared_w2, self.shared_gate)

    @staticmethod
    def _forget_after_load(module: MoE, incompatible_keys) -> None:
        module._forget_derived()

    # -- forward ---------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk: TopK | None = None,
        timer=None,
    ) -> torch.Tensor:
        """``hidden_states [..., H]`` with ``router_logits [..., E]`` (or ``topk``: routing
        with global expert ids, ``[T, k]``) -> ``[..., H]``.

        ``timer``: optional ``timer(stage)`` giving a context manager entered around
        ``dispatch``, ``experts`` and ``combine`` (``distributed_moe.StageTimer``); with
        the masked dispatcher, ``self.last_overflow`` is the step's overflow flag.
        """
        check_eager_inputs("MoE", hidden_states=hidden_states, w13=self.w13, w2=self.w2)
        step_key = None
        if topk is None and getattr(self, "_steps", None) is not None:
            step_key = self._step_key(hidden_states, router_logits)
            if step_key is not None:
                out = self._replay_step(step_key, hidden_states, router_logits)
                if out is not None:
                    return out
        if not self._single_process():
            return self._forward_dispatched(hidden_states, router_logits, topk, timer)
        x, topk, routed = self._inputs(hidden_states, router_logits, topk)
        out = self._run_local(x, topk, check_ids=not routed)
        if step_key is not None:
            self._make_step(step_key, x, router_logits)
        return out.reshape(hidden_states.shape)

    def _inputs(self, hidden_states, router_logits, topk) -> tuple[torch.Tensor, TopK, bool]:
        """Checked ``[T, H]`` hidden states, routing, and whether this layer routed."""
        cfg = self.config
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}"
            )
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != cfg.hidden_size:
            raise MoeInputError(
                f"hidden_states last dim must be H={cfg.hidden_size}, "
                f"got shape {list(hidden_states.shape)}"
            )
        x = hidden_states.reshape(-1, cfg.hidden_size)
        if (router_logits is None) == (topk is None):
            raise MoeInputError("pass exactly one of router_logits and topk=")
        routed = topk is None  # ids from select_experts are in range: no id check needed
        shared = 0 if self.placement is None else self.placement.num_shared
        if routed:
            topk = self._route(hidden_states, router_logits, x.shape[0])
            if shared:  # the placement's shared experts: one slot each, weight 1, every token
                topk = append_shared_slots(topk, self.placement)
        elif not isinstance(topk, TopK):
            raise TypeError(f"topk must be a TopK, got {type(topk).__name__}")
        else:  # given routing: its shapes here, before any exchange (an expert-parallel
            # layer's dispatch would otherwise take rows it cannot match to tokens)
            check_routing_shapes(x, topk.weights, topk.ids)
            if shared and self.routes and topk.ids.shape[1] == cfg.top_k:
                raise MoeInputError(
                    f"topk has the layer's top_k={cfg.top_k} slots but its placement has "
                    f"{shared} shared expert(s), which it would never run: pass "
                    "append_shared_slots(topk, placement) (or router_logits, which the layer "
                    "routes and gives the shared slots itself)"
                )
        if self.quantized is not None:
            self._check_held_quantized()
        return x, topk, routed

    def _check_held_quantized(self) -> None:
        """Keep the quantized experts in step with the parameters they came from: quantize
        again after w13 / w2 edits (``keep_float_weights``), carry replaced biases; float
        weights assigned to a layer holding only quantized ones raise (they would be
        ignored). Host-side checks; traced calls skip the edit checks (call ``quantize_``
        again after edits there)."""
        if self._quantized_from is None and (self.w13 is not None or self.w2 is not None):
            raise MoeInputError(
                "float w13 / w2 were assigned to a layer that holds quantized experts "
                f"({self.quantized.scheme}), which would run without them: build a float "
                "layer with these weights and quantize_ it, or load a quantized state dict"
            )
        if torch.compiler.is_compiling():
            return
        self._held_current()  # buffers assigned or substituted (functional_call)
        if self._quantized_from is not None and self._quantized_from[1] != self._float_state():
            self.quantize_(**self._quantized_from[0], keep_float_weights=True)  # w13 / w2 edited
        biases = (tensor_key(self.w13_bias), tensor_key(self.w2_bias))
        if self._held_bias_keys is not None and biases != self._held_bias_keys:
            b13, b2 = self._detached_biases()  # a bias replaced or its .data assigned
            self.quantized = dataclasses.replace(self.quantized, w13_bias=b13, w2_bias=b2)
            self._held_bias_keys = biases

    def _route(self, hidden_states, router_logits, tokens: int) -> TopK:
        cfg = self.config
        if not self.routes:
            raise MoeInputError(
                "this layer was built from weights without routing settings: pass topk="
            )
        if not isinstance(router_logits, torch.Tensor):
            raise TypeError(
                f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}"
            )
        if router_logits.shape[:-1] != hidden_states.shape[:-1]:
            raise MoeInputError(
                f"router_logits leading shape {list(router_logits.shape[:-1])} differs from "
                f"hidden_states' {list(hidden_states.shape[:-1])}"
            )
        check_router_width(router_logits, cfg.num_experts, "MoE")
        kwargs = self._routing_kwargs()
        return select_experts(
            router_logits.reshape(tokens, cfg.num_experts), kwargs.pop("top_k"), **kwargs
        )

    def _routing_kwargs(self) -> dict:
        """``select_experts``' arguments besides the logits, from the config and the
        correction bias."""
        cfg = self.config
        r = cfg.routing
        return dict(
            top_k=cfg.top_k,
            scoring_func=r.scoring_func,
            renormalize=r.renormalize,
            correction_bias=self.correction_bias,
            num_expert_group=r.num_expert_group,
            topk_group=r.topk_group,
            routed_scaling_factor=r.routed_scaling_factor,
            group_score=r.group_score,
        )

    def _check_shared_single_process(self) -> None:
        if not self._single_process():
            raise MoeInputError(
                "shared experts run in the one-process layer with the standard dispatcher; "
                f"this layer has dispatcher {self.dispatcher_kind!r} and a placement or group"
            )

    def shared_experts(self) -> SharedExperts | None:
        """The shared experts the layer runs (detached views of its parameters, rebuilt only
        when one is replaced or edited, so their prepared weights are reused), or None."""
        if self._given_shared is not None or self.shared_w13 is None:
            return self._given_shared
        params = (self.shared_w13, self.shared_w2, self.shared_gate)
        if (key := tuple(tensor_key(p) for p in params)) != self._shared_key:
            w13, w2, gate = (None if p is None else p.detach() for p in params)
            self._shared_view = SharedExperts(w13, w2, gate)
            self._shared_key = key
        return self._shared_view

    def _shared_params(self) -> SharedExperts | None:
        """The shared experts as the parameters themselves (differentiable and traceable;
        ``shared_experts`` gives the memoised views of eager inference), or None."""
        if self._given_shared is not None or self.shared_w13 is None:
            return self._given_shared
        return SharedExperts(self.shared_w13, self.shared_w2, self.shared_gate)

    def _single_process(self) -> bool:
        return self.group is None and self.placement is None and self._standard_dispatch

    def expert_weights(self) -> ExpertWeights:
        """The weights the experts run on: the quantized ones, or the parameters (where grad
        mode is off: as the compiled op gets them, so eager and compiled calls share the
        runner's prepared weights memoised on them; detached views where it is on). Rebuilt
        only when a parameter is replaced, moved or edited in place, so the prepared weights
        are reused across calls."""
        if self.quantized is not None:
            return self.quantized
        params = (self.w13, self.w2, self.w13_bias, self.w2_bias)
        key = tuple(tensor_key(p) for p in params)
        grad = torch.is_grad_enabled()
        cached = self._weights_views.get(grad)
        if cached is None or cached[0] != key:
            for stale in [g for g, (made_of, _) in self._weights_views.items() if made_of != key]:
                del self._weights_views[stale]  # views of replaced parameters (either mode's)
            w13, w2, b13, b2 = (op_tensor(p) for p in params)
            view = ExpertWeights(w13, w2, b13, b2, self.config.gate_up_interleaved)
            cached = self._weights_views[grad] = (key, view)
        return cached[1]

    def _trains(self, x: torch.Tensor, router_logits: torch.Tensor | None) -> bool:
        """Grad mode is on and the input, the router's output or a parameter the experts read
        requires grad (host metadata only)."""
        if not torch.is_grad_enabled():
            return False
        given, held = self._given_shared, self.quantized
        tensors = (x, router_logits, self.w13_bias, self.w2_bias)
        if held is None:
            tensors += (self.w13, self.w2)
        else:  # what the call reads: weights given to from_weights (quantized ones are not
            # tensors); kept float weights of keep_float_weights are not read
            tensors += (held.w13, held.w2, held.w13_bias, held.w2_bias)
        tensors += (self.shared_w13, self.shared_w2, self.shared_gate)
        tensors += tuple(self.config.activation.tensors().values())  # (a trained swiglu alpha)
        if given is not None:
            tensors += (given.w13, given.w2, given.gate)
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)

    def _run_local(self, x: torch.Tensor, topk: TopK, check_ids: bool) -> torch.Tensor:
        """One process: the fused path; the custom op while compiling or where the call
        needs gradients (``_trains``)."""
        act = self.config.activation
        compiling = torch.compiler.is_compiling()
        train = self._trains(x, topk.weights)
        held = self.quantized
        if train and not compiling and act.extended and self.backend not in ("auto", "torch"):
            raise MoeInputError(
                f"training with swiglu_oai of per-expert parameters or swiglu_beta != 1 runs on "
                f"the torch backend only (the custom op that gives backend {self.backend!r} a "
                "backward takes scalar alpha / limit and beta 1): build the layer with "
                "backend='torch' or 'auto', or run it under torch.no_grad()"
            )
        if train and not compiling and (act.extended or self.backend in ("auto", "torch")):
            # Eager training on the torch backend's differentiable path (as fused_moe): no
            # recomputation in the backward; it also serves per-expert swiglu parameters,
            # which the custom op (scalar alpha / limit) does not carry.
            # (the bias parameters themselves: held quantized weights keep detached ones)
            w13, w2 = (self.w13, self.w2) if held is None else (held.w13, held.w2)
            weights = ExpertWeights(
                w13, w2, self.w13_bias, self.w2_bias, self.config.gate_up_interleaved
            )
            return run_experts(
                self.runner, weights, x, topk.weights, topk.ids, act, check_ids,
                shared=self._shared_params(),
            )  # fmt: skip
        if compiling or train:
            # (raised outside the traced graph: dynamo would wrap the error)
            if self._op_registry is not None:
                refuse(self._op_registry)
            if act.extended:  # the custom op's schema carries scalar alpha and limit only
                refuse(
                    "torch.compile of the MoE layer takes swiglu_oai with scalar alpha / limit "
                    "and beta 1 only; per-expert parameters or another beta run eagerly"
                )
            # Traced, or training eagerly on another backend: its forward, and a backward
            # recomputed on the torch backend. The tensors themselves: where the call needs
            # no gradients (``_trains``), none of them requires grad in grad mode.
            w = self if held is None else held  # plain, or as held
            # (held weights keep detached biases: a training call takes the parameters)
            b13, b2 = (self.w13_bias, self.w2_bias) if train else (w.w13_bias, w.w2_bias)
            w13, w2 = (w.w13, w.w2) if held is None else self._held_call_weights()
            routed = call_fused_experts(
                x, w13, w2, topk.weights, topk.ids, b13, b2, act.name, act.alpha, act.limit,
                self.config.gate_up_interleaved, self.backend, check_ids,
            )  # fmt: skip
            shared = self._shared_params()
            if shared is None or shared.num_shared == 0:
                return routed
            # the shared experts: a call of their own, as in eager calls (``moerunner.shared``)
            own = own_slots(x, shared)
            out = call_fused_experts(
                x, shared.w13, shared.w2, own.weights, own.ids, None, None, act.name,
                act.alpha, act.limit, self.config.gate_up_interleaved, self.backend, False,
            )  # fmt: skip
            return (routed.float() + out.float()).to(x.dtype)
        shared = self.shared_experts()
        return run_experts(
            self.runner,
            self.expert_weights(),
            x.detach(),
            topk.weights,
            topk.ids,
            act,
            check_ids,
            shared=shared,
        )

    def _prepared(self, x: torch.Tensor, weights: ExpertWeights, dispatch_format: str, top_k: int):
        """The prepared weights for a call of ``x [T, H]`` with ``top_k`` slots: those of the
        backend chosen for T's token-count bucket (``MoeRunner.select``)."""
        spec = weights.spec(self.config.activation)
        problem = MoeProblem.of(x, weights, spec, dispatch_format)
        prepared = prepared_for(self.runner, weights, problem, spec, x.shape[0], top_k)
        self._dtype = x.dtype  # the hidden dtype of the last call that could run
        return prepared

    def prepare(self, dtype: torch.dtype, top_k: int | None = None) -> None:
        """Choose the backend and prepare the weights for hidden states of ``dtype`` now
        (else the first call does): an unservable request raises here, on every rank.
        Where a measured table names several backends for this shape, every form they
        need is prepared (``runner.prepare_forms``). ``top_k``: of the calls (default: the
        config's; give it for a layer built ``from_weights``). The forms prepared are those
        of inference calls (grad mode off)."""
        weights, spec, problem, k = self._calls_of(dtype, top_k)
        prepare_forms(self.runner, weights, problem, spec, k)
        self._dtype = dtype

    def _calls_of(self, dtype: torch.dtype, top_k: int | None):
        """The weights, spec and problem of calls with hidden states of ``dtype`` and
        ``top_k`` slots (default: the config's), and that top_k; checked as such a call
        would be on the standard dispatcher."""
        with torch.no_grad():
            weights = self.expert_weights()
        probe = torch.empty((0, self.config.hidden_size), dtype=dtype, device=weights.device)
        k = top_k or self.config.top_k
        if self._standard_dispatch:
            validate_call(
                probe,
                weights,
                probe.new_empty((0, k), dtype=torch.float32),
                probe.new_empty((0, k), dtype=torch.int32),
                self.config.activation,
            )
        spec = weights.spec(self.config.activation)
        problem = MoeProblem.of(probe, weights, spec, self.dispatcher.dispatch_format)
        return weights, spec, problem, k

    def backend_plan(self, dtype: torch.dtype, top_k: int | None = None) -> dict:
        """Which backend serves each token-count bucket for hidden states of ``dtype`` and
        why, and the bytes each prepared form holds beyond the layer's weights (it prepares
        them, as ``prepare`` does): ``{"buckets": [(range, backend, reason)], "forms":
        {backend: bytes}}``."""
        weights, spec, problem, top_k = self._calls_of(dtype, top_k)
        forms = prepare_forms(self.runner, weights, problem, spec, top_k)
        plan = self.runner.bucket_plan(problem, top_k)
        if plan is None:
            selection = self.runner.select(problem)
            buckets = [("every T", selection.backend.name, f"no table: {selection.reason}")]
        else:
            buckets = [
                (s.reason.split(": ", 1)[0], s.backend.name, s.reason.split(": ", 1)[1])
                for s in plan.selections
            ]
        return {
            "buckets": buckets,
            "forms": {name: form_bytes(p, weights) for name, p in forms.items()},
        }

    def extra_repr(self) -> str:
        parts = [f"config={self.config!r}", f"backend={self.backend!r}"]
        if not self._single_process():
            parts.append(f"dispatcher={self.dispatcher_kind!r}, rank={self.rank}")
        return ", ".join(parts)
