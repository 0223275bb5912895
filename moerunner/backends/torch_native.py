"""Backend ``torch``: portable PyTorch experts for any device, every scheme (emulated).

One GEMM1 -> activation -> GEMM2 per non-empty expert (never a per-token loop), or, on CUDA
for bf16 weights with 16-byte aligned rows, PyTorch's grouped GEMM over all experts at once
with no host sync.

On CPU a bf16 standard call with large experts, or with at least a quarter of them hit, runs
as two grouped GEMMs (``_cpu_grouped``). Otherwise the experts hit run in chunks of
consecutive experts (at most 256 grouped rows, or one expert with more): each chunk gathers
its rows once, runs every expert's GEMM1 into one buffer, the activation once, every
expert's GEMM2, and (standard dispatch, as a fused op) adds its weighted rows into one
float32 sum; few Python-level ops per expert, and no [T*k, H] copies. Each expert GEMM
takes the form this CPU ran fastest for its dtype and row count (the measurements are on
``TorchOptions``).

Quantized weights stay quantized in the prepared weights: each expert GEMM dequantizes its
expert's weight to float32 when it runs (``ExpertDequantizer``), so a call holds one expert's
float32 weight at a time, never all experts' (``[E, N, K]`` float32 of DeepSeek-V3 fp8_block
would be 45 GB beside the 11 GB it is stored in). At run time GEMM
inputs are quantized exactly as the scheme's kernels quantize them (dynamic per-token fp8,
per-128-group fp8, MX blocks...) and multiplied in float32, so the result equals what a real
kernel computes up to accumulation order. As in the fused kernels, whose GEMM1 epilogue
applies the activation to its float32 accumulators, a quantized GEMM1's float32 output goes
to the activation unrounded, and only the activation's output is stored in the input dtype
(and from there quantized for GEMM2). Rounding GEMM1's output to bf16 first would move ~3 %
of the fp8 codes of GEMM2's input by one step: ~1.5 % relative error against the float64
reference, where the kernels sit at ~0.3 %.

Shape suffixes: T tokens, H hidden, I intermediate, N a GEMM's output width (2I or H), K its
input width, M one expert's rows, R one chunk's rows, P slices of N, S rows per slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..activations import apply_activation
from ..config import ACTIVATIONS, ExpertSpec
from ..dispatch.formats import STANDARD, StandardDispatchOutput
from ..dispatch.permute import group_pairs, is_scratch
from ..hooks import HookRows, MoeHooks, RowHooks, expert_of_rows
from ..quant.families import CODECS
from ..registry import DEFAULT_REGISTRY
from ..weights import ExpertWeights, PreparedWeights, is_quantized
from .base import Backend, Capabilities, SchemeSupport
from .option_fields import options_and_name
from .torch_options import DEFAULT_TORCH_OPTIONS, TorchOptions, _options

NAME = "torch"
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


class TorchBackend(Backend):
    """Plain PyTorch; runs wherever torch runs."""

    name = NAME

    def __init__(self, options: TorchOptions | None = None, *, name: str = NAME) -> None:
        self.options, self.name = options_and_name(
            options, TorchOptions, DEFAULT_TORCH_OPTIONS, name
        )
        self.capabilities = Capabilities(
            devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
            dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
            # Every family with a codec, mixed w13/w2 schemes included: weights are
            # dequantized and each GEMM quantizes its input by its own weight's scheme.
            schemes=SchemeSupport(frozenset(c.name for c in CODECS), mixed=True),
            activations=frozenset(ACTIVATIONS),
            extended_swiglu=True,
            hooks=True,
            static_input_scales=True,
        )
        self.fused_ops = {STANDARD: torch_fused_standard}
        self.core = torch_core

    def prepare_weights(self, weights: ExpertWeights, spec: ExpertSpec) -> PreparedWeights:
        """Plain weights are used as they are; quantized ones stay quantized and are
        dequantized one expert at a time when it runs (module doc). ``w13_experts`` /
        ``w2_experts``: expert ``e``'s ``[N, K]`` weight by index."""
        prepared = PreparedWeights(
            backend=self.name, source=weights, spec=spec, options=self.options
        )
        tensors = prepared.tensors
        tensors["w13"], tensors["w2"] = weights.w13, weights.w2
        if is_quantized(weights.w13):
            tensors["w13_experts"] = ExpertDequantizer(weights.w13)
            tensors["w2_experts"] = ExpertDequantizer(weights.w2)
            tensors["scheme"] = weights.w13.scheme
            tensors["scheme2"] = weights.w2.scheme
            tensors["input_scale"] = weights.w13.input_scale  # [E] or None (dynamic)
            tensors["input_scale2"] = weights.w2.input_scale
            prepared.notes.append("w13/w2 dequantized to float32 per expert as it runs")
        elif weights.w13.device.type == "cpu":  # one view per expert, made once, not per call
            tensors["w13_experts"] = weights.w13.unbind(0)
            tensors["w2_experts"] = weights.w2.unbind(0)
        else:
            tensors["w13_experts"], tensors["w2_experts"] = weights.w13, weights.w2
        tensors["w13_bias"], tensors["w2_bias"] = weights.w13_bias, weights.w2_bias
        # What the grouped GEMM needs of the weights, known once (``_grouped_fits``).
        rows = tensors["grouped_rows"] = _grouped_rows(weights.w13, spec)
        tensors["grouped_aligned"] = rows and _aligned16(weights.w13) and _aligned16(weights.w2)
        return prepared

    def __repr__(self) -> str:
        if self.options == DEFAULT_TORCH_OPTIONS:
            return f"<backend {self.name}>"
        return f"<backend {self.name} {self.options!r}>"


