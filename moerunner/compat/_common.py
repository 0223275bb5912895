"""What the vLLM and SGLang entry points share: the experts call in peer terms.

Peer weights are ``w1 [E, 2I, H]`` (gate rows then up rows, or for ``swigluoai`` / GPT-OSS
interleaved) and ``w2 [E, H, I]``, as moerunner's; pre-quantized weights come as the data
tensor plus scale (and zero-point) tensors selected by ``use_*`` flags. ``peer_weights``
wraps them into ``QuantizedWeight`` values, sharing the data tensors (scales are viewed, or
copied to float32 where the peer stores them in another dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import fused_moe
from ..config import check_bool
from ..device_checks import check_ids_async
from ..dispatch.expert_map import local_ids
from ..errors import INDEX_DTYPES_TEXT, MoeInputError, is_index_tensor
from ..memo import memoised, view_key
from ..quant.schemes import get_scheme
from ..quant.weight import QuantizedWeight


@dataclass(frozen=True)
class ExpertsCall:
    """One experts call in moerunner's terms (what ``run`` passes to ``fused_moe``)."""

    activation: str
    w13_order: str = "gate_up"
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    swiglu_beta: float | None = None


@dataclass(frozen=True)
class QuantArgs:
    """The peers' flat quantization arguments of one experts call."""

    use_fp8_w8a8: bool = False
    use_int8_w8a8: bool = False
    use_int8_w8a16: bool = False
    use_int4_w4a16: bool = False
    per_channel_quant: bool = False
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w1_zp: torch.Tensor | None = None
    w2_zp: torch.Tensor | None = None
    a1_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    block_shape: list[int] | tuple[int, ...] | None = None


def _given(where: str, **named: object) -> None:
    """Raise naming the first argument that is set where it has no meaning."""
    for name, value in named.items():
        if value is not None and value is not False:
            raise MoeInputError(f"{where}: {name} has no meaning here; {_WHY[name]}")


_WHY = {
    "w1_scale": "weight scales go with a use_* quantization flag",
    "w2_scale": "weight scales go with a use_* quantization flag",
    "w1_zp": "zero points are accepted with use_int4_w4a16 only",
    "w2_zp": "zero points are accepted with use_int4_w4a16 only",
    "a1_scale": "static activation scales are accepted with use_fp8_w8a8 per tensor and "
    "use_int8_w8a8 only",
    "a2_scale": "static activation scales are accepted with use_fp8_w8a8 per tensor and "
    "use_int8_w8a8 only",
    "block_shape": "block_shape is accepted with use_fp8_w8a8 and, as [0, group], use_int4_w4a16",
    "per_channel_quant": "per_channel_quant is accepted with use_fp8_w8a8 and use_int8_w8a8",
}


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_router_input(where: str, hidden_states: object, logits: object, name: str) -> None:
    """A peer routing call's ``hidden_states`` (read for its token count only) and router
    logits ``name``: a 2-D floating ``[T, E]`` tensor with the hidden states' T."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"{where}: hidden_states must be a torch.Tensor")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise MoeInputError(
            f"{where}: {name} must be a 2-D floating tensor [T, E], got "
            f"{logits.dtype} {list(logits.shape)}"
        )
    if hidden_states.dim() < 1 or hidden_states.shape[0] != logits.shape[0]:
        raise MoeInputError(
            f"{where}: {name} has T={logits.shape[0]} rows but hidden_states has shape "
            f"{list(hidden_states.shape)}"
        )


def _fp32(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A peer scale as float32 of ``shape`` (a view where it already is float32): of that
    shape, with trailing dims of 1 allowed (``[E, N, 1]`` for ``[E, N]``). A tensor of the
    same size in another shape (a transposed grid) is refused, not read in the wrong order."""
    t = _tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    got = tuple(t.shape)
    while len(got) > len(shape) and got[-1] == 1:
        got = got[:-1]
    if got != tuple(shape) and not (got == () and _numel(shape) == 1):
        raise MoeInputError(
            f"{name} must have shape {list(shape)} (trailing dims of 1 allowed), got "
            f"{list(t.shape)}"
        )
    return t.reshape(shape).to(torch.float32)


