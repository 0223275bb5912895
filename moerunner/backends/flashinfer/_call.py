# Stage "experts" of the flashinfer backend (private): one ``cutlass_fused_moe`` call for the
# standard dispatch format. FlashInfer permutes the rows, runs both grouped GEMMs with the
# activation fused, and sums each token's k rows weighted by its routing weights; ids outside
# [0, E) (-1: not on this rank) are skipped by its expert-range check. Every launch stays on
# the device, so a call is CUDA-graph capturable once the module is loaded and tuned.
#
# Kernel choice: FlashInfer picks each GEMM's CUTLASS tile per token-count bucket with its own
# autotuner. Untuned, it runs a fallback tile that can be tens of times slower (an SM90 MXFP4
# GPT-OSS layer measured 10 ms at T = 16 against 0.38 ms tuned), so the first call of each
# prepared weight set profiles every bucket once (``FlashInferOptions``), outside any capture.
# A tuning pass in which every tactic fails to profile leaves FlashInfer on that fallback
# without an error (it logs at debug level); the backend then notes it on the prepared weights
# and warns (``_check_profiled``). With FLASHINFER_DISABLE_JIT set, the profiling needs
# FlashInfer's ``trtllm_utils`` module (the delay kernel its timer launches first) among the
# prebuilt modules: without it every bf16 and MXFP4 tactic failed and a layer ran 3.3-5.3x
# slower than tuned (bf16; mxfp4 1.1-2.3x) on an H100.

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...weights import UNTUNED_NOTE, PreparedWeights
from ..option_fields import check_bool, check_int

#: FlashInfer's own default for the largest token count its buckets reach.
DEFAULT_TUNE_MAX_TOKENS = 8192


@dataclass(frozen=True)
class FlashInferOptions:
    """The flashinfer backend's options: how FlashInfer chooses its kernels.

    ``autotune``: profile FlashInfer's tactics at the first call of each prepared weight set
    (seconds, once per shape and process; FlashInfer keeps the winners per token bucket).
    ``tune_max_tokens``: the largest token count the buckets reach (FlashInfer's
    ``tune_max_num_tokens``); larger batches use the last bucket's tactic.
    ``tune_tokens``: profile only these buckets (each should be one of FlashInfer's buckets,
    e.g. powers of two up to 256); ``None`` profiles all of them up to ``tune_max_tokens``. A
    token count whose bucket was not profiled runs FlashInfer's fallback tactic.
    """

    autotune: bool = True
    tune_max_tokens: int = DEFAULT_TUNE_MAX_TOKENS
    tune_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_bool(self, "autotune")
        check_int(self, "tune_max_tokens", 1)
        top = self.tune_max_tokens
        if self.tune_tokens is not None:
            if not isinstance(self.tune_tokens, tuple) or not self.tune_tokens:
                raise TypeError(
                    "tune_tokens must be a non-empty tuple of ints or None, got "
                    f"{self.tune_tokens!r}"
                )
            for t in self.tune_tokens:
                if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= top:
                    raise ValueError(
                        f"tune_tokens must hold ints in [1, tune_max_tokens={top}], got {t!r}"
                    )


class _FlashInfer(NamedTuple):
    """What the backend uses of FlashInfer, imported once (``_flashinfer``)."""

    fused_moe: Any  # the ``flashinfer.fused_moe`` module
    activation_type: Any  # its ``ActivationType``
    autotune: Callable  # ``flashinfer.autotuner.autotune``
    # The custom ops its autotuner holds profiled tactics for (a set of names), or None
    # where this FlashInfer version does not expose them.
    profiled_ops: Callable[[], set[str] | None]


@functools.cache
def _flashinfer() -> _FlashInfer:
    """FlashInfer's parts the backend calls (``_FlashInfer``)."""
    from flashinfer import fused_moe
    from flashinfer.autotuner import autotune
    from flashinfer.fused_moe import ActivationType

    def profiled_ops() -> set[str] | None:
        from flashinfer.autotuner import AutoTuner

        cache = getattr(AutoTuner.get(), "profiling_cache", None)
        if not isinstance(cache, dict):
            return None
        return {str(getattr(key, "custom_op", "")) for key in cache}

    return _FlashInfer(fused_moe, ActivationType, autotune, profiled_ops)


#: The custom ops of ``cutlass_fused_moe``'s two GEMMs in FlashInfer's autotuner.
FUSED_MOE_OPS = ("trtllm::fused_moe::gemm1", "trtllm::fused_moe::gemm2")


