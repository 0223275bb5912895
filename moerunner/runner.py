"""Stage 3, experts: the runner that walks the registry's kernel paths.

The registry (``moerunner.registry``) holds the backend objects and the permutes; for a
dispatch output of some format and the chosen backend:

- the backend's *fused op* for the format handles it whole in one call (it may decline a call
  by returning None, e.g. off the device it is built for);
- otherwise the format's *pre-permute* brings tokens into the grouped layout, the backend's
  *core* computes the experts, and the format's *post-permute* brings them back.

``MoeRunner`` holds one backend choice and runs a ``DispatchOutput`` through the fused op or
the permute path (``force_permute=True`` takes the permute path even where a fused op exists,
so the two can be tested against each other). Backend choice travels as arguments; there is no
process-global "current backend".
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import OrderedDict
from typing import Any

import torch

from . import backends as _backends  # noqa: F401  (importing registers every backend)
from .backends.base import Backend, MoeProblem
from .backends.prepare import pad_to_alignment
from .config import Activation, ExpertSpec
from .dispatch.formats import STANDARD
from .errors import BackendUnavailableError, MoeInputError
from .hooks import MoeHooks, RowHooks, check_hooks
from .memory import kept
from .profiling import trace_range
from .registry import DEFAULT_PREFERENCE, DEFAULT_REGISTRY, Registry, Selection
from .weights import ExpertWeights, PreparedWeights, gate_up_first

__all__ = [
    "DEFAULT_PREFERENCE",
    "DEFAULT_REGISTRY",
    "MoeRunner",
    "Registry",
    "Selection",
    "default_registry",
    "prepare_for_backend",
    "prepared_for",
]


def empty_output(dispatch_output: Any) -> torch.Tensor:
    """The correctly shaped empty result of a format with no rows (T = 0): no kernel runs."""
    hidden = dispatch_output.hidden_states
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


class MoeRunner:
    """Runs dispatched tokens through one backend's experts.

    Args:
        backend: a registered backend name, or ``"auto"`` (chosen per problem at ``prepare``).
        registry: where backends and paths are looked up (default: the one filled at import).
        force_permute: take pre-permute -> core -> post-permute even where a fused op exists.
        preference: per device type, backend names in order of preference for ``"auto"``.
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        registry: Registry | None = None,
        force_permute: bool = False,
        preference: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        self.requested = backend
        self.registry = registry if registry is not None else default_registry()
        self.force_permute = force_permute
        self.preference = preference
        self.selection: Selection | None = None

    @property
    def backend(self) -> str | None:
        """Name of the backend chosen by the last ``prepare`` (None before)."""
        return None if self.selection is None else self.selection.backend.name

    def select(self, problem: MoeProblem) -> Selection:
        """Choose the backend for ``problem`` and remember the choice and its reason."""
        self.selection = self.registry.select(problem, self.requested, self.preference)
        return self.selection

    def prepare(
        self, weights: ExpertWeights, problem: MoeProblem, spec: ExpertSpec
    ) -> PreparedWeights:
        """Select a backend for ``problem`` and convert ``weights`` for it (do this once)."""
        return prepare_for_backend(self.select(problem).backend, weights, spec)

    def run(
        self, dispatch_output: Any, prepared: PreparedWeights, hooks: MoeHooks | None = None
    ) -> torch.Tensor:
        """Compute the experts for ``dispatch_output`` with ``prepared`` weights.

        ``hooks``: ``MoeHooks`` run inside the expert computation (standard format only; the
        prepared weights' backend must declare ``Capabilities.hooks``)."""
        hooks = check_hooks(hooks)
        if hooks is not None:
            self._check_hooks(dispatch_output, prepared, hooks)
        if dispatch_output.num_tokens == 0:
            return empty_output(dispatch_output)
        hidden_size = dispatch_output.hidden_states.shape[-1]
        if prepared.spec.hidden_size != hidden_size:  # weights padded to the kernel's alignment
            pad = prepared.spec.hidden_size - hidden_size
            padded = torch.nn.functional.pad(dispatch_output.hidden_states, (0, pad))
            padded_output = dataclasses.replace(dispatch_output, hidden_states=padded)
            out = self._run(padded_output, prepared, hooks)
            return out[..., :hidden_size].contiguous()
        return self._run(dispatch_output, prepared, hooks)

    def _check_hooks(
        self, dispatch_output: Any, prepared: PreparedWeights, hooks: MoeHooks
    ) -> None:
        if dispatch_output.format != STANDARD:
            raise MoeInputError(
                f"hooks need the {STANDARD!r} dispatch format (a row's token is known there), "
                f"got {dispatch_output.format!r}"
            )
        if hooks.num_tokens is not None and hooks.num_tokens != dispatch_output.num_tokens:
            raise MoeInputError(
                f"hooks were made for {hooks.num_tokens} tokens (e.g. lora_hooks' adapter_ids), "
                f"the call has {dispatch_output.num_tokens}"
            )
        backend = self.registry.backends.get(prepared.backend)
        if backend is None or not backend.capabilities.hooks:
            raise MoeInputError(
                f"backend {prepared.backend!r} does not run hooks (Capabilities.hooks); "
                "select one that does, e.g. 'torch', or 'auto' for a problem with hooks=True"
            )

    def _run(
        self, dispatch_output: Any, prepared: PreparedWeights, hooks: MoeHooks | None = None
    ) -> torch.Tensor:
        fmt = dispatch_output.format
        name = prepared.backend
        extra = {} if hooks is None else {"hooks": hooks}
        fused = None if self.force_permute else self.registry.fused_op(fmt, name)
        if fused is not None:
            with trace_range(f"moerunner.{name}.fused"):
                out = fused(dispatch_output, prepared, **extra)
            if out is not None:
                return out
        core = self.registry.core(name)
        if core is None or fmt not in self.registry.permutes:
            raise BackendUnavailableError(
                f"backend {name!r} has no fused op for format {fmt!r} and no core to permute into"
            )
        pre, post = self.registry.permutes[fmt]
        with trace_range("moerunner.pre_permute"):
            grouped, ctx = pre(dispatch_output, prepared.spec.num_experts)
        if hooks is not None:
            rows = grouped.hidden_states.shape[0]
            row_hooks = _row_hooks(hooks, ctx, dispatch_output, prepared.spec.num_experts, rows)
            extra = {"hooks": row_hooks}
        with trace_range(f"moerunner.{name}.core"):
            y = core(grouped.hidden_states, grouped.expert_offsets, prepared, **extra)
        with trace_range("moerunner.post_permute"):
            return post(y, ctx, dispatch_output)


