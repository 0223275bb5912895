"""Expert weights in the canonical layout, and their validation.

Canonical layout (one for the whole library; a backend that wants another converts once in
its ``prepare_weights``):

- ``w13_E2IH``: ``[E, 2I, H]`` gate rows then up rows (``w13_order="gate_up"``, the default),
  up rows then gate rows (``"up_gate"``, FlashInfer / TensorRT-LLM order; swapped once to
  gate then up where weights are prepared, ``gate_up_first``) or alternating
  (``"interleaved"``, the same as ``gate_up_interleaved=True``: row 2j is gate j, row 2j+1
  is up j); ``[E, I, H]`` for a non-gated activation.
- ``w2_EHI``: ``[E, H, I]``.
- ``w13_bias``: ``[E, 2I]`` (or ``[E, I]``) in the rows' order; ``w2_bias``: ``[E, H]``.

``w13`` / ``w2`` are plain floating tensors or quantized weights (``moerunner.quant``), which
expose ``shape`` (E, N, K), ``scheme`` and ``dequantize()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .config import Activation, ExpertSpec
from .errors import MoeInputError
from .quant.schemes import QuantScheme, plain_scheme

PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Row orders of a gated w13: gate then up, up then gate, or alternating gate, up.
W13_ORDERS = ("gate_up", "up_gate", "interleaved")


def is_quantized(weight: Any) -> bool:
    """True for a quantized weight object (anything with a scheme and ``dequantize``)."""
    return not isinstance(weight, torch.Tensor) and hasattr(weight, "dequantize")


def weight_shape(weight: Any) -> tuple[int, ...]:
    """Logical shape of a plain or quantized weight."""
    return tuple(weight.shape)


def weight_scheme(weight: Any) -> QuantScheme:
    """The weight's `QuantScheme`: its own, or for a plain tensor the scheme of its dtype."""
    if is_quantized(weight):
        return weight.scheme
    if isinstance(weight, torch.Tensor) and weight.dtype in PLAIN_DTYPES:
        return plain_scheme(weight.dtype)
    raise TypeError(
        f"weight dtype {getattr(weight, 'dtype', type(weight).__name__)} is not accepted: use "
        "bf16/fp16/fp32 or a quantized weight from moerunner.quantize"
    )


