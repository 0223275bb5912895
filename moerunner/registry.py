"""The registry: every extension axis as values, in one place below the backends.

- **Backends** are objects (``moerunner.backends.base.Backend``) that own what they can serve
  (``supports``), how they convert weights (``prepare_weights``), a fused op per dispatch
  format (``fused_ops``) and/or a core between permutes (``core``). Each registers once, by
  object, under its ``name``; which dispatch formats it serves is derived from the object.
- **Permutes** bring each dispatch format into the grouped layout a core computes on, and back.
- **Dispatchers** are a name -> factory table (``register_dispatcher``): a factory takes a
  ``DispatchSetup`` and returns an object of the ``Dispatcher`` protocol
  (``moerunner.dispatch.base``).

This module imports the dispatch layer (permutes, dispatchers) and nothing above it; the
backends import it to register themselves, and ``moerunner.runner`` (``MoeRunner``) reads it.
Backend choice travels as arguments: there is no process-global "current backend".
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .dispatch import permute
from .dispatch.base import DispatchSetup
from .dispatch.builtin import default_dispatchers
from .dispatch.formats import MASKED, PERMUTED, STANDARD
from .errors import BackendUnavailableError, ExtensionContractError, MoeInputError

if TYPE_CHECKING:  # annotations only: the backends import this module, not the reverse
    from .backend_table import BackendTable
    from .backends.base import Backend, MoeProblem
    from .dispatch.base import Dispatcher

__all__ = [
    "DEFAULT_PREFERENCE",
    "DEFAULT_REGISTRY",
    "BucketPlan",
    "DispatcherFactory",
    "Registry",
    "Selection",
]

_log = logging.getLogger("moerunner")

DispatcherFactory = Callable[[DispatchSetup], "Dispatcher"]

# Measured order of preference per device type (see benchmarks/results/): the first backend
# that is available and supports a request wins under backend="auto".
DEFAULT_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "flashinfer", "torch"),
    "cpu": ("torch", "triton"),
}


@dataclass
class Registry:
    """Backends (by object), permutes per dispatch format and dispatcher factories."""

    backends: dict[str, Backend] = field(default_factory=dict)
    permutes: dict[str, tuple[Callable, Callable]] = field(default_factory=dict)
    dispatchers: dict[str, DispatcherFactory] = field(default_factory=dict)
    # Selections memoised per (problem, request, preference); cleared by every register_*.
    _selections: dict = field(default_factory=dict, repr=False)
    #: Counts the times the memoised choices were dropped: what was decided from them before
    #: (``call_steps``) is stale once it moves.
    generation: int = field(default=0, repr=False)

    def register_backend(self, backend: Backend, *, replace: bool = False) -> Backend:
        """Add a backend object under its ``name`` (once: a second object under the same name
        needs ``replace=True``)."""
        name = getattr(backend, "name", "")
        if not isinstance(name, str) or not name:
            raise ValueError("a backend needs a non-empty str name")
        if name == "auto":
            raise ValueError("'auto' names the automatic choice; a backend needs another name")
        if name in self.backends and self.backends[name] is not backend and not replace:
            raise ValueError(
                f"a backend named {name!r} is already registered; pass replace=True to swap it"
            )
        _check_backend(backend)
        self._drop_choices()
        self.backends[name] = backend
        return backend

    def unregister_backend(self, name: str) -> None:
        """Remove the backend registered as ``name`` (and the choices made with it)."""
        if name not in self.backends:
            self.check_name(name)  # (raises, naming the registered ones)
        self._drop_choices()
        del self.backends[name]

    def _drop_choices(self) -> None:
        self._selections.clear()
        self.generation += 1

    def check_name(self, requested: str) -> None:
        """``requested`` is ``"auto"`` or a registered backend; else ``BackendUnavailableError``
        naming the registered ones."""
        if requested != "auto" and requested not in self.backends:
            raise BackendUnavailableError(
                f"backend {requested!r} is not registered; registered: "
                f"{', '.join(sorted(self.backends))} or 'auto'"
            )

    def forget_choices(self) -> None:
        """Drop the memoised selections and bucket plans: the next call of each problem
        chooses again (and logs its choice at debug level on the ``moerunner`` logger). For a
        process whose backends changed state (a kernel module built since, a table edited)
        and for benchmarks that record which backend served what."""
        self._drop_choices()

    def register_permute(self, dispatch_format: str, pre: Callable, post: Callable) -> None:
        """Pre- and post-permute between ``dispatch_format`` and the grouped layout."""
        self._drop_choices()
        self.permutes[dispatch_format] = (pre, post)

    def register_dispatcher(
        self, name: str, factory: DispatcherFactory, *, replace: bool = False
    ) -> None:
        """A dispatcher kind: ``factory(setup: DispatchSetup) -> Dispatcher`` (once per name:
        another factory under a registered name needs ``replace=True``)."""
        if not isinstance(name, str) or not name:
            raise ValueError("a dispatcher needs a non-empty str name")
        if not callable(factory):
            raise TypeError(
                f"dispatcher {name!r}: factory must be callable (DispatchSetup -> Dispatcher), "
                f"got {type(factory).__name__}"
            )
        if name in self.dispatchers and self.dispatchers[name] is not factory and not replace:
            raise ValueError(
                f"a dispatcher named {name!r} is already registered; pass replace=True to swap it"
            )
        self.dispatchers[name] = factory

    def unregister_dispatcher(self, name: str) -> None:
        """Remove the dispatcher kind registered as ``name``."""
        if name not in self.dispatchers:
            raise MoeInputError(
                f"dispatcher must be one of {sorted(self.dispatchers)}, got {name!r}"
            )
        del self.dispatchers[name]

    def make_dispatcher(self, name: str, setup: DispatchSetup) -> Dispatcher:
        """Build the dispatcher registered as ``name`` for ``setup``."""
        factory = self.dispatchers.get(name)
        if factory is None:
            raise MoeInputError(
                f"dispatcher must be one of {sorted(self.dispatchers)}, got {name!r}"
            )
        dispatcher = factory(setup)
        from .dispatch.base import Dispatcher

        if not isinstance(dispatcher, Dispatcher):
            missing = [
                a
                for a in ("dispatch_format", "accepts_quantized", "dispatch", "combine")
                if not hasattr(dispatcher, a)
            ]
            raise ExtensionContractError(
                f"dispatcher {name!r}: its factory returned a {type(dispatcher).__name__}, not "
                f"a Dispatcher (moerunner.dispatch.base); it lacks {', '.join(missing)}"
            )
        return dispatcher

    def fused_op(self, dispatch_format: str, backend: str) -> Callable | None:
        """The backend's fused op for the format, or None."""
        obj = self.backends.get(backend)
        return None if obj is None else obj.fused_ops.get(dispatch_format)

    def core(self, backend: str) -> Callable | None:
        """The backend's core between permutes, or None."""
        obj = self.backends.get(backend)
        return None if obj is None else obj.core

    def paths(self, backend: str) -> dict[str, str]:
        """For each dispatch format the backend serves: ``"fused"`` or ``"permute"``."""
        return self._paths(self.backends[backend])

    def _paths(self, obj: Backend) -> dict[str, str]:
        result = {}
        for fmt in dict.fromkeys([*self.permutes, *obj.fused_ops]):
            if fmt in obj.fused_ops:
                result[fmt] = "fused"
            elif obj.core is not None and fmt in self.permutes:
                result[fmt] = "permute"
        return result

    def has_both_paths(self, dispatch_format: str, backend: str) -> bool:
        """True when a fused op and the permute path exist for the pair."""
        obj = self.backends[backend]
        return (
            dispatch_format in obj.fused_ops
            and obj.core is not None
            and dispatch_format in self.permutes
        )

    def verdicts(self, problem: MoeProblem, auto: bool = False) -> dict[str, tuple[bool, str]]:
        """Each backend's (can serve, reason if not) for ``problem``. ``auto``: for a choice
        the caller left to us, where a backend that is not ``ready`` (its first call would
        build kernels for minutes) does not serve either."""
        return self._verdicts(dict(self.backends), problem, auto)

    def _verdicts(self, backends: dict, problem: MoeProblem, auto: bool) -> dict:
        # ``backends``: a copy, so another thread registering one meanwhile changes nothing here.
        result = {}
        for name, backend in backends.items():
            ok, reason = verdict(backend, "available")
            if ok and problem.dispatch_format not in self._paths(backend):
                ok, reason = False, f"no path for dispatch format {problem.dispatch_format!r}"
            if ok:
                ok, reason = verdict(backend, "supports", problem)
            if ok and auto:
                ready, why = verdict(backend, "ready")
                if not ready:
                    ok, reason = False, f"not ready for 'auto': {why}"
            result[name] = (ok, reason)
        return result

    def select(
        self,
        problem: MoeProblem,
        requested: str = "auto",
        preference: dict[str, tuple[str, ...]] | None = None,
    ) -> Selection:
        """Pick a backend for ``problem``; raise naming every backend and why it was not taken.

        Successful choices are memoised (a decode step asks the same question every layer).
        """
        key = (problem, requested, _pref_key(preference))
        cached = self._selections.get(key)
        if cached is not None:
            return cached
        selection = self._select(problem, requested, preference)
        self._remember(key, selection)
        _log.debug("backend %r selected (%s) for %s", selection.backend, selection.reason, problem)
        return selection

    #: Choices memoised at most (oldest dropped): a process that meets many shapes.
    MAX_SELECTIONS = 1024

    def _remember(self, key, choice) -> None:
        selections = self._selections
        selections[key] = choice
        while len(selections) > self.MAX_SELECTIONS:
            try:
                del selections[next(iter(selections))]
            except (KeyError, StopIteration, RuntimeError):  # changed by another thread
                break

    def _select(
        self,
        problem: MoeProblem,
        requested: str,
        preference: dict[str, tuple[str, ...]] | None,
    ) -> Selection:
        backends = dict(self.backends)  # one view of them for this choice
        if requested != "auto" and requested not in backends:
            self.check_name(requested)  # (raises, naming the registered ones)
        verdicts = self._verdicts(backends, problem, auto=requested == "auto")
        if requested != "auto":
            ok, reason = verdicts[requested]
            if not ok:
                raise BackendUnavailableError(_explain(problem, verdicts, requested))
            return Selection(backends[requested], verdicts, "requested")
        order = (preference or DEFAULT_PREFERENCE).get(problem.device_type, ())
        ranked = [n for n in order if n in verdicts] + sorted(set(verdicts) - set(order))
        for name in ranked:
            if verdicts[name][0]:
                return Selection(backends[name], verdicts, f"first of {ranked} that serves")
        raise BackendUnavailableError(_explain(problem, verdicts, "auto"))

    def bucket_plan(
        self,
        problem: MoeProblem,
        top_k: int,
        table: BackendTable,
        preference: dict[str, tuple[str, ...]] | None = None,
        backend_forms: int | None = None,
    ) -> BucketPlan | None:
        """``backend="auto"`` per token-count bucket from a measured ``table`` (None where
        it has no entry for the problem: the preference order serves every T). Memoised
        like ``select``; a call then only bisects ``plan.bounds`` (``BucketPlan.choose``).

        Per bucket: the measured winner where it can serve (its verdict), else the fastest
        measured backend that can, else the preference order's choice. ``backend_forms``
        (None: no limit) bounds how many backends, each with its own prepared weights, the
        plan uses: those winning the most buckets stay (ties: the one winning the lowest
        token counts), and a bucket won by another takes the fastest kept one measured.
        """
        key = (problem, "table", top_k, table, backend_forms, _pref_key(preference))
        if key in self._selections:
            return self._selections[key]
        plan = self._bucket_plan(problem, top_k, table, preference, backend_forms)
        self._remember(key, plan)
        if plan is not None:
            _log.debug("backend plan %s for %s, top_k %d", plan.summary(), problem, top_k)
        return plan

    def _bucket_plan(self, problem, top_k, table, preference, backend_forms):
        from .backend_table import ShapeKey, bucket_range

        buckets = table.buckets(ShapeKey.of(problem, top_k))
        if buckets is None:
            return None
        fallback = self.select(problem, "auto", preference)  # raises where none can serve
        verdicts = fallback.verdicts
        names, reasons = [], []
        for bucket in buckets:
            ok, why = verdicts.get(bucket.backend, (False, "not registered"))
            if ok:
                names.append(bucket.backend)
                reasons.append(f"measured: {bucket.measured()}")
                continue
            serving = [
                n for n in sorted(bucket.times_us, key=bucket.times_us.get) if _ok(verdicts, n)
            ]
            name = serving[0] if serving else fallback.backend.name
            names.append(name)
            how = (
                f"fastest measured that serves ({bucket.measured()})"
                if serving
                else f"preference order ({fallback.reason})"
            )
            reasons.append(f"measured winner {bucket.backend!r} cannot serve ({why}); {how}")
        if backend_forms is not None and len(set(names)) > backend_forms:
            won = {n: names.count(n) for n in dict.fromkeys(names)}  # first = lowest T
            keep = sorted(won, key=lambda n: -won[n])[:backend_forms]
            for i, (bucket, name) in enumerate(zip(buckets, names, strict=True)):
                if name in keep:
                    continue
                timed = [n for n in keep if n in bucket.times_us]
                names[i] = min(timed, key=bucket.times_us.get) if timed else keep[0]
                reasons[i] = (
                    f"backend_forms={backend_forms} keeps {', '.join(keep)}: {names[i]} "
                    f"instead of {name} ({bucket.measured()})"
                )
        selections = tuple(
            Selection(self.backends[n], verdicts, f"{bucket_range(buckets, i)}: {r}")
            for i, (n, r) in enumerate(zip(names, reasons, strict=True))
        )
        return BucketPlan(table.bounds(buckets), selections, buckets)

    def copy(self) -> Registry:
        """A registry with the same entries, to add to or replace in (tests, experiments)."""
        return Registry(
            backends=dict(self.backends),
            permutes=dict(self.permutes),
            dispatchers=dict(self.dispatchers),
        )