def _row_hooks(
    hooks: MoeHooks, ctx: Any, dispatch_output: Any, num_experts: int, num_rows: int
) -> RowHooks:
    """The token and slot of each grouped row of the standard pre-permute, on the device:
    grouped row ``ctx.pair_row[t, s]`` holds pair ``(t, s)`` when its id is a local expert;
    rows past the valid ones get -1."""
    ids = dispatch_output.topk.ids
    tokens, top_k = ids.shape
    dev = ids.device
    valid = (ids >= 0) & (ids < num_experts)
    slot_TK = torch.arange(top_k, device=dev).expand(tokens, top_k)
    # invalid pairs write to a spare row num_rows, dropped after the scatter
    target = torch.where(valid, ctx.pair_row, num_rows).reshape(-1)
    slot = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=dev)
    slot.scatter_(0, target, slot_TK.reshape(-1))
    slot = slot[:num_rows]
    token = torch.where(slot >= 0, ctx.source_row, -1)
    return RowHooks(hooks, token, slot)


def default_registry() -> Registry:
    """The registry filled at import with every backend this installation has."""
    return DEFAULT_REGISTRY


# Prepared weights of the functional API live on the w13 object itself (an attribute), so
# they die with the weights; a reference cycle through them is collected as usual.
_CACHE_ATTR = "_moerunner_prepared"


#: Prepared forms kept per weights (one per backend, options and spec asked for).
_PREPARED_PER_WEIGHT = 4


class DerivedCache(OrderedDict):
    """A memo of data derived from an object's tensors (prepared weights, launch plans). A
    copy of its owner (``copy.deepcopy(model)``, pickling, ``torch.save``) starts with an
    empty one: derived data would be duplicated in memory or stored in a checkpoint (and
    launch plans cannot be copied at all); the copy derives its own on first use."""

    def __deepcopy__(self, memo: dict) -> DerivedCache:
        return type(self)()

    def __reduce__(self):
        return (type(self), ())


