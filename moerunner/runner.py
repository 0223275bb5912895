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

import copy
import dataclasses
import functools
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import torch

from . import backends as _backends  # noqa: F401  (importing registers every backend)
from .backend_table import BackendTable, default_table
from .backends.base import Backend, MoeProblem
from .backends.prepare import pad_to_alignment
from .config import Activation, ExpertSpec
from .dispatch.formats import STANDARD
from .errors import BackendUnavailableError, ExtensionContractError, MoeInputError
from .hooks import MoeHooks, RowHooks, check_hooks
from .memo import DerivedCache, StepCache, object_ref, view_key
from .memory import kept
from .profiling import trace_range
from .registry import DEFAULT_PREFERENCE, DEFAULT_REGISTRY, BucketPlan, Registry, Selection
from .weights import ExpertWeights, PreparedWeights, gate_up_first

__all__ = [
    "DEFAULT_PREFERENCE",
    "DEFAULT_REGISTRY",
    "MoeRunner",
    "Registry",
    "Selection",
    "default_registry",
    "form_bytes",
    "prepare_for_backend",
    "prepare_forms",
    "prepared_for",
]


def empty_output(dispatch_output: Any) -> torch.Tensor:
    """The correctly shaped empty result of a format with no rows (T = 0): no kernel runs."""
    hidden = dispatch_output.hidden_states
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


