# Backend "flashinfer": FlashInfer's CUTLASS fused MoE on Hopper (SM90), when the optional
# package is installed (``pip install moerunner[flashinfer]``).
#
# The backend registers always, so ``moerunner info`` lists it; without the package it is
# unavailable with the reason "not installed", and off an SM90 GPU it says which device it
# needs. What it computes is declared from what the SM90 kernels implement: bf16 / fp16
# weights, fp8 weights with 128x128 block scales (DeepSeek-V3; bf16 inputs quantized per
# 1x128 group inside the kernel), and MXFP4 weights with bf16 inputs (GPT-OSS W4A16, with the
# clamped SwiGLU's alpha, beta and limit per expert, and biases). H and I are zero-padded to
# multiples of 128 by the runner (the mixed-input interleave and the block scales need them).
# Weights are converted once in ``prepare_weights`` (``layout.py``: up-then-gate rows, the
# e2m1 interleave and folded scales); a call is one ``cutlass_fused_moe`` launch sequence
# with the routing weights applied and the top-k sum done inside (``_call.py``). FlashInfer's
# autotuner picks the kernels per token bucket at the first call of each weight set
# (``FlashInferOptions``, the backend's options).

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from ...config import ACTIVATIONS, ExpertSpec
from ...dispatch.formats import STANDARD
from ...quant.schemes import QuantScheme
from ...registry import DEFAULT_REGISTRY, Registry
from ...weights import ExpertWeights, PreparedWeights
from ..base import Backend, Capabilities, MoeProblem, SchemeSupport
from ..option_fields import options_and_name
from ._call import FlashInferOptions, fused_standard
from ._prepare import ACTIVATION_TYPES, prepare

NAME = "flashinfer"
PACKAGE = "flashinfer"
#: The compute capability (major, minor) whose kernels this backend declares.
SM90 = (9, 0)
#: Alignment of H and I: the SM90 e2m1 interleave and folded scales work on 128-wide K
#: blocks and 64-row blocks, fp8 block scales on 128 x 128 blocks.
ALIGN = 128
ACTIVATION_DTYPES = frozenset({torch.bfloat16, torch.float16})

__all__ = ["ALIGN", "NAME", "FlashInferBackend", "FlashInferOptions", "register"]


def _scheme_rule(s: QuantScheme) -> str:
    """What FlashInfer's SM90 fused MoE cannot compute of ``s`` ("" when it can)."""
    if s.family == "plain":
        return "" if s.weight_format in ("bf16", "fp16") else "plain weights must be bf16 or fp16"
    if s.family == "fp8":
        if s.granularity == "block" and s.block_shape == (128, 128):
            if s.activation_format == "fp8_group128" and s.activation_scales == "dynamic":
                return ""
            return "128x128 block fp8 needs dynamic fp8 inputs per 1x128 group"
        return (
            "fp8 weights need 128x128 block scales (the per-tensor path quantizes inputs "
            "with one static scale for all experts, which no scheme here describes)"
        )
    if s.family == "mx":
        if s.weight_format == "e2m1" and s.activation_format == "none":
            return ""
        return "MX weights must be mxfp4 with bf16 inputs (W4A16)"
    return f"{s.family} weights are not implemented by the SM90 fused MoE"


SUPPORTED_SCHEMES = SchemeSupport(frozenset({"plain", "fp8", "mx"}), _scheme_rule)


@functools.cache
def _installed() -> tuple[bool, str]:
    """Whether ``import flashinfer`` works (checked once: importing it is slow)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return False, "not installed (pip install 'moerunner[flashinfer]')"
    try:
        import flashinfer.fused_moe  # noqa: F401
    except Exception as err:  # an install that cannot import is as good as none
        return False, f"not installed: import flashinfer failed ({type(err).__name__}: {err})"
    return True, ""


#: Names FlashInfer gives its SM90 fused-MoE module (the second: its H20 variant).
SM90_MODULES = ("fused_moe_90", "fused_moe_90_h20_prebuilt_d")


def _module_built(names, aot_artifacts, jit_dir) -> bool:
    """Whether one of FlashInfer's modules ``names`` loads without compiling: prebuilt
    (``aot_artifacts(name)`` non-empty: its wheel or ``flashinfer-jit-cache``) or compiled
    before into ``jit_dir/<name>/<name>.so``."""
    return any(aot_artifacts(n) or (jit_dir / n / f"{n}.so").exists() for n in names)


@functools.cache
def _module_ready() -> tuple[bool, str]:
    """Whether FlashInfer's SM90 fused-MoE module is built (checked once per process)."""
    try:
        from flashinfer.jit import env
    except ImportError:  # a FlashInfer that does not say: as before, assume it is
        return True, ""
    get_artifacts = getattr(env, "get_aot_artifacts", None)
    jit_dir = getattr(env, "FLASHINFER_JIT_DIR", None)
    if get_artifacts is None or jit_dir is None:
        return True, ""
    if _module_built(SM90_MODULES, get_artifacts, jit_dir):
        return True, ""
    return False, (
        "FlashInfer's SM90 fused-MoE module is not built: its first call would compile it "
        "(many minutes). Install FlashInfer's prebuilt kernels (flashinfer-jit-cache), or "
        "call once with backend='flashinfer' to build it"
    )


