# Backend "triton": fused MoE kernels for CUDA GPUs (and the Triton interpreter on CPU).
#
# Importing this package registers the backend object (default options; its fused op for the
# "standard" dispatch format and its core for the grouped layout) in the default registry.
# Both run the one kernel sequence of ``experts.run_kernel_sequence``. A backend with other
# options (``TritonOptions``) is registered under a name of its own with ``register``; its
# prepared weights carry the options to every launch. Layout of the package:
#   options.py       TritonOptions: every switch of the kernel sequence, frozen and validated
#   experts.py       public launcher: validates, allocates (cached workspaces), launches
#   _prepare.py      each weight described for the kernel and re-laid once (prepare time)
#   _align.py        expert alignment kernels and the top-k reduction kernel
#   _gemm_kernel.py  the grouped GEMM kernel (all schemes, fused activation)
#   _activation.py   the activation math of its epilogue, and the same as a kernel of its own
#   _weight_decode.py weight tiles as its K loop reads them: scale codes, packed 4-bit and fp4
#                    decodes (inline PTX on the GPU)
#   _quant_kernel.py GEMM-input quantization (fp8 per token / per 128, int8) on the GPU
#   _pdl.py          programmatic dependent launch: how each kernel waits for its predecessor
#   _overlap.py      a GEMM launch overlapping the one before: GEMM2 streamed behind GEMM1,
#                    early L2 prefetch
#   _launch.py       every kernel launch: compiled kernels cached per argument key (eager cost)
#   tile_config.py   heuristic tiles, tuned JSON files (user folder, then configs/)
#   tune.py          ``moerunner tune``: searches tiles on the current GPU and writes them
#   autotune.py      ``autotune="first_call"``: a missing token bucket tuned on its first call
#   hooked.py        the sequence split around hooks (moerunner.hooks): calls with hooks only
#   lora.py          LoRA kernels' launchers: in the hooked sequence, or its deltas in the fused
#                    one (decode sizes)

from __future__ import annotations

import dataclasses

import torch
import triton

from ...config import ACTIVATIONS, ExpertSpec
from ...dispatch.formats import STANDARD
from ...registry import DEFAULT_REGISTRY, Registry
from ...weights import ExpertWeights, PreparedWeights
from ..base import Backend, Capabilities, MoeProblem
from ..option_fields import options_and_name
from . import _gemm_kernel
from ._align import MAX_EXPERTS
from ._prepare import SUPPORTED_SCHEMES, WeightLayout, fragment_ok, prepare
from ._step import experts_step, layer_step
from .experts import ROUTING_DTYPES, fused_standard, grouped_core
from .hooked import hooked_core, hooked_standard
from .lora import sequence_lora
from .options import DEFAULT_OPTIONS, PREPARE_TIME_FIELDS, TritonOptions

NAME = "triton"

__all__ = [
    "NAME",
    "TritonBackend",
    "TritonOptions",
    "WeightLayout",
    "interpreted",
    "register",
    "with_options",
]


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when triton was imported)."""
    interpreter = getattr(triton.runtime, "interpreter", None)
    kind = getattr(interpreter, "InterpretedFunction", None)
    return kind is not None and isinstance(_gemm_kernel.moe_gemm_kernel, kind)


class TritonBackend(Backend):
    """Fused grouped-GEMM MoE kernels written in Triton.

    Args:
        options: the kernel sequence's switches (default: ``TritonOptions()``, the measured
            best); recorded in every prepared weight and read from there by each launch.
        name: the name it is registered and selected under (``register``); a backend with
            options of its own needs a name of its own beside the default ``"triton"``.
    """

    name = NAME

    def __init__(self, options: TritonOptions | None = None, *, name: str = NAME) -> None:
        self.options, self.name = options_and_name(options, TritonOptions, DEFAULT_OPTIONS, name)
        devices = {"cuda", "cpu"} if interpreted() else {"cuda"}
        self.capabilities = Capabilities(
            devices=frozenset(devices),
            dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
            schemes=SUPPORTED_SCHEMES,
            activations=frozenset(ACTIVATIONS),
            hooks=True,
        )
        # The ops read the options from the prepared weights, so every triton backend
        # shares them.
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
        if ok and problem.num_experts > MAX_EXPERTS:
            return False, f"more than {MAX_EXPERTS} experts (the expert alignment's bound)"
        if ok and problem.hooks and fragment_ok(problem.w13_scheme, self.options):
            return False, (
                "hooks need GEMM1's columns in row order; e2m1 weights in the fragment layout "
                "store gate/up row pairs (a backend of TritonOptions(e2m1_layout='split') runs "
                "them)"
            )
        return ok, reason

    def prepare_weights(self, weights: ExpertWeights, spec: ExpertSpec) -> PreparedWeights:
        """Views of the stored layouts for the kernels (no copy for contiguous weights;
        packed 4-bit weights re-laid as ``options.e2m1_layout`` says), with this backend's
        options and the weights' tuned tiles (found in ``options.tile_dirs``, then shipped)."""
        return prepare(weights, spec, self.name, self.options)

    def __repr__(self) -> str:
        if self.options == DEFAULT_OPTIONS:
            return f"<backend {self.name}>"
        return f"<backend {self.name} {self.options!r}>"


