# Checkpoint import: published quantized MoE layouts -> QuantizedWeight, without conversion loss.
#
# GPT-OSS MXFP4: `<proj>_blocks` uint8 [E, N, K/32, 16] and `<proj>_scales` uint8 e8m0
#   [E, N, K/32] where N is the output dim (gate_up: 2I rows, gate/up interleaved: row 2j is
#   gate j, row 2j+1 is up j; down: H rows) and K the input dim, nibbles low = even k. This is
#   how transformers' GPT-OSS integration decodes them (value = table[nibble] * 2^(scale-127),
#   then transposed to its [E, in, out] parameter), so data is a plain reshape.
# DeepSeek-V3 FP8: per expert `<proj>.weight` e4m3 [N, K] and `<proj>.weight_scale_inv` fp32
#   [ceil(N/128), ceil(K/128)] (bf16 / fp16 ones are upcast, exactly); despite its name the
#   scale is a multiplier (w = e4m3 * s).
# ModelOpt NVFP4: per expert `<proj>.weight` uint8 [N, K/2], `weight_scale` e4m3 [N, K/16],
#   `weight_scale_2` fp32 scalar (global dequantization scale), `input_scale` fp32 scalar
#   (static activation global scale, used by nvfp4 activations).
# Integer weight-only formats (4 or 8 bits, one scale per group of g along the input dim K;
# every packed word is an int32 holding 32/bits values, the first in the lowest bits):
# compressed-tensors "pack-quantized": per projection `weight_packed` int32 [N, K*bits/32]
#   (packed along K), `weight_scale` [N, K/g] (float), optional `weight_zero_point` int32
#   [ceil(N*bits/32), K/g] (packed along N), `weight_shape` [2] = (N, K). Values and zero points are
#   signed and stored with the offset 2^(bits-1) added, so w = (u - u_zero) * scale on the
#   stored unsigned codes (u_zero = 2^(bits-1) when symmetric).
# GPTQ: `qweight` int32 [K*bits/32, N] (packed along K), `qzeros` int32 [K/g, N*bits/32]
#   (packed along N), `scales` [K/g, N], `g_idx` int32 [K] (group of each input row). The
#   original format ("gptq", AutoGPTQ) stores zero - 1 and adds 1 when reading; "gptq_v2"
#   stores the zero itself. w = (u - zero) * scale. Act-order checkpoints (desc_act) have a
#   g_idx other than k // g; they are refused.
# AWQ (GEMM): `qweight` int32 [K, N*bits/32] and `qzeros` [K/g, N*bits/32] packed along N in
#   the order [0, 2, 4, 6, 1, 3, 5, 7] (slot i of a word holds column 8c + order[i]),
#   `scales` [K/g, N]; w = (u - zero) * scale.
# All map onto moerunner's int4_g<g>[_zp] / int8_g<g>[_zp]: int4 keeps u (0..15) and the zero
# (uint8), int8 stores u - 128 and zero - 128; zero points that all equal the midpoint
# 2^(bits-1) give the symmetric scheme (no zero-point tensor). Float scales become fp32 (exact).
# Gate and up projections are joined row-wise by `cat_rows` (gate rows, then up rows; it lives
# in families.py, beside the other rules of how each family stores a weight).

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from moerunner.errors import MoeInputError
from moerunner.quant.codecs import pack_nibbles
from moerunner.quant.families import cat_rows
from moerunner.quant.schemes import QuantScheme, get_scheme
from moerunner.quant.weight import QuantizedWeight, check_scale_values

__all__ = [
    "AWQ_ORDER",
    "GPTQ_FORMATS",
    "cat_rows",
    "deepseek_fp8_experts_from_safetensors",
    "gpt_oss_experts_from_safetensors",
    "import_awq",
    "import_compressed_tensors",
    "import_deepseek_fp8",
    "import_gptq",
    "import_gpt_oss_mxfp4",
    "import_modelopt_nvfp4",
    "load_prefixed",
    "modelopt_nvfp4_experts_from_safetensors",
]

PathLike = str | os.PathLike