@functools.cache
def _device_verdict(index: int) -> tuple[bool, str]:
    cap = torch.cuda.get_device_capability(index)
    if cap != SM90:
        name = torch.cuda.get_device_name(index)
        return False, f"needs an SM90 (Hopper) GPU; cuda:{index} is {name} (sm_{cap[0]}{cap[1]})"
    return True, ""


class FlashInferBackend(Backend):
    """FlashInfer's SM90 CUTLASS fused MoE (standard dispatch format, fused op only).

    Args:
        options: how FlashInfer chooses its kernels (default: ``FlashInferOptions()``, its
            autotuner over every bucket up to 8192 tokens at the first call); recorded in every
            prepared weight set and read from there by its first call.
        name: the name it is registered and selected under (``register``); a backend with
            options of its own needs a name of its own beside the default ``"flashinfer"``.
    """

    name = NAME

    def __init__(self, options: FlashInferOptions | None = None, *, name: str = NAME) -> None:
        self.options, self.name = options_and_name(
            options, FlashInferOptions, FlashInferOptions(), name
        )
        self.capabilities = Capabilities(
            devices=frozenset({"cuda"}),
            dtypes=ACTIVATION_DTYPES,
            schemes=SUPPORTED_SCHEMES,
            activations=frozenset(ACTIVATION_TYPES),
            align_h=ALIGN,
            align_i=ALIGN,
            extended_swiglu=True,
        )
        self.fused_ops = {STANDARD: fused_standard}
        self.core = None

    def available(self) -> tuple[bool, str]:
        """Needs the flashinfer package and an SM90 GPU."""
        ok, reason = _installed()
        if not ok:
            return ok, reason
        if not torch.cuda.is_available():
            return False, "needs a CUDA GPU (SM90)"
        return _device_verdict(torch.cuda.current_device())

    def measuring(self, tokens) -> FlashInferBackend:
        """For a benchmark at ``tokens``: the same backend with FlashInfer's autotuner
        profiling exactly those counts (``FlashInferOptions.tune_tokens``, reaching the
        largest), so each count runs the tactics tuned for it rather than its nearest
        bucket's; itself where tuning is off or no count is positive."""
        counts = tuple(sorted({int(t) for t in tokens if t > 0}))
        if not self.options.autotune or not counts:
            return self
        options = dataclasses.replace(
            self.options,
            tune_tokens=counts,
            tune_max_tokens=max(counts[-1], self.options.tune_max_tokens),
        )
        return FlashInferBackend(options, name=self.name)

    def ready(self) -> tuple[bool, str]:
        """Ready for ``backend="auto"`` once FlashInfer's SM90 fused-MoE module is built
        (prebuilt or compiled before): otherwise a first call would compile it for many
        minutes. Checked once per process."""
        return _module_ready()

    def supports(self, problem: MoeProblem) -> tuple[bool, str]:
        """Declared capabilities, plus what each weight format runs with."""
        ok, reason = super().supports(problem)
        if not ok:
            return ok, reason
        scheme = problem.w13_scheme
        if scheme.family == "plain" and scheme.weight_format != _dtype_name(problem.dtype):
            return False, (
                f"plain weights run in the input dtype: {scheme.weight_format} weights with "
                f"{_dtype_name(problem.dtype)} inputs"
            )
        if scheme.family != "plain" and problem.dtype != torch.bfloat16:
            return False, f"{scheme.name} weights run with bf16 inputs, got {problem.dtype}"
        if scheme.family == "fp8" and problem.interleaved:
            return False, (
                "interleaved gate/up rows of 128x128 block fp8 weights share a scale block "
                "between gate and up rows; store them gate-then-up"
            )
        gated = ACTIVATIONS.get(problem.activation, True)
        if scheme.family == "fp8" and gated and problem.intermediate_size % ALIGN:
            return False, (
                f"128x128 block fp8 with I={problem.intermediate_size}: I must be a multiple "
                f"of {ALIGN}, or padding the gate and up halves would split a scale block"
            )
        if scheme.family == "fp8" and problem.has_bias:
            return False, "biases are not implemented with block-scaled fp8 weights"
        return True, ""

    def prepare_weights(self, weights: ExpertWeights, spec: ExpertSpec) -> PreparedWeights:
        """FlashInfer's layouts, once: w13 rows up-then-gate, mxfp4 interleaved with folded
        scales, biases and swiglu parameters as the kernels read them; the backend's options
        travel with them to the first call (its tuning)."""
        return prepare(weights, spec, self.name, self.options)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype)
    )


def register(
    backend: FlashInferBackend, registry: Registry | None = None, *, replace: bool = False
) -> FlashInferBackend:
    """Make ``backend`` selectable by its name in ``registry`` (default: the one every entry
    point uses)."""
    if not isinstance(backend, FlashInferBackend):
        raise TypeError(f"backend must be a FlashInferBackend, got {type(backend).__name__}")
    registry = DEFAULT_REGISTRY if registry is None else registry
    return registry.register_backend(backend, replace=replace)


register(FlashInferBackend())