def with_options(prepared: PreparedWeights, options: TritonOptions) -> PreparedWeights:
    """``prepared`` (triton weights) run with ``options`` instead of the ones it was prepared
    with, sharing its tensors: for options read per call. Raises ValueError where a prepare
    time option (``e2m1_layout``, ``tile_dirs``) differs: prepare the weights again then."""
    if not isinstance(options, TritonOptions):
        raise TypeError(f"options must be a TritonOptions, got {type(options).__name__}")
    if not isinstance(prepared.options, TritonOptions):
        raise ValueError(f"prepared weights of backend {prepared.backend!r} have no triton options")
    if options.differs_at_prepare(prepared.options):
        raise ValueError(
            f"options differ from the prepared weights' in a prepare time field "
            f"({', '.join(PREPARE_TIME_FIELDS)}): prepare the weights with a backend of "
            f"these options"
        )
    return dataclasses.replace(prepared, options=options)


def triton_fused_standard(dispatch_output, prepared: PreparedWeights, hooks=None) -> torch.Tensor:
    """Standard format in one kernel sequence: ``[T, H]`` weighted and reduced over k
    (``hooks``: LoRA records at decode sizes inside the sequence, ``lora.sequence_lora``;
    others through the hooked sequence of ``hooked.py``)."""
    topk = dispatch_output.topk
    deltas = None
    if hooks is not None:
        num_rows, top_k = topk.ids.numel(), topk.ids.shape[-1]
        deltas = sequence_lora(hooks, num_rows, top_k, prepared.options)
        if deltas is None:
            return hooked_standard(
                dispatch_output.hidden_states, topk.weights, topk.ids, prepared, hooks
            )
    return fused_standard(
        dispatch_output.hidden_states,
        topk.weights,
        topk.ids,
        prepared,
        check_ids=dispatch_output.check_ids,
        deltas=deltas,
    )


# Checks ``dispatch_output.check_ids`` inside its top-k reduction (no launch of its own).
triton_fused_standard.checks_ids_on_device = True
# Reads int32/int64 ids and fp32/bf16/fp16 weights as they come (no conversion launches).
triton_fused_standard.routing_dtypes = ROUTING_DTYPES
# Joins a layer call's routing and expert launches into one replay (``_step``).
triton_fused_standard.layer_step = layer_step
# Replays a pre-routed call's expert launches behind no other Python (``_step``).
triton_fused_standard.call_step = experts_step


def triton_core(
    x_MH: torch.Tensor, expert_offsets: torch.Tensor, prepared: PreparedWeights, hooks=None
) -> torch.Tensor:
    """Grouped layout through the same kernel sequence (no routing weights)."""
    if hooks is not None:
        return hooked_core(x_MH, expert_offsets, prepared, hooks)
    return grouped_core(x_MH, expert_offsets, prepared)


def register(
    backend: TritonBackend, registry: Registry | None = None, *, replace: bool = False
) -> TritonBackend:
    """Make ``backend`` selectable by its name in ``registry`` (default: the one every entry
    point uses): ``register(TritonBackend(TritonOptions(e2m1_layout="split"),
    name="triton-split"))``, then ``backend="triton-split"`` in ``fused_moe``, ``MoE`` or
    ``MoeRunner``. ``replace=True`` swaps a backend already registered under that name."""
    if not isinstance(backend, TritonBackend):
        raise TypeError(f"backend must be a TritonBackend, got {type(backend).__name__}")
    registry = DEFAULT_REGISTRY if registry is None else registry
    return registry.register_backend(backend, replace=replace)


register(TritonBackend())
