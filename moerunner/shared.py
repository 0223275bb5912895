"""Shared experts as always-selected slots of the routed call.

DeepSeek-V2/V3, Qwen2-MoE, Qwen3-Next, Llama-4 and GLM-4-MoE add to the routed experts'
output one or more *shared* experts that every token passes through (Qwen2-MoE and
Qwen3-Next scale it by a per-token gate ``sigmoid(hidden @ shared_gate.T)``). Here they run
in the same kernel sequence as the routed experts: the expert table is the routed experts
followed by the shared ones, and each token gets extra top-k slots naming them, with weight
1 or its gate value.

Intermediate sizes. A shared expert's intermediate size ``I_s`` may differ from the routed
experts' ``I`` (Qwen2-MoE's shared expert is 4-8x wider; DeepSeek-V2/V3's ``n_shared``
experts are one MLP of ``n_shared x I``). A gated MLP is a sum over its intermediate
columns: ``W2 @ (act(Wg x) * Wu x) = sum_c W2[:, c] @ (act(Wg[c] x) * Wu[c] x)`` for any
split of the columns into chunks ``c``. So a shared expert is split into
``m = ceil(I_s / I)`` chunks of ``I`` columns, each an expert of the table with the routed
experts' shape, and a token gets ``m`` slots per shared expert (all with its weight).
When ``I`` does not divide ``I_s`` the last chunk is zero-padded: zero gate/up rows give an
activation of exactly 0 for every activation moerunner has (``act(0) * 0``, ``relu(0)^2``),
so the padding adds nothing. No routed expert is padded, and when ``I`` divides ``I_s``
(every family above) nothing is padded at all.

Memory: the table is one copy of the routed and shared weights, built once per weight
version and memoised on the shared weights (``SharedExperts.w13``); the routed weights it
was built from stay as they are.

Quantized routed experts: quantized shared weights must have the routed weights' format and,
being stored in blocks along I, ``I_s == I`` (then no split is needed). Float shared weights
beside quantized routed ones stay in floating point, as a model keeps its shared MLP when
only its experts are quantized (transformers' blocks, a compiled layer): they run as a call
of their own (``runs_apart``), so eager and compiled calls compute the same, the table holds
no second copy of the routed weights, and the shared weights can train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import Activation
from .errors import MoeInputError
from .memo import memoised, view_key
from .routing import TopK
from .weights import PLAIN_DTYPES, ExpertWeights, gate_up_first, is_quantized, weight_shape

__all__ = [
    "SharedExperts",
    "append_shared_slots",
    "expert_table",
    "own_slots",
    "runs_apart",
    "shared_dense",
]


@dataclass(frozen=True)
class SharedExperts:
    """Shared experts: every token passes through each of them.

    ``w13``: ``[S, 2I_s, H]`` (gate rows then up rows, or alternating like the routed
    weights when the call has ``gate_up_interleaved``), ``[S, I_s, H]`` for a non-gated
    activation; ``w2``: ``[S, H, I_s]``. Plain tensors, or quantized weights in the routed
    weights' format. ``gate``: optional ``[S, H]``; each token's output of shared expert
    ``s`` is multiplied by ``sigmoid(hidden @ gate[s])`` (Qwen2-MoE's ``shared_expert_gate``;
    computed in float32).
    """

    w13: Any
    w2: Any
    gate: torch.Tensor | None = None

    @property
    def num_shared(self) -> int:
        """S."""
        return weight_shape(self.w13)[0]

    def intermediate_size(self, activation: Activation) -> int:
        """I_s."""
        return weight_shape(self.w2)[2]

    def validate(self, routed: ExpertWeights, activation: Activation) -> None:
        """Shapes, kinds and devices against the routed weights; raises naming the field."""
        for name, w in (("shared w13", self.w13), ("shared w2", self.w2)):
            if not (isinstance(w, torch.Tensor) or is_quantized(w)):
                raise TypeError(
                    f"{name} must be a torch.Tensor or a quantized weight, got {type(w).__name__}"
                )
            if len(weight_shape(w)) != 3:
                raise MoeInputError(f"{name} must be 3-D, got shape {list(weight_shape(w))}")
            if isinstance(w, torch.Tensor) and w.dtype not in PLAIN_DTYPES:
                raise TypeError(f"{name} dtype {w.dtype} is not accepted: bf16, fp16 or fp32")
            if w.device != routed.device:
                raise MoeInputError(
                    f"{name} is on {w.device} but the routed weights on {routed.device}"
                )
        s13, rows, h13 = weight_shape(self.w13)
        s2, h2, inter = weight_shape(self.w2)
        hidden = routed.hidden_size
        if s13 != s2:
            raise MoeInputError(f"shared w13 has S={s13} experts but shared w2 has S={s2}")
        if h13 != hidden or h2 != hidden:
            raise MoeInputError(
                f"shared w13 {list(weight_shape(self.w13))} and w2 {list(weight_shape(self.w2))} "
                f"must have the routed experts' hidden size H={hidden}"
            )
        want = 2 * inter if activation.gated else inter
        if rows != want:
            raise MoeInputError(
                f"shared w13 has {rows} rows but activation {activation.name!r} with shared "
                f"w2's I_s={inter} needs {want}"
            )
        if inter == 0 and s13:
            raise MoeInputError("shared experts need an intermediate size I_s >= 1")
        if is_quantized(self.w13) != is_quantized(self.w2):
            raise TypeError("shared w13 and w2 must both be plain tensors or both be quantized")
        if is_quantized(routed.w13):
            if is_quantized(self.w13):
                for name, w, ref in (
                    ("shared w13", self.w13, routed.w13),
                    ("shared w2", self.w2, routed.w2),
                ):
                    if not w.scheme.same_format(ref.scheme):
                        raise MoeInputError(
                            f"{name} is {w.scheme.name!r} but the routed weights are "
                            f"{ref.scheme.name!r}: quantized shared experts need the routed "
                            "format (or pass float ones, which run in floating point)"
                        )
                if inter != routed.intermediate_size(activation):
                    raise MoeInputError(
                        f"quantized shared experts need I_s equal to the routed I="
                        f"{routed.intermediate_size(activation)}, got I_s={inter}; pass them "
                        "as float weights (which run in floating point)"
                    )
            elif self.w13.dtype != self.w2.dtype:
                raise TypeError(
                    f"shared w13/w2 dtypes {self.w13.dtype}/{self.w2.dtype} must be equal"
                )
        elif is_quantized(self.w13):
            raise TypeError("shared experts are quantized but the routed weights are not")
        elif self.w13.dtype != routed.w13.dtype or self.w2.dtype != routed.w13.dtype:
            raise TypeError(
                f"shared w13/w2 dtypes {self.w13.dtype}/{self.w2.dtype} must equal the routed "
                f"weights' {routed.w13.dtype}"
            )
        if self.gate is not None:
            if not isinstance(self.gate, torch.Tensor):
                raise TypeError(f"shared gate must be a torch.Tensor, got {type(self.gate)}")
            if tuple(self.gate.shape) != (s13, hidden):
                raise MoeInputError(
                    f"shared gate must be [S={s13}, H={hidden}], got {list(self.gate.shape)}"
                )
            if not self.gate.is_floating_point():
                raise TypeError(f"shared gate must be floating, got {self.gate.dtype}")
            if self.gate.device != routed.device:
                raise MoeInputError(
                    f"shared gate is on {self.gate.device} but the routed weights on "
                    f"{routed.device}"
                )


def chunks_per_shared(shared: SharedExperts, routed: ExpertWeights, act: Activation) -> int:
    """m: experts of the table per shared expert (``ceil(I_s / I)``)."""
    inter = routed.intermediate_size(act)
    return -(-shared.intermediate_size(act) // inter)


def _split_w13(w: torch.Tensor, inter: int, m: int, act: Activation, interleaved: bool):
    """[S, rows_s, H] -> [S*m, rows, H]: chunk c holds the gate/up rows of columns
    c*I..(c+1)*I-1, in the routed row order; zero rows pad the last chunk."""
    s, _, h = w.shape
    pad = m * inter
    if not act.gated:
        out = w.new_zeros(s, pad, h)
        out[:, : w.shape[1]] = w
        return out.reshape(s * m, inter, h)
    i_s = w.shape[1] // 2
    if interleaved:
        out = w.new_zeros(s, pad, 2, h)
        out[:, :i_s] = w.view(s, i_s, 2, h)
        return out.reshape(s * m, 2 * inter, h)
    out = w.new_zeros(s, 2, pad, h)
    out[:, :, :i_s] = w.view(s, 2, i_s, h)
    return out.view(s, 2, m, inter, h).transpose(1, 2).reshape(s * m, 2 * inter, h)


def _split_w2(w: torch.Tensor, inter: int, m: int) -> torch.Tensor:
    """[S, H, I_s] -> [S*m, H, I]: chunk c holds columns c*I..(c+1)*I-1 (zero padded)."""
    s, h, i_s = w.shape
    out = w.new_zeros(s, h, m * inter)
    out[:, :, :i_s] = w
    return out.view(s, h, m, inter).transpose(1, 2).reshape(s * m, h, inter)


def _cat_weights(routed, shared):
    """Routed experts followed by shared ones (plain or quantized, same format)."""
    if isinstance(routed, torch.Tensor):
        return torch.cat([routed, shared.to(routed.dtype)], dim=0)
    from .quant import QuantizedWeight
    from .quant.weight import TENSOR_FIELDS

    fields = {}
    for f in TENSOR_FIELDS:
        a, b = getattr(routed, f), getattr(shared, f)
        if (a is None) != (b is None):
            raise MoeInputError(
                f"routed and shared {routed.scheme.name!r} weights differ in having {f}"
            )
        fields[f] = None if a is None else torch.cat([a, b.to(a.dtype)], dim=0)
    e, n, k = routed.shape
    return QuantizedWeight(routed.scheme, (e + shared.shape[0], n, k), **fields)


def _bias_table(routed_bias, rows: int, count: int) -> torch.Tensor | None:
    """Routed bias followed by zeros for the shared experts (which have none)."""
    if routed_bias is None:
        return None
    return torch.cat([routed_bias, routed_bias.new_zeros(count, rows)], dim=0)


def build_table(routed: ExpertWeights, shared: SharedExperts, act: Activation) -> ExpertWeights:
    """The expert table: routed experts ``0..E-1``, then each shared expert's ``m`` chunks
    (unmemoised; differentiable for plain weights). Up-then-gate routed rows are brought to
    gate then up first, the order of the shared experts' rows and of the table."""
    routed = gate_up_first(routed)
    inter = routed.intermediate_size(act)
    m = chunks_per_shared(shared, routed, act)
    if is_quantized(shared.w13):  # I_s == I, same format (validated): no split
        s13, s2 = shared.w13, shared.w2
    else:
        s13 = _split_w13(shared.w13, inter, m, act, routed.gate_up_interleaved)
        s2 = _split_w2(shared.w2, inter, m)
    count = weight_shape(s13)[0]
    return ExpertWeights(
        _cat_weights(routed.w13, s13),
        _cat_weights(routed.w2, s2),
        _bias_table(routed.w13_bias, weight_shape(routed.w13)[1], count),
        _bias_table(routed.w2_bias, routed.hidden_size, count),
        routed.gate_up_interleaved,
    )


