# Backend "triton": fused MoE kernels for CUDA GPUs (and the Triton interpreter on CPU).
#
# Importing this package registers the backend object (its fused op for the "standard"
# dispatch format and its core for the grouped layout) in the default registry. Both run the
# one kernel sequence of ``experts.run_kernel_sequence``. Layout of the package:
#   experts.py       public launcher: validates, allocates (cached workspaces), launches
#   _prepare.py      each weight described for the kernel and re-laid once (prepare time)
#   _align.py        expert alignment kernels and the top-k reduction kernel
#   _gemm_kernel.py  the grouped GEMM kernel (all schemes, fused activation)
#   _quant_kernel.py GEMM-input quantization (fp8 per token / per 128, int8) on the GPU
#   _pdl.py          programmatic dependent launch: how each kernel waits for its predecessor
#   _launch.py       every kernel launch: compiled kernels cached per argument key (eager cost)
#   tile_config.py   heuristic tiles and tuned JSON files in configs/
#   tune.py          ``moerunner tune``: searches tiles on the current GPU and writes them

from __future__ import annotations

import torch
import triton

from ...config import ACTIVATIONS, ExpertSpec
from ...dispatch.formats import STANDARD
from ...registry import DEFAULT_REGISTRY
from ...weights import ExpertWeights, PreparedWeights
from ..base import Backend, Capabilities, MoeProblem
from . import _gemm_kernel
from ._prepare import SUPPORTED_SCHEMES, prepare
from .experts import fused_standard, grouped_core

NAME = "triton"


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when triton was imported)."""
    interpreter = getattr(triton.runtime, "interpreter", None)
    kind = getattr(interpreter, "InterpretedFunction", None)
    return kind is not None and isinstance(_gemm_kernel.moe_gemm_kernel, kind)


class TritonBackend(Backend):
    """Fused grouped-GEMM MoE kernels written in Triton."""

    name = NAME

    def __init__(self) -> None:
        devices = {"cuda", "cpu"} if interpreted() else {"cuda"}
        self.capabilities = Capabilities(
            devices=frozenset(devices),
            dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
            schemes=SUPPORTED_SCHEMES,
            activations=frozenset(ACTIVATIONS),
        )
        self.fused_ops = {STANDARD: triton_fused_standard}
        self.core = triton_core

    def available(self) -> tuple[bool, str]:
        """Runs on a CUDA GPU, or on CPU in the Triton interpreter."""
        if interpreted() or torch.cuda.is_available():
            return True, ""
        return False, "needs a CUDA GPU (or the Triton interpreter, TRITON_INTERPRET=1)"

    def supports(self, problem: MoeProblem) -> tuple[bool, str]:
        """Declared capabilities, plus: the interpreter computes bf16 wrongly."""
        ok, reason = super().supports(problem)
        if ok and problem.device_type == "cpu" and problem.dtype == torch.bfloat16:
            return False, "bf16 is computed wrongly by the Triton CPU interpreter"
        return ok, reason

    def prepare_weights(self, weights: ExpertWeights, spec: ExpertSpec) -> PreparedWeights:
        """Views of the stored layouts for the kernels (no copy for contiguous weights)."""
        return prepare(weights, spec, NAME)


def triton_fused_standard(dispatch_output, prepared: PreparedWeights) -> torch.Tensor:
    """Standard format in one kernel sequence: ``[T, H]`` weighted and reduced over k."""
    topk = dispatch_output.topk
    return fused_standard(dispatch_output.hidden_states, topk.weights, topk.ids, prepared)


def triton_core(
    x_MH: torch.Tensor, expert_offsets: torch.Tensor, prepared: PreparedWeights
) -> torch.Tensor:
    """Grouped layout through the same kernel sequence (no routing weights)."""
    return grouped_core(x_MH, expert_offsets, prepared)


DEFAULT_REGISTRY.register_backend(TritonBackend())
