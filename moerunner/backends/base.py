"""What a backend is: a named kernel family that declares what it can serve.

A backend is one object that provides ``available()`` (can it run on this machine at all),
``supports(problem)`` (can it serve this request, and if not, why), ``prepare_weights`` (convert
the canonical weights once into its own form) and its compute functions: ``fused_ops``, a fused
op per dispatch format, and/or ``core``, the experts on the grouped layout between the
format's permutes. It registers once, by object, in ``moerunner.registry``; which dispatch
formats it serves is derived from these two attributes, never declared twice.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..config import ExpertSpec, HashedOnce
from ..quant.schemes import SCHEME_NAMES, QuantScheme, get_scheme
from ..weights import ExpertWeights, PreparedWeights


@dataclass(frozen=True)
class SchemeSupport:
    """The weight schemes a backend computes: a predicate over ``QuantScheme`` fields, so a
    custom scheme with the fields of a supported one is supported too (names never matter).

    ``families``: the ``QuantScheme.family`` values accepted. ``rule``: further limits within
    them; returns "" for an accepted scheme, else what is not supported. ``mixed``: whether
    w13 and w2 may differ in format (each GEMM computed in its own scheme).
    """

    families: frozenset[str]
    rule: Callable[[QuantScheme], str] | None = None
    mixed: bool = False

    @classmethod
    def of_names(cls, names: Iterable[str | QuantScheme], mixed: bool = False) -> SchemeSupport:
        """Exactly the formats of the given schemes (or registered names)."""
        schemes = [get_scheme(n) for n in names]
        formats = frozenset(s.format_key for s in schemes)

        def same_format(scheme: QuantScheme) -> str:
            return "" if scheme.format_key in formats else "its fields match no supported scheme"

        return cls(frozenset(s.family for s in schemes), same_format, mixed)

    def check(self, scheme: QuantScheme | str) -> str:
        """ "" when ``scheme`` is supported, else why not (naming the scheme)."""
        s = get_scheme(scheme)
        try:
            family = s.family
        except ValueError as err:
            return f"scheme {s.name!r}: {err}"
        if family not in self.families:
            return (
                f"scheme {s.name!r} (family {family!r}) not supported; families: "
                f"{', '.join(sorted(self.families))}"
            )
        why = self.rule(s) if self.rule is not None else ""
        return f"scheme {s.name!r} not supported: {why}" if why else ""

    def __contains__(self, scheme: object) -> bool:
        if not isinstance(scheme, (str, QuantScheme)):
            return False
        try:
            return not self.check(scheme)
        except ValueError:  # an unknown name
            return False

    def names(self) -> tuple[str, ...]:
        """The registered scheme names supported, in registration order (for printing)."""
        return tuple(n for n in SCHEME_NAMES if n in self)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __and__(self, other: Iterable[str]) -> frozenset[str]:
        return frozenset(self.names()) & frozenset(other)

    __rand__ = __and__


@dataclass(frozen=True)
class Capabilities:
    """Declared limits of a backend. ``align_h`` / ``align_i``: padding its kernels need.

    ``schemes`` is a `SchemeSupport`; a collection of scheme names is accepted and means
    exactly those schemes' formats (``SchemeSupport.of_names``). ``hooks``: whether its
    fused ops and core run ``moerunner.hooks.MoeHooks`` (they then take a ``hooks=``
    keyword: a ``MoeHooks`` for a fused op, a ``RowHooks`` for the core; it is passed only
    when a call has hooks).
    """

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    schemes: SchemeSupport
    activations: frozenset[str]
    biases: bool = True
    interleaved: bool = True
    align_h: int = 1
    align_i: int = 1
    # swiglu_oai with per-expert [E] parameters or beta != 1 (``Activation.extended``).
    extended_swiglu: bool = False
    hooks: bool = False
    # quantized weights carrying a static activation scale (``QuantizedWeight.input_scale``)
    # on a scheme whose inputs are otherwise quantized dynamically: the scale is used
    static_input_scales: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.schemes, SchemeSupport):
            if isinstance(self.schemes, str) or not isinstance(self.schemes, Iterable):
                raise TypeError(
                    "schemes must be a SchemeSupport or a collection of scheme names, got "
                    f"{type(self.schemes).__name__}"
                )
            object.__setattr__(self, "schemes", SchemeSupport.of_names(self.schemes))
        # Typos (a dtype's name, an activation misspelt) would only show later as "not
        # supported" on every call: the sets hold what they are compared with.
        for name, kind, example in (
            ("devices", str, "'cuda'"),
            ("dtypes", torch.dtype, "torch.bfloat16"),
            ("activations", str, "'silu'"),
        ):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(f"Capabilities.{name} must be a set of values like {example}")
            bad = [v for v in value if not isinstance(v, kind)]
            if bad:
                raise TypeError(
                    f"Capabilities.{name} must hold {kind.__name__} values like {example}, "
                    f"got {bad[0]!r}"
                )
            object.__setattr__(self, name, frozenset(value))
        for name in ("biases", "interleaved", "extended_swiglu", "hooks", "static_input_scales"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Capabilities.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("align_h", "align_i"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Capabilities.{name} must be a positive int (the multiple its kernels "
                    f"need; 1 for none), got {value!r}"
                )
        from ..config import ACTIVATIONS

        unknown = sorted(set(self.activations) - set(ACTIVATIONS))
        if unknown:
            raise ValueError(
                f"Capabilities.activations: {unknown} not among moerunner's activations "
                f"{sorted(ACTIVATIONS)} (a new one is added to config.ACTIVATIONS first)"
            )

    def describe(self) -> dict[str, object]:
        """A plain dict for printing (registered names for the schemes)."""
        return {
            "devices": sorted(self.devices),
            "dtypes": sorted(str(d).replace("torch.", "") for d in self.dtypes),
            "schemes": list(self.schemes.names()),
            "scheme families": sorted(self.schemes.families),
            "mixed w13/w2 schemes": self.schemes.mixed,
            "activations": sorted(self.activations),
            "biases": self.biases,
            "interleaved gate/up": self.interleaved,
            "per-expert swiglu parameters, beta": self.extended_swiglu,
            "align H, I": (self.align_h, self.align_i),
            "hooks": self.hooks,
            "static input scales on any scheme": self.static_input_scales,
        }


@dataclass(frozen=True)
class MoeProblem(HashedOnce):
    """One request, as the selector sees it.

    ``w13_scheme`` / ``w2_scheme``: the weights' `QuantScheme` values (a name is resolved;
    ``w2_scheme`` None means the same as w13's). Plain weights have the scheme of their dtype.
    """

    device_type: str
    dtype: torch.dtype
    w13_scheme: QuantScheme
    activation: str
    dispatch_format: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    has_bias: bool = False
    interleaved: bool = False
    w2_scheme: QuantScheme | None = None
    extended_swiglu: bool = False  # Activation.extended
    hooks: bool = False  # the call has ``MoeHooks``
    static_input_scales: bool = False  # a quantized weight carries ``input_scale``

    __hash__ = HashedOnce.__hash__

    def __post_init__(self) -> None:
        object.__setattr__(self, "w13_scheme", get_scheme(self.w13_scheme))
        w2 = self.w13_scheme if self.w2_scheme is None else get_scheme(self.w2_scheme)
        object.__setattr__(self, "w2_scheme", w2)

    def summary(self) -> str:
        """One line for messages: device, dtype, schemes, activation, shape, format, extras."""
        schemes = self.w13_scheme.name
        if not self.w13_scheme.same_format(self.w2_scheme):
            schemes += f" / w2 {self.w2_scheme.name}"
        extras = [
            word
            for word, on in (
                ("biases", self.has_bias),
                ("interleaved gate/up", self.interleaved),
                ("per-expert swiglu parameters or swiglu_beta != 1", self.extended_swiglu),
                ("hooks", self.hooks),
                ("static input scales", self.static_input_scales),
            )
            if on
        ]
        return (
            f"{self.device_type} {str(self.dtype).removeprefix('torch.')} inputs, {schemes} "
            f"weights, {self.activation}, E={self.num_experts} H={self.hidden_size} "
            f"I={self.intermediate_size}, {self.dispatch_format} format"
            + "".join(f", {w}" for w in extras)
        )

    @classmethod
    def of(
        cls,
        hidden_states: torch.Tensor,
        weights: ExpertWeights,
        spec: ExpertSpec,
        dispatch_format: str,
    ) -> MoeProblem:
        """Describe a request from its tensors."""
        return cls(
            device_type=hidden_states.device.type,
            dtype=hidden_states.dtype,
            w13_scheme=weights.w13_scheme,
            w2_scheme=weights.w2_scheme,
            activation=spec.activation.name,
            dispatch_format=dispatch_format,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_experts=spec.num_experts,
            has_bias=weights.w13_bias is not None or weights.w2_bias is not None,
            interleaved=spec.gate_up_interleaved,
            extended_swiglu=spec.activation.extended,
            static_input_scales=any(
                getattr(w, "input_scale", None) is not None for w in (weights.w13, weights.w2)
            ),
        )


def _scheme_check(support: SchemeSupport, w13: QuantScheme, w2: QuantScheme) -> tuple[bool, str]:
    """(supported, reason) for the two weights' schemes."""
    for which, scheme in (("w13", w13), ("w2", w2)):
        why = support.check(scheme)
        if why:
            return False, f"{which} {why}"
    if not support.mixed and not w13.same_format(w2):
        return False, (
            f"w13 scheme {w13.name!r} and w2 scheme {w2.name!r} differ; this backend computes "
            "both GEMMs in one scheme"
        )
    return True, ""