def _state(weight) -> tuple:
    if weight is None:
        return ()
    if isinstance(weight, torch.Tensor):
        return (view_key(weight),)
    return (weight.scheme, *(view_key(t) for t in weight.flat_tensors()))


def expert_table(routed: ExpertWeights, shared: SharedExperts, act: Activation) -> ExpertWeights:
    """``build_table`` memoised on the shared w13 (its tensor, or a quantized one's data)
    and keyed on the state of every weight tensor: an edit or a replaced tensor rebuilds."""

    key = (
        "shared_table",
        act,
        routed.w13_order,
        *(_state(w) for w in (routed.w13, routed.w2, routed.w13_bias, routed.w2_bias)),
        *(_state(w) for w in (shared.w13, shared.w2)),
    )
    anchor = shared.w13 if isinstance(shared.w13, torch.Tensor) else shared.w13.data
    return memoised(anchor, key, lambda: build_table(routed, shared, act))


def shared_weights_TS(hidden_TH: torch.Tensor, shared: SharedExperts) -> torch.Tensor:
    """Per token and shared expert: the gate value ``sigmoid(x @ gate[s])`` (float32), or 1."""
    tokens, count = hidden_TH.shape[0], shared.num_shared
    if shared.gate is None:
        return torch.ones(tokens, count, dtype=torch.float32, device=hidden_TH.device)
    return torch.sigmoid(hidden_TH.float() @ shared.gate.float().T)


