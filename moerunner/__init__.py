"""moerunner: the Mixture-of-Experts layer of LLMs, every family and format, one runner.

Public API: ``select_experts``, ``fused_moe``, ``MoE``, ``MoeRunner``, ``quantize``,
``dequantize``, ``check_errors`` (raise what the GPU-side input checks found) and the
configuration values they take.
"""

from . import ops as _ops  # noqa: F401  (registers the moerunner::fused_experts custom op)
from .api import fused_moe
from .config import Activation, ExpertSpec, MoeConfig, RoutingConfig
from .device_checks import check_errors
from .errors import BackendUnavailableError, CapacityOverflowError, MoeInputError, RankFailedError
from .layer import MoE
from .reference import reference_moe
from .routing import TopK, select_experts
from .runner import DEFAULT_REGISTRY, MoeRunner, Registry, default_registry
from .weights import ExpertWeights


def quantize(weight, scheme, *, input_scale=None):
    """Quantize expert weights ``[E, N, K]`` into ``scheme`` (a name or ``QuantScheme``).

    ``input_scale`` (fp32 ``[E]``) is the calibrated activation scale that ``*_static``
    schemes need. See ``moerunner.quant`` and docs/quantization.md for the formats.
    """
    from .quant import quantize as _quantize

    return _quantize(weight, scheme, input_scale=input_scale)


def dequantize(qweight):
    """Float32 ``[E, N, K]`` value of a quantized weight."""
    from .quant import dequantize as _dequantize

    return _dequantize(qweight)


__version__ = "0.1.0"

__all__ = [
    "Activation",
    "BackendUnavailableError",
    "CapacityOverflowError",
    "DEFAULT_REGISTRY",
    "ExpertSpec",
    "ExpertWeights",
    "MoE",
    "MoeConfig",
    "MoeInputError",
    "MoeRunner",
    "RankFailedError",
    "Registry",
    "RoutingConfig",
    "TopK",
    "check_errors",
    "default_registry",
    "dequantize",
    "fused_moe",
    "quantize",
    "reference_moe",
    "select_experts",
]