class ExpertDequantizer:
    """A quantized weight's experts by index: ``self[e]`` is expert ``e``'s float32 ``[N, K]``,
    dequantized when asked (``QuantizedWeight.dequantize_experts``: bit for bit the rows of a
    whole dequantization, without a device sync) and not kept."""

    __slots__ = ("weight",)

    def __init__(self, weight) -> None:
        self.weight = weight

    def __len__(self) -> int:
        return self.weight.shape[0]

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.weight.dequantize_experts(int(e))[0]


def _gemm_input(x: torch.Tensor, scheme, input_scale: torch.Tensor | None) -> torch.Tensor:
    """What a kernel multiplies: the quantized-dequantized activation (fp32) or x itself."""
    if scheme is None:
        return x
    from ..quant import fake_quantize_activation

    q = fake_quantize_activation(x, scheme, input_scale=input_scale)
    if torch.is_grad_enabled() and x.requires_grad:  # (the gradient passes straight through)
        return x.float() + (q - x.float()).detach()
    return q


def _linear(
    x: torch.Tensor,
    w_NK: torch.Tensor,
    bias: torch.Tensor | None,
    scheme,
    input_scale: torch.Tensor | None = None,
    float32: bool = False,
) -> torch.Tensor:
    """x @ w.T (+ bias) with the scheme's activation quantization; fp32 result if biased.
    ``float32``: plain weights multiplied in float32, rounded to x's dtype
    (``_float32_gemm``)."""
    if float32 and scheme is None:
        out = (x.float() @ w_NK.transpose(-2, -1).float()).to(x.dtype)
    else:
        out = _gemm_input(x, scheme, input_scale) @ w_NK.transpose(-2, -1).to(
            torch.float32 if scheme is not None else x.dtype
        )
    if bias is not None:
        out = out.float() + bias.float()
    return out


def _float32_gemm(x_RK: torch.Tensor, options: TorchOptions) -> bool:
    """Whether a CPU expert GEMM on rows ``x`` multiplies in float32: a dtype of
    ``options.cpu_float32_gemms`` and at least ``cpu_float32_from_rows`` rows."""
    return (
        x_RK.device.type == "cpu"
        and x_RK.dtype in options.cpu_float32_gemms
        and x_RK.shape[0] >= options.cpu_float32_from_rows
    )


def _expert_forward(
    x_MH: torch.Tensor, e: int, prepared: PreparedWeights, out_MH: torch.Tensor
) -> None:
    """One expert on its rows, written into ``out_MH`` (a row slice of the core's output)."""
    t = prepared.tensors
    scheme, scheme2 = t.get("scheme"), t.get("scheme2")
    b13 = None if t["w13_bias"] is None else t["w13_bias"][e]
    b2 = None if t["w2_bias"] is None else t["w2_bias"][e]
    s13, s2 = (None if t.get(k) is None else t[k][e] for k in ("input_scale", "input_scale2"))
    h = _linear(x_MH, t["w13_experts"][e], b13, scheme, s13)  # float32 if quantized (doc)
    a = apply_activation(h if scheme is not None else h.to(x_MH.dtype), prepared.spec, e)
    a = a.to(x_MH.dtype)
    if scheme2 is None and b2 is None:  # plain weights: GEMM2 straight into the output rows
        torch.mm(a, t["w2_experts"][e].transpose(0, 1), out=out_MH)
    else:
        out_MH.copy_(_linear(a, t["w2_experts"][e], b2, scheme2, s2))