def own_slots(hidden_TH: torch.Tensor, shared: SharedExperts) -> TopK:
    """The routing of the shared experts run as a call of their own (``S`` experts, every
    token to each with its gate value): ``S`` slots per token, ids ``0..S-1``."""
    count = shared.num_shared
    ids = torch.arange(count, dtype=torch.int32, device=hidden_TH.device)
    return TopK(shared_weights_TS(hidden_TH, shared), ids.expand(hidden_TH.shape[0], count))


def runs_apart(shared: SharedExperts, routed: ExpertWeights, weight_on_input: bool) -> bool:
    """Whether the shared experts run as a call of their own beside the routed call instead
    of in the expert table: with ``apply_router_weight_on_input`` (the routed input is scaled
    by its weight, the shared experts' is not, so they cannot share the table's rows), and
    float shared experts beside quantized routed ones (they stay in floating point, as the
    model's own shared MLP is; module doc)."""
    return weight_on_input or (is_quantized(routed.w13) and not is_quantized(shared.w13))


def append_shared_slots(
    topk: TopK, hidden_TH: torch.Tensor, shared: SharedExperts, num_routed: int, chunks: int
) -> TopK:
    """``topk`` with ``S * m`` slots appended per token naming the table's shared experts
    ``E .. E + S*m - 1`` (all of a shared expert's chunks with its weight). Routed ids
    outside ``[0, E)`` become -1 first, so they cannot reach a shared expert. On the device,
    no host read."""
    ids = topk.ids
    routed_ids = torch.where((ids >= 0) & (ids < num_routed), ids, -1).to(torch.int32)
    count = shared.num_shared * chunks
    shared_ids = torch.arange(num_routed, num_routed + count, dtype=torch.int32, device=ids.device)
    weights = shared_weights_TS(hidden_TH, shared).repeat_interleave(chunks, dim=1)
    return TopK(
        weights=torch.cat([topk.weights.float(), weights], dim=1),
        ids=torch.cat([routed_ids, shared_ids.expand(ids.shape[0], count)], dim=1),
    )