@dataclass(frozen=True)
class Selection:
    """The chosen backend and every backend's verdict (for ``info`` and error messages)."""

    backend: Any
    verdicts: dict[str, tuple[bool, str]]
    reason: str


@dataclass(frozen=True)
class BucketPlan:
    """The measured choice for one problem and top-k: bucket ``i`` serves the token counts
    up to ``bounds[i]`` (the last, every count above) with ``selections[i]``."""

    bounds: tuple[int, ...]
    selections: tuple[Selection, ...]
    buckets: tuple = ()  # the table's ``Bucket`` values (for printing)

    def choose(self, tokens: int) -> Selection:
        """The selection for a call of ``tokens`` tokens: one bisect on the host."""
        return self.selections[bisect_left(self.bounds, tokens)]

    def summary(self) -> str:
        """``"T <= 2048: triton; T > 2048: flashinfer"``: the backend of each run of
        buckets (for logs and benchmark records)."""
        runs: list[tuple[int | None, str]] = []  # (last bound of the run, backend)
        for i, selection in enumerate(self.selections):
            bound = self.bounds[i] if i < len(self.bounds) else None
            name = selection.backend.name
            if runs and runs[-1][1] == name:
                runs[-1] = (bound, name)
            else:
                runs.append((bound, name))
        parts, low = [], None
        for bound, name in runs:
            if bound is None:
                parts.append(f"T > {low}: {name}" if low is not None else f"every T: {name}")
            else:
                parts.append(
                    f"T <= {bound}: {name}" if low is None else f"{low} < T <= {bound}: {name}"
                )
            low = bound
        return "; ".join(parts)

    @property
    def forms(self) -> tuple[str, ...]:
        """The backends the plan uses (each holds its own prepared weights), lowest T first."""
        return tuple(dict.fromkeys(s.backend.name for s in self.selections))