# CPU expert GEMMs take the form this CPU ran fastest for their dtype and row count, and
# run in chunks of consecutive experts (the measurements are on ``TorchOptions``).


def _cpu_mm_columns(out_MN: torch.Tensor, x_MK: torch.Tensor, w_NK: torch.Tensor) -> None:
    """``out = x @ w.T`` into the transposed view of a column block (bf16 forms above)."""
    if x_MK.shape[0] == 1:
        torch.mv(w_NK, x_MK[0], out=out_MN[0])
    else:
        torch.mm(w_NK, x_MK.T, out=out_MN.T)


def _cpu_mm_rows(
    out_MN: torch.Tensor, x_MK: torch.Tensor, w_NK: torch.Tensor, options: TorchOptions
) -> None:
    """``out = x @ w.T`` into a row block of a row-major buffer (fp32: the forms of
    ``options.cpu_float32_row_forms``; other dtypes x @ W^T)."""
    rows, n = x_MK.shape[0], w_NK.shape[0]
    if x_MK.dtype == torch.float32:
        split_from, transposed_from, plain_from = options.cpu_float32_row_forms
    else:
        split_from = transposed_from = plain_from = math.inf
    if rows < split_from or rows >= plain_from:
        torch.mm(x_MK, w_NK.T, out=out_MN)
    elif rows >= transposed_from:
        out_MN.copy_((w_NK @ x_MK.T).T)
    elif n % options.cpu_split_slice_rows == 0 and w_NK.is_contiguous():
        slice_rows = options.cpu_split_slice_rows
        parts = n // slice_rows
        w_PSK = w_NK.view(parts, slice_rows, -1)
        y_PMS = torch.bmm(x_MK.expand(parts, *x_MK.shape), w_PSK.transpose(1, 2))
        out_MN.view(rows, parts, slice_rows).copy_(y_PMS.transpose(0, 1))
    else:
        torch.mm(x_MK, w_NK.T, out=out_MN)


_SCHEME_KEYS = {"w13": ("scheme", "input_scale"), "w2": ("scheme2", "input_scale2")}


def _cpu_gemms(
    out_RN: torch.Tensor,
    x_RK: torch.Tensor,
    experts: list[tuple[int, int, int]],
    name: str,
    prepared: PreparedWeights,
    columns: bool,
) -> None:
    """GEMM ``name`` ("w13" or "w2") of each ``(expert, start, end)`` on its rows of the
    chunk, into its block of ``out``: plain weights in the fast forms (a bias added to the
    rounded product); quantized ones through ``_linear``, rounded once into the buffer."""
    t = prepared.tensors
    w, bias = t[f"{name}_experts"], t[f"{name}_bias"]
    scheme, scale = (t.get(k) for k in _SCHEME_KEYS[name])
    if scheme is not None:
        for e, start, end in experts:
            out_RN[start:end] = _linear(
                x_RK[start:end],
                w[e],
                None if bias is None else bias[e],
                scheme,
                None if scale is None else scale[e],
            )
        return
    options = _options(prepared)
    w32_NK = None  # one float32 weight buffer, refilled per expert (``cpu_float32_gemms``)
    for e, start, end in experts:
        x_MK, out_MN = x_RK[start:end], out_RN[start:end]
        if _float32_gemm(x_MK, options):
            if w32_NK is None:
                w32_NK = torch.empty(w[e].shape, dtype=torch.float32)
            y_MN = x_MK.new_empty((end - start, w32_NK.shape[0]), dtype=torch.float32)
            _cpu_mm_rows(y_MN, x_MK.float(), w32_NK.copy_(w[e]), options)
            out_MN.copy_(y_MN)
        elif columns:
            _cpu_mm_columns(out_MN, x_MK, w[e])
        else:
            _cpu_mm_rows(out_MN, x_MK, w[e], options)
    if bias is not None:
        for e, start, end in experts:
            out_RN[start:end] = out_RN[start:end].float() + bias[e].float()


