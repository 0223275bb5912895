# Quantized expert weights and activations: schemes, codecs, weights, checkpoint import.
#
# Public surface of the quantization stage. A `QuantScheme` (or its name) says how expert
# weights [E, N, K] are stored and how a kernel quantizes its GEMM input; `quantize` /
# `dequantize` convert weights, `quantize_activation` / `fake_quantize_activation` model the
# kernel's input path, and `moerunner.quant.checkpoints` imports GPT-OSS MXFP4, DeepSeek-V3
# FP8 and ModelOpt NVFP4 checkpoint tensors. Layouts: docs/architecture.md and
# docs/quantization.md.

from moerunner.quant.activations import (
    QuantizedActivation,
    dequantize_activation,
    fake_quantize_activation,
    quantize_activation,
)
from moerunner.quant.schemes import ACTIVATION_FORMATS, SCHEME_NAMES, QuantScheme, get_scheme
from moerunner.quant.weight import TENSOR_FIELDS, QuantizedWeight, dequantize, quantize

__all__ = [
    "ACTIVATION_FORMATS",
    "SCHEME_NAMES",
    "TENSOR_FIELDS",
    "QuantScheme",
    "QuantizedActivation",
    "QuantizedWeight",
    "dequantize",
    "dequantize_activation",
    "fake_quantize_activation",
    "get_scheme",
    "quantize",
    "quantize_activation",
]
