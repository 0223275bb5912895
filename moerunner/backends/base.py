"""What a backend is: a named kernel family that declares what it can serve.

A backend provides ``available()`` (can it run on this machine at all), ``supports(problem)``
(can it serve this request, and if not, why) and ``prepare_weights`` (convert the canonical
weights once into its own form). Its compute functions — a fused op per dispatch format and/or
a core between permutes — are registered in ``moerunner.runner.Registry``; which dispatch
formats a backend serves is derived from that registry, never declared twice.
"""

from __future__ import annotations

from dataclasses import dataclass
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


class Backend:
    """Base class. Subclasses set ``name`` and ``capabilities`` and may override the rest.

    ``options``: the backend's own options value (frozen, hashable; None where it has none),
    which its ``prepare_weights`` records in the prepared weights for its kernels."""

    name: str = ""
    capabilities: Capabilities
    options: Any = None

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
