"""The one tolerance check every test, ``check`` and the demo use against the reference.

``compare(out, ref)`` reports NaN/Inf first, then the max and RMS error relative to the
reference's max magnitude and RMS, and where the worst element is. ``assert_close`` raises
``AssertionError`` (this is a testing helper) with that report when a bound is exceeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ErrorReport:
    """Error of ``out`` against a float64 reference."""

    max_rel: float  # max |out - ref| / max |ref|
    rms_rel: float  # rms(out - ref) / rms(ref)
    nonfinite: int  # NaN/Inf elements in out
    worst_index: tuple[int, ...]
    worst_out: float
    worst_ref: float

    def __str__(self) -> str:
        return (
            f"max rel {self.max_rel:.3e}, rms rel {self.rms_rel:.3e}, "
            f"non-finite {self.nonfinite}, worst at {list(self.worst_index)}: "
            f"out {self.worst_out:.6g} vs ref {self.worst_ref:.6g}"
        )


def compare(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> ErrorReport:
    """Compare ``out`` (any dtype/device) with ``ref`` (float64) of the same shape.

    ``floor``: the least magnitude the errors are taken relative to (max and RMS). Where the
    reference's few elements are sums that cancel (one token, H = 1), its own max is far
    below the terms whose rounding makes the error; pass the terms' typical magnitude.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape {list(out.shape)} differs from reference {list(ref.shape)}")
    o = out.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    nonfinite = int((~torch.isfinite(o)).sum())
    if o.numel() == 0:
        return ErrorReport(0.0, 0.0, 0, (), 0.0, 0.0)
    diff = torch.where(torch.isfinite(o), (o - r).abs(), torch.full_like(o, float("inf")))
    flat = int(torch.argmax(diff))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), o.shape))
    scale = max(r.abs().max().item(), floor, 1e-30)
    rms_ref = max(r.square().mean().sqrt().item(), floor, 1e-30)
    finite_diff = torch.where(torch.isfinite(diff), diff, 0.0)
    return ErrorReport(
        max_rel=diff.max().item() / scale,
        rms_rel=finite_diff.square().mean().sqrt().item() / rms_ref,
        nonfinite=nonfinite,
        worst_index=index,
        worst_out=o.reshape(-1)[flat].item(),
        worst_ref=r.reshape(-1)[flat].item(),
    )


# Error bounds (max |out - ref| / max |ref|) of one MoE call against the float64 reference.
# Plain dtypes: fp32 keeps ~1e-7 per op through two GEMMs; bf16 / fp16 round inputs, weights,
# the stored GEMM1 output and the activation to 8 / 11 significant bits. Schemes that quantize
# activations add, at most, a rare one-quantum rounding flip of one GEMM input element between
# a kernel's fp32 and the reference's float64 intermediate (the reference quantizes GEMM2's
# input from the intermediate rounded to the hidden dtype, as the kernels store it; from the
# float64 value about 3 % of the elements flipped in bf16, too many for this bound at small K).
DTYPE_BOUND = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
ACTIVATION_QUANT_BOUND = 5e-3


def error_bound(dtype: torch.dtype, quantizes_activations: bool) -> float:
    """The bound a backend must meet for ``dtype`` hidden states and a scheme."""
    return DTYPE_BOUND[dtype] + (ACTIVATION_QUANT_BOUND if quantizes_activations else 0.0)


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    max_rel: float,
    rms_rel: float | None = None,
    what: str = "",
    floor: float = 0.0,
) -> ErrorReport:
    """Raise AssertionError with the report if NaN/Inf or the relative errors exceed bounds
    (relative to at least ``floor``, see ``compare``)."""
    report = compare(out, ref, floor)
    rms_bound = max_rel if rms_rel is None else rms_rel
    if report.nonfinite or report.max_rel > max_rel or report.rms_rel > rms_bound:
        raise AssertionError(f"{what}: {report} (bounds: max {max_rel:g}, rms {rms_bound:g})")
    return report