def scheme_name(weight: Any) -> str:
    """Name of the weight's scheme: the dtype name for plain tensors (``bf16``...)."""
    if isinstance(weight, torch.Tensor) and weight.dtype not in PLAIN_DTYPES:
        return str(weight.dtype)
    return weight_scheme(weight).name


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's expert weights in the canonical layout (see module docstring)."""

    w13: Any
    w2: Any
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    gate_up_interleaved: bool = False
    w13_order: str | None = None  # W13_ORDERS; None: from gate_up_interleaved

    def __post_init__(self) -> None:
        order = self.w13_order
        if order is None:
            order = "interleaved" if self.gate_up_interleaved else "gate_up"
        elif not isinstance(order, str) or order not in W13_ORDERS:
            raise MoeInputError(f"w13_order: got {order!r}; accepted: {', '.join(W13_ORDERS)}")
        elif self.gate_up_interleaved and order != "interleaved":
            raise MoeInputError(
                f"gate_up_interleaved=True is w13_order='interleaved', but w13_order={order!r} "
                "was given too; pass one of them"
            )
        object.__setattr__(self, "w13_order", order)
        object.__setattr__(self, "gate_up_interleaved", order == "interleaved")

    @property
    def num_experts(self) -> int:
        """Experts held (leading dim)."""
        return weight_shape(self.w13)[0]

    @property
    def hidden_size(self) -> int:
        """H."""
        return weight_shape(self.w13)[2]

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.w13.device

    @property
    def w13_scheme(self) -> QuantScheme:
        """`QuantScheme` of w13 (of its dtype for a plain tensor)."""
        return weight_scheme(self.w13)

    @property
    def w2_scheme(self) -> QuantScheme:
        """`QuantScheme` of w2 (of its dtype for a plain tensor)."""
        return weight_scheme(self.w2)

    @property
    def scheme(self) -> str:
        """Readable name of the weights' scheme: w13's, or "w13 <a>, w2 <b>" when the two
        differ in format (see ``w13_scheme`` / ``w2_scheme`` for the values)."""
        a, b = scheme_name(self.w13), scheme_name(self.w2)
        if a == b or self.w13_scheme.same_format(self.w2_scheme):
            return a
        return f"w13 {a}, w2 {b}"

    def intermediate_size(self, activation: Activation) -> int:
        """I, from w13's rows and whether the activation is gated."""
        rows = weight_shape(self.w13)[1]
        return rows // 2 if activation.gated else rows

    def spec(self, activation: Activation) -> ExpertSpec:
        """The ExpertSpec these weights imply for ``activation``."""
        return ExpertSpec(
            num_experts=self.num_experts,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size(activation),
            activation=activation,
            gate_up_interleaved=self.gate_up_interleaved,
        )

    def validate(self, activation: Activation) -> None:
        """Check shapes, dtypes and the agreement of E/H/I between all tensors."""
        for name, w in (("w13", self.w13), ("w2", self.w2)):
            if not (isinstance(w, torch.Tensor) or is_quantized(w)):
                raise TypeError(
                    f"{name} must be a torch.Tensor or a quantized weight, got {type(w).__name__}"
                )
            if len(weight_shape(w)) != 3:
                raise MoeInputError(f"{name} must be 3-D [E, N, K], got shape {weight_shape(w)}")
            if isinstance(w, torch.Tensor) and w.dtype not in PLAIN_DTYPES:
                raise TypeError(
                    f"{name} dtype {w.dtype} is not accepted: use bf16/fp16/fp32 or a quantized "
                    "weight from moerunner.quantize"
                )
        e13, n13, h13 = weight_shape(self.w13)
        e2, h2, i2 = weight_shape(self.w2)
        if e13 != e2:
            raise MoeInputError(f"w13 has E={e13} experts but w2 has E={e2}")
        if h13 != h2:
            hint = ""
            if n13 == h2 or i2 == h13:  # a weight given as [E, K, N] (GPT-OSS stores them so)
                hint = (
                    "; transposed? w13 must be [E, 2I, H] and w2 [E, H, I] (for [E, H, 2I] / "
                    "[E, I, H] pass .transpose(1, 2))"
                )
            raise MoeInputError(
                f"w13 has hidden size H={h13} but w2 has H={h2} (w2 is [E, H, I]){hint}"
            )
        expected_rows = 2 * i2 if activation.gated else i2
        if n13 != expected_rows:
            layout = "[E, 2I, H]" if activation.gated else "[E, I, H] (non-gated)"
            rows = "2I" if activation.gated else "I"
            fixes = [f"w13 needs {rows} = {expected_rows} rows"]
            if not activation.gated or n13 % 2 == 0:
                fixes.append(f"w2 I = {n13 // 2 if activation.gated else n13}")
            if activation.gated and n13 == i2:
                fixes.append("a non-gated activation (relu2, silu_no_mul, gelu_no_mul, ...)")
            elif not activation.gated and n13 == 2 * i2:
                fixes.append("a gated activation (silu, gelu, ...)")
            raise MoeInputError(
                f"w13 ({n13} rows) and w2 (I={i2}) disagree: activation {activation.name!r} "
                f"takes w13 {layout} and w2 [E, H, I] with one I, so " + ", or ".join(fixes)
            )
        if self.w13_order != "gate_up" and not activation.gated:
            raise MoeInputError(
                f"w13_order={self.w13_order!r} (gate_up_interleaved) needs a gated activation"
            )
        for name, param in activation.tensors().items():
            if tuple(param.shape) != (e13,):
                raise MoeInputError(
                    f"{name} must have one value per expert [E={e13}], got shape "
                    f"{list(param.shape)}"
                )
            if param.device != self.w13.device:
                raise MoeInputError(f"{name} is on {param.device} but w13 on {self.w13.device}")
        if isinstance(self.w13, torch.Tensor) and isinstance(self.w2, torch.Tensor):
            if self.w13.dtype != self.w2.dtype:
                raise TypeError(f"w13 dtype {self.w13.dtype} differs from w2 dtype {self.w2.dtype}")
        if is_quantized(self.w13) != is_quantized(self.w2):
            raise TypeError("w13 and w2 must both be plain tensors or both be quantized")
        if self.w2.device != self.w13.device:
            raise MoeInputError(f"w2 is on {self.w2.device} but w13 on {self.w13.device}")
        for name, bias, shape in (
            ("w13_bias", self.w13_bias, (e13, n13)),
            ("w2_bias", self.w2_bias, (e2, h2)),
        ):
            if bias is None:
                continue
            if not isinstance(bias, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(bias).__name__}")
            if tuple(bias.shape) != shape:
                raise MoeInputError(f"{name} must have shape {list(shape)}, got {list(bias.shape)}")
            if not bias.is_floating_point():
                raise TypeError(f"{name} must be floating, got {bias.dtype}")
            if bias.device != self.w13.device:
                raise MoeInputError(f"{name} is on {bias.device} but w13 on {self.w13.device}")


