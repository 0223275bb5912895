"""MoE LoRA adapters read from PEFT checkpoints (``moerunner.lora_checkpoints``).

Adapters are written here with safetensors in the two layouts PEFT saves (per-expert Linear
modules of transformers 4; ``target_parameters`` ParamWrappers on transformers 5's fused
3-D expert parameters). The float64 reference never reads them through the loader: it
merges each saved module's update by PEFT's own formula (``s B @ A`` per expert Linear;
``einsum("o r e, e r i -> e o i")`` of the reshaped wrapper factors) into per-expert weights
and runs ``reference_moe`` on each adapter's tokens. fp32 bound: ``DTYPE_BOUND`` (the deltas
are rank-r fp32 GEMMs added to fp32 GEMM outputs, the base GEMMs' order of rounding).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import moerunner
from moerunner import MoeInputError
from moerunner.config import Activation
from moerunner.lora import MoeLoraWeights, lora_hooks
from moerunner.lora_checkpoints import (
    MoeModelShape,
    load_peft_adapter_set,
    load_peft_adapters,
)
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights

safetensors_torch = pytest.importorskip("safetensors.torch")

E, H, I, T, K = 4, 24, 16, 10, 2
QWEN = MoeModelShape(E, H, I)
MIXTRAL = MoeModelShape(E, H, I, ("w1", "w3", "w2"))
GPT_OSS = MoeModelShape(E, H, I, interleaved=True)
PREFIX = "base_model.model.model.layers"


def write_adapter(folder, tensors: dict, **config):
    """A PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": False, **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors")
    )
    return folder


def _scaling(cfg: dict, r: int, alpha: float) -> float:
    return alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def per_expert_adapter(
    g, shape, layers, r, roles=("gate", "up", "down"), experts=None, block="mlp"
):
    """Saved tensors of per-expert Linear adapters, and the float64 deltas (unscaled) per
    layer: {layer: (d13 [E, 2I, H] in gate/up row order, d2 [E, H, I])}."""
    names = dict(zip(("gate", "up", "down"), shape.projections, strict=True))
    tensors, deltas = {}, {}
    for layer in layers:
        d13 = torch.zeros(E, 2 * I, H, dtype=torch.float64)
        d2 = torch.zeros(E, H, I, dtype=torch.float64)
        for e in range(E) if experts is None else experts:
            for role in roles:
                k_in, n_out = (I, H) if role == "down" else (H, I)
                a = torch.randn(r, k_in, generator=g) * k_in**-0.5
                b = torch.randn(n_out, r, generator=g) * r**-0.5
                key = f"{PREFIX}.{layer}.{block}.experts.{e}.{names[role]}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
                d = b.double() @ a.double()
                if role == "down":
                    d2[e] = d
                else:
                    rows = slice(0, I) if role == "gate" else slice(I, 2 * I)
                    d13[e, rows] = d
        deltas[layer] = (d13, d2)
    return tensors, deltas


def fused_adapter(g, layers, r13, r2, gate_up_inner=True):
    """Saved tensors of ParamWrappers on gate_up_proj / down_proj (PEFT's lora_A
    ``[E r, in]``, lora_B ``[out, r E]``) and the float64 deltas by PEFT's einsum."""
    tensors, deltas = {}, {}
    for layer in layers:
        out = []
        for k_in, n_out, r, inner in (
            (H, 2 * I, r13, gate_up_inner),
            (I, H, r2, not gate_up_inner),
        ):
            a = torch.randn(E * r, k_in, generator=g) * k_in**-0.5
            b = torch.randn(n_out, r * E, generator=g) * r**-0.5
            key = f"{PREFIX}.{layer}.mlp.experts." + ("base_layer." if inner else "")
            tensors[f"{key}lora_A.weight"], tensors[f"{key}lora_B.weight"] = a, b
            wa = a.double().reshape(E, r, k_in)
            wb = b.double().reshape(n_out, r, E)
            out.append(torch.einsum("o r e, e r i -> e o i", wb, wa))
        deltas[layer] = tuple(out)
    return tensors, deltas