def shared_dense(
    hidden_TH: torch.Tensor, shared: SharedExperts, act: Activation, interleaved: bool = False
) -> torch.Tensor:
    """The shared experts as separate dense MLPs in PyTorch (float32 ``[T, H]``, gate
    applied): what a model computes beside its routed call; the benchmarks' baseline."""
    from .activations import activate

    w13 = shared.w13.dequantize() if is_quantized(shared.w13) else shared.w13
    w2 = shared.w2.dequantize() if is_quantized(shared.w2) else shared.w2
    x = hidden_TH if w13.dtype == hidden_TH.dtype else hidden_TH.float()
    gate_TS = shared_weights_TS(hidden_TH, shared)
    out = torch.zeros(hidden_TH.shape, dtype=torch.float32, device=hidden_TH.device)
    for s in range(shared.num_shared):
        a = activate(x @ w13[s].to(x.dtype).T, act, interleaved).to(x.dtype)
        out = out + (a @ w2[s].to(x.dtype).T).float() * gate_TS[:, s : s + 1]
    return out


def shared_order(weights: ExpertWeights) -> str:
    """The row order of shared experts beside these routed weights: alternating with
    interleaved ones, else gate then up (``SharedExperts``)."""
    return "interleaved" if weights.w13_order == "interleaved" else "gate_up"


def check_shared(
    shared: object, weights: ExpertWeights, act: Activation, hidden_states: torch.Tensor
) -> bool:
    """Shared experts a call of ``hidden_states`` can run beside these routed weights; False
    when there are none (S = 0)."""
    if not isinstance(shared, SharedExperts):
        raise TypeError(f"shared_experts must be a SharedExperts, got {type(shared).__name__}")
    shared.validate(weights, act)
    if isinstance(shared.w13, torch.Tensor) and shared.w13.dtype != hidden_states.dtype:
        raise TypeError(
            f"shared w13/w2 dtype {shared.w13.dtype} must equal hidden_states dtype "
            f"{hidden_states.dtype} (or pass quantized shared experts)"
        )
    if act.per_expert and shared.num_shared:
        raise MoeInputError(
            f"shared_experts with per-expert activation parameters "
            f"({', '.join(act.tensors())} of shape [E]) are not supported: the shared experts "
            "would need values of their own; pass scalar parameters"
        )
    return shared.num_shared > 0
