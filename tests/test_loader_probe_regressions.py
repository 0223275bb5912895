"""moerunner.load_experts: checkpoints that loaded wrong values, or failed with an error that
named no tensor or config.json field.

Integer checkpoints are packed here by each format's published rules (the packer of
tests/quant/test_quant_checkpoints_integer.py) and compared bit-exactly with a float64
dequantization of the same codes: (code - zero) * fp16 scale needs at most 8 + 11 bits, so
float32 holds it exactly.
"""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import moerunner
from moerunner.quant.checkpoints import cat_rows
from tests.quant.test_quant_checkpoints_integer import pack

QWEN = "model.layers.0.mlp.experts."
MIXTRAL = "model.layers.0.block_sparse_moe.experts."
E, H, I = 2, 64, 64
SHAPES = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def _write(folder, tensors, config=None, name="model.safetensors"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / name)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _qwen_config(num=E, **extra):
    return {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 1,
        "num_experts": num,
        "num_experts_per_tok": 2,
        **extra,
    }


def _codes(rng, proj, bits, group, zeros):
    """Unsigned codes [E, N, K], zero points [E, N, K/g], fp16 scales and the float64 values."""
    n, k = SHAPES[proj]
    top = 1 << bits
    q = rng.integers(0, top, (E, n, k))
    if zeros == "random":
        z = rng.integers(1, top, (E, n, k // group))
    else:  # "mid" (stored, all at the midpoint) or None (symmetric, not stored)
        z = np.full((E, n, k // group), top // 2)
    s = rng.uniform(0.002, 0.05, (E, n, k // group)).astype(np.float16)
    value = (q - np.repeat(z, group, -1)) * np.repeat(s.astype(np.float64), group, -1)
    return q, z, s, value


def _compressed(rng, tensors, expected, proj, bits=4, group=32, zeros="random"):
    q, z, s, expected[proj] = _codes(rng, proj, bits, group, zeros)
    for e in range(E):
        key = f"{QWEN}{e}.{proj}."
        tensors[key + "weight_packed"] = pack(q[e], bits, 1)
        tensors[key + "weight_scale"] = torch.from_numpy(s[e])
        if zeros is not None:
            tensors[key + "weight_zero_point"] = pack(z[e], bits, 0)
        tensors[key + "weight_shape"] = torch.tensor(SHAPES[proj])


def _gptq(rng, tensors, expected, proj, bits=4, group=32, g_idx=True):
    q, z, s, expected[proj] = _codes(rng, proj, bits, group, "random")
    k = SHAPES[proj][1]
    for e in range(E):
        key = f"{QWEN}{e}.{proj}."
        tensors[key + "qweight"] = pack(q[e].T, bits, 0)
        tensors[key + "qzeros"] = pack(z[e].T - 1, bits, 1)  # the original format: zero - 1
        tensors[key + "scales"] = torch.from_numpy(np.ascontiguousarray(s[e].T))
        if g_idx:
            tensors[key + "g_idx"] = torch.arange(k, dtype=torch.int32) // group


def _layer(build, per_proj=None, **common):
    """One layer of ``build`` (`_compressed` / `_gptq`) with keyword arguments ``common``;
    ``per_proj`` overrides them for a projection."""
    rng = np.random.default_rng(0)
    tensors, expected = {}, {}
    for proj in SHAPES:
        build(rng, tensors, expected, proj, **{**common, **(per_proj or {}).get(proj, {})})
    return tensors, expected


def _assert_exact(loaded, expected):
    w13 = np.concatenate([expected["gate_proj"], expected["up_proj"]], axis=1)
    assert torch.equal(loaded.weights.w13.dequantize().double(), torch.from_numpy(w13))
    w2 = torch.from_numpy(expected["down_proj"])
    assert torch.equal(loaded.weights.w2.dequantize().double(), w2)


# ---------------------------------------------------------------- compressed-tensors zero points


def test_unpacked_zero_points_are_refused_with_the_expected_shape(tmp_path):
    """An int32 [N, G] weight_zero_point (one zero point per int32, not packed along N) was
    read as packed: its first N*bits/32 rows gave the N zero points, wrong ones."""
    tensors, _ = _layer(_compressed)
    for e in range(E):
        for proj, (n, k) in SHAPES.items():
            zeros = torch.randint(0, 16, (n, k // 32), dtype=torch.int32)
            tensors[f"{QWEN}{e}.{proj}.weight_zero_point"] = zeros
    _write(tmp_path, tensors, _qwen_config())
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}{{0..1}}.gate_proj.*: weight_zero_point: expected int32 ")
        + r".*\[8, 2\] per expert .*got \[64, 2\] per expert",
    ):
        moerunner.load_experts(tmp_path, layer=0)


# ---------------------------------------------------------------- every expert alike


def test_zero_points_missing_on_expert_0_only_are_refused(tmp_path):
    """Expert 0's tensors decided what every expert stored: without its zero points the
    other experts' were dropped and the layer loaded as symmetric (wrong values)."""
    tensors, _ = _layer(_compressed)
    for proj in SHAPES:
        del tensors[f"{QWEN}0.{proj}.weight_zero_point"]
    _write(tmp_path, tensors, _qwen_config())
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}1.gate_proj.weight_zero_point is present, but ")
        + re.escape(f"{QWEN}0.gate_proj.weight_zero_point is not"),
    ):
        moerunner.load_experts(tmp_path, layer=0)


def test_an_act_order_g_idx_on_expert_1_only_is_refused(tmp_path):
    """Expert 1's act-order g_idx was ignored because expert 0 had none: the checkpoint
    loaded in the wrong row order, though act-order checkpoints are refused."""
    tensors, _ = _layer(_gptq, g_idx=False)
    tensors[f"{QWEN}1.gate_proj.g_idx"] = (torch.arange(H, dtype=torch.int32) // 32).flip(0)
    config = _qwen_config(quantization_config={"quant_method": "gptq", "bits": 4})
    _write(tmp_path, tensors, config)
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}1.gate_proj.g_idx is present, but {QWEN}0.gate_proj.g_idx is not"),
    ):
        moerunner.load_experts(tmp_path, layer=0)


# ---------------------------------------------------------------- gate and up schemes


@pytest.mark.parametrize("bits", [4, 8])
def test_gate_zero_points_all_at_the_midpoint_load_exactly(bits, tmp_path):
    """Gate's zero points all at the midpoint made it the symmetric scheme beside up's
    zero-point one, and joining them raised a bare ValueError naming no tensor."""
    for gate in ("mid", None):  # stored at the midpoint, or not stored (symmetric)
        tensors, expected = _layer(_compressed, {"gate_proj": {"zeros": gate}}, bits=bits)
        _write(tmp_path, tensors, _qwen_config())
        loaded = moerunner.load_experts(tmp_path, layer=0)
        assert loaded.weights.w13.scheme.name == f"int{bits}_g32_zp"
        _assert_exact(loaded, expected)
    sym, zp = (moerunner.quantize(torch.randn(2, 8, 64), f"int{bits}_g32{s}") for s in ("", "_zp"))
    joined = cat_rows([zp, sym])  # the twin schemes join as the zero-point one, exactly
    assert joined.scheme == zp.scheme
    assert torch.equal(joined.dequantize(), torch.cat([zp.dequantize(), sym.dequantize()], 1))


def test_gate_and_up_of_different_schemes_are_named(tmp_path):
    """Were a bare ValueError from joining gate and up, naming neither."""
    tensors, _ = _layer(_compressed, {"up_proj": {"bits": 8}})
    _write(tmp_path, tensors, _qwen_config())
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}0.gate_proj.weight_packed is int4_g32_zp, ")
        + re.escape(f"{QWEN}0.up_proj.weight_packed is int8_g32_zp"),
    ):
        moerunner.load_experts(tmp_path, layer=0)
    tensors, _ = _layer(_gptq, {"up_proj": {"group": 16}})
    _write(tmp_path, tensors, _qwen_config(quantization_config={"quant_method": "gptq"}))
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}0.gate_proj.qweight is int4_g32_zp, ")
        + re.escape(f"{QWEN}0.up_proj.qweight is int4_g16_zp"),
    ):
        moerunner.load_experts(tmp_path, layer=0)


