"""MoE LoRA adapters read from PEFT checkpoints (``adapter_model.safetensors`` +
``adapter_config.json``), as ``MoeLoraWeights`` for ``moerunner.lora``.

Stage: the edge between saved adapters and the hooks. Two layouts of the experts' LoRA
weights are read, per MoE layer ``i`` of the checkpoint:

- **per-expert modules**, what PEFT writes for a model whose experts are a list of
  ``nn.Linear`` (transformers 4: Qwen2/3-MoE and DeepSeek ``mlp.experts.{e}.gate_proj`` /
  ``up_proj`` / ``down_proj``, Mixtral ``block_sparse_moe.experts.{e}.w1`` / ``w3`` /
  ``w2``): ``...layers.{i}.<block>.experts.{e}.<proj>.lora_A.weight`` ``[r, in]`` and
  ``lora_B.weight`` ``[out, r]``;
- **fused expert parameters**, what PEFT writes with ``target_parameters`` for the 3-D
  parameters of transformers 5 experts (``gate_up_proj``, ``down_proj``; GPT-OSS had them in
  transformers 4 already): one ``lora.ParamWrapper`` per parameter, nested on the experts
  module (``...experts.lora_A.weight``, ``...experts.base_layer.lora_A.weight``, ...). A
  wrapper's ``lora_A.weight`` is ``[E * r, in]`` (expert-major: rows ``e * r .. e * r + r``)
  and its ``lora_B.weight`` ``[out, r * E]`` (rank-major: column ``j * E + e``); expert
  ``e``'s update of the parameter, in ``[out, in]`` terms, is ``s B_e A_e``. Which wrapper
  is which follows from the shapes (gate/up: ``in = H``, ``out = 2I``; down: ``in = I``,
  ``out = H``), not from the nesting order. The orientation is transformers 5's (A on the
  expert's input side, as PEFT >= 0.19.1 writes it there, and as PEFT 0.17-0.18 wrote it
  for GPT-OSS); factors whose shapes show the other orientation (PEFT 0.19.0, and later
  versions on a transformers 4 model, whose experts lack ``is_transposed``) are refused, but
  where ``in == out`` (e.g. GPT-OSS's down_proj, H = I) the shapes cannot show it.

Separate gate and up adapters combine as ``moerunner.lora`` describes: A's stacked (rank
``r_gate + r_up``), B's block-diagonal, its rows in the canonical w13 order of
``moerunner.lora`` (gate then up, whatever ``w13_order`` the experts are then passed with;
alternating for GPT-OSS's interleaved rows, ``MoeModelShape.interleaved``). Scaling is
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), per module through the
config's ``rank_pattern`` / ``alpha_pattern`` (the regular expressions PEFT matches against
the module's name, or ``<module>.<parameter>`` for a targeted parameter). A malformed config
(not a JSON object, a rank that is not a positive int, a non-finite alpha, a pattern that is
not a regular expression) raises naming the file and the field. ``MoeLoraWeights.scaling``
holds each adapter's default; a module whose own scaling differs has the ratio folded into
its B. Adapters of different ranks are zero-padded to the largest (a zero row of A adds
exactly 0).

``new_lora_set`` makes fresh trainable adapters (PEFT's initialisation) and
``save_peft_adapter`` writes one adapter back in the fused-parameter layout above.

moerunner applies the routed experts' factors only. An adapter that also holds LoRA weights
of other modules (attention, the router, a shared expert), or whole weights PEFT saved beside
them (``modules_to_save``: a trained router or lm_head), is refused unless
``other_modules="ignore"``, which loads the experts' factors alone.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import MoeInputError
from .lora import MoeLoraWeights, finite_in_float32

__all__ = ["MoeLoraSet", "MoeModelShape", "load_peft_adapter_set", "load_peft_adapters"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
OTHER_MODULES = ("error", "ignore")


@dataclass(frozen=True)
class MoeModelShape:
    """What the loader needs of a model: its experts' sizes, the per-expert projection names
    (gate, up, down) of its transformers 4 layout, whether w13 rows alternate, and whether
    the experts are gated (``gated=False``: ``act(x W_up) W_down``, w13 ``[E, I, H]`` is
    the up projection, which transformers 5 names ``up_proj``; no gate projection)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    interleaved: bool = False
    gated: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TypeError(f"MoeModelShape.{name} must be a positive int, got {value!r}")
        names = self.projections
        if not (
            isinstance(names, tuple) and len(names) == 3 and all(isinstance(n, str) for n in names)
        ):
            raise TypeError(
                f"MoeModelShape.projections must be 3 names (gate, up, down), got {names!r}"
            )
        for name in ("interleaved", "gated"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MoeModelShape.{name} must be a bool")
        if self.interleaved and not self.gated:
            raise MoeInputError("MoeModelShape: interleaved gate/up rows need gated experts")

    @property
    def w13_rows(self) -> int:
        """GEMM1's output rows: 2I gated, I not."""
        return (2 if self.gated else 1) * self.intermediate_size

    @classmethod
    def of(cls, config) -> MoeModelShape:
        """The shape of a transformers config of a family the integration covers."""
        if isinstance(config, MoeModelShape):
            return config
        model_type = getattr(config, "model_type", None)
        family = _FAMILIES.get(model_type)
        if family is None:
            raise MoeInputError(
                f"config: model_type {model_type!r} is not one of {sorted(_FAMILIES)}; pass a "
                "MoeModelShape(num_experts, hidden_size, intermediate_size, ...) instead"
            )
        experts_attr, inter_attr, projections, interleaved = family
        return cls(
            int(getattr(config, experts_attr)),
            int(config.hidden_size),
            int(getattr(config, inter_attr)),
            projections,
            interleaved,
        )


# model_type -> (experts attribute, intermediate-size attribute, v4 projections, interleaved)
_QWEN = ("gate_proj", "up_proj", "down_proj")
_FAMILIES = {
    "mixtral": ("num_local_experts", "intermediate_size", ("w1", "w3", "w2"), False),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", _QWEN, False),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", _QWEN, False),
    "deepseek_v2": ("n_routed_experts", "moe_intermediate_size", _QWEN, False),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size", _QWEN, False),
    "gpt_oss": ("num_local_experts", "intermediate_size", _QWEN, True),
}