def _cpu_chunk(
    x_RH: torch.Tensor,
    offsets: list[int],
    first_expert: int,
    prepared: PreparedWeights,
    columns: bool,
) -> torch.Tensor:
    """Experts ``first_expert...`` on the grouped rows of one chunk (``offsets``: their local
    bounds): GEMM1 per expert, the activation once, GEMM2 per expert; ``[R, H]`` in x's
    dtype, a transposed view for column chunks."""
    spec, rows = prepared.spec, x_RH.shape[0]
    chunk_rows = _options(prepared).cpu_chunk_rows

    def buffer(width: int, dtype: torch.dtype = x_RH.dtype) -> torch.Tensor:
        if not columns:
            return x_RH.new_empty((rows, width), dtype=dtype)
        return x_RH.new_empty((width, max(rows, chunk_rows)), dtype=dtype)[:, :rows].T

    experts = [
        (first_expert + i, offsets[i], offsets[i + 1])
        for i in range(len(offsets) - 1)
        if offsets[i + 1] > offsets[i]
    ]
    # A quantized GEMM1's output stays float32 up to the activation (module doc).
    quantized = prepared.tensors.get("scheme") is not None
    h_RN = buffer(prepared.tensors["w13"].shape[1], torch.float32 if quantized else x_RH.dtype)
    _cpu_gemms(h_RN, x_RH, experts, "w13", prepared, columns)
    # Activation in float32 (as the fused kernels do), rounded once into row-major GEMM2 input.
    row_experts = None
    if spec.activation.per_expert:  # the expert of each row, for per-expert parameters
        row_experts = torch.repeat_interleave(
            torch.tensor([e for e, _, _ in experts]),
            torch.tensor([end - start for _, start, end in experts]),
        )
    a_RI = x_RH.new_empty((rows, spec.intermediate_size)).copy_(
        apply_activation(h_RN, spec, row_experts)
    )
    y_RH = buffer(spec.hidden_size)
    _cpu_gemms(y_RH, a_RI, experts, "w2", prepared, columns)
    return y_RH


def _experts_hit(bounds: list[int], num_experts: int) -> int:
    """How many experts have rows, from the grouped rows' ``bounds`` (``group_pairs``)."""
    return sum(bounds[e + 1] > bounds[e] for e in range(num_experts))


def _cpu_float32_call(dtype: torch.dtype, rows: int, hit: int, options: TorchOptions) -> bool:
    """Whether a CPU call of ``rows`` grouped rows over ``hit`` experts mostly multiplies in
    float32 (``cpu_float32_gemms``): at least ``cpu_float32_from_rows`` rows per expert hit
    on average. Such calls run the row-major chunks; the others take the half dtype's forms
    (transposed, or the grouped GEMMs), their experts of enough rows still in float32
    within the chunks."""
    return dtype in options.cpu_float32_gemms and rows >= options.cpu_float32_from_rows * hit


def _cpu_columns(dtype: torch.dtype, bounds: list[int], prepared: PreparedWeights) -> bool:
    """Whether a CPU call runs transposed: a ``cpu_columns_dtypes`` dtype with fewer than
    ``cpu_columns_until`` rows per expert hit on average, not a float32 call."""
    options, num_experts = _options(prepared), prepared.spec.num_experts
    if dtype not in options.cpu_columns_dtypes:
        return False
    hit, rows = _experts_hit(bounds, num_experts), bounds[num_experts]
    return rows < options.cpu_columns_until * hit and not _cpu_float32_call(
        dtype, rows, hit, options
    )


def _cpu_chunks(
    x: torch.Tensor,
    row_source: torch.Tensor | None,
    bounds: list[int],
    prepared: PreparedWeights,
    columns: bool,
):
    """Yield ``(start, end, y_RH)`` for chunks of consecutive experts of at most
    ``cpu_chunk_rows`` grouped rows; grouped row r is ``x[row_source[r]]`` (or ``x[r]``)."""
    num_experts, chunk_rows = prepared.spec.num_experts, _options(prepared).cpu_chunk_rows
    first = 0
    while first < num_experts:
        last = first + 1
        while last < num_experts and bounds[last + 1] - bounds[first] <= chunk_rows:
            last += 1
        start, end = bounds[first], bounds[last]
        if end > start:
            x_RH = x[start:end] if row_source is None else x[row_source[start:end]]
            offsets = [b - start for b in bounds[first : last + 1]]
            yield start, end, _cpu_chunk(x_RH, offsets, first, prepared, columns)
        first = last