# ---------------------------------------------------------------- weight_shape


def test_a_one_element_weight_shape_is_named(tmp_path):
    """Was an IndexError from reading its second entry."""
    tensors, _ = _layer(_compressed)
    for e in range(E):
        tensors[f"{QWEN}{e}.gate_proj.weight_shape"] = torch.tensor([I])
    _write(tmp_path, tensors, _qwen_config())
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}0.gate_proj.weight_shape holds [64]; expected (N, K)"),
    ):
        moerunner.load_experts(tmp_path, layer=0)


# ---------------------------------------------------------------- GPTQ bits


@pytest.mark.parametrize("g_idx", [True, False])
@pytest.mark.parametrize("config", ["none", "no bits"])
def test_gptq_8_bit_without_bits_in_the_config_loads_exactly(g_idx, config, tmp_path):
    """bits defaulted to 4: the 8-bit codes were read as twice as many 4-bit ones, refused
    with an error about g_idx's length or about shapes that do not fit."""
    tensors, expected = _layer(_gptq, bits=8, g_idx=g_idx)
    extra = {} if config == "none" else {"quantization_config": {"quant_method": "gptq"}}
    _write(tmp_path, tensors, _qwen_config(**extra))
    loaded = moerunner.load_experts(tmp_path, layer=0)
    assert loaded.format == "gptq" and loaded.weights.w13.scheme.name == "int8_g32_zp"
    _assert_exact(loaded, expected)