def _case(seed, act="silu", interleaved=False):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    x = torch.randn(T, H, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    weights = ExpertWeights(w13, w2, gate_up_interleaved=interleaved)
    return g, weights, x, topk, Activation.of(act)


def _interleave(d13):
    order = torch.stack([torch.arange(I), torch.arange(I) + I], dim=1).flatten()
    return d13[:, order]


def _reference(x, weights, topk, act, adapter_ids, merged):
    """float64: token t runs the merged weights of its adapter (plain weights for -1)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = weights.w13.double(), weights.w2.double()
    for a in [-1, *range(len(merged))]:
        tok = (adapter_ids == a).nonzero().flatten()
        d13, d2 = (0.0, 0.0) if a < 0 else merged[a]
        w = ExpertWeights(w13 + d13, w2 + d2, gate_up_interleaved=weights.gate_up_interleaved)
        out[tok] = moerunner.reference_moe(
            x[tok].double(), w, topk.weights[tok], topk.ids[tok], act
        )
    return out


def _run(x, weights, topk, act, lora, adapter_ids, backend="torch"):
    return moerunner.fused_moe(
        x,
        weights.w13,
        weights.w2,
        topk.weights,
        topk.ids,
        activation=act,
        gate_up_interleaved=weights.gate_up_interleaved,
        backend=backend,
        hooks=lora_hooks(lora, adapter_ids),
    )


ADAPTER_IDS = torch.tensor([0, 1, 2, -1, 0, 2, 1, -1, 2, 0])


@pytest.mark.parametrize("shape,block", [(QWEN, "mlp"), (MIXTRAL, "block_sparse_moe")])
def test_per_expert_modules_match_merged_weights(tmp_path, shape, block):
    g, weights, x, topk, act = _case(0)
    layer = 1
    # adapter 0: r=4, alpha 8; 1: r=8 rslora, only down_proj on experts 0 and 2 (ranks padded);
    # 2: r=2, gate and up only, alpha 3.
    t0, d0 = per_expert_adapter(g, shape, [0, layer], 4, block=block)
    t1, d1 = per_expert_adapter(g, shape, [layer], 8, roles=("down",), experts=[0, 2], block=block)
    t2, d2 = per_expert_adapter(g, shape, [layer], 2, roles=("gate", "up"), block=block)
    cfgs = [
        dict(r=4, lora_alpha=8),
        dict(r=8, lora_alpha=16, use_rslora=True),
        dict(r=2, lora_alpha=3),
    ]
    paths = [
        write_adapter(tmp_path / f"a{n}", t, **c)
        for n, (t, c) in enumerate(zip((t0, t1, t2), cfgs, strict=True))
    ]
    lora = load_peft_adapters(paths, shape, layer=layer)
    assert tuple(lora.w13_a.shape) == (3, E, 8, H) and tuple(lora.w2_a.shape) == (3, E, 8, I)
    torch.testing.assert_close(
        lora.scaling, torch.tensor([2.0, 16 / math.sqrt(8), 1.5]), rtol=0, atol=1e-7
    )
    merged = []
    for cfg, deltas in zip(cfgs, (d0, d1, d2), strict=True):
        s = _scaling(cfg, cfg["r"], cfg["lora_alpha"])
        merged.append(tuple(s * d for d in deltas[layer]))
    out = _run(x, weights, topk, act, lora, ADAPTER_IDS)
    ref = _reference(x, weights, topk, act, ADAPTER_IDS, merged)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=f"per-expert {shape.projections}")
    plain = _reference(x, weights, topk, act, torch.full((T,), -1), merged)
    for a in range(3):  # every adapter changes its tokens' output
        tok = ADAPTER_IDS == a
        assert (ref[tok] - plain[tok]).abs().max() > 0.05 * ref.abs().max()


@pytest.mark.parametrize("gate_up_inner", [True, False])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_parameters_match_merged_weights(tmp_path, gate_up_inner, interleaved):
    act = "swiglu_oai" if interleaved else "silu"
    g, weights, x, topk, act = _case(1, act, interleaved)
    shape = GPT_OSS if interleaved else QWEN
    # adapter 0: PEFT's v4 -> v5 conversion of gate/up r=4 (fused rank 8 with alpha 16 by
    # rank_pattern / alpha_pattern), down r=4; adapter 1: r=2 everywhere, rslora.
    t0, d0 = fused_adapter(g, [0], 8, 4, gate_up_inner)
    t1, d1 = fused_adapter(g, [0], 2, 2, not gate_up_inner)
    c0 = dict(
        r=4,
        lora_alpha=8,
        target_parameters=["gate_up_proj", "down_proj"],
        rank_pattern={r".*\.gate_up_proj": 8},
        alpha_pattern={r".*\.gate_up_proj": 16},
    )
    c1 = dict(r=2, lora_alpha=4, use_rslora=True, target_parameters=["gate_up_proj", "down_proj"])
    paths = [write_adapter(tmp_path / "x", t0, **c0), write_adapter(tmp_path / "y", t1, **c1)]
    lora = load_peft_adapters(paths, shape, layer=0)
    merged = [
        (2.0 * d0[0][0], 2.0 * d0[0][1]),
        (4 / math.sqrt(2) * d1[0][0], 4 / math.sqrt(2) * d1[0][1]),
    ]
    ids = ADAPTER_IDS.clamp(max=1)
    out = _run(x, weights, topk, act, lora, ids)
    ref = _reference(x, weights, topk, act, ids, merged)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="fused parameters")
    plain = _reference(x, weights, topk, act, torch.full((T,), -1), merged)
    assert (ref - plain).abs().max() > 0.05 * ref.abs().max()


def test_per_expert_gate_up_rows_interleave_for_gpt_oss_layout(tmp_path):
    """Per-expert gate/up factors land on the rows the interleaved w13 computes them in."""
    g, weights, x, topk, act = _case(2, "swiglu_oai", interleaved=True)
    t, d = per_expert_adapter(g, GPT_OSS, [0], 4)
    lora = load_peft_adapters(write_adapter(tmp_path / "a", t), GPT_OSS, layer=0)
    merged = [(2.0 * _interleave(d[0][0]), 2.0 * d[0][1])]
    ids = torch.where(ADAPTER_IDS > 0, -1, ADAPTER_IDS)
    out = _run(x, weights, topk, act, lora, ids)
    assert_close(out, _reference(x, weights, topk, act, ids, merged), DTYPE_BOUND[torch.float32])


def test_set_holds_every_touched_layer_and_untouched_layers_are_rank_zero(tmp_path):
    g = torch.Generator().manual_seed(3)
    t0, _ = per_expert_adapter(g, QWEN, [0, 2], 4)
    t1, _ = fused_adapter(g, [2, 3], 4, 4)
    paths = [write_adapter(tmp_path / "first", t0), write_adapter(tmp_path / "second", t1)]
    lora_set = load_peft_adapter_set(paths, QWEN, dtype=torch.float64)
    assert lora_set.names == ("first", "second") and sorted(lora_set.layers) == [0, 2, 3]
    assert lora_set.layer(1) is None and lora_set.layer(2).w13_a.dtype == torch.float64
    assert lora_set.layer(0).w13_a[1].abs().max() == 0  # the second adapter skips layer 0
    empty = load_peft_adapters(paths, QWEN, layer=1)
    assert empty.w13_a.shape[2] == 0 and empty.w2_a.shape[2] == 0
    _, weights, x, topk, act = _case(3)
    out = _run(x, weights, topk, act, empty, ADAPTER_IDS.clamp(max=1))
    plain = moerunner.reference_moe(x.double(), weights, topk.weights, topk.ids, act)
    assert_close(out, plain, DTYPE_BOUND[torch.float32])
    zero = _run(
        x[:0],
        weights,
        moerunner.select_experts(torch.randn(0, E), K),
        act,
        lora_set.layer(0),
        torch.zeros(0, dtype=torch.long),
    )
    assert zero.shape == (0, H)


def test_family_shapes_from_transformers_configs():
    pytest.importorskip("transformers")
    from moerunner.integrations.tiny_models import FAMILIES, tiny_config

    for family in FAMILIES:
        shape = MoeModelShape.of(tiny_config(family))
        assert (shape.num_experts, shape.hidden_size, shape.intermediate_size) == (8, 64, 32)
        assert shape.interleaved == (family == "gpt_oss")
    assert MoeModelShape.of(tiny_config("mixtral")).projections == ("w1", "w3", "w2")


def test_an_adapter_of_another_intermediate_size_is_not_called_an_orientation_problem(tmp_path):
    # gate_up_proj factors of an I=16 model, loaded for I=32: their shapes are those of
    # down_proj's with A and B swapped, which the message blamed on transformers 4 alone.
    g = torch.Generator().manual_seed(9)
    tensors, _ = fused_adapter(g, [0], 2, 2)
    gate_up = {k: v for k, v in tensors.items() if "base_layer." in k}
    path = write_adapter(tmp_path / "i16", gate_up, r=2, target_parameters=["gate_up_proj"])
    with pytest.raises(MoeInputError, match="another hidden or intermediate size"):
        load_peft_adapters(path, MoeModelShape(E, H, 2 * I), layer=0)


def test_bad_adapters_raise_naming_the_problem(tmp_path):
    g = torch.Generator().manual_seed(4)
    t, _ = per_expert_adapter(g, QWEN, [0], 4)
    good = write_adapter(tmp_path / "good", t)
    with pytest.raises(MoeInputError, match="has no adapter_config.json"):
        load_peft_adapters(tmp_path / "missing", QWEN, layer=0)
    with pytest.raises(MoeInputError, match="use_dora"):
        load_peft_adapters(write_adapter(tmp_path / "dora", t, use_dora=True), QWEN, layer=0)
    with pytest.raises(MoeInputError, match="peft_type"):
        load_peft_adapters(write_adapter(tmp_path / "ia3", t, peft_type="IA3"), QWEN, layer=0)
    attn = {**t, f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, H)}
    attn_path = write_adapter(tmp_path / "attn", attn)
    with pytest.raises(MoeInputError, match="outside the routed experts.*q_proj"):
        load_peft_adapters(attn_path, QWEN, layer=0)
    ignored = load_peft_adapters(attn_path, QWEN, layer=0, other_modules="ignore")
    torch.testing.assert_close(ignored.w13_a, load_peft_adapters(good, QWEN, layer=0).w13_a)
    # A trained router saved whole (PEFT's modules_to_save) was dropped without a word:
    # the model then differed from PEFT's by 1.3 (relative) once the adapter was on.
    router = {**t, f"{PREFIX}.0.mlp.gate.weight": torch.zeros(E, H)}
    router_path = write_adapter(tmp_path / "router", router, modules_to_save=["gate"])
    with pytest.raises(MoeInputError, match=r"outside the routed experts \(.*mlp\.gate\.weight"):
        load_peft_adapters(router_path, QWEN, layer=0)
    ignored = load_peft_adapters(router_path, QWEN, layer=0, other_modules="ignore")
    torch.testing.assert_close(ignored.w13_a, load_peft_adapters(good, QWEN, layer=0).w13_a)
    with pytest.raises(MoeInputError, match="other_modules"):
        load_peft_adapters(good, QWEN, layer=0, other_modules="skip")
    with pytest.raises(MoeInputError, match="where the model needs"):
        load_peft_adapters(good, MoeModelShape(E, 20, I), layer=0)
    with pytest.raises(MoeInputError, match="expert 4 >= num_experts 4"):
        bad = {**t}
        bad[f"{PREFIX}.0.mlp.experts.4.gate_proj.lora_A.weight"] = torch.zeros(4, H)
        bad[f"{PREFIX}.0.mlp.experts.4.gate_proj.lora_B.weight"] = torch.zeros(I, 4)
        load_peft_adapters(write_adapter(tmp_path / "e4", bad), QWEN, layer=0)
    with pytest.raises(MoeInputError, match=r"projection '\w+_proj' is none of \['w1'"):
        load_peft_adapters(good, MIXTRAL, layer=0)
    with pytest.raises(MoeInputError, match="no lora_B"):
        half = {k: v for k, v in t.items() if "experts.1.up_proj.lora_B" not in k}
        load_peft_adapters(write_adapter(tmp_path / "half", half), QWEN, layer=0)
    ft, _ = fused_adapter(g, [0], 4, 4)
    with pytest.raises(MoeInputError, match="do not hold E=4 experts of rank r=2"):
        load_peft_adapters(write_adapter(tmp_path / "f", ft, r=2), QWEN, layer=0)
    swapped = {  # gate_up_proj's factors with A on the 2I side
        f"{PREFIX}.0.mlp.experts.lora_A.weight": torch.zeros(E * 4, 2 * I),
        f"{PREFIX}.0.mlp.experts.lora_B.weight": torch.zeros(H, 4 * E),
    }
    with pytest.raises(MoeInputError, match="gate_up_proj with A on the parameter's output"):
        load_peft_adapters(write_adapter(tmp_path / "sw", swapped), QWEN, layer=0)
    with pytest.raises(MoeInputError, match="model_type 'llama'"):
        load_peft_adapters(good, type("Cfg", (), {"model_type": "llama"})(), layer=0)
    with pytest.raises(TypeError, match="MoeModelShape.hidden_size"):
        MoeModelShape(E, 0, I)
    with pytest.raises(TypeError, match="MoeModelShape.projections"):
        MoeModelShape(E, H, I, ("w1", "w3"))
    with pytest.raises(TypeError, match="dtype must be a floating"):
        load_peft_adapters(good, QWEN, layer=0, dtype=torch.int8)
    with pytest.raises(TypeError, match="layer"):
        load_peft_adapters(good, QWEN, layer="0")
    with pytest.raises(TypeError, match="adapters"):
        load_peft_adapters([], QWEN, layer=0)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "target-parameters"])
def test_adapters_of_non_gated_experts(tmp_path, fused):
    # A non-gated model's adapter (experts' up_proj and down_proj, Nemotron-H style) was
    # built gated-shaped, its up factors in rows I..2I: refused by the torch backend, and
    # dropped without a word by the triton one. MoeModelShape(gated=False) reads it as is.
    g = torch.Generator().manual_seed(7)
    r, shape = 4, MoeModelShape(E, H, I, gated=False)
    a_up, b_up = torch.randn(E, r, H, generator=g) * 0.3, torch.randn(E, I, r, generator=g) * 0.3
    a_dn, b_dn = torch.randn(E, r, I, generator=g) * 0.3, torch.randn(E, H, r, generator=g) * 0.3
    key = f"{PREFIX}.0.mlp.experts"
    if fused:  # transformers 5 3-D parameters: A [E r, in], B [out, r E] (column j E + e)
        tensors = {
            f"{key}.base_layer.lora_A.weight": a_up.reshape(E * r, H),
            f"{key}.base_layer.lora_B.weight": b_up.permute(1, 2, 0).reshape(I, r * E),
            f"{key}.lora_A.weight": a_dn.reshape(E * r, I),
            f"{key}.lora_B.weight": b_dn.permute(1, 2, 0).reshape(H, r * E),
        }
        config = {"target_parameters": ["up_proj", "down_proj"], "lora_alpha": 4}
    else:
        tensors = {}
        for e in range(E):
            for proj, (a, b) in (("up_proj", (a_up, b_up)), ("down_proj", (a_dn, b_dn))):
                tensors[f"{key}.{e}.{proj}.lora_A.weight"] = a[e]
                tensors[f"{key}.{e}.{proj}.lora_B.weight"] = b[e]
        config = {"lora_alpha": 4}
    folder = write_adapter(tmp_path / "a", tensors, **config)
    lora = load_peft_adapters([folder], shape, layer=0)
    assert tuple(lora.w13_b.shape) == (1, E, I, r)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K)
    merged = ExpertWeights(w13.double() + b_up.double() @ a_up.double(),
                           w2.double() + b_dn.double() @ a_dn.double())  # fmt: skip
    want = moerunner.reference_moe(x, merged, topk.weights, topk.ids, "silu_no_mul")
    hooks = lora_hooks(lora, torch.zeros(T, dtype=torch.long))
    got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="silu_no_mul",
                              hooks=hooks, backend="torch")  # fmt: skip
    assert_close(got, want, DTYPE_BOUND[torch.float32])
    if not fused:  # a gate adapter on gate-less experts
        gate = {}
        for e in range(E):
            gate[f"{key}.{e}.gate_proj.lora_A.weight"] = torch.randn(r, H)
            gate[f"{key}.{e}.gate_proj.lora_B.weight"] = torch.randn(I, r)
        folder = write_adapter(tmp_path / "b", {**tensors, **gate}, **config)
        with pytest.raises(MoeInputError, match="experts have none"):
            load_peft_adapters([folder], shape, layer=0)


def test_new_user_lora_faults_are_named(tmp_path):
    """A fused adapter of non-gated experts with H == I fit up_proj and down_proj alike and
    was read as the up adapter; a missing factor named no key; lora_alpha "x" raised a bare
    float() error; a NaN scaling and an empty adapter set failed late or not at all."""
    g = torch.Generator().manual_seed(9)
    r, square = 2, MoeModelShape(E, H, H, gated=False)
    key = f"{PREFIX}.0.mlp.experts"
    fused = {
        f"{key}.lora_A.weight": torch.randn(E * r, H, generator=g),
        f"{key}.lora_B.weight": torch.randn(H, r * E, generator=g),
    }
    folder = write_adapter(tmp_path / "square", fused, target_parameters=["down_proj"])
    with pytest.raises(MoeInputError, match="fit both up_proj and down_proj"):
        load_peft_adapters(folder, square, layer=0)
    t, _ = per_expert_adapter(g, QWEN, [0], 4)
    missing = f"{PREFIX}.0.mlp.experts.2.up_proj.lora_B.weight"
    del t[missing]
    with pytest.raises(MoeInputError, match=r"has no lora_B\.weight beside .*experts\.2\.up_proj"):
        load_peft_adapters(write_adapter(tmp_path / "missing", t), QWEN, layer=0)
    t, _ = per_expert_adapter(g, QWEN, [0], 4)
    with pytest.raises(MoeInputError, match="r and lora_alpha must be numbers.*'x'"):
        load_peft_adapters(write_adapter(tmp_path / "alpha", t, lora_alpha="x"), QWEN, layer=0)
    lora = load_peft_adapters(write_adapter(tmp_path / "good", t), QWEN, layer=0)
    factors = (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)
    with pytest.raises(MoeInputError, match="lora scaling must be finite"):
        lora_hooks(MoeLoraWeights(*factors, float("nan")), torch.zeros(T, dtype=torch.long))
    with pytest.raises(MoeInputError, match=r"no adapters \(L = 0\)"):
        lora_hooks(MoeLoraWeights(*(f[:0] for f in factors)), torch.full((T,), -1))


def _config_text(**fields) -> str:
    """adapter_config.json text: PEFT's defaults here with ``fields`` (NaN / Infinity as
    Python's json writes and reads them)."""
    return json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **fields})