def _per_tensor(scale: object, experts: int) -> bool:
    """Whether a weight scale is one per expert (``[E]``, ``[E, 1, 1]``)."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != experts:
        return False
    return scale.dim() == 1 or all(d == 1 for d in scale.shape[1:])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _static_scale(name: str, t: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A static activation scale (one value, or one per expert) as float32 ``[E]``."""
    t = _tensor(name, t)
    if not t.is_floating_point():  # (as every other scale: an int was taken as a value)
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if t.numel() not in (1, num_experts):
        raise MoeInputError(
            f"{name} must be one value or one per expert (E={num_experts}), got shape "
            f"{list(t.shape)}"
        )
    return t.reshape(-1).to(torch.float32).expand(num_experts).contiguous()


def _data(name: str, t: object, dtype: torch.dtype, flag: str) -> torch.Tensor:
    t = _tensor(name, t)
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} with {flag}=True, got {t.dtype}")
    if t.dim() != 3:
        raise MoeInputError(f"{name} must be 3-D [E, N, K], got shape {list(t.shape)}")
    return t


def _one(where: str, q: QuantArgs, which: str, w: object):
    """One weight (``which`` "1" or "2") as moerunner sees it. A quantized one is built once
    per set of caller tensors and memoised on the weight tensor (keyed on every tensor's
    memory, layout and in-place version): a new object per call would be checked (reading
    its scales: a device sync) and prepared again every call."""
    flags = tuple(f for f in _FLAGS if getattr(q, f))
    if not flags or not isinstance(w, torch.Tensor):
        return _build_one(where, q, which, w)
    tensors = (getattr(q, f"{kind}{which}_{part}") for kind, part in _QUANT_PARTS)
    key = (
        "compat",
        which,
        flags,
        None if q.block_shape is None else tuple(q.block_shape),
        q.per_channel_quant,
        view_key(w),
        *(view_key(t) if isinstance(t, torch.Tensor) else ("object", id(t)) for t in tensors),
    )
    # Built from an alias of w, so the memoised weight does not hold its own anchor.
    return memoised(w, key, lambda: _build_one(where, q, which, w.detach()))


#: The tensors of ``QuantArgs`` beside each weight: w{n}_scale, w{n}_zp, a{n}_scale.
_QUANT_PARTS = (("w", "scale"), ("w", "zp"), ("a", "scale"))