def test_gptq_rows_that_fit_no_bit_width_say_how_to_give_it(tmp_path):
    tensors, _ = _layer(_gptq, g_idx=False)
    for e in range(E):  # 12 rows: K = 64 takes 8 (4 bits) or 16 (8 bits)
        key = f"{QWEN}{e}.gate_proj.qweight"
        tensors[key] = torch.cat([tensors[key], tensors[key][:4]])
    _write(tmp_path, tensors, _qwen_config())
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}0.gate_proj.qweight has 12 rows") + r".*quantization_config.*bits",
    ):
        moerunner.load_experts(tmp_path, layer=0)


def test_gptq_bits_taken_as_4_say_so(tmp_path):
    """Without a quantization config or another projection to take K from, the bits are
    taken as 4; an error then says so (it was about shapes alone)."""
    tensors, _ = _layer(_gptq, bits=8, g_idx=False)
    for e in range(E):
        for suffix in ("qweight", "qzeros", "scales"):
            del tensors[f"{QWEN}{e}.down_proj.{suffix}"]
        tensors[f"{QWEN}{e}.down_proj.weight"] = torch.randn(H, I)
    _write(tmp_path, tensors, _qwen_config())
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{QWEN}{{0..1}}.gate_proj.* (bits taken as 4: config.json gives no ")
        + re.escape('quantization_config "bits"): qzeros'),
    ):
        moerunner.load_experts(tmp_path, layer=0)


# ---------------------------------------------------------------- plain dtypes


def _mixtral(folder, gate=torch.float32, down=torch.float32, config=True):
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for e in range(E):
        tensors[f"{MIXTRAL}{e}.w1.weight"] = torch.randn(32, 64, generator=gen).to(gate)
        tensors[f"{MIXTRAL}{e}.w3.weight"] = torch.randn(32, 64, generator=gen).to(gate)
        tensors[f"{MIXTRAL}{e}.w2.weight"] = torch.randn(64, 32, generator=gen).to(down)
    cfg = {"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": E}
    _write(folder, tensors, cfg if config else None, "a.safetensors")
    return tensors


def test_float64_weights_name_the_tensor_and_suggest_dtype(tmp_path):
    """Was a TypeError from ExpertWeights ("w13 dtype torch.float64 is not accepted")."""
    tensors = _mixtral(tmp_path, torch.float64, torch.float64)
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{MIXTRAL}0.w1.weight is torch.float64") + r".*dtype=torch\.float32",
    ):
        moerunner.load_experts(tmp_path, layer=0)
    loaded = moerunner.load_experts(tmp_path, layer=0, dtype=torch.float32)
    assert torch.equal(loaded.weights.w2[1], tensors[f"{MIXTRAL}1.w2.weight"].float())