# ...layers.{i}.<block>.experts.{e}.<proj>.lora_A.weight, or ...experts.(base_layer.)*lora_A.weight
_EXPERT_KEY = re.compile(
    r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)"
    r"\.(?:(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.|(?P<wrap>(?:base_layer\.)*))"
    r"(?P<ab>lora_A|lora_B)\.weight$"
)
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class MoeLoraSet:
    """L adapters over every MoE layer they touch: ``layers[i]`` is layer ``i``'s
    ``MoeLoraWeights`` (adapter ``a`` is ``names[a]``); a layer no adapter touches is absent."""

    layers: Mapping[int, MoeLoraWeights]
    names: tuple[str, ...]

    @property
    def num_adapters(self) -> int:
        """L."""
        return len(self.names)

    def layer(self, index: int) -> MoeLoraWeights | None:
        """Layer ``index``'s factors, None where no adapter touches it."""
        return self.layers.get(index)

    def __repr__(self) -> str:  # which adapters over which layers, not the factors
        return f"MoeLoraSet(names={self.names!r}, layers={sorted(self.layers)})"


@dataclass(frozen=True)
class _Module:
    """One PEFT LoRA module's factors for one layer: ``a [E, r, in]``, ``b [E, out, r]``
    (experts without factors are zero) and its own scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class _Adapter:
    name: str
    scaling: float  # lora_alpha / r (or / sqrt(r)) of the config's defaults
    # layer -> {"gate" | "up" | "down" | "gate_up": _Module}
    layers: dict[int, dict[str, _Module]]


def load_peft_adapters(
    adapters, config, *, layer: int, dtype=torch.float32, device=None, other_modules="error"
) -> MoeLoraWeights:
    """Layer ``layer``'s factors of one or several PEFT LoRA adapters.

    Args:
        adapters: a folder (holding ``adapter_config.json`` and ``adapter_model.safetensors``)
            or a sequence of folders; adapter ``a`` of the result is the ``a``-th folder.
        config: the base model's transformers config (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
            GPT-OSS) or a ``MoeModelShape``.
        layer: the decoder layer index (as in the checkpoint's ``layers.{i}``).
        dtype, device: of the returned factors (float32 by default: the hooks compute in
            float32).
        other_modules: ``"error"`` (default): an adapter holding LoRA weights of modules
            other than the routed experts, or ``modules_to_save`` weights, raises;
            ``"ignore"``: those are left out.

    Returns:
        ``MoeLoraWeights`` with ``w13_a [L, E, r13, H]``, ``w13_b [L, E, 2I, r13]``,
        ``w2_a [L, E, r2, I]``, ``w2_b [L, E, H, r2]`` and ``scaling`` float ``[L]``; all zero
        (rank 0) where no adapter touches the layer.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise TypeError(f"layer must be a non-negative int, got {layer!r}")
    shape = MoeModelShape.of(config)
    device = _device(device)
    read = _read_all(adapters, shape, other_modules, dtype)
    return _stack(read, shape, layer, dtype, device)


def load_peft_adapter_set(
    adapters, config, *, dtype=torch.float32, device=None, other_modules="error"
) -> MoeLoraSet:
    """Every MoE layer's factors of one or several PEFT LoRA adapters (arguments as
    ``load_peft_adapters``); the adapters' names are their folders' names."""
    shape = MoeModelShape.of(config)
    device = _device(device)
    read = _read_all(adapters, shape, other_modules, dtype)
    touched = sorted({i for adapter in read for i in adapter.layers})
    layers = {i: _stack(read, shape, i, dtype, device) for i in touched}
    return MoeLoraSet(layers, tuple(adapter.name for adapter in read))


def _read_all(adapters, shape: MoeModelShape, other_modules: str, dtype) -> list[_Adapter]:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if other_modules not in OTHER_MODULES:
        raise MoeInputError(f"other_modules: got {other_modules!r}; accepted: {OTHER_MODULES}")
    if isinstance(adapters, (str, os.PathLike)):
        adapters = [adapters]
    if (
        isinstance(adapters, (bytes, bytearray))
        or not isinstance(adapters, Sequence)
        or not adapters
    ):
        raise TypeError(
            f"adapters must be a folder or a non-empty sequence of folders, got {adapters!r}"
        )
    for n, path in enumerate(adapters):
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
            raise TypeError(
                f"adapters[{n}] must be a folder (a str or os.PathLike path), got {path!r}"
            )
    return [_read(os.fspath(path), shape, other_modules) for path in adapters]


def _device(device) -> torch.device | None:
    """``device`` as given to the loaders (None: where the checkpoint's tensors load)."""
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise MoeInputError(
            f"device: got {device!r}; accepted: None, a torch.device, or a device string or "
            "index ('cpu', 'cuda', 'cuda:1', 0)"
        ) from None


def _read(path: str, shape: MoeModelShape, other_modules: str) -> _Adapter:
    from safetensors.torch import load_file

    config_path, weights_path = (os.path.join(path, n) for n in (CONFIG_NAME, WEIGHTS_NAME))
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise MoeInputError(
                f"adapters: {path!r} has no {os.path.basename(needed)} (a PEFT LoRA adapter "
                f"folder holds {CONFIG_NAME} and {WEIGHTS_NAME})"
            )
    cfg = _load_config(config_path)
    _check_config(cfg, config_path)
    rank, alpha = cfg["r"], cfg.get("lora_alpha", 8)
    if _finite_number(alpha) is not None:
        raise MoeInputError(
            f"adapters: {config_path}: r and lora_alpha must be numbers (lora_alpha finite in "
            f"float32), got r={rank!r}, lora_alpha={alpha!r}"
        )
    rslora = cfg.get("use_rslora") or False
    if not isinstance(rslora, bool):
        raise MoeInputError(
            f"adapters: {config_path}: use_rslora must be true or false, got {rslora!r}"
        )
    # Checked here, once: a bad entry then names the file, not the module it first matched.
    ranks = _patterns(cfg, "rank_pattern", config_path, _positive_int)
    alphas = _patterns(cfg, "alpha_pattern", config_path, _finite_number)

    def scaling_of(key: str) -> tuple[int, float]:
        r = _pattern_value(ranks, key, rank)
        a = float(_pattern_value(alphas, key, alpha))
        return r, a / (math.sqrt(r) if rslora else r)

    tensors = load_file(weights_path)
    per_expert: dict[tuple[int, str], dict[int, dict[str, tuple[str, torch.Tensor]]]] = {}
    fused: dict[tuple[int, str], dict[str, dict[str, tuple[str, torch.Tensor]]]] = {}
    others = []
    for key, value in tensors.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            # LoRA factors of other modules, or whole weights PEFT saved beside them
            # (``modules_to_save``: a trained router or lm_head)
            others.append(key)
            continue
        layer = int(m["layer"])
        module = m["module"].removeprefix(_PEFT_PREFIX)
        if m["expert"] is not None:
            role = _role(m["proj"], shape, key)
            slot = per_expert.setdefault((layer, role), {}).setdefault(int(m["expert"]), {})
            slot[m["ab"]] = (f"{module}.{m['expert']}.{m['proj']}", value)
        else:
            slot = fused.setdefault((layer, module), {}).setdefault(m["wrap"], {})
            slot[m["ab"]] = (module, value)
    if others and other_modules == "error":
        shown = ", ".join(others[:4]) + (" ..." if len(others) > 4 else "")
        raise MoeInputError(
            f"adapters: {path!r} holds weights outside the routed experts ({shown}): LoRA "
            "factors of other modules or modules_to_save (a trained router, lm_head); "
            "moerunner applies the experts' factors only: pass other_modules='ignore' to load "
            "those alone"
        )

    layers: dict[int, dict[str, _Module]] = {}
    for (layer, role), experts in per_expert.items():
        layers.setdefault(layer, {})[role] = _per_expert_module(experts, role, shape, scaling_of)
    for (layer, module), wrappers in fused.items():
        for wrapper in wrappers.values():
            role, found = _fused_module(wrapper, module, shape, scaling_of)
            if role in layers.setdefault(layer, {}):
                raise MoeInputError(f"adapters: {path!r} has two {role} adapters on {module}")
            layers[layer][role] = found
    for layer, roles in layers.items():
        if "gate_up" in roles and ({"gate", "up"} & roles.keys()):
            raise MoeInputError(
                f"adapters: {path!r} layer {layer} has both fused gate_up_proj and per-expert "
                "gate/up LoRA weights"
            )
    default = scaling_of("")[1] or 1.0  # alpha = 0: every module's (zero) scaling sits in B
    return _Adapter(os.path.basename(os.path.normpath(path)), default, layers)


def _load_config(path: str) -> dict:
    """``adapter_config.json`` as a dict; a file that is not a JSON object raises naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as exc:  # not JSON (JSONDecodeError), or not UTF-8 text
        raise MoeInputError(f"adapters: {path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise MoeInputError(
            f"adapters: {path} must hold a JSON object (PEFT's LoraConfig fields: r, "
            f"lora_alpha, ...), got a JSON {type(cfg).__name__}"
        )
    return cfg


def _patterns(cfg: dict, field: str, where: str, check) -> dict:
    """``cfg[field]`` (``rank_pattern`` / ``alpha_pattern``): a JSON object of regular
    expressions (as PEFT matches them, ``_pattern_value``) to values ``check`` accepts."""
    patterns = cfg.get(field) or {}
    if not isinstance(patterns, dict):
        raise MoeInputError(
            f"adapters: {where}: {field} must be a JSON object of module-name patterns to "
            f"values, got {patterns!r}"
        )
    for pattern, value in patterns.items():
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise MoeInputError(
                f"adapters: {where}: {field} key {pattern!r} is not a valid regular "
                f"expression ({exc})"
            ) from None
        accepted = check(value)
        if accepted is not None:
            raise MoeInputError(
                f"adapters: {where}: {field}[{pattern!r}] must be {accepted}, got {value!r}"
            )
    return patterns


def _positive_int(value) -> str | None:
    """None where ``value`` is an int > 0, else what is accepted."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return None if ok else "a positive int (a rank)"


def _finite_number(value) -> str | None:
    """None where ``value`` is a number finite in float32 (a scale derived from it then is
    too: ranks are >= 1), else what is accepted."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and finite_in_float32(value):
        return None
    return "a finite number (an alpha; finite in float32)"


def _check_config(cfg: dict, where: str) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise MoeInputError(f"{where}: peft_type {peft_type!r}; only LORA adapters are read")
    if not isinstance(cfg.get("r"), int) or isinstance(cfg.get("r"), bool) or cfg["r"] <= 0:
        raise MoeInputError(f"{where}: r must be a positive int, got {cfg.get('r')!r}")
    for flag in ("use_dora", "lora_bias"):
        if cfg.get(flag):
            raise MoeInputError(f"{where}: {flag}=true is not supported (plain LoRA only)")


def _pattern_value(patterns: Mapping[str, object], key: str, default):
    """PEFT's rule: the first pattern ``p`` with ``re.match(rf"(.*\\.)?({p})$", key)``."""
    for pattern, value in patterns.items():
        if key and re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _role(proj: str, shape: MoeModelShape, key: str) -> str:
    names = dict(zip(shape.projections, ("gate", "up", "down"), strict=True))
    if proj not in names:
        raise MoeInputError(
            f"adapters: {key}: expert projection {proj!r} is none of {list(shape.projections)}"
        )
    return names[proj]


def _pair(found: dict, what: str) -> tuple[str, torch.Tensor, torch.Tensor]:
    missing = [ab for ab in ("lora_A", "lora_B") if ab not in found]
    if missing:
        beside = next((f" beside {key!r}" for key, _ in found.values()), "")
        raise MoeInputError(f"adapters: {what} has no {missing[0]}.weight{beside}")
    name, a = found["lora_A"]
    _, b = found["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() or not b.is_floating_point():
        raise MoeInputError(
            f"adapters: {name} ({what}): lora_A / lora_B must be floating 2-D, got {a.dtype} "
            f"{list(a.shape)} and {b.dtype} {list(b.shape)}"
        )
    return name, a, b


def _per_expert_module(experts: dict, role: str, shape: MoeModelShape, scaling_of) -> _Module:
    """``experts.{e}.<proj>`` Linear adapters: A ``[r, in]``, B ``[out, r]`` per expert."""
    h, i = shape.hidden_size, shape.intermediate_size
    k_in, n_out = (i, h) if role == "down" else (h, i)
    rank = None
    a_all = b_all = None
    scaling = 0.0
    for e, found in sorted(experts.items()):
        name, a, b = _pair(found, f"expert {e} {role}")
        if e >= shape.num_experts:
            raise MoeInputError(f"adapters: {name}: expert {e} >= num_experts {shape.num_experts}")
        r, s = scaling_of(name)
        if rank is None:
            rank, scaling = r, s
            a_all = torch.zeros(shape.num_experts, r, k_in, dtype=torch.float64)
            b_all = torch.zeros(shape.num_experts, n_out, r, dtype=torch.float64)
        if (r, s) != (rank, scaling):
            raise MoeInputError(
                f"adapters: {name}: rank/scaling {(r, s)} differ from the layer's other experts "
                f"{(rank, scaling)}"
            )
        if tuple(a.shape) != (r, k_in) or tuple(b.shape) != (n_out, r):
            raise MoeInputError(
                f"adapters: {name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} where the "
                f"model needs [{r}, {k_in}] / [{n_out}, {r}] (r={r})"
            )
        a_all[e], b_all[e] = a.double(), b.double()
    return _Module(a_all, b_all, scaling)


def _fused_module(wrapper: dict, module: str, shape: MoeModelShape, scaling_of):
    """A ``ParamWrapper`` on a 3-D expert parameter: A ``[E r, in]``, B ``[out, r E]``."""
    _, a, b = _pair(wrapper, f"{module} (target_parameters)")
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    w13_name = "gate_up_proj" if shape.gated else "up_proj"
    n13 = shape.w13_rows
    roles = {"gate_up": (h, n13, w13_name), "down": (i, h, "down_proj")}
    found = (a.shape[1], b.shape[0])
    fits = [ro for ro, (k, n, _) in roles.items() if found == (k, n)]
    if len(fits) > 1:  # non-gated experts with H == I: up_proj and down_proj look alike
        raise MoeInputError(
            f"adapters: {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} fit both "
            f"{w13_name} and down_proj of this model (non-gated, H = I = {h}), and the "
            "fused layout does not say which parameter it adapts: save per-projection "
            "adapters, or pass the factors to MoeLoraWeights yourself"
        )
    role = fits[0] if fits else None
    swapped = next((ro for ro, (k, n, _) in roles.items() if found == (n, k)), None)
    if role is None and swapped is not None:
        raise MoeInputError(
            f"adapters: {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} fit neither "
            f"{w13_name} ([E*r, {h}] / [{n13}, r*E]) nor down_proj ([E*r, {i}] / "
            f"[{h}, r*E]) of this model (H={h}, I={i}). Either they adapt "
            f"{roles[swapped][2]} with A on the parameter's output side (PEFT's orientation "
            "for a 3-D parameter of a transformers 4 model without is_transposed; moerunner "
            "reads transformers 5's, A on the input side: save the adapter from the "
            "transformers 5 model), or the adapter was trained for a model of another "
            "hidden or intermediate size"
        )
    if role is None:
        gating = (
            ""
            if shape.gated or b.shape[0] != 2 * i
            else "; an adapter of gated experts (2I rows) on a model whose MoeModelShape says "
            "gated=False"
        )
        raise MoeInputError(
            f"adapters: {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} fit neither "
            f"{w13_name} ([E*r, {h}] / [{n13}, r*E]) nor down_proj ([E*r, {i}] / [{h}, r*E])"
            + gating
        )
    r, s = scaling_of(f"{module}.{roles[role][2]}")
    if a.shape[0] != e * r or b.shape[1] != e * r:
        raise MoeInputError(
            f"adapters: {module}.{roles[role][2]}: lora_A {list(a.shape)} / lora_B "
            f"{list(b.shape)} do not hold E={e} experts of rank r={r}"
        )
    a_er = a.double().reshape(e, r, a.shape[1])
    b_er = b.double().reshape(b.shape[0], r, e).permute(2, 0, 1)  # column j*E + e
    return role, _Module(a_er, b_er, s)


def _stack(read: list[_Adapter], shape: MoeModelShape, layer: int, dtype, device):
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    w13 = [_w13(adapter.layers.get(layer, {}), adapter.scaling, shape) for adapter in read]
    w2 = [_scaled(adapter.layers.get(layer, {}).get("down"), adapter.scaling) for adapter in read]
    r13 = max(a.shape[1] for a, _ in w13)
    r2 = max((m[0].shape[1] for m in w2 if m is not None), default=0)
    count = len(read)
    out = {
        "w13_a": torch.zeros(count, e, r13, h, dtype=torch.float64),
        "w13_b": torch.zeros(count, e, shape.w13_rows, r13, dtype=torch.float64),
        "w2_a": torch.zeros(count, e, r2, i, dtype=torch.float64),
        "w2_b": torch.zeros(count, e, h, r2, dtype=torch.float64),
    }
    for n, ((a13, b13), down) in enumerate(zip(w13, w2, strict=True)):
        out["w13_a"][n, :, : a13.shape[1]] = a13
        out["w13_b"][n, :, :, : b13.shape[2]] = b13
        if down is not None:
            out["w2_a"][n, :, : down[0].shape[1]] = down[0]
            out["w2_b"][n, :, :, : down[1].shape[2]] = down[1]
    try:
        moved = {k: v.to(device=device, dtype=dtype) for k, v in out.items()}
        scaling = torch.tensor([a.scaling for a in read], dtype=torch.float32, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch without that device's support
        raise MoeInputError(f"device: cannot place the factors on {device}: {exc}") from None
    return MoeLoraWeights(**moved, scaling=scaling)


def _scaled(module: _Module | None, default: float):
    """(A, B) with the module's scaling relative to the adapter's default folded into B."""
    if module is None:
        return None
    return module.a, module.b * (module.scaling / default)


def _w13(roles: dict[str, _Module], default: float, shape: MoeModelShape):
    """GEMM1's (A ``[E, r, H]``, B ``[E, w13 rows, r]``), B's rows in the canonical order
    (gate then up, or alternating where ``shape.interleaved``: ``moerunner.lora``)."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    if "gate_up" in roles:
        return _scaled(roles["gate_up"], default)
    if not shape.gated and "gate" in roles:
        raise MoeInputError(
            f"adapters: the adapter adapts the gate projection {shape.projections[0]!r}, but "
            "the model's experts have none (MoeModelShape gated=False)"
        )
    halves = ("gate", "up") if shape.gated else ("up",)
    parts = [(half, _scaled(roles.get(name), default)) for half, name in enumerate(halves)]
    parts = [(half, ab) for half, ab in parts if ab is not None]
    rank = sum(ab[0].shape[1] for _, ab in parts)
    a = torch.zeros(e, rank, h, dtype=torch.float64)
    b = torch.zeros(e, shape.w13_rows, rank, dtype=torch.float64)
    col = 0
    for half, (a_part, b_part) in parts:  # stacked A, block-diagonal B (gate rows, up rows)
        r = a_part.shape[1]
        a[:, col : col + r] = a_part
        b[:, half * i : (half + 1) * i, col : col + r] = b_part
        col += r
    if shape.interleaved:  # row 2j is gate j, row 2j+1 is up j
        order = torch.stack([torch.arange(i), torch.arange(i) + i], dim=1).flatten()
        b = b[:, order]
    return a, b


# -- new adapters, and adapters written back in PEFT's layout ------------------------------


def _experts_layers(model) -> dict[int, str]:
    """Decoder layer index -> path of each experts module of a transformers model."""
    from .integrations.transformers import experts_modules

    found = {}
    for path, _ in experts_modules(model):
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
        if match is None:
            raise MoeInputError(f"experts module {path}: no layers.<i> in its path")
        found[int(match.group(1))] = path
    if not found:
        raise MoeInputError("model: no experts module runs on moerunner or transformers' experts")
    return found


def new_lora_set(
    model, *, r: int, lora_alpha: float, num_adapters: int = 1, seed: int = 0, device=None
) -> MoeLoraSet:
    """Fresh trainable LoRA adapters over every experts layer of a transformers ``model``, as
    PEFT initialises them: A uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` (kaiming-uniform with
    a = sqrt(5)), B zero, so the adapted model starts as the base model; scaling
    ``lora_alpha / r``. float32 factors on ``device`` (default: the experts' device) that
    require grad: attach them (``use_moerunner(model, lora=...)`` or ``attach_lora``), train,
    and write them with ``save_peft_adapter``."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise TypeError(f"r must be a positive int, got {r!r}")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)):
        raise TypeError(f"lora_alpha must be a number, got {lora_alpha!r}")
    if not finite_in_float32(lora_alpha):
        raise MoeInputError(f"lora_alpha must be finite in float32, got {lora_alpha!r}")
    if isinstance(num_adapters, bool) or not isinstance(num_adapters, int) or num_adapters < 1:
        raise TypeError(f"num_adapters must be an int >= 1, got {num_adapters!r}")
    shape = MoeModelShape.of(model.config)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator().manual_seed(seed)
    where = device if device is not None else next(model.parameters()).device

    def uniform(*size, fan_in):
        return (torch.rand(*size, generator=gen) * 2 - 1) * fan_in**-0.5

    layers = {}
    for index in sorted(_experts_layers(model)):
        factors = (
            uniform(num_adapters, e, r, h, fan_in=h),
            torch.zeros(num_adapters, e, shape.w13_rows, r),
            uniform(num_adapters, e, r, i, fan_in=i),
            torch.zeros(num_adapters, e, h, r),
        )
        layers[index] = MoeLoraWeights(
            *(f.to(where).requires_grad_() for f in factors),
            scaling=torch.full((num_adapters,), lora_alpha / r, device=where),
        )
    names = tuple(f"adapter_{a}" for a in range(num_adapters))
    return MoeLoraSet(layers, names)


def save_peft_adapter(lora: MoeLoraSet, folder, model, *, adapter: int = 0) -> str:
    """Write adapter ``adapter`` of ``lora`` into ``folder`` as PEFT saves LoRA on transformers
    5's fused expert parameters (``target_parameters``; the layout this module reads, so
    ``load_peft_adapter_set`` gives the same updates back), for ``model``'s experts module
    paths. Each layer's scaling is folded into its B (``lora_alpha = r``), and the two GEMMs'
    factors are zero-padded to one rank. Returns the folder."""
    from safetensors.torch import save_file

    if not isinstance(lora, MoeLoraSet):
        raise TypeError(f"lora must be a MoeLoraSet, got {type(lora).__name__}")
    if isinstance(adapter, bool) or not isinstance(adapter, int):
        raise TypeError(f"adapter must be an int, got {adapter!r}")
    if not 0 <= adapter < lora.num_adapters:
        raise MoeInputError(f"adapter must be in [0, {lora.num_adapters}), got {adapter}")
    paths = _experts_layers(model)
    missing = sorted(set(lora.layers) - set(paths))
    if missing:
        raise MoeInputError(f"lora: layers {missing} have no experts module in this model")
    rank = max(max(w.w13_a.shape[2], w.w2_a.shape[2]) for w in lora.layers.values())
    tensors = {}
    for index, weights in sorted(lora.layers.items()):
        s = weights.scaling
        s = float(s[adapter]) if isinstance(s, torch.Tensor) else float(s)
        parts = (("base_layer.", weights.w13_a, weights.w13_b), ("", weights.w2_a, weights.w2_b))
        for wrap, a_all, b_all in parts:
            a = a_all[adapter].detach().float().cpu()  # [E, r, in]
            b = b_all[adapter].detach().float().cpu() * s  # [E, out, r]
            pad = rank - a.shape[1]
            a = torch.cat([a, a.new_zeros(a.shape[0], pad, a.shape[2])], dim=1)
            b = torch.cat([b, b.new_zeros(b.shape[0], b.shape[1], pad)], dim=2)
            key = f"{_PEFT_PREFIX}{paths[index]}.{wrap}"
            tensors[key + "lora_A.weight"] = a.reshape(-1, a.shape[2]).contiguous()
            # column j * E + e holds expert e's column j
            tensors[key + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    shape = MoeModelShape.of(model.config)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": [],
        "target_parameters": ["gate_up_proj" if shape.gated else "up_proj", "down_proj"],
    }
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_NAME), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, WEIGHTS_NAME))
    return folder
