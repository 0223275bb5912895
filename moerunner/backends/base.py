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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..config import ExpertSpec
from ..weights import ExpertWeights, PreparedWeights


@dataclass(frozen=True)
class Capabilities:
    """Declared limits of a backend. ``align_h`` / ``align_i``: padding its kernels need."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    schemes: frozenset[str]
    activations: frozenset[str]
    biases: bool = True
    interleaved: bool = True
    align_h: int = 1
    align_i: int = 1

    def describe(self) -> dict[str, object]:
        """A plain dict for printing."""
        return {
            "devices": sorted(self.devices),
            "dtypes": sorted(str(d).replace("torch.", "") for d in self.dtypes),
            "schemes": sorted(self.schemes),
            "activations": sorted(self.activations),
            "biases": self.biases,
            "interleaved gate/up": self.interleaved,
            "align H, I": (self.align_h, self.align_i),
        }


@dataclass(frozen=True)
class MoeProblem:
    """One request, as the selector sees it."""

    device_type: str
    dtype: torch.dtype
    scheme: str
    activation: str
    dispatch_format: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    has_bias: bool = False
    interleaved: bool = False

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
            scheme=weights.scheme,
            activation=spec.activation.name,
            dispatch_format=dispatch_format,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_experts=spec.num_experts,
            has_bias=weights.w13_bias is not None or weights.w2_bias is not None,
            interleaved=spec.gate_up_interleaved,
        )


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

    def supports(self, problem: MoeProblem) -> tuple[bool, str]:
        """Whether the declared capabilities cover ``problem``; the reason when not."""
        caps = self.capabilities
        checks = (
            (
                problem.device_type in caps.devices,
                f"device {problem.device_type!r} not in {sorted(caps.devices)}",
            ),
            (problem.dtype in caps.dtypes, f"dtype {problem.dtype} not supported"),
            (problem.scheme in caps.schemes, f"scheme {problem.scheme!r} not supported"),
            (
                problem.activation in caps.activations,
                f"activation {problem.activation!r} not supported",
            ),
            (caps.biases or not problem.has_bias, "biases not supported"),
            (caps.interleaved or not problem.interleaved, "interleaved gate/up not supported"),
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