_RANK = r"rank_pattern\['gate_proj'\] must be a positive int"
_ALPHA = r"alpha_pattern\['(gate|up)_proj'\] must be a finite number"
BAD_CONFIGS = {  # adapter_config.json text -> what the message says after the file's path
    "not-json": ("{r: 4", "is not valid JSON"),
    "a-list": ("[4]", "must hold a JSON object"),
    "rank-0": (_config_text(rank_pattern={"gate_proj": 0}), _RANK),
    "rank-x": (_config_text(rank_pattern={"gate_proj": "x"}), _RANK),
    "rank-list": (_config_text(rank_pattern=["gate_proj"]), "rank_pattern must be a JSON object"),
    "bad-regex": (
        _config_text(rank_pattern={"gate_proj(": 2}),
        r"rank_pattern key 'gate_proj\(' is not a valid regular expression",
    ),
    "alpha-null": (_config_text(alpha_pattern={"gate_proj": None}), _ALPHA),
    "alpha-nan-pattern": (_config_text(alpha_pattern={"up_proj": math.nan}), _ALPHA),
    "alpha-nan": (_config_text(lora_alpha=math.nan), "lora_alpha finite.*lora_alpha=nan"),
    "alpha-inf": (_config_text(lora_alpha=math.inf), "lora_alpha finite.*lora_alpha=inf"),
    "rslora-str": (_config_text(use_rslora="yes"), "use_rslora must be true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_malformed_adapter_config_is_named(tmp_path, case):
    """A malformed adapter_config.json raised json's, Python's or re's own errors
    (JSONDecodeError, AttributeError, ZeroDivisionError, a bare int() ValueError, re.error,
    a float() TypeError), a misleading rank/scaling mismatch for lora_alpha NaN, or nothing
    for lora_alpha Infinity (an infinite scaling). Each now raises MoeInputError naming the
    file and the field."""
    text, says = BAD_CONFIGS[case]
    t, _ = per_expert_adapter(torch.Generator().manual_seed(11), QWEN, [0], 4)
    folder = write_adapter(tmp_path / case, t)
    (folder / "adapter_config.json").write_text(text)
    where = str(folder / "adapter_config.json")
    with pytest.raises(MoeInputError, match=f"adapters: {re.escape(where)}.*{says}"):
        load_peft_adapters(folder, QWEN, layer=0)


def test_loader_arguments_are_named(tmp_path):
    """device="nonsense" raised torch's RuntimeError; adapters=[123] an os.fspath TypeError
    that named no argument."""
    t, _ = per_expert_adapter(torch.Generator().manual_seed(12), QWEN, [0], 4)
    good = write_adapter(tmp_path / "good", t)
    with pytest.raises(MoeInputError, match=r"device: got 'nonsense'; accepted: None, a torch"):
        load_peft_adapters(good, QWEN, layer=0, device="nonsense")
    with pytest.raises(MoeInputError, match=r"device: got 'nonsense'"):
        load_peft_adapter_set([good], QWEN, device="nonsense")
    with pytest.raises(TypeError, match=r"adapters\[1\] must be a folder .*got 123"):
        load_peft_adapters([good, 123], QWEN, layer=0)
    if not torch.cuda.is_available():  # a device this torch cannot place tensors on
        with pytest.raises(MoeInputError, match="device: cannot place the factors on cuda"):
            load_peft_adapters(good, QWEN, layer=0, device="cuda")
    lora = load_peft_adapters(good, QWEN, layer=0, device=torch.device("cpu"))
    assert lora.w13_a.device.type == "cpu"


def test_rank_and_alpha_patterns_still_scale_per_module(tmp_path):
    """The checked patterns are PEFT's rules as before: rank_pattern / alpha_pattern per
    module, against the float64 scaling the config gives each module (``_scaling``)."""
    g = torch.Generator().manual_seed(13)
    t, deltas = per_expert_adapter(g, QWEN, [0], 4, roles=("down",))
    cfg = {"r": 4, "lora_alpha": 8, "alpha_pattern": {"down_proj": 3.0}}
    lora = load_peft_adapters(write_adapter(tmp_path / "p", t, **cfg), QWEN, layer=0)
    merged = lora.scaling[0].double() * torch.einsum(
        "ehr,eri->ehi", lora.w2_b[0].double(), lora.w2_a[0].double()
    )
    torch.testing.assert_close(merged, _scaling(cfg, 4, 3.0) * deltas[0][1])