def _build_one(where: str, q: QuantArgs, which: str, w: object):
    scale = getattr(q, f"w{which}_scale")
    zp = getattr(q, f"w{which}_zp")
    a_scale = getattr(q, f"a{which}_scale")
    name, sname, aname = f"w{which}", f"w{which}_scale", f"a{which}_scale"
    flags = [f for f in _FLAGS if getattr(q, f)]
    if len(flags) > 1:
        raise MoeInputError(f"{where}: {' and '.join(flags)} are exclusive; pass one")
    if not flags:
        _given(
            where,
            **{sname: scale, f"w{which}_zp": zp, aname: a_scale},
            block_shape=q.block_shape,
            per_channel_quant=q.per_channel_quant,
        )
        return w
    flag = flags[0]
    if scale is None:
        raise MoeInputError(f"{where}: {flag}=True needs {sname}")
    if flag == "use_fp8_w8a8":
        _given(where, **{f"w{which}_zp": zp})
        data = _data(name, w, torch.float8_e4m3fn, flag)
        e, n, k = data.shape
        if q.block_shape is not None:
            bn, bk = _block(q.block_shape)
            _given(where, **{aname: a_scale})
            scheme = get_scheme("fp8_block" if (bn, bk) == (128, 128) else f"fp8_block_{bn}x{bk}")
            grid = (e, -(-n // bn), -(-k // bk))
            return QuantizedWeight(scheme, (e, n, k), data, _fp32(sname, scale, grid))
        if (
            isinstance(scale, torch.Tensor)
            and scale.dim() == 3
            and min(scale.shape[1:]) > 1  # not a per-channel [E, N, 1] or per-tensor scale
        ):
            raise MoeInputError(
                f"{where}: {sname} {list(scale.shape)} holds block scales [E, N/bn, K/bk]: "
                "pass block_shape=[bn, bk] (e.g. [128, 128] for DeepSeek-V3)"
            )
        if q.per_channel_quant:
            _given(where, **{aname: a_scale})
            # Per-token activations. A per-tensor weight scale beside them (vLLM's quant config
            # keeps the weights' and the activations' granularity apart) is the per-channel
            # scale of equal rows: the same products.
            channel = (
                _fp32(sname, scale, (e,))[:, None].expand(e, n) if _per_tensor(scale, e) else scale
            )
            return QuantizedWeight("fp8_channel", (e, n, k), data, _fp32(sname, channel, (e, n)))
        if a_scale is None:
            return QuantizedWeight("fp8_tensor", (e, n, k), data, _fp32(sname, scale, (e,)))
        return QuantizedWeight(
            "fp8_tensor_static",
            (e, n, k),
            data,
            _fp32(sname, scale, (e,)),
            input_scale=_static_scale(aname, a_scale, e),
        )
    if flag == "use_int8_w8a8":
        _given(where, **{f"w{which}_zp": zp}, block_shape=q.block_shape)
        if not q.per_channel_quant:
            raise MoeInputError(
                f"{where}: use_int8_w8a8 with per-tensor weight scales has no moerunner "
                "scheme (int8 is per output channel); pass per_channel_quant=True with "
                f"{sname} [E, N]"
            )
        data = _data(name, w, torch.int8, flag)
        e, n, k = data.shape
        s = _fp32(sname, scale, (e, n))
        if a_scale is None:
            return QuantizedWeight("int8", (e, n, k), data, s)
        return QuantizedWeight(
            "int8_static", (e, n, k), data, s, input_scale=_static_scale(aname, a_scale, e)
        )
    if flag == "use_int8_w8a16":
        _given(
            where,
            **{f"w{which}_zp": zp, aname: a_scale},
            block_shape=q.block_shape,
            per_channel_quant=q.per_channel_quant,
        )
        data = _data(name, w, torch.int8, flag)
        e, n, k = data.shape
        return QuantizedWeight("int8_w8a16", (e, n, k), data, _fp32(sname, scale, (e, n)))
    # use_int4_w4a16: packed [E, N, K/2] (low nibble = even k, value - 8 or - zero point)
    _given(where, **{aname: a_scale}, per_channel_quant=q.per_channel_quant)
    data = _data(name, w, torch.uint8, flag)
    if q.block_shape is None or len(q.block_shape) != 2 or q.block_shape[0] != 0:
        raise MoeInputError(
            f"{where}: use_int4_w4a16 needs block_shape=[0, group_size] (scales per group of "
            f"K), got {q.block_shape!r}"
        )
    group = int(q.block_shape[1])
    e, n, half_k = data.shape
    k = 2 * half_k
    if group < 2 or k % group:
        raise MoeInputError(f"{where}: block_shape group {group} must divide K={k} (even)")
    s = _fp32(sname, scale, (e, n, k // group))
    zero = None
    if zp is not None:
        zero = _unpack_rows(f"w{which}_zp", zp, (e, n, k // group))
    scheme = get_scheme(f"int4_g{group}" + ("_zp" if zero is not None else ""))
    return QuantizedWeight(scheme, (e, n, k), data, s, zero_point=zero)


_FLAGS = ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16")


def _block(block_shape) -> tuple[int, int]:
    if (
        not isinstance(block_shape, (list, tuple))
        or len(block_shape) != 2
        or not all(isinstance(v, int) and v > 0 for v in block_shape)
    ):
        raise MoeInputError(
            f"block_shape must be [block_n, block_k] of positive ints, got {block_shape!r}"
        )
    return int(block_shape[0]), int(block_shape[1])


def _unpack_rows(name: str, zp: object, shape: tuple[int, int, int]) -> torch.Tensor:
    """int4 zero points packed two rows a byte along N (``[E, N/2, G]``, low nibble = even
    row) to one uint8 per row ``[E, N, G]`` (a copy of the small zero-point tensor)."""
    zp = _tensor(name, zp)
    e, n, g = shape
    if zp.dtype != torch.uint8 or tuple(zp.shape) != (e, n // 2, g) or n % 2:
        raise MoeInputError(
            f"{name} must be uint8 [E, N/2, K/group] = {[e, n // 2, g]} (two 4-bit zero "
            f"points per byte along N), got {zp.dtype} {list(zp.shape)}"
        )
    return torch.stack((zp & 0xF, zp >> 4), dim=2).reshape(e, n, g)


def peer_weights(where: str, w1: object, w2: object, q: QuantArgs):
    """``(w13, w2)`` for moerunner: the tensors as given, or ``QuantizedWeight`` values."""
    return _one(where, q, "1", w1), _one(where, q, "2", w2)


def global_to_local(
    where: str,
    topk_ids: torch.Tensor,
    num_local: int,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
) -> torch.Tensor:
    """The peers' expert parallelism: ids are global in ``[0, global_num_experts)`` and
    ``expert_map[global]`` is the local id or -1. Ids are checked against the global range
    (on a GPU without a host read, ``moerunner.check_errors``), then mapped."""
    check_global_num_experts(where, global_num_experts)
    if expert_map is None:
        if global_num_experts not in (-1, num_local):
            raise MoeInputError(
                f"{where}: global_num_experts={global_num_experts} differs from the "
                f"{num_local} experts of w1 but no expert_map says which are local"
            )
        return topk_ids
    expert_map = _tensor("expert_map", expert_map)
    if expert_map.dim() != 1 or not is_index_tensor(expert_map):
        raise MoeInputError(
            f"{where}: expert_map must be a 1-D [global_num_experts] tensor of "
            f"{INDEX_DTYPES_TEXT}, got {expert_map.dtype} {list(expert_map.shape)}"
        )
    total = expert_map.numel() if global_num_experts == -1 else global_num_experts
    if expert_map.numel() != total:
        raise MoeInputError(
            f"{where}: expert_map has {expert_map.numel()} entries but "
            f"global_num_experts={global_num_experts}"
        )
    if not isinstance(topk_ids, torch.Tensor) or not is_index_tensor(topk_ids):
        got = topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__
        raise TypeError(f"{where}: topk_ids must be a tensor of {INDEX_DTYPES_TEXT}, got {got}")
    if expert_map.device != topk_ids.device:
        raise MoeInputError(
            f"{where}: expert_map is on {expert_map.device} but topk_ids on {topk_ids.device}"
        )
    check_ids_async(topk_ids, total, where=where)

    # The map's entries are local ids or -1: checked once per map (and in-place version).
    def check_map() -> bool:
        check_ids_async(expert_map, num_local, where=where, names=("expert_map", "the local E"))
        return True  # (memoised: a value, not None)

    memoised(expert_map, ("expert_map checked", view_key(expert_map), num_local), check_map)
    return local_ids(topk_ids, expert_map)


def check_global_num_experts(where: str, global_num_experts: object) -> None:
    """``global_num_experts`` is an int (-1: w1's count); checked before the other
    arguments, so a call in an older release's positional order fails here, by name."""
    if isinstance(global_num_experts, bool) or not isinstance(global_num_experts, int):
        raise TypeError(
            f"{where}: global_num_experts must be an int, got {global_num_experts!r} (the "
            "flat quantization flags that older vLLM releases took by position are "
            "keyword-only here)"
        )


def run(
    where: str,
    hidden_states: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    call: ExpertsCall,
    *,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    apply_router_weight_on_input: bool,
    inplace: bool,
    output: torch.Tensor | None,
    backend: str,
    scale: float | None = None,
) -> torch.Tensor:
    """``fused_moe`` with the peers' result conventions: ``inplace`` writes into (and
    returns) ``hidden_states``, ``output`` is written and returned, else a new tensor.
    ``scale`` multiplies the output (SGLang's ``routed_scaling_factor``), through the
    routing weights where that is exact."""
    check_bool("inplace", inplace, f"{where}: ")
    check_bool("apply_router_weight_on_input", apply_router_weight_on_input, f"{where}: ")
    if inplace and output is not None:
        raise MoeInputError(f"{where}: inplace=True and output= both name the result; pass one")
    if apply_router_weight_on_input and w13_bias is not None:
        raise MoeInputError(
            f"{where}: apply_router_weight_on_input=True with a GEMM1 bias: the peers weight "
            "GEMM1's biased output, w * (x W1^T + b1), where moerunner weights the input, "
            "(w * x) W1^T + b1; the two differ, so this pair is refused (no model uses it)"
        )
    if apply_router_weight_on_input and getattr(w13, "input_scale", None) is not None:
        raise MoeInputError(
            f"{where}: apply_router_weight_on_input=True with a static activation scale "
            "(a1_scale): the peers differ on whether the input is weighted before it is "
            "quantized with that scale (vLLM's modular path) or GEMM1's output after it "
            "(SGLang's Triton path), which clips different values; this pair is refused"
        )
    target = hidden_states if inplace else output
    if target is not None:
        _check_result_target(where, "hidden_states" if inplace else "output", target, hidden_states)
    if scale is not None and not apply_router_weight_on_input:
        topk_weights = _tensor("topk_weights", topk_weights).float() * float(scale)
    out = fused_moe(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=call.activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        w13_order=call.w13_order,
        swiglu_alpha=call.swiglu_alpha,
        swiglu_limit=call.swiglu_limit,
        swiglu_beta=call.swiglu_beta,
        apply_router_weight_on_input=apply_router_weight_on_input,
        backend=backend,
    )
    if scale is not None and apply_router_weight_on_input:
        out = (out.float() * float(scale)).to(out.dtype)
    return out if target is None else target.copy_(out)


def _check_result_target(where: str, name: str, target: object, hidden_states: object) -> None:
    """``target`` (``output=``, or ``hidden_states`` itself for ``inplace=True``) can take the
    result, checked before the experts run: a tensor of the hidden states' shape, dtype and
    device that can be written in place (no element stored twice, as in an expanded tensor;
    not a leaf that requires grad while grad mode is on; not an inference tensor outside
    inference mode; these three in eager calls: traced, PyTorch checks them itself)."""
    target = _tensor(name, target)
    hidden_states = _tensor("hidden_states", hidden_states)
    if tuple(target.shape) != tuple(hidden_states.shape) or target.dtype != hidden_states.dtype:
        raise MoeInputError(
            f"{where}: {name} must be {hidden_states.dtype} {list(hidden_states.shape)} (the "
            f"hidden states') to take the result, got {target.dtype} {list(target.shape)}"
        )
    if target.device != hidden_states.device:
        raise MoeInputError(
            f"{where}: {name} is on {target.device}, the hidden states on {hidden_states.device}"
        )
    if torch.compiler.is_compiling():  # (what follows reads metadata dynamo cannot trace)
        return
    if any(st == 0 and n > 1 for st, n in zip(target.stride(), target.shape, strict=True)):
        raise MoeInputError(
            f"{where}: {name} stores some elements more than once (strides "
            f"{list(target.stride())}: expanded) and cannot take the result; pass a tensor of "
            "its own memory"
        )
    if target.is_leaf and target.requires_grad and torch.is_grad_enabled():
        raise MoeInputError(
            f"{where}: {name} is a leaf tensor that requires grad and cannot be written in "
            "place while grad mode is on; pass inplace=False / another output, or run under "
            "torch.no_grad()"
        )
    if target.is_inference() and not torch.is_inference_mode_enabled():
        raise MoeInputError(
            f"{where}: {name} is an inference tensor (made under torch.inference_mode()), "
            "which cannot be written in place outside it; call under torch.inference_mode()"
        )
