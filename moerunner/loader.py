"""One MoE layer's experts from safetensors checkpoints, without transformers.

``load_experts(path, layer=i)`` reads the routed experts of decoder layer ``i`` of a Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3 or GPT-OSS checkpoint (one ``.safetensors`` file, a folder,
or a sharded checkpoint's ``model.safetensors.index.json``) and returns them in the canonical
layout (``ExpertWeights``: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``) with the activation, top-k and
routing the family's ``config.json`` implies. Only the requested layer's tensors are read
(``safe_open`` maps the files; a tensor is read when asked for).

Checkpoint names (the files as published, i.e. what transformers' ``save_pretrained`` writes),
under ``model.layers.{i}.``:

- mixtral: ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (w1 gate, w3 up, w2 down);
- qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3:
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``;
- gpt_oss: ``mlp.experts.gate_up_proj [E, H, 2I]`` (gate/up columns alternating) and
  ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``; MXFP4
  checkpoints ``*_blocks`` / ``*_scales`` instead of the weights.

Per-expert projections may be stored plain (bf16/fp16/fp32) or quantized; the format is read
from the tensors present: ``weight`` e4m3 + ``weight_scale_inv`` (DeepSeek-V3 FP8 blocks),
``weight`` uint8 + ``weight_scale`` + ``weight_scale_2`` (ModelOpt NVFP4), ``weight_packed``
(compressed-tensors pack-quantized), ``qweight`` (GPTQ or AWQ, told apart by
``quantization_config.quant_method`` or the tensors' shapes). The quantized ones keep their
values exactly (``moerunner.quant.checkpoints`` has the importers and the format rules).
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from .config import Activation, RoutingConfig, check_groups
from .errors import MoeInputError
from .quant.checkpoints import block_aligned, join_gate_up, reading_safetensors
from .weights import ExpertWeights

__all__ = ["FAMILIES", "CheckpointFamily", "LoadedExperts", "load_experts"]

PathLike = str | os.PathLike


@dataclass(frozen=True)
class CheckpointFamily:
    """Where a model family keeps one layer's routed experts and what they compute.

    ``experts``: the module path after ``{root}.{layer}.``; ``projections``: per-expert
    (gate, up, down) names, or None for GPT-OSS's stacked tensors; ``num_experts_key``: the
    config.json field holding the routed expert count, or the fields in the order read
    (transformers 5 writes Qwen's ``num_experts`` as ``num_local_experts``).
    """

    name: str
    experts: str
    projections: tuple[str, str, str] | None
    num_experts_key: str | tuple[str, ...]
    activation: str = "silu"

    @property
    def num_experts_keys(self) -> tuple[str, ...]:
        """``num_experts_key`` as a tuple."""
        key = self.num_experts_key
        return (key,) if isinstance(key, str) else tuple(key)


FAMILIES: dict[str, CheckpointFamily] = {
    f.name: f
    for f in (
        CheckpointFamily(
            "mixtral", "block_sparse_moe.experts", ("w1", "w3", "w2"), "num_local_experts"
        ),
        *(
            CheckpointFamily(
                name,
                "mlp.experts",
                ("gate_proj", "up_proj", "down_proj"),
                ("num_experts", "num_local_experts"),
            )
            for name in ("qwen2_moe", "qwen3_moe")
        ),
        CheckpointFamily(
            "deepseek_v2", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts"
        ),
        CheckpointFamily(
            "deepseek_v3", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts"
        ),
        CheckpointFamily("gpt_oss", "mlp.experts", None, "num_local_experts", "swiglu_oai"),
    )
}


@dataclass(frozen=True)
class LoadedExperts:
    """One layer's experts as loaded, with what the family and its config imply.

    ``weights`` and ``activation`` go to ``moerunner.fused_moe`` / ``MoE.from_weights``.
    ``top_k`` and ``routing`` come from config.json (None without one).
    ``format``: "plain", "fp8_block", "nvfp4", "mxfp4", "compressed-tensors", "gptq" or "awq".
    """

    family: str
    layer: int
    weights: ExpertWeights
    activation: Activation
    format: str
    top_k: int | None = None
    routing: RoutingConfig | None = None

    @property
    def num_experts(self) -> int:
        """Routed experts of the layer."""
        return self.weights.num_experts


class _Checkpoint:
    """The tensors of a checkpoint by name, read lazily from the file that holds each."""

    def __init__(self, path: PathLike, stack: ExitStack):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        self._stack = stack
        self._open: dict[str, Any] = {}
        self._read: dict[str, torch.Tensor] = {}  # each tensor read once per load
        self.twice: dict[str, tuple[str, str]] = {}  # index-less: in two files (``get``)
        if os.path.isdir(path):
            folder = path
            index = os.path.join(path, "model.safetensors.index.json")
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if os.path.isfile(index):
                self._read_index(index)
            elif files:
                self._read_files([os.path.join(path, f) for f in files])
            else:
                raise MoeInputError(
                    f"path: folder {path!r} holds no .safetensors file and no "
                    "model.safetensors.index.json"
                )
        elif os.path.isfile(path):
            folder = os.path.dirname(path)
            if path.endswith(".json"):
                self._read_index(path)
            else:
                self._read_files([path])
        else:
            raise MoeInputError(f"path: {path!r} does not exist")
        self.config = self._json(os.path.join(folder, "config.json"))
        if "quantization_config" not in self.config:  # older GPTQ / AWQ exports
            for name in ("quantize_config.json", "quant_config.json"):
                found = self._json(os.path.join(folder, name))
                if found:
                    self.config = {**self.config, "quantization_config": found}
                    break

    @staticmethod
    def _json(path: str) -> dict:
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:  # JSON is UTF-8 (RFC 8259), whatever the locale
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise MoeInputError(f"checkpoint: {path!r} is not valid JSON: {e}") from None
            except UnicodeDecodeError as e:
                raise MoeInputError(f"checkpoint: {path!r} is not UTF-8 text: {e}") from None
        if not isinstance(data, dict):
            raise MoeInputError(
                f"checkpoint: {path!r} holds a JSON {type(data).__name__}, not an object"
            )
        return data

    def _read_index(self, index: str) -> None:
        data = self._json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise MoeInputError(f"path: index {index!r} has no 'weight_map' object")
        folder = os.path.dirname(index)
        bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise MoeInputError(
                f"path: index {index!r} maps {bad!r} to {weight_map[bad]!r}, not a file name"
            )
        self.files = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        self.where = f"the weight map of {index!r}"

    def _read_files(self, paths: list[str]) -> None:
        from safetensors import safe_open

        self.files = {}
        for p in paths:
            with reading_safetensors(p), safe_open(p, framework="pt") as f:
                keys = list(f.keys())
            # Without an index nothing says which copy is meant: a guess, refused if read.
            self.twice.update((k, (self.files[k], p)) for k in keys if k in self.files)
            self.files.update(dict.fromkeys(keys, p))
        self.where = repr(paths[0]) if len(paths) == 1 else f"any of {paths}"

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``; MoeInputError naming it and where it was looked for if absent."""
        from safetensors import safe_open

        if key not in self.files:
            raise MoeInputError(f"checkpoint: tensor {key!r} not found in {self.where}")
        if key in self.twice:
            raise MoeInputError(
                f"checkpoint: tensor {key!r} is in both {self.twice[key][0]!r} and "
                f"{self.twice[key][1]!r}, and no model.safetensors.index.json says which holds it"
            )
        file = self.files[key]
        if file not in self._open:
            if not os.path.isfile(file):
                raise MoeInputError(
                    f"checkpoint: tensor {key!r} is mapped to {file!r}, which does not exist"
                )
            with reading_safetensors(file):
                self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        handle = self._open[file]
        if key not in self._read:
            if key not in handle.keys():
                raise MoeInputError(f"checkpoint: tensor {key!r} not found in {file!r}")
            with reading_safetensors(file):
                self._read[key] = handle.get_tensor(key)
        return self._read[key]

    def layers(self, root: str) -> list[int]:
        """Layer numbers that have any tensor under ``root``."""
        pattern = re.compile(re.escape(root) + r"\.(\d+)\.")
        return sorted({int(m.group(1)) for k in self.files if (m := pattern.match(k))})


def _family(family: str | None, config: dict) -> CheckpointFamily:
    accepted = ", ".join(FAMILIES)
    if family is None:
        family = config.get("model_type")
        if family is None:
            raise MoeInputError(
                "family: the checkpoint has no config.json with a model_type; pass family= "
                f"(one of {accepted})"
            )
        if not isinstance(family, str):
            raise MoeInputError(
                f"checkpoint: config.json's model_type must be a str (one of {accepted}), "
                f"got {family!r}"
            )
    if not isinstance(family, str):
        raise TypeError(f"family must be a str, got {type(family).__name__}")
    if family not in FAMILIES:
        raise MoeInputError(f"family: unknown MoE family {family!r}; accepted: {accepted}")
    return FAMILIES[family]


def _check_layer(ckpt: _Checkpoint, root: str, layer: object) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    total = _config_count(ckpt.config, "num_hidden_layers")
    if total is not None:
        if not 0 <= layer < total:
            raise MoeInputError(
                f"layer={layer} is out of range: the model has {total} layers (0..{total - 1})"
            )
    else:
        seen = ckpt.layers(root)
        if layer not in seen:
            span = f"layers {seen[0]}..{seen[-1]}" if seen else f"no tensor under {root!r}"
            raise MoeInputError(f"layer={layer} is out of range: the checkpoint has {span}")
    return layer


def _configured_experts(ckpt: _Checkpoint, fam: CheckpointFamily) -> tuple[str | None, int | None]:
    """The config.json field giving the routed expert count and its value (None, None
    without one)."""
    key = next((k for k in fam.num_experts_keys if ckpt.config.get(k) is not None), None)
    if key is None:
        return None, None
    return key, _config_count(ckpt.config, key)


def _count_experts(ckpt: _Checkpoint, prefix: str, fam: CheckpointFamily, first: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for k in ckpt.files if (m := pattern.match(k))}
    key, counted = _configured_experts(ckpt, fam)
    if counted is not None:
        if found and max(found) >= counted:
            raise MoeInputError(
                f"checkpoint: config.json says {key}={counted}, but the "
                f"checkpoint also holds expert {max(found)} under {prefix!r}"
            )
        return counted
    if not found:
        ckpt.get(first)  # raises, naming the missing key
    return max(found) + 1


def _config_number(config: dict, key: str, kind: type, default: Any) -> Any:
    """config.json's ``key``: an int (``kind`` int) or a number (``kind`` float), not a bool;
    ``default`` where it is absent or null. Anything else is refused by name."""
    value = config.get(key)
    if value is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        what = "an int" if kind is int else "a number"
        raise MoeInputError(f"checkpoint: config.json's {key} must be {what}, got {value!r}")
    return value


def _config_count(config: dict, key: str) -> int | None:
    """config.json's count ``key`` (layers, experts): a positive int, or None where absent
    or null; anything else is refused by name, not passed over for the files' count."""
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise MoeInputError(
            f"checkpoint: config.json's {key} must be a positive int, got {value!r}"
        )
    return value


def _config_bool(config: dict, key: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise MoeInputError(f"checkpoint: config.json's {key} must be true or false, got {value!r}")
    return value


def _check_groups(groups: int | None, keep: int | None, top_k: int, num: int) -> None:
    """DeepSeek's expert groups against the layer as loaded: refused here in config.json's
    terms, not later in RoutingConfig's when the layer runs."""
    try:
        check_groups(num, top_k, groups, keep)
    except MoeInputError as e:
        why = str(e).replace("num_expert_group", "n_group").replace("top_k", "num_experts_per_tok")
        raise MoeInputError(
            f"checkpoint: config.json's n_group={groups!r}, topk_group={keep!r} and "
            f"num_experts_per_tok={top_k} do not fit the layer's {num} experts: {why} "
            "(n_group 1 or absent: no groups)"
        ) from None


def _routing(
    fam: CheckpointFamily, config: dict, num: int
) -> tuple[int | None, RoutingConfig | None]:
    if not config:
        return None, None
    top_k = _config_number(config, "num_experts_per_tok", int, None)
    if top_k is None:
        return None, None
    if not 1 <= top_k <= num:
        raise MoeInputError(
            f"checkpoint: config.json's num_experts_per_tok={top_k} is not in [1, {num}] (the "
            "layer's experts)"
        )
    name = fam.name
    if name in ("mixtral", "gpt_oss"):  # GPT-OSS: softmax over the top-k logits
        return top_k, RoutingConfig(renormalize=True)
    if name in ("qwen2_moe", "qwen3_moe"):
        return top_k, RoutingConfig(renormalize=_config_bool(config, "norm_topk_prob", False))
    scale = float(_config_number(config, "routed_scaling_factor", float, 1.0))
    if not (math.isfinite(scale) and scale > 0):
        raise MoeInputError(
            f"checkpoint: config.json's routed_scaling_factor must be finite and positive, "
            f"got {scale!r}"
        )
    groups = _config_number(config, "n_group", int, None)
    keep = _config_number(config, "topk_group", int, None)
    if name == "deepseek_v2":
        # DeepSeek-V2's own code renormalises (top_k > 1 and norm_topk_prob) or scales,
        # never both (released checkpoints: norm_topk_prob false; transformers always scales).
        renormalize = top_k > 1 and _config_bool(config, "norm_topk_prob", False)
        scale = 1.0 if renormalize else scale
        method = config.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise MoeInputError(
                "checkpoint: config.json's topk_method must be 'greedy' or "
                f"'group_limited_greedy' for deepseek_v2, got {method!r}"
            )
        if method == "group_limited_greedy":
            if groups is None or keep is None:
                raise MoeInputError(
                    "checkpoint: config.json's topk_method 'group_limited_greedy' needs "
                    f"n_group and topk_group, got {groups!r} and {keep!r}"
                )
            _check_groups(groups, keep, top_k, num)
            return top_k, RoutingConfig(
                "softmax", renormalize, groups, keep, scale, group_score="max"
            )  # groups ranked by their best score
        return top_k, RoutingConfig(renormalize=renormalize, routed_scaling_factor=scale)
    grouped = groups is not None and groups != 1  # 1 or absent: no groups, topk_group unread
    if grouped:
        _check_groups(groups, keep, top_k, num)
    return top_k, RoutingConfig(
        "sigmoid",
        _config_bool(config, "norm_topk_prob", True),
        groups if grouped else None,
        keep if grouped else None,
        scale,
        correction_bias=True,
    )


#: Per-expert tensors holding a projection's [out, in] matrix (stored or packed), in the
#: order `_matrix_key` looks for them.
_MATRICES = ("weight_packed", "qweight", "weight")


def _per_expert(ckpt: _Checkpoint, prefix: str, num: int, proj: str, suffix: str) -> list:
    """Tensor ``suffix`` of every expert's ``proj``, checked here so an error names the key:
    the first expert's that differs from expert 0's in dtype or shape (stacking them fails
    inside torch or an importer, which knows no key), and a matrix that is not 2-D."""
    keys = [f"{prefix}{e}.{proj}.{suffix}" for e in range(num)]
    parts = [ckpt.get(k) for k in keys]
    first = parts[0]
    if suffix in _MATRICES and first.dim() != 2:
        raise MoeInputError(
            f"checkpoint: {keys[0]} has shape {list(first.shape)}; a per-expert {suffix} must "
            "be a 2-D [out, in] matrix"
        )
    for key, part in zip(keys, parts, strict=True):
        if part.dtype != first.dtype or part.shape != first.shape:
            raise MoeInputError(
                f"checkpoint: the experts' {proj}.{suffix} dtypes/shapes differ under "
                f"{prefix!r}: {key} is {part.dtype} {list(part.shape)}, {keys[0]} is "
                f"{first.dtype} {list(first.shape)}; every expert needs the same"
            )
    return parts


def _stored(ckpt: _Checkpoint, prefix: str, num: int, proj: str, suffix: str) -> bool:
    """Whether every expert stores tensor ``suffix`` of ``proj`` (False: none does). Experts
    that disagree are refused, naming the first that differs from expert 0: deciding by
    expert 0 alone would leave the others' copies unread (zero points dropped, an act-order
    g_idx let through)."""
    keys = [f"{prefix}{e}.{proj}.{suffix}" for e in range(num)]
    first = keys[0] in ckpt
    odd = next((k for k in keys if (k in ckpt) != first), None)
    if odd is not None:
        have, lack = (keys[0], odd) if first else (odd, keys[0])
        raise MoeInputError(
            f"checkpoint: {have} is present, but {lack} is not; every expert must store a "
            "projection alike (the same tensors)"
        )
    return first


def _gptq_bits(ckpt: _Checkpoint, base: str, partner: str) -> tuple[int, str]:
    """GPTQ's bits where no quantization config gives them, and a note on where they came
    from: qweight holds K * bits / 32 rows, K being g_idx's length or else the output rows
    of ``partner`` (down's for gate and up, gate's for down); 4 where K is unknown."""
    if base + "g_idx" in ckpt:
        k, source = ckpt.get(base + "g_idx").numel(), f"{base}g_idx's length"
    elif partner + "scales" in ckpt and ckpt.get(partner + "scales").dim() == 2:
        k, source = ckpt.get(partner + "scales").shape[1], f"{partner}scales' output rows"
    else:
        return 4, 'bits taken as 4: config.json gives no quantization_config "bits"'
    rows = ckpt.get(base + "qweight").shape[0]
    bits = next((b for b in (4, 8) if rows * 32 == k * b), None)
    if bits is None:
        raise MoeInputError(
            f"checkpoint: {base}qweight has {rows} rows, which hold K={k} input rows ({source}) "
            "at neither 4 nor 8 bits, and no quantization config gives the bits: add them to "
            'config.json\'s quantization_config (e.g. "bits": 4)'
        )
    return bits, f"{bits} bits from {source}, for want of a quantization config"


def _matrix_key(ckpt: _Checkpoint, base: str) -> str:
    """The key of the matrix of projection ``base`` (``prefix{e}.{proj}.``)."""
    return next((base + m for m in _MATRICES if base + m in ckpt), base + "weight")


def _imported(what: str, importer, *args, **kwargs):
    """``importer(*args, **kwargs)``; its ValueError (which names a field, not a key) as a
    MoeInputError naming the tensors ``what`` it read."""
    try:
        return importer(*args, **kwargs)
    except MoeInputError:
        raise
    except ValueError as e:
        raise MoeInputError(f"checkpoint: {what}: {e}") from e


def _projection(
    ckpt: _Checkpoint, prefix: str, num: int, proj: str, partner: str
) -> tuple[Any, str]:
    """One projection of every expert, stacked: (plain tensor or QuantizedWeight, format).
    ``partner``: the projection whose output rows are this one's input rows."""
    from .quant import checkpoints as ck

    base = f"{prefix}0.{proj}."
    q = ck.quant_config(ckpt.config)
    what = f"{prefix}{{0..{num - 1}}}.{proj}.*"

    def each(suffix: str) -> list:
        return _per_expert(ckpt, prefix, num, proj, suffix)

    def stored(suffix: str) -> bool:
        return _stored(ckpt, prefix, num, proj, suffix)

    if stored("weight_packed"):
        first = ckpt.get(base + "weight_packed")
        shape = ckpt.get(base + "weight_shape") if stored("weight_shape") else None
        bits = ck.compressed_tensors_bits(q) or 4
        if shape is not None:  # words = ceil(K * bits / 32)
            if shape.numel() != 2 or shape.is_floating_point():
                raise MoeInputError(
                    f"checkpoint: {base}weight_shape holds {shape.tolist()}; expected (N, K), "
                    "the two integer dims of the unpacked [out, in] matrix"
                )
            k = int(shape.reshape(-1)[1])
            bits = 8 if first.shape[1] != -(-k // 8) and first.shape[1] == -(-k // 4) else 4
        weight = _imported(
            what,
            ck.import_compressed_tensors,
            each("weight_packed"),
            each("weight_scale"),
            each("weight_zero_point") if stored("weight_zero_point") else None,
            each("weight_shape") if shape is not None else None,
            num_bits=bits,
            g_idx=each("weight_g_idx") if stored("weight_g_idx") else None,
            group_size=ck.compressed_tensors_group_size(q),
        )
        return weight, "compressed-tensors"
    if stored("qweight"):
        method = q.get("quant_method")
        if method is None:  # GPTQ packs along K (N columns), AWQ along N
            qweight, scales = ckpt.get(base + "qweight"), ckpt.get(base + "scales")
            method = "gptq" if qweight.shape[1] == scales.shape[1] else "awq"
        bits = q.get("bits", q.get("w_bit"))
        if bits is None and method == "gptq":
            stored("g_idx")  # every expert alike before expert 0's g_idx gives K
            bits, note = _gptq_bits(ckpt, base, f"{prefix}0.{partner}.")
            what += f" ({note})"
        bits = 4 if bits is None else bits
        if method == "awq":  # AutoAWQ's quant_config.json calls it q_group_size
            weight = _imported(
                what,
                ck.import_awq,
                each("qweight"),
                each("qzeros"),
                each("scales"),
                bits=bits,
                group_size=q.get("group_size", q.get("q_group_size")),
            )
            return weight, "awq"
        if method == "gptq":
            weight = _imported(
                what,
                ck.import_gptq,
                each("qweight"),
                each("qzeros"),
                each("scales"),
                each("g_idx") if stored("g_idx") else None,
                bits=bits,
                checkpoint_format=q.get("checkpoint_format", "gptq"),
                group_size=q.get("group_size"),
            )
            return weight, "gptq"
        raise MoeInputError(
            f"checkpoint: {base}qweight with quant_method {method!r}; accepted: 'gptq', 'awq'"
        )
    first = ckpt.get(base + "weight")
    if first.dtype == torch.float8_e4m3fn:
        if not stored("weight_scale_inv"):
            raise MoeInputError(
                f"checkpoint: {base}weight is e4m3 without {base}weight_scale_inv; moerunner "
                "reads FP8 experts with 128x128 block scales (DeepSeek-V3 layout)"
            )
        weight = _imported(what, ck.import_deepseek_fp8, each("weight"), each("weight_scale_inv"))
        return weight, "fp8_block"
    if first.dtype == torch.uint8 and stored("weight_scale_2"):
        inputs = each("input_scale") if stored("input_scale") else None
        weight = _imported(
            what,
            ck.import_modelopt_nvfp4,
            each("weight"),
            each("weight_scale"),
            each("weight_scale_2"),
            inputs,
        )
        return weight, "nvfp4"
    if not first.is_floating_point() or first.dtype.itemsize == 1:
        raise MoeInputError(
            f"checkpoint: {base}weight has dtype {first.dtype}, which no known format of "
            "moerunner's stores without its companion tensors"
        )
    return torch.stack(each("weight")), "plain"


def _check_gate_up(ckpt: _Checkpoint, prefix: str, projections: tuple, gate, up) -> None:
    """Gate and up must both be [I, H] per expert: stacked row-wise, surplus gate rows would
    silently become up rows (down checks only their sum, 2I)."""
    if tuple(gate.shape[1:]) == tuple(up.shape[1:]):
        return
    kg, ku = (_matrix_key(ckpt, f"{prefix}0.{p}.") for p in projections[:2])
    raise MoeInputError(
        f"checkpoint: gate and up projections differ in shape: {kg} holds [out, in] = "
        f"{list(gate.shape[1:])} per expert, {ku} holds {list(up.shape[1:])}; both must be "
        "[I, H], the same"
    )


def _check_plain_dtypes(named: dict[str, torch.Tensor], w13, w2, dtype) -> None:
    """Plain projections keep their stored dtype unless ``dtype`` converts them (gate and up
    joined in their promoted dtype, exactly), and a layer runs in one of bf16 / fp16 / fp32:
    anything else is refused naming the tensors."""
    if dtype is None and (
        w13.dtype != w2.dtype or w13.dtype not in (torch.bfloat16, torch.float16, torch.float32)
    ):
        listed = ", ".join(f"{key} is {t.dtype}" for key, t in named.items())
        raise MoeInputError(
            f"checkpoint: {listed}; a layer runs in one dtype of bf16, fp16 or fp32: pass "
            "dtype=torch.float32 (or torch.bfloat16 / torch.float16) to load_experts to convert "
            "the plain weights"
        )


def _check_stacked_count(ckpt: _Checkpoint, fam: CheckpointFamily, key: str) -> None:
    """A stacked ``[E, ...]`` tensor (GPT-OSS) must hold config.json's expert count, as the
    per-expert families' keys must (`_count_experts`)."""
    field, counted = _configured_experts(ckpt, fam)
    shape = list(ckpt.get(key).shape)
    if counted is not None and shape[:1] != [counted]:
        raise MoeInputError(
            f"checkpoint: config.json says {field}={counted}, but {key} has shape {shape} "
            f"([E, ...]: {shape[0] if shape else 'no'} experts)"
        )


def _check_shapes(w13, w2, b13, b2, prefix: str, gated: bool = True) -> None:
    e, n, h = tuple(w13.shape)
    e2, h2, i = tuple(w2.shape)
    if (e2, h2) != (e, h) or n != (2 * i if gated else i):
        raise MoeInputError(
            f"checkpoint: experts under {prefix!r} do not fit together: gate/up give "
            f"[E, 2I, H] = {[e, n, h]}, down gives [E, H, I] = {[e2, h2, i]}"
        )
    for name, bias, shape in (("w13_bias", b13, (e, n)), ("w2_bias", b2, (e, h))):
        if bias is not None and tuple(bias.shape) != shape:
            raise MoeInputError(
                f"checkpoint: {name} under {prefix!r} has shape {list(bias.shape)}, "
                f"expected {list(shape)}"
            )


def _gpt_oss(ckpt: _Checkpoint, prefix: str) -> tuple:
    from .quant import checkpoints as ck

    if prefix + "gate_up_proj_blocks" in ckpt:
        w13, w2 = (
            _imported(
                f"{prefix}{proj}_blocks / _scales",
                ck.import_gpt_oss_mxfp4,
                ckpt.get(f"{prefix}{proj}_blocks"),
                ckpt.get(f"{prefix}{proj}_scales"),
            )
            for proj in ("gate_up_proj", "down_proj")
        )
        fmt = "mxfp4"
    else:
        gate_up, down = ckpt.get(prefix + "gate_up_proj"), ckpt.get(prefix + "down_proj")
        for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
            if t.dim() != 3 or not t.is_floating_point():
                raise MoeInputError(
                    f"checkpoint: {prefix}{name} must be a floating [E, in, out] tensor, got "
                    f"{t.dtype} {list(t.shape)}"
                )
        w13, w2, fmt = (
            gate_up.transpose(1, 2).contiguous(),
            down.transpose(1, 2).contiguous(),
            "plain",
        )
    # Both biases or neither: one without the other is a checkpoint missing a tensor.
    names = ("gate_up_proj_bias", "down_proj_bias")
    present = any(prefix + n in ckpt for n in names)
    b13, b2 = (ckpt.get(prefix + n) if present else None for n in names)
    return w13, w2, b13, b2, fmt


def load_experts(
    path: PathLike,
    *,
    layer: int,
    family: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    root: str = "model.layers",
    rescale: bool = False,
) -> LoadedExperts:
    """Read the routed experts of decoder layer ``layer`` from a safetensors checkpoint.

    ``path``: a ``.safetensors`` file, a sharded checkpoint's index json, or a folder holding
    either (its ``config.json`` supplies the family, expert count, top-k and routing).
    ``family``: one of `FAMILIES` (default: config.json's ``model_type``). ``device``: where the
    weights go (default: the CPU). ``dtype``: the dtype of plain weights and of biases
    (default: as stored for plain weights, float32 beside quantized ones); quantized weights
    keep their format. ``root``: the layer list's name (``"model.language_model.layers"`` for
    some multimodal wrappers). ``rescale``: where gate and up carry different per-expert
    global scales (NVFP4 ``weight_scale_2``), re-round both to the larger one (lossy; vLLM
    keeps the gate's and warns); by default such a checkpoint is refused, naming the tensors.

    Gate and up rows are stacked gate then up (GPT-OSS: alternating, as stored, with
    ``gate_up_interleaved=True``). fp8_block experts whose I is not a whole number of the
    128-row scale blocks get zero rows (gate, up) and zero columns (down) up to one: exact,
    since the padded units add zero, and their ``intermediate_size`` is then the padded I.

    Raises ``MoeInputError`` for a missing tensor (naming it and the file or index it was
    looked for in), a file that is not readable safetensors (naming it), an expert count other
    than config.json's, experts storing a projection with other tensors, dtypes or shapes
    (naming the first key that differs from expert 0's), gate and up of different shapes or
    schemes (naming both), plain weights in several dtypes or one moerunner does not run
    (naming them; ``dtype=`` converts), experts that do not fit together, an importer's refusal
    (naming the projection's keys), a config.json field of the wrong type or value (naming
    it), an unknown family or a layer out of range.
    """
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype must be torch.bfloat16, float16, float32 or None, got {dtype}")
    if not isinstance(root, str) or not root:
        raise TypeError(f"root must be a non-empty str, got {root!r}")
    if not isinstance(rescale, bool):
        raise TypeError(f"rescale must be a bool, got {type(rescale).__name__}")
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise MoeInputError(f"device: {device!r} is not a torch device ({e})") from None
        if target.type == "cuda" and not torch.cuda.is_available():
            raise MoeInputError(f"device={device!r}, but this torch sees no CUDA device")
        try:  # a device type this torch build or machine lacks (mps, xpu, cuda:7, ...)
            torch.empty(0, device=target)
        except Exception as e:  # noqa: BLE001  (torch raises several kinds here)
            raise MoeInputError(
                f"device={device!r} cannot hold tensors here ({type(e).__name__}: {e})"
            ) from None
    with ExitStack() as stack:
        ckpt = _Checkpoint(path, stack)
        fam = _family(family, ckpt.config)
        layer = _check_layer(ckpt, root, layer)
        prefix = f"{root}.{layer}.{fam.experts}."
        if not any(k.startswith(prefix) for k in ckpt.files):
            raise MoeInputError(
                f"layer={layer} has no routed experts: no tensor named {prefix}* in "
                f"{ckpt.where} (a dense layer, or another family's names?)"
            )
        if fam.projections is None:
            w13, w2, b13, b2, fmt = _gpt_oss(ckpt, prefix)
            stacked = "gate_up_proj_blocks" if fmt == "mxfp4" else "gate_up_proj"
            _check_stacked_count(ckpt, fam, prefix + stacked)
            plain = {prefix + "gate_up_proj": w13, prefix + "down_proj": w2}
        else:
            gate, up, down = fam.projections
            num = _count_experts(ckpt, prefix, fam, f"{prefix}0.{gate}.weight")
            (g, fmt), (u, fmt_up), (w2, fmt_down) = (
                _projection(ckpt, prefix, num, p, gate if p == down else down)
                for p in (gate, up, down)
            )
            if len({fmt, fmt_up, fmt_down}) != 1:
                raise MoeInputError(
                    f"checkpoint: the projections under {prefix!r} are stored in different "
                    f"formats ({gate}: {fmt}, {up}: {fmt_up}, {down}: {fmt_down})"
                )
            _check_gate_up(ckpt, prefix, fam.projections, g, u)
            keys = [_matrix_key(ckpt, f"{prefix}0.{p}.") for p in fam.projections]
            if fmt == "plain":
                plain = dict(zip(keys, (g, u, w2), strict=True))
                w13 = torch.cat([g, u], dim=1)
            else:
                g, u, w2 = block_aligned(g, u, w2)
                names = f"{prefix}{{0..{num - 1}}}.{{{gate},{up}}}"
                w13 = join_gate_up(g, u, keys[:2], names, rescale)
            b13 = b2 = None
        _check_shapes(w13, w2, b13, b2, prefix)
        if fmt == "plain":
            _check_plain_dtypes(plain, w13, w2, dtype)
            w13, w2 = (w.to(device=device, dtype=dtype) for w in (w13, w2))
        elif device is not None:
            w13, w2 = w13.to(device), w2.to(device)
        bias_dtype = dtype or (w13.dtype if fmt == "plain" else torch.float32)
        b13, b2 = (None if b is None else b.to(device=device, dtype=bias_dtype) for b in (b13, b2))
    config = ckpt.config
    if fam.name == "gpt_oss":
        activation = Activation(
            "swiglu_oai", config.get("swiglu_alpha"), config.get("swiglu_limit")
        )
    else:
        activation = Activation(fam.activation)
    weights = ExpertWeights(w13, w2, b13, b2, gate_up_interleaved=fam.projections is None)
    weights.validate(activation)
    top_k, routing = _routing(fam, config, weights.num_experts)
    return LoadedExperts(fam.name, layer, weights, activation, fmt, top_k, routing)