def _cpu_grouped(dtype: torch.dtype, prepared: PreparedWeights, bounds: list[int]) -> bool:
    """Whether a CPU standard call runs as two grouped GEMMs over every expert instead of the
    per-expert chunks: plain ``cpu_grouped_dtypes`` weights with 16-byte aligned rows, not a
    float32 call (``_cpu_float32_call``), and at least one expert in
    ``cpu_grouped_hit_share`` hit or experts of at least ``cpu_grouped_large`` weights each
    (``TorchOptions``)."""
    t, num_experts, options = prepared.tensors, prepared.spec.num_experts, _options(prepared)
    if dtype not in options.cpu_grouped_dtypes or not _grouped_fits(prepared, dtype):
        return False
    if not t["grouped_aligned"]:
        return False
    hit, rows = _experts_hit(bounds, num_experts), bounds[num_experts]
    if _cpu_float32_call(dtype, rows, hit, options):
        return False
    w13 = t["w13"]
    if w13.shape[1] * w13.shape[2] >= options.cpu_grouped_large:  # large: whatever is hit
        return rows > 0
    return hit > 0 and hit * options.cpu_grouped_hit_share >= num_experts


def _grouped_fits(prepared: PreparedWeights, dtype: torch.dtype) -> bool:
    """The grouped GEMM can take these weights for ``dtype`` inputs: plain weights of that
    dtype, and 16-byte aligned rows of every input it reads (its kernels need them)."""
    t = prepared.tensors
    return t["grouped_rows"] and t["w13"].dtype == dtype


def _grouped_rows(w13, spec: ExpertSpec) -> bool:
    """The prepare-time part of ``_grouped_fits``: PyTorch has the grouped GEMM, the weights
    are plain and the rows of H and I in their dtype are 16-byte multiples."""
    if _GROUPED_MM is None or is_quantized(w13):
        return False
    width = w13.element_size()
    return (spec.hidden_size * width) % 16 == 0 and (spec.intermediate_size * width) % 16 == 0


def _aligned16(w: torch.Tensor) -> bool:
    """What the grouped GEMM needs of a 3-D weight (of its inputs too, which are made
    row-major here): each matrix row- or column-major (a unit stride in one of the last two
    dims), no broadcast dim (stride 0, from ``expand``), and every other stride and the start
    16-byte aligned."""
    size = w.element_size()
    last_two = w.stride()[-2:]
    if 1 not in last_two or 0 in w.stride():
        return False
    strides = [st * size for st in w.stride() if st != 1]
    return w.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in strides)


def _use_grouped_mm(x_MH: torch.Tensor, prepared: PreparedWeights) -> bool:
    """The grouped GEMM for ``TorchOptions.grouped_mm``'s (device, dtype) pairs (CUDA bf16)
    with plain weights whose rows are 16-byte aligned (its kernels need it); elsewhere one
    GEMM pair per expert (the CPU fused op: ``_cpu_grouped``)."""
    pair = (x_MH.device.type, x_MH.dtype)
    return pair in _options(prepared).grouped_mm and _grouped_fits(prepared, x_MH.dtype)


#: A grouped GEMM ``mm(a [M, K], b [E, K, N], ends [E]) -> [M, N]`` (rows ``ends[e-1]:ends[e]``
#: times ``b[e]``), as PyTorch's ``_grouped_mm`` computes it.
GroupedMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """PyTorch's grouped GEMM (``GroupedMm``)."""
    return _GROUPED_MM(a, b, offs=ends)


def _grouped_forward(
    x_MH: torch.Tensor, offsets: torch.Tensor, prepared: PreparedWeights
) -> torch.Tensor:
    """All segments of the prepared weights in two grouped GEMMs (``grouped_experts``)."""
    t = prepared.tensors
    return grouped_experts(
        x_MH, offsets, prepared.spec, t["w13"], t["w2"], t["w13_bias"], t["w2_bias"]
    )