def _check_backend(backend: Any) -> None:
    """What every path reads of a backend, checked when it registers (a malformed one would
    fail later inside every call's choice, whichever backend the call named)."""
    from .backends.base import Capabilities

    name = backend.name
    caps = getattr(backend, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise ExtensionContractError(
            f"backend {name!r}: capabilities must be a moerunner.backends.base.Capabilities, "
            f"got {type(caps).__name__}"
        )
    fused_ops = getattr(backend, "fused_ops", None)
    core = getattr(backend, "core", None)
    if not hasattr(fused_ops, "items") or not all(
        isinstance(fmt, str) and callable(op) for fmt, op in fused_ops.items()
    ):
        raise ExtensionContractError(
            f"backend {name!r}: fused_ops must map dispatch formats (str) to callables, "
            f"got {fused_ops!r}"
        )
    if core is not None and not callable(core):
        raise ExtensionContractError(f"backend {name!r}: core must be callable or None")
    if not fused_ops and core is None:
        raise ExtensionContractError(
            f"backend {name!r} has neither fused_ops nor a core: it could serve no call"
        )
    for method in ("available", "supports", "ready", "prepare_weights"):
        if not callable(getattr(backend, method, None)):
            raise ExtensionContractError(
                f"backend {name!r}: {method} must be a method (see moerunner.backends.base)"
            )


def verdict(backend: Any, method: str, *args: Any) -> tuple[bool, str]:
    """``backend.<method>(*args)`` as ``(ok, reason)``; an extension that raises or returns
    something else serves nothing, the reason saying why, so that it cannot break the
    choice of every other backend."""
    try:
        result = getattr(backend, method)(*args)
    except Exception as err:  # noqa: BLE001  (an extension's own fault, reported as its verdict)
        return False, f"{method}() raised {type(err).__name__}: {err}"
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not isinstance(result[0], bool)
        or not isinstance(result[1], str)
    ):
        return False, f"{method}() returned {result!r}, not (bool, str)"
    return result