def test_projections_of_different_dtypes_name_the_tensors(tmp_path):
    """Was a TypeError ("w13 dtype torch.float32 differs from w2 dtype torch.bfloat16")."""
    tensors = _mixtral(tmp_path, torch.float32, torch.bfloat16)
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{MIXTRAL}0.w1.weight is torch.float32")
        + ".*"
        + re.escape(f"{MIXTRAL}0.w2.weight is torch.bfloat16")
        + r".*dtype=",
    ):
        moerunner.load_experts(tmp_path, layer=0)
    loaded = moerunner.load_experts(tmp_path, layer=0, dtype=torch.float32)
    assert torch.equal(loaded.weights.w2[0], tensors[f"{MIXTRAL}0.w2.weight"].float())

    prefix = QWEN
    oss = {
        prefix + "gate_up_proj": torch.randn(E, 64, 64).bfloat16(),
        prefix + "down_proj": torch.randn(E, 32, 64),
    }
    _write(tmp_path, oss, None, "oss.safetensors")
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"{prefix}gate_up_proj is torch.bfloat16")
        + ".*"
        + re.escape(f"{prefix}down_proj is torch.float32")
        + r".*dtype=",
    ):
        moerunner.load_experts(tmp_path / "oss.safetensors", layer=0, family="gpt_oss")


def test_gate_and_up_that_promote_to_down_s_dtype_load_exactly(tmp_path):
    """fp32 gate, bf16 up and fp32 down join exactly in fp32, as they always loaded (the
    mixed-dtype refusal took these in for a while)."""
    tensors = _mixtral(tmp_path)
    for e in range(E):
        tensors[f"{MIXTRAL}{e}.w3.weight"] = tensors[f"{MIXTRAL}{e}.w3.weight"].bfloat16()
    _write(tmp_path, tensors, None, "a.safetensors")
    loaded = moerunner.load_experts(tmp_path, layer=0)
    assert loaded.weights.w13.dtype == torch.float32
    assert torch.equal(loaded.weights.w13[1, 32:], tensors[f"{MIXTRAL}1.w3.weight"].float())


# ---------------------------------------------------------------- files and config.json


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path):
    """Was read from the file that sorts last, silently."""
    _mixtral(tmp_path)
    key = f"{MIXTRAL}0.w1.weight"
    _write(tmp_path, {key: torch.full((32, 64), 7.0)}, None, "b.safetensors")
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(repr(key)) + r" is in both .*a\.safetensors.* and .*b\.safetensors",
    ):
        moerunner.load_experts(tmp_path, layer=0)
    # A tensor the layer does not read may be in two files (the checkpoint's own business).
    _mixtral(tmp_path)
    for name in ("b.safetensors", "c.safetensors"):
        _write(tmp_path, {"lm_head.weight": torch.zeros(4, 64)}, None, name)
    assert moerunner.load_experts(tmp_path, layer=0).weights.num_experts == E


