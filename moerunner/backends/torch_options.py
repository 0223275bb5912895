"""The torch backend's switches (``TorchOptions``): which form each call takes, by device,
dtype and rows, with the measurements that chose the defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights import PreparedWeights
from .option_fields import changed_repr, check_int, dtype_set, frozen_set

__all__ = ["DEFAULT_TORCH_OPTIONS", "TorchOptions"]


def _slow_cpu_half_gemms() -> frozenset:
    """The half dtypes whose CPU matmul PyTorch runs without oneDNN here (its own checks; a
    build without them counts as without oneDNN)."""
    checks = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }
    slow = set()
    for dtype, check in checks.items():
        try:
            fast = bool(getattr(torch.ops.mkldnn, check)())
        except (AttributeError, RuntimeError):
            fast = False
        if not fast:
            slow.add(dtype)
    return frozenset(slow)


_SLOW_CPU_HALF_GEMMS = _slow_cpu_half_gemms()


@dataclass(frozen=True, slots=True)
class TorchOptions:
    """Switches of the torch backend (defaults: the measured best), given to
    ``TorchBackend(options=...)``, recorded in the weights it prepares and read from there by
    each call, so backends with different options run side by side. Derive a variant with
    ``dataclasses.replace``; its ``repr`` rebuilds it.

    The CPU forms were measured per expert GEMM at the Qwen3-30B-A3B shape (H=2048, I=768,
    weights streamed from memory) on an AVX-512 / AMX-bf16 CPU with 2 threads, and checked
    on whole calls against transformers' experts (benchmarks/cpu_torch_vs_transformers.py);
    the float32 GEMMs of half dtypes (``cpu_float32_gemms``) on an AVX2 CPU with 2 threads,
    where PyTorch has no oneDNN half matmul. One default depends on the CPU at hand: that
    one's.
    """

    #: (device type, dtype) pairs whose calls run PyTorch's grouped GEMM over all experts at
    #: once (no host reads: CUDA graphs capture it). Plain weights with 16-byte aligned rows
    #: only; elsewhere one GEMM pair per expert hit (on CPU: the chunks below).
    grouped_mm: frozenset = frozenset({("cuda", torch.bfloat16)})
    #: Device types whose calls in training (the differentiable path) run the grouped GEMM
    #: in every dtype, beyond ``grouped_mm``'s pairs. CPU: autograd's per-expert work costs
    #: far more than the GEMMs (``benchmarks/training_step.py``, record
    #: cpu-training-step-2026-12-06: Qwen3-30B-A3B / 16 fp32, T = 256 and 1024, one GEMM pair
    #: per expert 0.08-0.12x transformers' grouped_mm experts, grouped 0.68-0.86x). CUDA fp16
    #: / fp32 (PyTorch's grouped GEMM there: one host read of the offsets and a GEMM per
    #: group in C++, as the per-expert form reads them too): Qwen3-30B-A3B fp32 on an H100 at
    #: T = 256 / 1024 17.7 / 21.4 ms a step against 52.3 / 49.7 per expert (record
    #: nvidia-h100-training-step-2026-12-07).
    grouped_training: frozenset = frozenset({"cpu", "cuda"})
    #: (device type, dtype) pairs whose grouped GEMMs in training compute their backward in
    #: float32. CPU bf16: PyTorch's CPU bf16 matmul with a row-major right operand (the input
    #: gradient, ``grad @ W``) ran 50-150x slower than the float32 product here (torch 2.13,
    #: [16-128, 1792] x [1792, 256]); whole training steps 1.5-11.9x faster: Qwen3-30B-A3B /
    #: 16 at T = 256 / 1024 45.1 / 173.0 -> 29.6 / 83.8 ms, Mixtral-8x7B / 16 776 / 3089 ->
    #: 83 / 260 ms (``benchmarks/training_step.py``, record
    #: cpu-training-step-fp32-backward-2026-12-06; transformers' grouped_mm experts, which
    #: keep PyTorch's backward, are now 1.6-11.5x slower).
    #: The backward holds a float32 copy of the weights while it runs.
    fp32_backward: frozenset = frozenset({("cpu", torch.bfloat16)})
    #: CPU dtypes whose expert GEMMs compute in float32: each expert's weight is copied to
    #: float32 when it runs (one buffer per GEMM and chunk), and the output is rounded as the
    #: dtype's own GEMM rounds it; training's grouped GEMMs run their forward in float32 too.
    #: Default: the half dtypes for which PyTorch has no oneDNN matmul on this CPU (its own
    #: checks, ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` and ``..._fp16_...``: x86
    #: without AVX-512 or AVX-NE-CONVERT; fp16 without AVX512-FP16), whose half matmul then
    #: falls back to a kernel with no blocking. On a 2-thread AVX2 CPU (torch 2.13), bf16 and
    #: fp16 ``[M, 2048] x [2048, 1536]`` ran at 20-24 GFLOP/s at every M, float32 at 20-142
    #: (7x from M = 128); per Qwen3-30B-A3B expert the upcast form ran GEMM1 1.3x faster at 3
    #: rows, 3.5x at 16 and 6x at 128 rows. Calls with at least ``cpu_float32_from_rows`` rows
    #: per expert hit on average run the row-major chunks, taking neither the grouped GEMMs
    #: (``cpu_grouped_dtypes``) nor the transposed form (``cpu_columns_dtypes``); fewer
    #: rows keep the half dtype's forms.
    cpu_float32_gemms: frozenset = _SLOW_CPU_HALF_GEMMS
    #: ... for experts with at least this many rows: below it the half GEMV is as fast as the
    #: upcast alone (1 row: 0.33 ms per Qwen3 GEMM1 against 0.33 ms of upcast; 2 rows 0.64
    #: against 0.99 ms upcast and float32 GEMM).
    cpu_float32_from_rows: int = 3
    #: CPU standard calls of these dtypes run as two grouped GEMMs over the valid rows instead
    #: of the chunks where ``cpu_grouped_large`` or ``cpu_grouped_hit_share`` says. bf16 (torch
    #: 2.13; 2.11 ran the GEMMs alone the same): Qwen3-30B-A3B's full experts (3.1M w13
    #: weights each) 1.4-1.6x at T = 1-64; DeepSeek-V3 at half H and I 1.26-1.31x at T = 1
    #: and 4; Mixtral-8x7B (I / 4) 1.4-1.6x at T = 1-32; small experts (H, I / 16 or / 4)
    #: 1.06-1.36x at T = 32-2048, but 0.88-0.94x where under a quarter of 128 are hit. fp32
    #: was mixed (0.8-1.6x) and keeps the chunks, whose forms were tuned for it.
    cpu_grouped_dtypes: frozenset = frozenset({torch.bfloat16})
    #: ... when at least one expert in this many is hit (the grouped GEMM visits every expert,
    #: which small experts hit by few rows do not repay),
    cpu_grouped_hit_share: int = 4
    #: ... or whatever is hit when each expert's w13 has at least this many weights.
    cpu_grouped_large: int = 1 << 20
    #: CPU chunk calls of these dtypes with fewer than ``cpu_columns_until`` rows per expert
    #: hit on average run transposed ("columns"): each expert writes a column block of [N,
    #: rows] buffers and the sum is kept as [H, T]. bf16: W @ x^T (weights as the left
    #: operand) ran 1.2-1.9x faster than x @ W^T from 2 to about 130 rows, a GEMV 1.15-1.45x
    #: faster than a one-row GEMM; with more rows x @ W^T is as fast or faster, and a
    #: transposed sum of many tokens is not (T = 3072-4096 ran 1.2-1.3x slower transposed).
    #: fp32 runs row-major: GEMVs on strided fp32 vectors ran up to 2.6x slower.
    cpu_columns_dtypes: frozenset = frozenset({torch.bfloat16})
    cpu_columns_until: int = 160
    #: fp32 row-major forms by rows per expert: (N-split from, W @ x^T from, x @ W^T from).
    #: x @ W^T is fastest at 1-3 rows and from 48; from 3 to 4 rows its time grows 1.7-1.8x,
    #: and split in N into a batch of ``cpu_split_slice_rows``-row slices of W the product ran
    #: 1.4-1.9x faster at 4-15 rows. At 16-47 rows W @ x^T (copied into the rows) ran GEMM1
    #: 1.1-1.45x faster and GEMM2 up to 25% slower, whole calls at T = 256-512 7-12% faster;
    #: beyond that it was slower (up to 1.5x at odd row counts near 64). Other dtypes run
    #: x @ W^T.
    cpu_float32_row_forms: tuple = (4, 16, 48)
    cpu_split_slice_rows: int = 32
    #: Grouped rows per chunk of experts on CPU (an expert with more rows is a chunk of its
    #: own): the chunk's buffers and float32 activation temporaries stay ~1-3 MiB (in cache)
    #: whatever T is. Column buffers always have this leading dimension, so oneDNN sees the
    #: same strides call after call: with one per chunk size its primitive cache (1024
    #: entries) overflowed at T=512 and every GEMM rebuilt its primitive (3x slower calls).
    cpu_chunk_rows: int = 256

    def __post_init__(self) -> None:
        frozen_set(
            self,
            "grouped_mm",
            "(device type, dtype) pairs such as ('cuda', torch.bfloat16)",
            _device_dtype,
        )
        frozen_set(self, "grouped_training", "device types such as 'cpu'", _device_type)
        frozen_set(
            self,
            "fp32_backward",
            "(device type, dtype) pairs such as ('cpu', torch.bfloat16)",
            _device_dtype,
        )
        dtype_set(self, "cpu_float32_gemms")
        check_int(self, "cpu_float32_from_rows", 1)
        dtype_set(self, "cpu_grouped_dtypes")
        dtype_set(self, "cpu_columns_dtypes")
        check_int(self, "cpu_grouped_hit_share", 1)
        check_int(self, "cpu_grouped_large", 0)
        check_int(self, "cpu_columns_until", 0)
        check_int(self, "cpu_split_slice_rows", 1)
        check_int(self, "cpu_chunk_rows", 1)
        forms = self.cpu_float32_row_forms
        if not (
            isinstance(forms, tuple)
            and len(forms) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in forms)
            and forms[0] <= forms[1] <= forms[2]
        ):
            raise ValueError(
                f"TorchOptions.cpu_float32_row_forms must be three non-decreasing row counts "
                f"(N-split from, W @ x^T from, x @ W^T from), got {forms!r}"
            )

    def __repr__(self) -> str:
        return changed_repr(self)


def _device_type(name) -> bool:
    return isinstance(name, str) and bool(name)


def _device_dtype(pair) -> bool:
    return (
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and isinstance(pair[1], torch.dtype)
    )


#: The defaults (the registered ``torch`` backend's options).
DEFAULT_TORCH_OPTIONS = TorchOptions()


def _options(prepared: PreparedWeights) -> TorchOptions:
    """The options ``prepared`` was made with (the defaults for weights made by hand)."""
    options = prepared.options
    return options if isinstance(options, TorchOptions) else DEFAULT_TORCH_OPTIONS