def _check_profiled(prepared: PreparedWeights) -> None:
    """After a weight set's tuning call: if FlashInfer's autotuner holds no profiled tactic
    for the fused-MoE GEMMs, which then run its fallback tile, note it on the weights
    (``PreparedWeights.untuned``: benchmarks and ``moerunner tune`` leave such times out)
    and warn."""
    profiled = _flashinfer().profiled_ops()
    missing = [op for op in FUSED_MOE_OPS if profiled is not None and op not in profiled]
    if missing:
        prepared.notes.append(
            f"{UNTUNED_NOTE}FlashInfer's autotuner profiled no tactic for {missing}; "
            "its fallback tile runs"
        )
        warnings.warn(
            f"flashinfer backend: FlashInfer's autotuner profiled no tactic for {missing}: "
            "every candidate failed to profile (FLASHINFER_LOGGING_LEVEL=DEBUG shows why), so "
            "these GEMMs run FlashInfer's fallback tile, measured up to 5x slower than tuned ones "
            "on an H100. With FLASHINFER_DISABLE_JIT set, FlashInfer's prebuilt modules must "
            "include 'trtllm_utils' (its autotuner's delay kernel).",
            RuntimeWarning,
            stacklevel=4,
        )


def _call_kwargs(prepared: PreparedWeights) -> dict:
    """The call's constant keyword arguments, built at the first call and kept with the
    prepared weights (nothing per call but the tensors of the batch)."""
    t = prepared.tensors
    cached = t.get("call")
    if cached is not None:
        return cached
    activation_type = _flashinfer().activation_type
    kwargs = {
        "fc1_expert_weights": t["w13"],
        "fc2_expert_weights": t["w2"],
        "output_dtype": t["out_dtype"],
        "quant_scales": t["quant_scales"],
        "fc1_expert_biases": t["w13_bias"],
        "fc2_expert_biases": t["w2_bias"],
        "swiglu_alpha": t.get("swiglu_alpha"),
        "swiglu_beta": t.get("swiglu_beta"),
        "swiglu_limit": t.get("swiglu_limit"),
        "use_deepseek_fp8_block_scale": t["mode"] == "fp8_block",
        "use_w4_group_scaling": t["mode"] == "w4a16",
        "activation_type": getattr(activation_type, t["activation_type"]),
        "tune_max_num_tokens": prepared.options.tune_max_tokens,
    }
    t["call"] = kwargs
    return kwargs


def _capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s stream is being captured into a CUDA graph (a host query, no sync)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _tuning_context(prepared: PreparedWeights, x: torch.Tensor):
    """FlashInfer's tuning context for this call, or ``None`` where the call runs with the
    tactics chosen so far (tuned already, tuning off, or a CUDA graph being captured)."""
    t = prepared.tensors
    if t.get("tuned"):
        return None
    options: FlashInferOptions = prepared.options
    if not options.autotune:
        t["tuned"] = True
        return None
    if _capturing(x):
        if not t.get("warned_capture"):
            t["warned_capture"] = True
            warnings.warn(
                "flashinfer backend: first call of these weights is inside a CUDA-graph capture, "
                "where FlashInfer cannot profile its kernels; the graph runs its fallback tactic. "
                "Call the layer once outside the capture first.",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    autotune = _flashinfer().autotune
    if options.tune_tokens is None:  # FlashInfer's own buckets (any version's autotune)
        return autotune(True)
    return autotune(True, tuning_buckets=options.tune_tokens)


def fused_standard(dispatch_output, prepared: PreparedWeights) -> torch.Tensor:
    """Standard format: ``[T, H]`` in the hidden dtype, routing weights applied."""
    x = dispatch_output.hidden_states
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    topk = dispatch_output.topk
    fused_moe = _flashinfer().fused_moe
    kwargs = _call_kwargs(prepared)
    args = (
        x.contiguous(),
        topk.ids.to(torch.int32).contiguous(),
        topk.weights.to(torch.float32).contiguous(),
    )
    tuning = _tuning_context(prepared, x)
    if tuning is None:
        fused_moe.cutlass_fused_moe(*args, output=out, **kwargs)
    else:
        with tuning:
            fused_moe.cutlass_fused_moe(*args, output=out, **kwargs)
        prepared.tensors["tuned"] = True  # only once a tuning call has gone through
        _check_profiled(prepared)
    return out