# ``fn(dispatch_output, prepared) -> output``, or None to decline the call (it then takes the
# permute path); ``fn(x_MH, expert_offsets, prepared) -> y_MH`` on the grouped layout.
FusedOp = Callable[[Any, PreparedWeights], "torch.Tensor | None"]
Core = Callable[[torch.Tensor, torch.Tensor, PreparedWeights], torch.Tensor]


class Backend:
    """Base class. Subclasses set ``name`` and ``capabilities``, and ``fused_ops`` and/or
    ``core`` on the instance (in ``__init__``: a function stored on the class would bind as a
    method), and may override the rest.

    ``options``: the backend's own options value (frozen, hashable; None where it has none),
    which its ``prepare_weights`` records in the prepared weights for its kernels."""

    name: str = ""
    capabilities: Capabilities
    fused_ops: Mapping[str, FusedOp] = MappingProxyType({})  # dispatch format -> fused op
    core: Core | None = None  # experts on the grouped layout (between permutes)
    options: Any = None

    def variant(
        self,
        *,
        name: str | None = None,
        fused_ops: Mapping[str, FusedOp] | None = None,
        core: Any = ...,  # a Core or None; ... keeps the current one
        capabilities: Capabilities | None = None,
    ) -> Backend:
        """A copy with some parts replaced (tests, experiments, a backend under another name)."""
        other = copy.copy(self)
        if name is not None:
            other.name = name
        if fused_ops is not None:
            other.fused_ops = MappingProxyType(dict(fused_ops))
        if core is not ...:
            other.core = core
        if capabilities is not None:
            other.capabilities = capabilities
        return other

    def available(self) -> tuple[bool, str]:
        """Whether this machine can run the backend at all, and why not."""
        return True, ""

    def measuring(self, tokens: Sequence[int]) -> Backend:
        """This backend as a benchmark should time it at these token counts (``moerunner
        bench`` and ``tune --backends``): itself by default. A backend that tunes its kernels
        per token bucket at a first call returns a variant that tunes exactly these counts,
        so each is timed with the kernels chosen for it."""
        return self

    def ready(self) -> tuple[bool, str]:
        """Whether a first call can start without a one-time build of many minutes (its
        kernels compiled or prebuilt), and why not. ``backend="auto"`` takes only ready
        backends; naming the backend builds what it needs. Default: ready."""
        return True, ""

    def supports(self, problem: MoeProblem) -> tuple[bool, str]:
        """Whether the declared capabilities cover ``problem``; the reason when not."""
        caps = self.capabilities
        checks = (
            (
                problem.device_type in caps.devices,
                f"device {problem.device_type!r} not in {sorted(caps.devices)}",
            ),
            (problem.dtype in caps.dtypes, f"dtype {problem.dtype} not supported"),
            _scheme_check(caps.schemes, problem.w13_scheme, problem.w2_scheme),
            (
                problem.activation in caps.activations,
                f"activation {problem.activation!r} not supported",
            ),
            (caps.biases or not problem.has_bias, "biases not supported"),
            (caps.interleaved or not problem.interleaved, "interleaved gate/up not supported"),
            (
                caps.extended_swiglu or not problem.extended_swiglu,
                "swiglu_oai with per-expert [E] parameters or swiglu_beta != 1 not supported",
            ),
            (caps.hooks or not problem.hooks, "hooks (moerunner.hooks) not supported"),
            (
                caps.static_input_scales or not problem.static_input_scales,
                "static activation scales (QuantizedWeight.input_scale) not supported",
            ),
        )
        for ok, reason in checks:
            if not ok:
                return False, reason
        return True, ""

    def prepare_weights(self, weights: ExpertWeights, spec: ExpertSpec) -> PreparedWeights:
        """Convert canonical weights once. Default: use them as they are."""
        return PreparedWeights(backend=self.name, source=weights, spec=spec)

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def caller(device: torch.device) -> tuple:
    """Who may share per-call state (workspaces, launch plans, a layer's replayed steps):
    one thread on one CUDA stream (its handle). Two threads, or two streams of one thread,
    calling at once would otherwise write the same buffers; on one stream calls are ordered.
    No sync."""
    thread = threading.get_ident()
    if device.type != "cuda":
        return (thread,)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (thread, torch._C._cuda_getCurrentRawStream(index))
