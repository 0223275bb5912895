"""moerunner: the Mixture-of-Experts layer of LLMs, every family and format, one runner.

Public API: ``select_experts``, ``fused_moe``, ``fused_moe_from_logits`` (both in one
call), ``MoE``, ``MoeRunner``, ``quantize``, ``dequantize``, ``load_experts`` (one layer's
experts from safetensors checkpoints), ``check_errors`` (raise what the GPU-side input
checks found) and the configuration values they take.
"""

from . import op_flops as _op_flops  # noqa: F401  (their FLOPs for FlopCounterMode)
from . import ops as _ops  # noqa: F401  (registers the moerunner::fused_experts custom op)
from .api import fused_moe, fused_moe_from_logits
from .config import Activation, ExpertSpec, MoeConfig, RoutingConfig, SharedExpertsConfig
from .device_checks import check_errors
from .errors import (
    BackendUnavailableError,
    CapacityOverflowError,
    ExtensionContractError,
    MoeInputError,
    RankFailedError,
)
from .layer import MoE
from .loader import LoadedExperts, load_experts
from .memo import weights_changed
from .reference import reference_moe
from .routing import TopK, select_experts
from .runner import DEFAULT_REGISTRY, MoeRunner, Registry, default_registry
from .shared import SharedExperts
from .weights import ExpertWeights


def quantize(weight, scheme, *, input_scale=None, chunk_bytes=None):
    """Quantize expert weights ``[E, N, K]`` into ``scheme`` (a name or ``QuantScheme``).

    ``input_scale`` (fp32 ``[E]``) is the calibrated activation scale that ``*_static``
    schemes need. ``chunk_bytes`` bounds the float32 working copy of the experts quantized
    at once (None: 256 MiB), so memory beyond input and result does not grow with E. See
    ``moerunner.quant.quantize`` and docs/quantization.md for the formats and the bound.
    """
    from .quant import quantize as _quantize
    from .quant.weight import DEFAULT_CHUNK_BYTES

    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES
    return _quantize(weight, scheme, input_scale=input_scale, chunk_bytes=chunk_bytes)


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
    "LoadedExperts",
    "RankFailedError",
    "ExtensionContractError",
    "Registry",
    "RoutingConfig",
    "SharedExperts",
    "SharedExpertsConfig",
    "TopK",
    "check_errors",
    "default_registry",
    "dequantize",
    "fused_moe",
    "fused_moe_from_logits",
    "load_experts",
    "quantize",
    "reference_moe",
    "select_experts",
    "weights_changed",
]