def swap_row_halves(w: Any) -> Any:
    """``[E, 2I, ...]`` with its two row halves swapped (up-then-gate to gate-then-up and
    back): a plain tensor or bias, or a quantized weight whose per-row scales and zero points
    move with their rows. A scale shared by a block of rows (fp8_block) moves whole when I is
    a multiple of the block's rows; otherwise the block straddles the halves: ValueError."""
    if w is None:
        return None
    rows = weight_shape(w)[1]
    if rows % 2:
        raise MoeInputError(f"w13_order='up_gate' needs an even number of w13 rows, got {rows}")
    half = rows // 2
    if not is_quantized(w):
        return torch.cat((w[:, half:], w[:, :half]), dim=1)
    scheme = w.scheme
    if scheme.granularity == "block" and scheme.block_shape[0] > 1:
        block = scheme.block_shape[0]
        if half % block:
            raise MoeInputError(
                f"w13_order='up_gate': scheme {scheme.name!r} shares a scale across {block} "
                f"rows and I={half} is not a multiple of it, so a scale block straddles the "
                "up and gate halves; re-quantize the weights in gate-then-up order"
            )
        b = half // block
        fields = {
            "data": torch.cat((w.data[:, half:], w.data[:, :half]), dim=1),
            "scale": torch.cat((w.scale[:, b:], w.scale[:, :b]), dim=1),
        }
        return w._replace(w.shape, **fields)
    index = torch.cat((torch.arange(half, rows), torch.arange(half)))
    return w.select_rows(index)


def gate_up_first(weights: ExpertWeights) -> ExpertWeights:
    """``weights`` with an up-then-gate w13 (and its bias) swapped to gate then up; other
    orders as they are. Done once where weights are prepared, never per call."""
    if weights.w13_order != "up_gate":
        return weights
    return ExpertWeights(
        swap_row_halves(weights.w13),
        weights.w2,
        swap_row_halves(weights.w13_bias),
        weights.w2_bias,
    )


#: Prefix of a ``PreparedWeights`` note by which a backend says that these weights' kernels run
#: without the tuning their speed depends on (``PreparedWeights.untuned``): the results are
#: right, the times are not the backend's. Benchmarks mark such rows and tables leave them out.
UNTUNED_NOTE = "untuned: "


@dataclass
class PreparedWeights:
    """A backend's own form of one layer's weights, made once by ``prepare_weights``.

    ``tensors`` holds whatever the backend's kernels read; ``notes`` records what preparation
    did (padding, reordering), and what a backend found at a first call (``UNTUNED_NOTE``), so
    it can be inspected and tested; ``options`` the options of
    the backend that prepared them (None for a backend without options), which its kernels
    read per call.

    Ownership: the caller owns the canonical weights; the prepared weights own what the
    backend made of them (re-laid, padded or converted copies) and share every tensor read as
    stored. ``source`` is the canonical weights where the backend computes from them as they
    are (torch: the same tensors, no extra memory), and None where it re-laid them into
    tensors of its own (triton): then nothing here keeps the canonical tensors alive, and a
    caller that drops them holds one copy of the experts, not two (docs/architecture.md,
    "Memory: who owns what").
    """

    backend: str
    source: ExpertWeights | None
    spec: ExpertSpec
    tensors: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    options: Any = None

    def untuned(self) -> str | None:
        """Why these weights' kernels run untuned (a backend's ``UNTUNED_NOTE``), or None."""
        notes = (n[len(UNTUNED_NOTE) :] for n in self.notes if n.startswith(UNTUNED_NOTE))
        return next(notes, None)


def as_parameter(t: torch.Tensor | None, trainable: bool = True) -> torch.nn.Parameter | None:
    """A given tensor as a module's parameter: the tensor's storage, not a copy, with its
    gradient requirement (none where not ``trainable``); a parameter as it is."""
    if t is None or isinstance(t, torch.nn.Parameter):
        return t
    return torch.nn.Parameter(t.detach(), requires_grad=trainable and t.requires_grad)