class MoeRunner:
    """Runs dispatched tokens through one backend's experts.

    Args:
        backend: a registered backend name, or ``"auto"`` (chosen per problem, and per
            token-count bucket where a measured table has the problem's shape).
        registry: where backends and paths are looked up (default: the one filled at import).
        force_permute: take pre-permute -> core -> post-permute even where a fused op exists.
        preference: per device type, backend names in order of preference for ``"auto"``.
        table: the measured table ``"auto"`` consults (``backend_table.BackendTable``);
            None: the table of the problem's device in the table folders
            (``backend_table.default_table``: read once per process and device);
            ``BackendTable("none")`` (no entries): the preference order alone.
        backend_forms: at most this many backends (each with its own prepared weights)
            serve one problem under a table (None: as many as the table names); with 1 the
            backend winning the most buckets serves every T (``Registry.bucket_plan``).
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        registry: Registry | None = None,
        force_permute: bool = False,
        preference: dict[str, tuple[str, ...]] | None = None,
        table: BackendTable | None = None,
        backend_forms: int | None = None,
    ) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if table is not None and not isinstance(table, BackendTable):
            raise TypeError(f"table must be a BackendTable or None, got {type(table).__name__}")
        if backend_forms is not None and (
            not isinstance(backend_forms, int)
            or isinstance(backend_forms, bool)
            or backend_forms < 1
        ):
            raise MoeInputError(f"backend_forms must be None or an int >= 1, got {backend_forms!r}")
        self.requested = backend
        self.registry = registry if registry is not None else default_registry()
        self.registry.check_name(backend)
        self.force_permute = force_permute
        self.preference = preference
        self.table = table
        self.backend_forms = backend_forms
        self.selection: Selection | None = None

    # A registry is the process's directory of backends, shared like a module: a copied
    # runner (``copy.deepcopy`` of a layer) looks backends up in the same one, and a pickled
    # runner of the default registry is restored onto the loading process's default one,
    # not onto a frozen copy of the saving process's (which may hold backends that cannot
    # be pickled, such as a ``variant``'s read-only fused ops).
    def __deepcopy__(self, memo: dict) -> MoeRunner:
        other = copy.copy(self)
        memo[id(self)] = other
        other.preference = copy.deepcopy(self.preference, memo)
        return other

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state["registry"] is DEFAULT_REGISTRY:
            state["registry"] = None
        state["selection"] = None  # a memo of the registry's backends: chosen again
        return state

    def __setstate__(self, state: dict) -> None:
        if state.get("registry") is None:
            state["registry"] = default_registry()
        self.__dict__.update(state)

    @property
    def backend(self) -> str | None:
        """Name of the backend chosen by the last ``select`` / ``prepare`` (None before)."""
        return None if self.selection is None else self.selection.backend.name

    def table_for(self, device_type: str) -> BackendTable:
        """The measured table ``"auto"`` consults on ``device_type`` (``table`` above)."""
        return self.table if self.table is not None else default_table(device_type)

    def bucket_plan(self, problem: MoeProblem, top_k: int) -> BucketPlan | None:
        """The measured per-bucket choice for ``problem`` with ``top_k`` slots, or None
        (a named backend, or no table entry: one choice serves every T)."""
        if self.requested != "auto":
            return None
        return self.registry.bucket_plan(
            problem,
            top_k,
            self.table_for(problem.device_type),
            self.preference,
            self.backend_forms,
        )

    def select(
        self, problem: MoeProblem, tokens: int | None = None, top_k: int | None = None
    ) -> Selection:
        """Choose the backend for ``problem`` (for a call of ``tokens`` tokens with ``top_k``
        slots each: its bucket's measured choice, see ``bucket_plan``) and remember it.
        Memoised: a call costs dictionary lookups and one bisect, no device work."""
        plan = None
        if tokens is not None and top_k is not None and self.requested == "auto":
            table = self.table_for(problem.device_type)
            if table.entries:  # (most tables are empty: no plan to look up)
                plan = self.registry.bucket_plan(
                    problem, top_k, table, self.preference, self.backend_forms
                )
        if plan is not None:
            self.selection = plan.choose(tokens)
        else:
            self.selection = self.registry.select(problem, self.requested, self.preference)
        return self.selection

    def prepare(
        self,
        weights: ExpertWeights,
        problem: MoeProblem,
        spec: ExpertSpec,
        tokens: int | None = None,
        top_k: int | None = None,
    ) -> PreparedWeights:
        """Select a backend for ``problem`` (and a call's ``tokens`` / ``top_k``, as in
        ``select``) and convert ``weights`` for it (do this once)."""
        return prepare_for_backend(self.select(problem, tokens, top_k).backend, weights, spec)

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
        declined = False
        if fused is not None:
            with trace_range(f"moerunner.{name}.fused"):
                out = fused(dispatch_output, prepared, **extra)
            if out is not None:
                _check_output(out, dispatch_output.hidden_states, name, "fused op")
                return out
            declined = True
        core = self.registry.core(name)
        if core is None or fmt not in self.registry.permutes:
            if name not in self.registry.backends:
                self.registry.check_name(name)  # unregistered since it prepared: names them
            what = "its fused op declined the call" if declined else "it has no fused op"
            raise BackendUnavailableError(
                f"backend {name!r}: {what} for format {fmt!r} and it has no core to permute into"
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
        _check_output(y, grouped.hidden_states, name, "core")
        with trace_range("moerunner.post_permute"):
            return post(y, ctx, dispatch_output)


def _check_output(out: Any, rows: torch.Tensor, backend: str, what: str) -> None:
    """A backend's output must be its rows' shape and dtype (``backends.base``): a shape or
    dtype check, no values read."""
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != rows.shape
        or out.dtype != rows.dtype
        or out.device != rows.device
    ):
        got = (
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ExtensionContractError(
            f"backend {backend!r}: its {what} returned {got}; expected its rows' shape "
            f"{tuple(rows.shape)} in {rows.dtype} on {rows.device}"
        )


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
# they die with the weights; they are made of an alias of w13 (``_memo_free``), so no cycle
# runs through them and reference counting alone frees them.
_CACHE_ATTR = "_moerunner_prepared"


#: Prepared forms kept per weights (one per backend, options and spec asked for).
_PREPARED_PER_WEIGHT = 4


class _PreparedCache(DerivedCache):
    """The per-weight memo: prepared forms by (backend, options, spec), all made from the
    weights in ``state`` (their tensors' identities and versions, see ``prepared_for``) and
    from the w2 that ``w2`` weakly refers to (the memo lives on w13 and adds no reference to
    either weight)."""

    state: tuple | None = None

    def __init__(self) -> None:
        super().__init__()
        self.w2 = lambda: None
        # ``auto`` only: forms that ran out of memory -> the held form serving instead
        self.stand_ins: dict = {}
        # pre-routed calls on these weights replayed behind a key lookup (``call_steps``)
        self.steps = StepCache()


#: Serialises ``prepared_for``'s look-up, clearing and storing of forms: threads that call
#: on shared weights must not store a form of one thread's weights under another's state.
_PREPARE_LOCK = threading.RLock()


def prepared_for(
    runner: MoeRunner,
    weights: ExpertWeights,
    problem: MoeProblem,
    spec: ExpertSpec,
    tokens: int | None = None,
    top_k: int | None = None,
    backend: Backend | None = None,
) -> PreparedWeights:
    """``runner.prepare`` memoised on the weight objects and on the state of every tensor
    they consist of (see ``tensor_state``): an in-place edit, a ``.data`` assignment or a
    replaced ``QuantizedWeight`` field prepares again. Forms for several backends (or
    options) of the same weights are kept side by side (``_PREPARED_PER_WEIGHT``): a
    measured table that names two backends for a shape (``MoeRunner.bucket_plan``) holds
    two forms, the second prepared on the first call of a bucket it serves (or at once by
    ``prepare_forms``). ``backend``: prepare for this one instead of the runner's choice."""
    if backend is None:
        backend = runner.select(problem, tokens, top_k).backend
    state = weights_state(weights)
    # A form is made of the weights in ``state`` and of what varies between calls on the
    # same weights: w13's row order and the biases (their identities and states).
    # (the object's token too: a backend replaced under its name prepares anew)
    key = (backend.name, backend.options, spec, form_variant(weights), object_ref(backend))
    with _PREPARE_LOCK:  # (threads calling on shared weights: one check-and-set at a time)
        per_weight = getattr(weights.w13, _CACHE_ATTR, None)
        if per_weight is None:
            per_weight = _PreparedCache()
            try:
                setattr(weights.w13, _CACHE_ATTR, per_weight)
            except (AttributeError, TypeError):  # no attributes allowed: prepare every time
                return prepare_for_backend(backend, weights, spec)
        if per_weight.state != state or per_weight.w2() is not weights.w2:
            # w13 or w2 changed (or id(w2) was reused by a new object): every form is stale.
            per_weight.clear()
            per_weight.stand_ins.clear()
            per_weight.steps.clear()
            per_weight.state = state
            per_weight.w2 = _ref(weights.w2)
        auto = runner.requested == "auto"
        cached = per_weight.get(key)
        if cached is None and auto:
            cached = per_weight.stand_ins.get(key)
        if cached is None:
            # A form of the same backend, spec, order and bias tensors whose biases were edited
            # since is stale (an in-place bias edit must not leave copies of the weights
            # behind); beyond that the forms kept are bounded, oldest first.
            for old in [k for k in per_weight if k[:3] == key[:3] and k[3][:3] == key[3][:3]]:
                del per_weight[old]
            if len(per_weight) >= _PREPARED_PER_WEIGHT:
                del per_weight[next(iter(per_weight))]
                per_weight.stand_ins.clear()
            _note_repeat(key, state, weights.w13)
            make = lambda: prepare_for_backend(backend, weights, spec)  # noqa: E731
            try:
                cached = per_weight[key] = kept(make, weights.device)
            except torch.OutOfMemoryError as err:
                if not auto:  # a named backend is not replaced
                    raise
                cached = per_weight.stand_ins[key] = _form_in_memory(per_weight, spec, backend, err)
        return cached


#: Forms prepared lately, by what they were made of (memory, by weak references to the
#: storages, and versions; not tensor objects): how often each was prepared
#: (``_note_repeat``). Holds no tensors.
_RECENT_FORMS: OrderedDict = OrderedDict()
_RECENT_MAX = 256
_REPEATS_WARNED = [False]


def _note_repeat(key: tuple, state: tuple, w13: Any) -> None:
    """Warn once per process where the same memory, unchanged, is prepared a third time: a
    caller that passes a new tensor object per call (``param.data``, ``param.detach()``)
    misses the memo, which lives on the objects, and pays the preparation every call (for
    some backends a copy of the weights). Twice is normal (a layer's parameters and, in grad
    mode, their detached views)."""
    # backend (its name, options and object: one replaced under its name prepares anew by
    # design), spec, order; the tensors' states (their storages while they live: new weights
    # at a freed one's memory are others), no ids
    memory = (key[:3], key[3][0], key[3][3:], key[4], state[1:])
    data = w13 if isinstance(w13, torch.Tensor) else getattr(w13, "data", None)
    if not isinstance(data, torch.Tensor):
        return
    count = _RECENT_FORMS.pop(memory, 0) + 1
    _RECENT_FORMS[memory] = count
    if len(_RECENT_FORMS) > _RECENT_MAX:
        _RECENT_FORMS.popitem(last=False)
    if count >= 3 and not _REPEATS_WARNED[0]:
        _REPEATS_WARNED[0] = True
        warnings.warn(
            f"moerunner: the same expert weights, unchanged, were prepared for {key[0]!r} "
            f"{count} times, each for new tensor objects over the same memory. Prepared weights "
            "are kept on the weight objects: pass the same objects every call (the parameter "
            "itself, not param.data or param.detach() made per call)",
            RuntimeWarning,
            stacklevel=4,
        )


def _form_in_memory(
    per_weight: _PreparedCache, spec: ExpertSpec, backend: Backend, err: Exception
) -> PreparedWeights:
    """``backend="auto"``: a further prepared form of weights that already have one ran out
    of device memory: the form held serves in its place (every form of a plan serves the
    problem at every T), once warned. The memo's ``stand_ins`` then map the failed form to it
    for ``auto``, so no call tries again (a named backend still prepares its own). With no
    form held, the error stands."""
    held = [p for key, p in per_weight.items() if key[2] == spec]
    if not held:
        raise err
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    warnings.warn(
        f"moerunner: preparing the {backend.name!r} form of these weights (a measured table "
        f"chose it for some token counts) ran out of device memory ({first_line}); the "
        f"{held[0].backend!r} form already prepared serves those counts instead. Pass "
        "backend_forms=1 (MoeRunner, MoE) to keep one form from the start.",
        RuntimeWarning,
        stacklevel=4,
    )
    return held[0]


def prepare_forms(
    runner: MoeRunner,
    weights: ExpertWeights,
    problem: MoeProblem,
    spec: ExpertSpec,
    top_k: int,
) -> dict[str, PreparedWeights]:
    """Every prepared form ``problem`` can run on with ``top_k`` slots: one per backend of
    its bucket plan (the runner's single choice where there is none), memoised as in
    ``prepared_for``. Preparing them up front keeps the first call of a bucket free of
    weight conversion (and CUDA-graph capture free of it)."""
    plan = runner.bucket_plan(problem, top_k)
    if plan is None:
        selected = [runner.select(problem).backend]
    else:
        selected = [runner.registry.backends[name] for name in plan.forms]
    return {b.name: prepared_for(runner, weights, problem, spec, backend=b) for b in selected}


def form_bytes(prepared: PreparedWeights, weights: ExpertWeights) -> int:
    """Bytes a prepared form's tensors hold beyond the canonical ``weights`` it was made
    from (storages each counted once: a form computing from the weights as stored holds 0)."""
    from .memory import storages

    sources = [weights.w13, weights.w2, weights.w13_bias, weights.w2_bias]
    canonical = set()
    for weight in sources:
        parts = (weight,) if isinstance(weight, torch.Tensor) else ()
        if weight is not None and hasattr(weight, "tensors"):
            parts = tuple(t for t in weight.tensors().values() if isinstance(t, torch.Tensor))
        canonical.update((str(t.device), t.untyped_storage().data_ptr()) for t in parts)
    # The canonical weight objects are not walked: w13 carries the memo of every form.
    roots = [v for v in prepared.tensors.values() if not any(v is w for w in sources)]
    held = storages(*roots)
    return sum(n for key, n in held.items() if key not in canonical)


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
    weights = gate_up_first(_memo_free(weights))
    padded, padded_spec, notes = pad_to_alignment(weights, spec, caps.align_h, caps.align_i)
    prepared = backend.prepare_weights(padded, padded_spec)
    if not isinstance(prepared, PreparedWeights):
        raise ExtensionContractError(
            f"backend {backend.name!r}: prepare_weights returned a {type(prepared).__name__}, "
            "not a moerunner.weights.PreparedWeights"
        )
    if prepared.backend != backend.name:
        # Calls run the fused op or core of the backend the prepared weights name: a backend
        # handing on another's weights as they are would have that one's kernels run.
        raise ExtensionContractError(
            f"backend {backend.name!r}: prepare_weights returned weights prepared for "
            f"{prepared.backend!r}; PreparedWeights.backend must be the preparing backend's "
            f"own name (a backend wrapping another sets it, e.g. "
            f"dataclasses.replace(prepared, backend=self.name))"
        )
    prepared.notes[:0] = notes
    return prepared


def _memo_free(weights: ExpertWeights) -> ExpertWeights:
    """``weights`` with w13, the object ``prepared_for`` keeps its memo on, replaced by an alias
    of the same memory (same storage, version counter and values; no memo, no grad). A form
    that held w13 itself would make a cycle only the garbage collector frees; one that held a
    view of it (a per-expert ``unbind``, a transpose) would never be freed, since a view keeps
    its base alive from C++, where the collector cannot follow. Forms made of the alias die
    with the weights by reference counting."""
    w13 = weights.w13
    alias = w13.detach() if isinstance(w13, torch.Tensor) else w13.alias()
    return dataclasses.replace(weights, w13=alias)


def weights_state(weights: ExpertWeights) -> tuple:
    """What every prepared form of ``weights`` was made from (``prepared_for``): w2's
    identity and the ``tensor_state`` of w13 and w2. No sync."""
    return (id(weights.w2), tensor_state(weights.w13), tensor_state(weights.w2))


def form_variant(weights: ExpertWeights) -> tuple:
    """What one prepared form of ``weights`` was made from besides ``weights_state``: w13's
    row order and the biases' identities and ``tensor_state`` (whose storage reference tells
    a later bias at a freed one's ``id`` and address apart). No sync."""
    return (
        weights.w13_order,
        id(weights.w13_bias),
        id(weights.w2_bias),
        tensor_state(weights.w13_bias),
        tensor_state(weights.w2_bias),
    )


def forget_prepared(weight: Any) -> None:
    """Drop the prepared forms (and call steps) ``prepared_for`` keeps on ``weight`` (a w13),
    for edits its state key cannot see."""
    try:
        delattr(weight, _CACHE_ATTR)
    except AttributeError:
        pass


def prepared_memo(weights: ExpertWeights) -> _PreparedCache | None:
    """The memo ``prepared_for`` keeps on ``weights`` (their w13), if it is current: made
    from the weights as they are now (``weights_state``) with this w2; else None."""
    per_weight = getattr(weights.w13, _CACHE_ATTR, None)
    if (
        per_weight is None
        or per_weight.w2() is not weights.w2
        or per_weight.state != weights_state(weights)
    ):
        return None
    return per_weight


def tensor_state(weight: Any) -> tuple:
    """Host-side identity of a weight's contents, no device sync: per tensor (a plain tensor,
    or each component of a quantized weight) ``memo.view_key``: its storage (by a weak
    reference, never equal to a later storage at the freed one's address: forms that hold a
    copy, a bias converted or rows swapped, were served for a new tensor there), offset,
    shape, strides, dtype, device and in-place version counter. ``.data`` assignment changes
    the storage or the strides (a view of the same memory read another way); in-place edits
    the version (inference tensors keep none: their in-place edits inside ``inference_mode``
    go unseen)."""
    if weight is None:
        return ()
    if isinstance(weight, torch.Tensor):
        tensors = (weight,)
    else:
        parts = weight.tensors() if hasattr(weight, "tensors") else {}
        tensors = tuple(t for t in parts.values() if isinstance(t, torch.Tensor))
    return tuple(view_key(t) for t in tensors)


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
    if alpha is None and limit is None and beta is None and not torch.compiler.is_compiling():
        return _named_activation(activation)  # (the tracer would step around the cache)
    return Activation(activation, alpha, limit, beta)


@functools.lru_cache(maxsize=64)
def _named_activation(name: str) -> Activation:
    """``Activation(name)``, one value per name (its hash is then worked out once)."""
    return Activation(name)