def grouped_experts(
    x_MH: torch.Tensor,
    offsets: torch.Tensor,
    spec: ExpertSpec,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    valid: torch.Tensor | None = None,
    mm: GroupedMm | None = None,
) -> torch.Tensor:
    """Grouped rows (expert ``e``'s are ``offsets[e]:offsets[e+1]``) through both GEMMs as two
    grouped GEMMs; no host synchronisation, out-of-place ops (autograd differentiates it:
    ``torch_autograd``). ``valid`` (bool ``[M, 1]``): rows past ``offsets[E]`` belong to no
    group, and the grouped GEMMs leave their outputs (and in a backward their input
    gradients) undefined; where given, they are selected out (never multiplied: undefined
    values may be NaN) where such values could reach defined ones: GEMM1's input (the
    gather's backward adds its gradient into the hidden states') and GEMM2's output (summed
    into the tokens). Between the two they meet only elementwise ops and the other GEMM,
    whose output and weight gradient read no row outside the groups. A bias or per-expert
    activation parameter is gathered by each row's expert, so its gradient would add those
    rows into expert 0: with one, each GEMM selects at its input and output. ``mm``: the
    grouped GEMM (default PyTorch's; training passes one with its own backward)."""
    mm = mm or grouped_mm
    ends = offsets[1:].to(torch.int32)
    expert_of_row = None
    if w13_bias is not None or w2_bias is not None or spec.activation.per_expert:
        expert_of_row = expert_of_rows(offsets, x_MH.shape[0]).clamp(min=0)
    inner = valid if expert_of_row is not None else None
    h_MN = _grouped_gemm(x_MH, w13, w13_bias, ends, expert_of_row, valid, inner, mm)
    # Activation in fp32 (as the fused kernels do), rounded once into the GEMM2 input.
    a_MI = apply_activation(h_MN, spec, expert_of_row).to(x_MH.dtype)
    y_MH = _grouped_gemm(a_MI, w2, w2_bias, ends, expert_of_row, inner, valid, mm)
    return y_MH if w2_bias is None else y_MH.to(x_MH.dtype)


def _grouped_gemm(
    x_MK: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    ends: torch.Tensor,
    row_expert: torch.Tensor | None,
    valid_in: torch.Tensor | None,
    valid_out: torch.Tensor | None,
    mm: GroupedMm,
) -> torch.Tensor:
    """One grouped GEMM ``x @ w[e]^T`` over grouped rows (``ends``): in x's dtype, or float32
    with the bias (of each row's expert, ``row_expert``) added. Rows outside every group
    (false in ``valid_in`` / ``valid_out``, where given) are selected out at the input / the
    output."""
    if valid_in is not None:
        x_MK = torch.where(valid_in, x_MK, 0)
    out = mm(x_MK, w.transpose(-2, -1), ends)
    if bias is not None:
        out = out.float() + bias[row_expert].float()
    return out if valid_out is None else torch.where(valid_out, out, 0)


#: One expert GEMM of the hooked sequence: ``gemm(which, e, x_RK)`` with ``which`` "w13" or
#: "w2" is expert ``e``'s float32 ``[R, N]`` output on rows ``x_RK``, bias added.
ExpertGemm = Callable[[str, int, torch.Tensor], torch.Tensor]
#: The hooked sequence's GEMM ``which`` on all its grouped rows at once: float32 ``[M, N]``,
#: bias added; rows of no expert give zeros.
RowGemms = Callable[[str, torch.Tensor], torch.Tensor]


def _prepared_gemm(prepared: PreparedWeights) -> ExpertGemm:
    """The expert GEMMs of prepared weights (``_linear``: the scheme's input quantization)."""
    t, options = prepared.tensors, _options(prepared)

    def gemm(which: str, e: int, x_RK: torch.Tensor) -> torch.Tensor:
        suffix = "2" if which == "w2" else ""
        bias, scale = t[f"{which}_bias"], t.get(f"input_scale{suffix}")
        return _linear(
            x_RK,
            t[f"{which}_experts"][e],
            None if bias is None else bias[e],
            t.get(f"scheme{suffix}"),
            None if scale is None else scale[e],
            _float32_gemm(x_RK, options),
        ).float()

    return gemm


def _prepared_plain(x_MH: torch.Tensor, prepared: PreparedWeights) -> tuple | None:
    """The prepared plain weights and biases for the grouped hooked GEMMs, where the grouped
    GEMM serves the call (``_use_grouped_mm``), else None."""
    if not _use_grouped_mm(x_MH, prepared):
        return None
    t = prepared.tensors
    return t["w13"], t["w2"], t["w13_bias"], t["w2_bias"]


