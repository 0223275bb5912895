"""Weight preparation shared by all backends: zero-padding to a kernel's alignment.

A backend declares ``align_h`` / ``align_i`` in its capabilities; before its own
``prepare_weights`` runs (once per layer, never per call), the runner pads:

- I (w13 rows, w2 columns, w13 bias) to a multiple of ``align_i``, the gate and up halves
  each padded at their own end so they stay separately aligned (interleaved gate/up rows
  get whole zero pairs at the end);
- H (w13 columns, w2 rows, w2 bias) to a multiple of ``align_h``; the runner then pads the
  hidden states' last dim per call and trims the output back.

Zero padding is exact for every activation: a padded unit has gate = up = 0 and
act(0) * 0 = 0 (swiglu_oai: (0 + 1) * 0 * sigmoid(0) = 0; relu2: relu(0)^2 = 0), and its
w2 column is zero. Quantized weights pad through ``QuantizedWeight.pad`` (which raises where
a format's block structure cannot express the padding).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..config import ExpertSpec
from ..weights import ExpertWeights, is_quantized


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def _pad_plain(w: torch.Tensor, segments: int, rows_per_segment: int, k: int) -> torch.Tensor:
    """Zero-pad ``[E, N, K]`` (or a bias ``[E, N]``) per row segment and along K."""
    bias = w.dim() == 2
    w3 = w[..., None] if bias else w
    e, n, k0 = w3.shape
    parts = w3.reshape(e, segments, n // segments, k0)
    parts = F.pad(parts, (0, (0 if bias else k - k0), 0, rows_per_segment - n // segments))
    out = parts.reshape(e, segments * rows_per_segment, parts.shape[-1])
    return out[..., 0] if bias else out


def _pad(w, segments: int, rows_per_segment: int, k: int | None):
    if w is None:
        return None
    if is_quantized(w):
        return w.pad(rows_per_segment=rows_per_segment, k=k, segments=segments)
    return _pad_plain(w, segments, rows_per_segment, k if k is not None else 1)


def pad_to_alignment(
    weights: ExpertWeights, spec: ExpertSpec, align_h: int, align_i: int
) -> tuple[ExpertWeights, ExpertSpec, list[str]]:
    """Weights and spec padded so H % align_h == 0 and I % align_i == 0, and what was done."""
    h0, i0 = spec.hidden_size, spec.intermediate_size
    h1, i1 = round_up(h0, align_h), round_up(i0, align_i)
    if (h1, i1) == (h0, i0):
        return weights, spec, []
    if spec.gated and not spec.gate_up_interleaved:
        segments, rows = 2, i1  # gate half and up half, each padded at its end
    else:
        segments, rows = 1, (2 * i1 if spec.gated else i1)
    padded = ExpertWeights(
        w13=_pad(weights.w13, segments, rows, h1),
        w2=_pad(weights.w2, 1, h1, i1),
        w13_bias=_pad(weights.w13_bias, segments, rows, None),
        w2_bias=_pad(weights.w2_bias, 1, h1, None),
        gate_up_interleaved=weights.gate_up_interleaved,
    )
    notes = []
    if i1 != i0:
        how = "gate and up halves separately" if segments == 2 else "at the end"
        notes.append(f"padded I {i0} -> {i1} ({how}) for alignment {align_i}")
    if h1 != h0:
        notes.append(
            f"padded H {h0} -> {h1} for alignment {align_h}; hidden padded per call, output trimmed"
        )
    return padded, dataclasses.replace(spec, hidden_size=h1, intermediate_size=i1), notes