def test_json_files_that_are_not_utf8_are_named(tmp_path):
    """Were a bare UnicodeDecodeError."""
    tensors = _mixtral(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(moerunner.MoeInputError, match=r"config\.json' is not UTF-8"):
        moerunner.load_experts(tmp_path, layer=0)
    (tmp_path / "config.json").unlink()
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(
        json.dumps({"weight_map": dict.fromkeys(tensors, "a.é")}, ensure_ascii=False).encode(
            "latin-1"
        )
    )
    with pytest.raises(moerunner.MoeInputError, match=r"index\.json' is not UTF-8"):
        moerunner.load_experts(tmp_path, layer=0, family="mixtral")


@pytest.mark.parametrize("value", ["2", 2.0, True, 0])
@pytest.mark.parametrize(
    ("family", "field"),
    [
        ("mixtral", "num_local_experts"),
        ("qwen3_moe", "num_experts"),
        ("deepseek_v3", "n_routed_experts"),
        ("mixtral", "num_hidden_layers"),
    ],
)
def test_counts_that_are_not_positive_ints_are_named(family, field, value, tmp_path):
    """Were ignored silently (the count then came from the files), unlike
    num_experts_per_tok of the same kind; 0 was refused, by a message about its effect."""
    if family == "mixtral":
        _mixtral(tmp_path, config=False)
    else:
        _mlp_plain(tmp_path)
    cfg = {"model_type": family, "num_hidden_layers": 1, field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        moerunner.MoeInputError,
        match=re.escape(f"config.json's {field} must be a positive int, got {value!r}"),
    ):
        moerunner.load_experts(tmp_path, layer=0)


def test_a_model_type_that_is_not_a_str_names_config_json(tmp_path):
    """Said "family must be a str", a TypeError about an argument not given."""
    _mixtral(tmp_path, config=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": 5}))
    with pytest.raises(
        moerunner.MoeInputError, match=r"config\.json's model_type must be a str .*got 5"
    ):
        moerunner.load_experts(tmp_path, layer=0)


# ---------------------------------------------------------------- DeepSeek groups


def _mlp_plain(tmp_path, num=E, config=None):
    """Plain ``mlp.experts`` projections (Qwen / DeepSeek names) of ``num`` experts."""
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for e in range(num):
        for proj, shape in (
            ("gate_proj", (16, 32)),
            ("up_proj", (16, 32)),
            ("down_proj", (32, 16)),
        ):
            tensors[f"{QWEN}{e}.{proj}.weight"] = torch.randn(shape, generator=gen)
    _write(tmp_path, tensors, config)


def _deepseek(tmp_path, num=8, **fields):
    _mlp_plain(tmp_path, num, {"n_routed_experts": num, "num_experts_per_tok": 2, **fields})


GROUPED = "topk_method"  # DeepSeek-V2 groups only with group_limited_greedy


@pytest.mark.parametrize(
    ("family", "fields", "match"),
    [
        ("deepseek_v3", {"n_group": 0, "topk_group": 1}, "n_group=0 must divide E=8"),
        ("deepseek_v3", {"n_group": -2, "topk_group": 1}, "n_group=-2 must divide E=8"),
        ("deepseek_v3", {"n_group": 4}, "n_group and topk_group must be given together"),
        ("deepseek_v3", {"n_group": 4, "topk_group": 0}, "topk_group must be in [1, n_group=4]"),
        ("deepseek_v3", {"n_group": 4, "topk_group": 5}, "topk_group must be in [1, n_group=4]"),
        ("deepseek_v3", {"n_group": 3, "topk_group": 1}, "n_group=3 must divide E=8"),
        (
            "deepseek_v3",
            {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
            "num_experts_per_tok=3 exceeds the experts in the 1 kept groups (2)",
        ),
        (
            "deepseek_v2",
            {GROUPED: "group_limited_greedy", "n_group": 0, "topk_group": 1},
            "n_group=0 must divide E=8",
        ),
        (
            "deepseek_v2",
            {GROUPED: "group_limited_greedy", "n_group": 4, "topk_group": 6},
            "topk_group must be in [1, n_group=4], got 6",
        ),
    ],
)
def test_deepseek_group_fields_are_checked_at_load(family, fields, match, tmp_path):
    """Loaded, and failed later naming RoutingConfig's fields (n_group 0 or negative meant
    no groups, silently)."""
    _deepseek(tmp_path, model_type=family, **fields)
    top_k = fields.get("num_experts_per_tok", 2)
    named = f"config.json's n_group={fields['n_group']!r}, topk_group={fields.get('topk_group')!r}"
    named += f" and num_experts_per_tok={top_k} do not fit the layer's 8 experts: "
    with pytest.raises(moerunner.MoeInputError, match=re.escape(named) + ".*" + re.escape(match)):
        moerunner.load_experts(tmp_path, layer=0)


@pytest.mark.parametrize(
    "fields", [{"n_group": 1}, {"n_group": 1, "topk_group": 1}, {"topk_group": 2}]
)
def test_deepseek_v3_n_group_1_still_means_no_groups(tmp_path, fields):
    """n_group 1 or absent is no groups whatever topk_group says (Moonlight-style configs
    set both to 1); the load-time group check refused those for a while."""
    _deepseek(tmp_path, model_type="deepseek_v3", **fields)
    routing = moerunner.load_experts(tmp_path, layer=0).routing
    assert routing.num_expert_group is None and routing.topk_group is None


def test_a_symmetric_twin_joined_as_the_zero_point_scheme_keeps_its_input_scale():
    """The rebuilt symmetric part dropped its input_scale: the join then took the other
    part's smaller one (1.0 where the maximum, 4.0, is right)."""
    import dataclasses

    from moerunner.quant.schemes import QuantScheme

    zp = QuantScheme(
        "probe_zp", "int8", "fp32", "group", (1, 64), zero_point=True,
        activation_format="int8_token",
    )  # fmt: skip
    sym = dataclasses.replace(zp, name="probe_sym", zero_point=False)
    a = moerunner.quantize(torch.randn(2, 8, 64), sym, input_scale=torch.full((2,), 4.0))
    b = moerunner.quantize(torch.randn(2, 8, 64), zp, input_scale=torch.full((2,), 1.0))
    joined = cat_rows([a, b])
    assert joined.scheme == zp and torch.equal(joined.input_scale, torch.full((2,), 4.0))
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()], 1))