def _per_expert_gemms(gemm: ExpertGemm, offsets: torch.Tensor, spec: ExpertSpec) -> RowGemms:
    """``gemm`` on each expert's rows: one host read of the offsets, a GEMM per expert hit.
    The rows are split once and the outputs concatenated (zeros for the rows of no expert):
    in a backward, a slice of the rows per expert made a zero gradient of all of them each."""
    bounds = offsets.tolist()
    num_experts = spec.num_experts
    sizes = [bounds[e + 1] - bounds[e] for e in range(num_experts)]
    width = {"w13": spec.intermediate_size * (2 if spec.gated else 1), "w2": spec.hidden_size}

    def gemms(which: str, x_MK: torch.Tensor) -> torch.Tensor:
        parts = x_MK.split([*sizes, x_MK.shape[0] - bounds[num_experts]])
        outs = [gemm(which, e, x).float() for e, x in enumerate(parts[:-1]) if x.shape[0]]
        tail = parts[-1].new_zeros((parts[-1].shape[0], width[which]), dtype=torch.float32)
        return torch.cat([*outs, tail])

    return gemms


def _grouped_gemms(
    plain: tuple, offsets: torch.Tensor, expert: torch.Tensor, mm: GroupedMm | None = None
) -> RowGemms:
    """Plain weights ``(w13, w2, w13_bias, w2_bias)`` as one grouped GEMM per GEMM over every
    row: no host read, no launch per expert. Rows of no expert (``expert`` -1: the grouped
    GEMM leaves their outputs, and in a backward their input gradients, undefined) are
    selected out at the input and the output, as in ``grouped_experts``; ``mm`` as there."""
    w13, w2, b13, b2 = plain
    mm = mm or grouped_mm
    ends = offsets[1:].to(torch.int32)
    valid, row_expert = (expert >= 0)[:, None], expert.clamp(min=0)

    def gemms(which: str, x_MK: torch.Tensor) -> torch.Tensor:
        w, bias = (w13, b13) if which == "w13" else (w2, b2)
        return _grouped_gemm(x_MK, w, bias, ends, row_expert, valid, valid, mm).float()

    return gemms


def _row_gemms(
    gemm: ExpertGemm,
    plain: tuple | None,
    offsets: torch.Tensor,
    expert: torch.Tensor,
    spec: ExpertSpec,
    mm: GroupedMm | None = None,
) -> RowGemms:
    """The hooked sequence's GEMMs: grouped on ``plain`` weights where given, else ``gemm``
    per expert hit."""
    if plain is None:
        return _per_expert_gemms(gemm, offsets, spec)
    return _grouped_gemms(plain, offsets, expert, mm)


def _hooked_experts(
    x_MH: torch.Tensor, spec: ExpertSpec, gemms: RowGemms, hooks: MoeHooks, rows: HookRows
) -> torch.Tensor:
    """Grouped rows through GEMM1, the gate/up hook, the activation, GEMM2 and the down hook
    (``moerunner.hooks``); float32 ``[M, H]``. Autograd carries gradients through it where
    ``gemms`` and the hooks do."""
    h_MN = hooks.apply("gate_up", gemms("w13", x_MH), x_MH, rows)
    # (per-expert activation parameters: each row's expert; rows of none compute nothing)
    row_experts = rows.expert.clamp(min=0) if spec.activation.per_expert else None
    a_MI = apply_activation(h_MN, spec, row_experts).to(x_MH.dtype)
    return hooks.apply("down", gemms("w2", a_MI), a_MI, rows)


def _hooked_standard(
    dispatch_output: StandardDispatchOutput,
    spec: ExpertSpec,
    gemm: ExpertGemm,
    hooks: MoeHooks,
    plain: tuple | None = None,
    mm: GroupedMm | None = None,
) -> torch.Tensor:
    """The standard format with hooks, on any device: grouped rows, hooked experts (one GEMM
    per expert hit, or with ``plain`` weights the grouped GEMMs: ``_grouped_gemms``), each
    row weighted and added into a float32 [T, H] sum, rounded once."""
    x_TH, topk = dispatch_output.hidden_states, dispatch_output.topk
    order, token, offsets, weight_TK = group_pairs(topk, spec.num_experts)
    expert = expert_of_rows(offsets, order.shape[0])
    valid = expert >= 0
    rows = HookRows(
        expert=expert,
        token=torch.where(valid, token, -1),
        slot=torch.where(valid, order % topk.top_k, -1),
    )
    gemms = _row_gemms(gemm, plain, offsets, expert, spec, mm)
    y_MH = _hooked_experts(x_TH[token], spec, gemms, hooks, rows)
    weight = weight_TK.reshape(-1)[order]
    y_MH = torch.where(valid[:, None], y_MH * weight[:, None], 0.0)
    acc = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    return acc.index_add_(0, token, y_MH).to(x_TH.dtype)