class _PreparedCache(DerivedCache):
    """The per-weight memo: prepared forms by (backend, options, spec), all made from the
    weights in ``state`` (their tensors' identities and versions, see ``prepared_for``) and
    from the w2 that ``w2`` weakly refers to (the memo lives on w13 and adds no reference to
    either weight)."""

    state: tuple | None = None

    def __init__(self) -> None:
        super().__init__()
        self.w2 = lambda: None


def prepared_for(
    runner: MoeRunner, weights: ExpertWeights, problem: MoeProblem, spec: ExpertSpec
) -> PreparedWeights:
    """``runner.prepare`` memoised on the weight objects and on the state of every tensor
    they consist of (see ``tensor_state``): an in-place edit, a ``.data`` assignment or a
    replaced ``QuantizedWeight`` field prepares again. Forms for several backends (or
    options) of the same weights are kept side by side (``_PREPARED_PER_WEIGHT``)."""
    backend = runner.select(problem).backend
    state = (
        id(weights.w2),
        id(weights.w13_bias),
        id(weights.w2_bias),
        weights.w13_order,
        tensor_state(weights.w13),
        tensor_state(weights.w2),
        tensor_state(weights.w13_bias),
        tensor_state(weights.w2_bias),
    )
    key = (backend.name, backend.options, spec)
    per_weight = getattr(weights.w13, _CACHE_ATTR, None)
    if per_weight is None:
        per_weight = _PreparedCache()
        try:
            setattr(weights.w13, _CACHE_ATTR, per_weight)
        except (AttributeError, TypeError):  # no attributes allowed: prepare every time
            return prepare_for_backend(backend, weights, spec)
    if per_weight.state != state or per_weight.w2() is not weights.w2:
        # The weights changed (or id(w2) was reused by a new object): every form is stale.
        per_weight.clear()
        per_weight.state = state
        per_weight.w2 = _ref(weights.w2)
    cached = per_weight.get(key)
    if cached is None:
        if len(per_weight) >= _PREPARED_PER_WEIGHT:  # bound the forms kept (oldest first)
            del per_weight[next(iter(per_weight))]
        make = lambda: prepare_for_backend(backend, weights, spec)  # noqa: E731
        cached = per_weight[key] = kept(make, weights.device)
    return cached


def _ref(obj: Any):
    """A weak reference to ``obj`` (the memo must not keep w2 alive), or a strong one where
    the object takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def prepare_for_backend(
    backend: Backend, weights: ExpertWeights, spec: ExpertSpec
) -> PreparedWeights:
    """Bring w13 to gate-then-up (or interleaved) row order, pad to the backend's declared
    alignment, then let it convert the weights (once)."""
    caps = backend.capabilities
    weights = gate_up_first(weights)
    padded, padded_spec, notes = pad_to_alignment(weights, spec, caps.align_h, caps.align_i)
    prepared = backend.prepare_weights(padded, padded_spec)
    prepared.notes[:0] = notes
    return prepared


def tensor_state(weight: Any) -> tuple:
    """Host-side identity of a weight's contents, no device sync: per tensor (a plain tensor,
    or each component of a quantized weight) its storage address, dtype, shape and in-place
    version counter. ``.data`` assignment changes the address; in-place edits the version
    (inference tensors keep none: their in-place edits inside ``inference_mode`` go unseen)."""
    if weight is None:
        return ()
    if isinstance(weight, torch.Tensor):
        tensors = (weight,)
    else:
        parts = weight.tensors() if hasattr(weight, "tensors") else {}
        tensors = tuple(t for t in parts.values() if isinstance(t, torch.Tensor))
    return tuple(
        (t.data_ptr(), t.dtype, tuple(t.shape), -1 if t.is_inference() else t._version)
        for t in tensors
    )


def check_activation(
    activation: str | Activation,
    alpha: float | torch.Tensor | None,
    limit: float | torch.Tensor | None,
    beta: float | torch.Tensor | None = None,
) -> Activation:
    """Build the Activation value from the functional API's arguments."""
    if isinstance(activation, Activation):
        if alpha is not None or limit is not None or beta is not None:
            raise MoeInputError(
                "pass swiglu_alpha / swiglu_beta / swiglu_limit inside the Activation value"
            )
        return activation
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if alpha is None and limit is None and beta is None:
        return _named_activation(activation)
    return Activation(activation, alpha, limit, beta)


@functools.lru_cache(maxsize=64)
def _named_activation(name: str) -> Activation:
    """``Activation(name)``, one value per name (its hash is then worked out once)."""
    return Activation(name)