def _ok(verdicts: dict[str, tuple[bool, str]], name: str) -> bool:
    return verdicts.get(name, (False, ""))[0]


def _pref_key(preference: dict[str, tuple[str, ...]] | None) -> tuple | None:
    return None if preference is None else tuple(preference.items())


def _explain(problem: Any, verdicts: dict[str, tuple[bool, str]], requested: str) -> str:
    what = problem.summary() if hasattr(problem, "summary") else repr(problem)
    lines = [f"no backend can serve this request (asked for {requested!r}): {what}"]
    for name, (ok, reason) in sorted(verdicts.items()):
        lines.append(f"  {name}: {'can serve' if ok else 'rejected: ' + reason}")
    return "\n".join(lines)


DEFAULT_REGISTRY = Registry()
DEFAULT_REGISTRY.register_permute(
    STANDARD, permute.pre_permute_standard, permute.post_permute_standard
)
DEFAULT_REGISTRY.register_permute(
    PERMUTED, permute.pre_permute_permuted, permute.post_permute_permuted
)
DEFAULT_REGISTRY.register_permute(MASKED, permute.pre_permute_masked, permute.post_permute_masked)
for _name, _factory in default_dispatchers().items():
    DEFAULT_REGISTRY.register_dispatcher(_name, _factory)