def torch_fused_standard(
    dispatch_output: StandardDispatchOutput,
    prepared: PreparedWeights,
    hooks: MoeHooks | None = None,
) -> torch.Tensor | None:
    """CPU: the experts hit, in chunks (``_cpu_chunks``), each chunk's rows weighted and added
    into a float32 [T, H] sum, rounded once. Declines (None) on other devices, where the
    permute path runs. With ``hooks``: the hooked sequence, on any device."""
    if hooks is not None:
        plain = _prepared_plain(dispatch_output.hidden_states, prepared)
        return _hooked_standard(
            dispatch_output, prepared.spec, _prepared_gemm(prepared), hooks, plain
        )
    x_TH = dispatch_output.hidden_states
    if x_TH.device.type != "cpu":
        return None
    num_experts = prepared.spec.num_experts
    order, token, offsets, weight_TK = group_pairs(dispatch_output.topk, num_experts)
    bounds = offsets.tolist()
    weight = weight_TK.reshape(-1)[order]
    if _cpu_grouped(x_TH.dtype, prepared, bounds):
        rows = bounds[num_experts]  # the valid pairs; the others sort past them
        tok = token[:rows]
        y_MH = _grouped_forward(x_TH[tok], offsets, prepared)
        acc = torch.zeros(x_TH.shape, dtype=torch.float32)
        return acc.index_add_(0, tok, y_MH.float().mul_(weight[:rows, None])).to(x_TH.dtype)
    # The float32 sum is [T, H], or [H, T] for transposed calls (their y chunks are [H, R]).
    columns = _cpu_columns(x_TH.dtype, bounds, prepared)
    acc = torch.zeros(x_TH.shape[::-1] if columns else x_TH.shape, dtype=torch.float32)
    for start, end, y_RH in _cpu_chunks(x_TH, token, bounds, prepared, columns):
        tok, w = token[start:end], weight[start:end]
        if columns:
            acc.index_add_(1, tok, y_RH.T.float().mul_(w))
        else:
            acc.index_add_(0, tok, y_RH.float().mul_(w[:, None]))
    out_TH = torch.empty(x_TH.shape, dtype=x_TH.dtype, device=x_TH.device)  # row-major
    return out_TH.copy_(acc.T if columns else acc)


def torch_core(
    x_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    prepared: PreparedWeights,
    hooks: RowHooks | None = None,
) -> torch.Tensor:
    """Experts on the grouped layout: rows ``offsets[e]:offsets[e+1]`` go to expert ``e``.

    Rows a pre-permute gathered for this call (``permute.is_scratch``) take the output in
    place: each expert (or chunk) reads its rows before writing them, so the permute path
    holds one ``[M, H]`` buffer, not two (the grouped-GEMM path allocates its own).
    ``hooks``: the hooked sequence (``moerunner.hooks``)."""
    if hooks is not None:
        expert = expert_of_rows(expert_offsets, x_MH.shape[0])
        plain, spec = _prepared_plain(x_MH, prepared), prepared.spec
        gemms = _row_gemms(_prepared_gemm(prepared), plain, expert_offsets, expert, spec)
        out = _hooked_experts(x_MH, spec, gemms, hooks.hooks, hooks.rows(expert))
        return out.to(x_MH.dtype)
    if _use_grouped_mm(x_MH, prepared):
        return _grouped_forward(x_MH, expert_offsets, prepared)
    if is_scratch(x_MH) and x_MH.shape[1] == prepared.spec.hidden_size:
        y_MH = x_MH
    else:
        y_MH = torch.empty(
            (x_MH.shape[0], prepared.spec.hidden_size), dtype=x_MH.dtype, device=x_MH.device
        )
    bounds = expert_offsets.tolist()
    if x_MH.device.type == "cpu":
        columns = _cpu_columns(x_MH.dtype, bounds, prepared)
        for start, end, y_RH in _cpu_chunks(x_MH, None, bounds, prepared, columns):
            y_MH[start:end] = y_RH
        return y_MH
    for e in range(prepared.spec.num_experts):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            _expert_forward(x_MH[start:end], e, prepared, y_MH[start:end])
    return y_MH


DEFAULT_REGISTRY.register_backend(TorchBackend())