def _tensor(
    name: str, t: object, dtype: torch.dtype | None = None, dims: int | None = None
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {list(t.shape)}")
    return t


def _stack(name: str, parts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-expert list -> stacked tensor; a tensor is taken as already stacked."""
    if isinstance(parts, torch.Tensor):
        return parts
    if not isinstance(parts, Sequence) or not parts:
        raise ValueError(
            f"{name} must be a stacked tensor or a non-empty list of per-expert tensors"
        )
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"{name}[{i}] must be a torch.Tensor (one per expert), got {type(p).__name__}"
            )
    first = (parts[0].dtype, list(parts[0].shape))
    for i, p in enumerate(parts):
        if (p.dtype, list(p.shape)) != first:  # name the first one off (E may be hundreds)
            raise ValueError(
                f"{name}: per-expert tensors differ in dtype/shape: {name}[{i}] is {p.dtype} "
                f"{list(p.shape)}, {name}[0] is {first[0]} {first[1]}"
            )
    return torch.stack(list(parts))


def _deinterleave_index(n: int, device: torch.device) -> torch.Tensor:
    if n % 2:
        raise ValueError(f"deinterleave: interleaved gate/up needs an even row count, got {n}")
    return torch.cat([torch.arange(0, n, 2, device=device), torch.arange(1, n, 2, device=device)])


def import_gpt_oss_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    *,
    scheme: str | QuantScheme = "mxfp4",
    deinterleave: bool = False,
) -> QuantizedWeight:
    """GPT-OSS ``*_blocks`` uint8 ``[E, N, G, 16]`` + ``*_scales`` uint8 ``[E, N, G]`` -> weight.

    The result has shape ``(E, N, 32*G)``. ``scheme`` is "mxfp4" (W4A16) or "mxfp4_mxfp8"
    (W4A8). ``deinterleave=True`` (gate_up only) reorders rows from GPT-OSS's alternating
    gate/up to gate rows then up rows; otherwise rows keep the checkpoint order.
    """
    s = get_scheme(scheme)
    if s.weight_format != "e2m1" or s.scale_format != "e8m0":
        raise ValueError(f"scheme must be an MXFP4 scheme ('mxfp4', 'mxfp4_mxfp8'), got {s.name!r}")
    _tensor("blocks", blocks, torch.uint8, 4)
    _tensor("scales", scales, torch.uint8, 3)
    e, n, g, b = blocks.shape
    if b != 16 or tuple(scales.shape) != (e, n, g):
        raise ValueError(
            f"blocks/scales: expected blocks [E, N, G, 16] and scales [E, N, G], got "
            f"{list(blocks.shape)} and {list(scales.shape)}"
        )
    check_scale_values({"scale": scales}, {"scale": "scales"}, e8m0_nan=False)
    qw = QuantizedWeight(s, (e, n, 32 * g), blocks.reshape(e, n, 16 * g), scales)
    return qw.select_rows(_deinterleave_index(n, blocks.device)) if deinterleave else qw


#: Float scale dtypes the importers upcast to fp32 (exactly: fp32 holds every value of each).
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def import_deepseek_fp8(
    weight: torch.Tensor | Sequence[torch.Tensor],
    weight_scale_inv: torch.Tensor | Sequence[torch.Tensor],
) -> QuantizedWeight:
    """DeepSeek-V3 FP8 expert projections -> fp8_block weight ``(E, N, K)``.

    ``weight``: e4m3 ``[N, K]`` per expert (a list) or stacked ``[E, N, K]``;
    ``weight_scale_inv``: fp32 ``[ceil(N/128), ceil(K/128)]`` per expert, or stacked (bf16 /
    fp16 scales are taken too: their upcast to fp32 is exact).
    """
    w = _tensor("weight", _stack("weight", weight), torch.float8_e4m3fn, 3)
    s = _tensor("weight_scale_inv", _stack("weight_scale_inv", weight_scale_inv), None, 3)
    if s.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"weight_scale_inv must have dtype torch.float32, torch.bfloat16 or torch.float16, "
            f"got {s.dtype}"
        )
    s = s.float()
    e, n, k = w.shape
    grid = (e, -(-n // 128), -(-k // 128))
    if tuple(s.shape) != grid:
        raise ValueError(
            f"weight_scale_inv: expected fp32 [ceil(N/128), ceil(K/128)] per expert = "
            f"{list(grid)} (stacked) for weight {list(w.shape)}, got {list(s.shape)}"
        )
    check_scale_values({"scale": s}, {"scale": "weight_scale_inv"})
    return QuantizedWeight("fp8_block", (e, n, k), w, s)


def import_modelopt_nvfp4(
    weight: torch.Tensor | Sequence[torch.Tensor],
    weight_scale: torch.Tensor | Sequence[torch.Tensor],
    weight_scale_2: torch.Tensor | Sequence[torch.Tensor],
    input_scale: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    scheme: str | QuantScheme = "nvfp4",
) -> QuantizedWeight:
    """ModelOpt NVFP4 expert projections -> weight ``(E, N, K)``.

    Per expert (lists) or stacked: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` e4m3
    ``[N, K/16]``, ``weight_scale_2`` fp32 scalar, ``input_scale`` fp32 scalar. ``scheme``
    "nvfp4" (W4A16) drops ``input_scale``; "nvfp4_a4" / "nvfp4_a4_static" keep it as the
    static activation global scale.
    """
    s = get_scheme(scheme)
    if not s.has_global_scale:
        raise ValueError(f"scheme must be an NVFP4 scheme ('nvfp4', 'nvfp4_a4'), got {s.name!r}")
    w = _tensor("weight", _stack("weight", weight), torch.uint8, 3)
    sc = _tensor("weight_scale", _stack("weight_scale", weight_scale), torch.float8_e4m3fn, 3)
    gs = _tensor("weight_scale_2", _stack("weight_scale_2", weight_scale_2), torch.float32)
    gs = gs.reshape(-1)
    e, n, half_k = w.shape
    if tuple(sc.shape) != (e, n, 2 * half_k // 16):
        raise ValueError(
            f"weight_scale: expected e4m3 [N, K/16] per expert = {[e, n, 2 * half_k // 16]} "
            f"(stacked) for weight {list(w.shape)}, got {list(sc.shape)}"
        )
    if gs.numel() != e:
        raise ValueError(
            f"weight_scale_2: expected one fp32 value per expert ({e}), got {gs.numel()}"
        )
    act_scale = None
    if input_scale is not None and s.activation_format == "nvfp4":
        act_scale = _tensor("input_scale", _stack("input_scale", input_scale), torch.float32)
        act_scale = act_scale.reshape(-1)
    check_scale_values(
        {"scale": sc, "global_scale": gs, "input_scale": act_scale},
        {"scale": "weight_scale", "global_scale": "weight_scale_2", "input_scale": "input_scale"},
    )
    return QuantizedWeight(s, (e, n, 2 * half_k), w, sc, global_scale=gs, input_scale=act_scale)


#: AWQ's packing order: slot i of an int32 word holds output column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _check_bits(name: str, bits: object, accepted: tuple[int, ...] = (4, 8)) -> int:
    if isinstance(bits, bool) or bits not in accepted:
        raise ValueError(
            f"{name} must be one of {accepted} (moerunner's int4 / int8 group schemes), "
            f"got {bits!r}"
        )
    return int(bits)


def _floating(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor (the group scales), got {t.dtype}")
    return t


def _unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned codes (int32) along ``dim``; a word's first value in its low bits."""
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


def _group_size(k: int, groups: int, group_size: object, g_idx: object, scales_name: str) -> int:
    """The group size of ``k`` input rows whose scales hold ``groups`` groups: the checkpoint
    config's ``group_size`` (-1: one group) where given, else the rows of group 0 in
    ``g_idx``, else ``k / groups`` where no other common group size (a power of two) makes
    that many groups. The peers make ceil(K / g) groups, so a group size that does not
    divide K leaves a ragged last group, which the int<bits>_g<g> schemes cannot hold:
    refused, as is a scale count that does not fit the group size."""
    if group_size is not None:
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, int)
            or group_size == 0
            or group_size < -1
        ):
            raise ValueError(f"group_size must be a positive int or -1, got {group_size!r}")
        g = k if group_size == -1 else group_size
    elif g_idx is not None:
        g = int((_group_index(g_idx, "g_idx", k).reshape(-1, k)[0] == 0).sum()) or k
    elif groups <= 1:
        g = k
    else:
        g = k // groups
        ragged = [c for c in (2**p for p in range(4, 12)) if -(-k // c) == groups and k % c]
        if k % groups or ragged:
            raise ValueError(
                f"{scales_name}: {groups} groups for K={k} input rows fit a group size of "
                f"{k / groups:g} and also {ragged[0] if ragged else 'another'} with a ragged "
                "last group (the peers make ceil(K / g) groups): pass group_size (the "
                "checkpoint's quantization config) or g_idx"
            )
    if -(-k // g) != groups:
        raise ValueError(
            f"{scales_name}: group size {g} makes {-(-k // g)} groups of K={k} input rows, the "
            f"scales hold {groups}"
        )
    if k % g:
        raise ValueError(
            f"group size {g} does not divide K={k}: the checkpoint's last group is ragged "
            f"({k % g} rows), which moerunner's int<bits>_g<group> schemes cannot hold"
        )
    return g


def _group_index(g_idx: object, name: str, k: int) -> torch.Tensor:
    """``g_idx`` (per expert or stacked) as a tensor, checked: integers, one per input row."""
    idx = _tensor(name, _stack(name, g_idx))
    if idx.is_floating_point() or idx.shape[-1] != k:
        raise ValueError(
            f"{name}: expected integer group indices with one entry per input row ({k}), got "
            f"{idx.dtype} {list(idx.shape)}"
        )
    return idx


def _check_group_index(g_idx: object, name: str, k: int, group: int) -> None:
    """Refuse act-order checkpoints: input row k must belong to group k // group."""
    if g_idx is None:
        return
    idx = _group_index(g_idx, name, k)
    trivial = torch.arange(k, device=idx.device) // group
    if not bool((idx.long() == trivial).all()):
        raise ValueError(
            f"{name}: the input rows are not in group order (group of row k != k // {group}): "
            "act-order (desc_act) checkpoints are not supported; use a checkpoint quantized "
            "without desc_act (or with static groups)"
        )


def _integer_weight(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    names: tuple[str, str, str],
) -> QuantizedWeight:
    """Unsigned codes int32 [E, N, K], zeros int32 [E, N, G], float scales [E, N, G] ->
    int<bits>_g<K/G>[_zp] (see the module header)."""
    e, n, k = codes.shape
    if tuple(scales.shape[:2]) != (e, n):
        raise ValueError(
            f"{names[2]}: expected [E, N, groups] = [{e}, {n}, G] for {names[0]} (N={n} output "
            f"rows, K={k} input rows), got {list(scales.shape)}"
        )
    if tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(
            f"{names[1]}: expected [E, N, groups] = {list(scales.shape)} after unpacking, like "
            f"{names[2]}, got {list(zeros.shape)}"
        )
    groups = scales.shape[2]
    if groups == 0 or k % groups:
        raise ValueError(
            f"{names[2]}: {groups} groups do not divide the {k} input rows of {names[0]}"
        )
    top = (1 << bits) - 1
    if zeros.numel() and not (0 <= int(zeros.min()) and int(zeros.max()) <= top):
        raise ValueError(
            f"{names[1]}: zero points must lie in [0, {top}] for {bits}-bit weights, got values "
            f"in [{int(zeros.min())}, {int(zeros.max())}] (the original GPTQ format stores "
            f"zero - 1, so a zero point of 0 wraps to {top + 1}; such checkpoints cannot be "
            "read exactly)"
        )
    mid = 1 << (bits - 1)
    symmetric = bool((zeros == mid).all())
    group = k // groups
    if bits == 4 and (group % 2 or k % 2):
        raise ValueError(
            f"{names[0]}: int4 weights pack two values per byte along the input dim, which needs "
            f"an even group size and K; got group {group}, K={k}"
        )
    scheme = get_scheme(f"int{bits}_g{group}" + ("" if symmetric else "_zp"))
    scale = scales.float().contiguous()
    check_scale_values({"scale": scale}, {"scale": names[2]})
    if bits == 4:
        data = pack_nibbles(codes.to(torch.uint8))
        zero = None if symmetric else zeros.to(torch.uint8)
    else:
        data = (codes - 128).to(torch.int8)
        zero = None if symmetric else (zeros - 128).to(torch.int8)
    zero = None if zero is None else zero.contiguous()
    return QuantizedWeight(scheme, (e, n, k), data.contiguous(), scale, zero_point=zero)


def import_compressed_tensors(
    weight_packed: torch.Tensor | Sequence[torch.Tensor],
    weight_scale: torch.Tensor | Sequence[torch.Tensor],
    weight_zero_point: torch.Tensor | Sequence[torch.Tensor] | None = None,
    weight_shape: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    num_bits: int = 4,
    g_idx: torch.Tensor | Sequence[torch.Tensor] | None = None,
    group_size: int | None = None,
) -> QuantizedWeight:
    """compressed-tensors ``pack-quantized`` expert projections -> int4 / int8 group weight.

    Per expert (lists) or stacked: ``weight_packed`` int32 ``[N, K*bits/32]``,
    ``weight_scale`` float ``[N, K/g]`` (g = K for channel-wise), ``weight_zero_point`` int32
    ``[N*bits/32, K/g]`` (asymmetric only), ``weight_shape`` ``[2]`` = (N, K), or for a
    stacked 3-D weight ``[3]`` = (E, N, K) (K is taken from the packed size when omitted),
    ``g_idx`` (``weight_g_idx``; only the trivial order is accepted). ``group_size``: the
    quantization config's (-1: channel-wise); without it the group size follows from the
    scales' shape where that is unambiguous (``_group_size``).
    """
    bits = _check_bits("num_bits", num_bits)
    packed = _tensor("weight_packed", _stack("weight_packed", weight_packed), torch.int32, 3)
    scales = _tensor("weight_scale", _stack("weight_scale", weight_scale), None, 3)
    _floating("weight_scale", scales)
    e, n, words = packed.shape
    per = 32 // bits
    k = words * per
    if weight_shape is not None:
        shapes = _tensor("weight_shape", _stack("weight_shape", weight_shape))
        if shapes.dim() == 1 and shapes.numel() == 3:  # a stacked weight's (E, N, K)
            if int(shapes[0]) != e:
                raise ValueError(
                    f"weight_shape: {shapes.tolist()} names {int(shapes[0])} experts, "
                    f"weight_packed holds {e}"
                )
            shapes = shapes[1:]
        shapes = shapes.reshape(-1, 2) if shapes.numel() % 2 == 0 else shapes
        if shapes.dim() != 2 or shapes.is_floating_point() or not bool((shapes == shapes[0]).all()):
            raise ValueError(
                f"weight_shape: expected one integer (N, K) pair (or (E, N, K)), got {shapes}"
            )
        n_, k_ = (int(v) for v in shapes[0])
        if n_ != n or not k - per < k_ <= k:
            raise ValueError(
                f"weight_shape: ({n_}, {k_}) does not match weight_packed {list(packed.shape)} "
                f"({32 // bits} values per int32)"
            )
        k = k_
    codes = _unpack_words(packed, bits, 2)[:, :, :k]
    if weight_zero_point is None:
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32, device=packed.device)
    else:
        zp = _stack("weight_zero_point", weight_zero_point)
        zp = _tensor("weight_zero_point", zp, torch.int32, 3)
        # Exactly the packed rows: an unpacked [N, groups] tensor also has enough rows, and
        # reading it as packed would give wrong zero points.
        rows = -(-n // per)
        if tuple(zp.shape[1:]) != (rows, scales.shape[2]):
            raise ValueError(
                f"weight_zero_point: expected int32 [ceil(N*{bits}/32), groups] = "
                f"[{rows}, {scales.shape[2]}] per expert (N={n} packed {per} to a word, the "
                f"groups of weight_scale), got {list(zp.shape[1:])} per expert"
            )
        zeros = _unpack_words(zp, bits, 1)[:, :n]
    group = _group_size(k, scales.shape[2], group_size, g_idx, "weight_scale")
    _check_group_index(g_idx, "g_idx", k, group)
    return _integer_weight(
        codes, zeros, scales, bits, ("weight_packed", "weight_zero_point", "weight_scale")
    )


GPTQ_FORMATS = ("gptq", "gptq_v2")


def import_gptq(
    qweight: torch.Tensor | Sequence[torch.Tensor],
    qzeros: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    g_idx: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    bits: int = 4,
    checkpoint_format: str = "gptq",
    group_size: int | None = None,
) -> QuantizedWeight:
    """GPTQ expert projections -> int4 / int8 group weight ``(E, N, K)``.

    Per expert (lists) or stacked: ``qweight`` int32 ``[K*bits/32, N]``, ``qzeros`` int32
    ``[K/g, N*bits/32]``, ``scales`` float ``[K/g, N]``, ``g_idx`` int ``[K]`` (must be
    ``k // g``: act-order checkpoints are refused). ``checkpoint_format`` "gptq" (stored
    zeros are zero - 1, AutoGPTQ's format and the default of ``quantize_config.json``) or
    "gptq_v2" (stored as is). ``group_size``: ``quantize_config.json``'s (-1: one group);
    without it the group size comes from ``g_idx`` or, where unambiguous, the scales' shape
    (``_group_size``; a K that is not a multiple of it is refused).
    """
    bits = _check_bits("bits", bits)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"checkpoint_format must be one of {GPTQ_FORMATS}, got {checkpoint_format!r}"
        )
    qw = _tensor("qweight", _stack("qweight", qweight), torch.int32, 3)
    qz = _tensor("qzeros", _stack("qzeros", qzeros), torch.int32, 3)
    sc = _floating("scales", _tensor("scales", _stack("scales", scales), None, 3))
    codes = _unpack_words(qw, bits, 1)  # [E, K, N]
    zeros = _unpack_words(qz, bits, 2)  # [E, G, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    k = codes.shape[1]
    group = _group_size(k, sc.shape[1], group_size, g_idx, "scales")
    _check_group_index(g_idx, "g_idx", k, group)
    return _integer_weight(
        codes.transpose(1, 2),
        zeros.transpose(1, 2),
        sc.transpose(1, 2),
        bits,
        ("qweight", "qzeros", "scales"),
    )


def import_awq(
    qweight: torch.Tensor | Sequence[torch.Tensor],
    qzeros: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    *,
    bits: int = 4,
    group_size: int | None = None,
) -> QuantizedWeight:
    """AWQ (GEMM) expert projections -> int4 group weight ``(E, N, K)``.

    Per expert (lists) or stacked: ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32
    ``[K/g, N/8]`` (both in `AWQ_ORDER` within a word), ``scales`` float ``[K/g, N]``.
    ``group_size``: the quantization config's (``group_size`` / ``q_group_size``; -1: one
    group); without it the group size follows from the scales' shape where that is
    unambiguous (``_group_size``; a K that is not a multiple of it is refused, as for GPTQ).
    """
    bits = _check_bits("bits", bits, (4,))
    qw = _tensor("qweight", _stack("qweight", qweight), torch.int32, 3)
    qz = _tensor("qzeros", _stack("qzeros", qzeros), torch.int32, 3)
    sc = _floating("scales", _tensor("scales", _stack("scales", scales), None, 3))
    codes = _unpack_words(qw, bits, 2)  # [E, K, N] in slot order
    zeros = _unpack_words(qz, bits, 2)  # [E, G, N] in slot order
    if qz.shape[2] != qw.shape[2] or qz.shape[0] != qw.shape[0]:
        raise ValueError(
            f"qzeros: expected int32 [E, groups, N/8] with the {qw.shape[2]} words per row of "
            f"qweight {list(qw.shape)}, got {list(qz.shape)}"
        )
    # The peers group ceil(K / g) rows: a scale count alone cannot tell g from a ragged g.
    _group_size(codes.shape[1], sc.shape[1], group_size, None, "scales")
    slot_of = torch.tensor([AWQ_ORDER.index(m) for m in range(8)], device=qw.device)
    words = codes.shape[2] // 8
    column = (torch.arange(words, device=qw.device)[:, None] * 8 + slot_of).reshape(-1)
    return _integer_weight(
        codes.index_select(2, column).transpose(1, 2),
        zeros.index_select(2, column).transpose(1, 2),
        sc.transpose(1, 2),
        bits,
        ("qweight", "qzeros", "scales"),
    )


# Quantization configs (config.json's quantization_config) and the layer as a whole.


def quant_config(config: dict) -> dict:
    """config.json's ``quantization_config`` ({} where absent or not an object)."""
    q = config.get("quantization_config")
    return q if isinstance(q, dict) else {}


def compressed_tensors_bits(q: dict) -> int | None:
    """The weights' bits of a compressed-tensors quantization config, where its config
    groups agree on one; else None."""
    bits = {
        (group.get("weights") or {}).get("num_bits")
        for group in (q.get("config_groups") or {}).values()
        if isinstance(group, dict)
    }
    bits.discard(None)
    return bits.pop() if len(bits) == 1 else None


def compressed_tensors_group_size(q: dict) -> int | None:
    """The weights' group size of a compressed-tensors quantization config (-1 for the
    channel strategy), where its config groups agree on one; else None (the importer then
    reads it from the scales' shape where that is unambiguous)."""
    sizes = set()
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") or {} if isinstance(group, dict) else {}
        if weights.get("strategy") == "channel":
            sizes.add(-1)
        elif isinstance(weights.get("group_size"), int):
            sizes.add(weights["group_size"])
    return sizes.pop() if len(sizes) == 1 else None


def block_aligned(gate: QuantizedWeight, up: QuantizedWeight, down: QuantizedWeight) -> tuple:
    """fp8_block gate / up / down with I padded to whole 128-row scale blocks (zero rows of
    gate and up, zero columns of down: the same blocks, so the scales stay as stored)."""
    if gate.scheme.granularity != "block":
        return gate, up, down
    rows = gate.scheme.block_shape[0]
    inter = gate.shape[1]
    if inter % rows == 0:
        return gate, up, down
    padded = -(-inter // rows) * rows
    return gate.pad(rows_per_segment=padded), up.pad(rows_per_segment=padded), down.pad(k=padded)


def join_gate_up(
    gate: QuantizedWeight, up: QuantizedWeight, keys: Sequence[str], names: str, rescale: bool
) -> QuantizedWeight:
    """``cat_rows([gate, up])`` for ``moerunner.load_experts``, its refusals as MoeInputErrors
    naming the checkpoint's tensors (``keys``: gate's and up's matrix, ``names``: both
    projections of every expert)."""
    try:
        return cat_rows([gate, up], rescale=rescale)
    except ValueError:
        if gate.scheme != up.scheme:  # (E and K are equal here; zero-point twins join)
            raise MoeInputError(
                f"checkpoint: gate and up projections are stored in different schemes: "
                f"{keys[0]} is {gate.scheme.name}, {keys[1]} is {up.scheme.name}; w13 holds "
                "both in one, so they need the same bits and group size"
            ) from None
        scales = (gate.global_scale, up.global_scale)
        if scales[0] is None or torch.equal(*scales):
            raise
        raise MoeInputError(
            f"checkpoint: {names}: gate and up carry different per-expert global scales "
            "(NVFP4 weight_scale_2); pass rescale=True to load_experts to re-round both to "
            "the larger one (lossy)"
        ) from None


@contextmanager
def reading_safetensors(file: str):
    """safetensors' error for a damaged file (a truncated download, not a safetensors file)
    as a MoeInputError naming the file, which safetensors' own message does not."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise MoeInputError(
            f"checkpoint: {file!r} cannot be read as a safetensors file ({e}); a truncated or "
            "corrupt download? (fetch the file again)"
        ) from e


def load_prefixed(paths: PathLike | Sequence[PathLike], prefix: str) -> dict[str, torch.Tensor]:
    """Tensors named ``prefix + rest`` in one or more safetensors files, keyed by ``rest``.
    A path that is not a file, or a file that is not safetensors, is a MoeInputError naming
    it."""
    from safetensors import safe_open

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"paths: expected file paths, got {type(path).__name__}")
        file = os.fspath(path)
        if not os.path.isfile(file):
            raise MoeInputError(f"paths: {file!r} is not a file")
        with reading_safetensors(file), safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = f.get_tensor(name)
    return out


def _need(found: dict[str, torch.Tensor], key: str, prefix: str) -> torch.Tensor:
    if key not in found:
        raise ValueError(f"paths: tensor {prefix + key!r} not found in the checkpoint")
    return found[key]


def gpt_oss_experts_from_safetensors(
    paths: PathLike | Sequence[PathLike],
    prefix: str,
    *,
    scheme: str | QuantScheme = "mxfp4",
    deinterleave: bool = False,
) -> dict[str, object]:
    """Read one GPT-OSS MoE layer (``prefix`` e.g. "model.layers.0.mlp.experts.").

    Returns ``{"w13": [E, 2I, H], "w2": [E, H, I], "w13_bias", "w2_bias" (fp32 or None),
    "gate_up_interleaved": bool}``; rows of w13 and w13_bias are interleaved gate/up unless
    ``deinterleave`` (then gate rows, then up rows).
    """
    found = load_prefixed(paths, prefix)
    w13 = import_gpt_oss_mxfp4(
        _need(found, "gate_up_proj_blocks", prefix),
        _need(found, "gate_up_proj_scales", prefix),
        scheme=scheme,
        deinterleave=deinterleave,
    )
    w2 = import_gpt_oss_mxfp4(
        _need(found, "down_proj_blocks", prefix),
        _need(found, "down_proj_scales", prefix),
        scheme=scheme,
    )
    b13, b2 = found.get("gate_up_proj_bias"), found.get("down_proj_bias")
    if b13 is not None:
        b13 = b13.float()
        if deinterleave:
            b13 = b13.index_select(1, _deinterleave_index(b13.shape[1], b13.device))
    return {
        "w13": w13,
        "w2": w2,
        "w13_bias": b13,
        "w2_bias": None if b2 is None else b2.float(),
        "gate_up_interleaved": not deinterleave,
    }


def _per_expert(
    found: dict[str, torch.Tensor], prefix: str, num_experts: int, proj: str, key: str
) -> list[torch.Tensor]:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    extra = sorted(
        int(name.split(".", 1)[0])
        for name in found
        if name.endswith(f".{proj}.{key}")
        and name.split(".", 1)[0].isdigit()
        and int(name.split(".", 1)[0]) >= num_experts
    )
    if extra:
        raise ValueError(
            f"num_experts={num_experts}, but the checkpoint also holds {prefix}{extra[0]}."
            f"{proj}.{key} ({len(extra)} experts numbered >= {num_experts}): pass the "
            "checkpoint's expert count"
        )
    return [_need(found, f"{e}.{proj}.{key}", prefix) for e in range(num_experts)]


def deepseek_fp8_experts_from_safetensors(
    paths: PathLike | Sequence[PathLike],
    prefix: str,
    num_experts: int,
    *,
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> dict[str, QuantizedWeight]:
    """Read DeepSeek-V3 FP8 routed experts ``prefix{e}.{proj}.weight[_scale_inv]``.

    ``prefix`` is e.g. "model.layers.3.mlp.experts."; returns ``{"w13", "w2"}`` (fp8_block,
    gate rows then up rows).
    """
    found = load_prefixed(paths, prefix)
    gate, up, down = (
        import_deepseek_fp8(
            _per_expert(found, prefix, num_experts, p, "weight"),
            _per_expert(found, prefix, num_experts, p, "weight_scale_inv"),
        )
        for p in proj_names
    )
    return {"w13": cat_rows([gate, up]), "w2": down}


def modelopt_nvfp4_experts_from_safetensors(
    paths: PathLike | Sequence[PathLike],
    prefix: str,
    num_experts: int,
    *,
    scheme: str | QuantScheme = "nvfp4",
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    rescale: bool = False,
) -> dict[str, QuantizedWeight]:
    """Read ModelOpt NVFP4 routed experts ``prefix{e}.{proj}.weight / weight_scale / ...``.

    Returns ``{"w13", "w2"}``. Gate and up have separate ``weight_scale_2`` in ModelOpt files;
    when they differ, ``rescale=True`` is needed (see `cat_rows`).
    """
    found = load_prefixed(paths, prefix)

    def one(proj: str) -> QuantizedWeight:
        has_input = f"0.{proj}.input_scale" in found
        return import_modelopt_nvfp4(
            _per_expert(found, prefix, num_experts, proj, "weight"),
            _per_expert(found, prefix, num_experts, proj, "weight_scale"),
            _per_expert(found, prefix, num_experts, proj, "weight_scale_2"),
            _per_expert(found, prefix, num_experts, proj, "input_scale") if has_input else None,
            scheme=scheme,
        )

    gate, up, down = (one(p) for p in proj_names)
    return {"w13": cat_rows([gate, up], rescale=rescale), "w2": down}
