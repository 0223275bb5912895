"""moerunner.load_experts: one layer's experts from safetensors checkpoints.

Two sources: checkpoints written by transformers' own ``save_pretrained`` (sharded, so the
key names and the index are the published ones), whose experts module is then the
independent reference; and checkpoints written here tensor by tensor (formats, errors).
"""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import moerunner
from moerunner.loader import FAMILIES
from moerunner.testing import assert_close, error_bound

FP32_BOUND = error_bound(torch.float32, False)  # fp32 experts on both sides vs float64


# ---------------------------------------------------------------- transformers checkpoints

EXPECTED_ROUTING = {
    "mixtral": moerunner.RoutingConfig(renormalize=True),
    "qwen2_moe": moerunner.RoutingConfig(renormalize=False),
    "qwen3_moe": moerunner.RoutingConfig(renormalize=True),
    "deepseek_v3": moerunner.RoutingConfig("sigmoid", True, 4, 2, 2.5, correction_bias=True),
    "gpt_oss": moerunner.RoutingConfig(renormalize=True),
}


@pytest.mark.parametrize("family", sorted(EXPECTED_ROUTING))
def test_transformers_checkpoint_matches_its_experts_module(family, tmp_path):
    pytest.importorskip("transformers")
    from tests.integrations._tiny_models import build

    model = build(family)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    layer = 1  # DeepSeek-V3's tiny config has a dense layer 0
    loaded = moerunner.load_experts(tmp_path, layer=layer)
    assert (loaded.family, loaded.layer, loaded.format) == (family, layer, "plain")
    assert loaded.top_k == 2 and loaded.routing == EXPECTED_ROUTING[family]
    assert loaded.num_experts == 8
    assert loaded.activation.name == ("swiglu_oai" if family == "gpt_oss" else "silu")

    experts = model.model.layers[layer].mlp.experts
    x = torch.randn(10, model.config.hidden_size)
    topk = moerunner.select_experts(torch.randn(10, 8), 2, renormalize=True)
    with torch.no_grad():
        theirs = experts(x, topk.ids.long(), topk.weights)
    ours = moerunner.reference_moe(x, loaded.weights, topk.weights, topk.ids, loaded.activation)
    assert_close(theirs, ours, FP32_BOUND, what=f"{family} layer {layer}")
    out = moerunner.fused_moe(
        x,
        loaded.weights.w13,
        loaded.weights.w2,
        topk.weights,
        topk.ids,
        activation=loaded.activation.name,
        w13_bias=loaded.weights.w13_bias,
        w2_bias=loaded.weights.w2_bias,
        gate_up_interleaved=loaded.weights.gate_up_interleaved,
        backend="torch",
    )
    assert_close(out, ours, FP32_BOUND, what=f"fused_moe on {family}")


def test_transformers_deepseek_dense_layer_is_named(tmp_path):
    pytest.importorskip("transformers")
    from tests.integrations._tiny_models import build

    build("deepseek_v3").save_pretrained(tmp_path)
    with pytest.raises(
        moerunner.MoeInputError,
        match=r"layer=0 has no routed experts.*model\.layers\.0\.mlp\.experts\.",
    ):
        moerunner.load_experts(tmp_path, layer=0)
    with pytest.raises(moerunner.MoeInputError, match=r"layer=2 is out of range.*2 layers"):
        moerunner.load_experts(tmp_path, layer=2)


# ---------------------------------------------------------------- hand-written checkpoints

E, H, I = 4, 32, 32


def mixtral_tensors(layer=0, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen)
    down = torch.randn(E, H, I, generator=gen)
    prefix = f"model.layers.{layer}.block_sparse_moe.experts."
    tensors = {}
    for e in range(E):
        tensors[f"{prefix}{e}.w1.weight"] = gate[e].to(dtype)
        tensors[f"{prefix}{e}.w3.weight"] = up[e].to(dtype)
        tensors[f"{prefix}{e}.w2.weight"] = down[e].to(dtype)
    return tensors, gate, up, down


def write_sharded(folder, tensors, shards=2, config=None):
    """Tensors spread over ``shards`` files (round robin, so a layer spans files) + index."""
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def test_sharded_mixtral_stacks_gate_then_up_and_converts(tmp_path):
    tensors, gate, up, down = mixtral_tensors(layer=1)
    tensors.update(mixtral_tensors(layer=0, seed=1)[0])
    config = {
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "num_local_experts": E,
        "num_experts_per_tok": 2,
    }
    write_sharded(tmp_path, tensors, shards=3, config=config)
    loaded = moerunner.load_experts(tmp_path, layer=1, dtype=torch.float32)
    w = loaded.weights
    assert w.w13.dtype == torch.float32 and w.w13.shape == (E, 2 * I, H)
    assert torch.equal(w.w13, torch.cat([gate, up], dim=1).bfloat16().float())
    assert torch.equal(w.w2, down.bfloat16().float())
    assert not w.gate_up_interleaved and w.w13_bias is None
    # The index file itself, and bf16 kept as stored without dtype=.
    again = moerunner.load_experts(tmp_path / "model.safetensors.index.json", layer=1)
    assert again.weights.w13.dtype == torch.bfloat16
    assert torch.equal(again.weights.w13.float(), w.w13)


def test_only_the_layer_is_read(tmp_path, monkeypatch):
    tensors, *_ = mixtral_tensors(layer=0)
    tensors.update(mixtral_tensors(layer=1, seed=1)[0])
    save_file(tensors, tmp_path / "model.safetensors")
    import safetensors

    read = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    moerunner.load_experts(tmp_path / "model.safetensors", layer=1, family="mixtral")
    assert read and all(n.startswith("model.layers.1.") for n in read)
    assert len(read) == 3 * E


def test_qwen_and_deepseek_bf16_names(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(
                shape, generator=gen
            ).bfloat16()
    save_file(tensors, tmp_path / "model.safetensors")
    for family in ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
        loaded = moerunner.load_experts(tmp_path, layer=0, family=family)
        assert loaded.top_k is None and loaded.routing is None  # no config.json
        g = tensors["model.layers.0.mlp.experts.2.gate_proj.weight"]
        u = tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
        assert torch.equal(loaded.weights.w13[2], torch.cat([g, u]))


def test_gpt_oss_bf16_and_mxfp4(tmp_path):
    gen = torch.Generator().manual_seed(3)
    prefix = "model.layers.0.mlp.experts."
    gate_up = torch.randn(E, H, 2 * I, generator=gen)  # [E, in, out], columns gate/up alternating
    down = torch.randn(E, I, H, generator=gen)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    tensors = {
        prefix + "gate_up_proj": gate_up.bfloat16(),
        prefix + "gate_up_proj_bias": b13.bfloat16(),
        prefix + "down_proj": down.bfloat16(),
        prefix + "down_proj_bias": b2.bfloat16(),
    }
    (tmp_path / "bf16").mkdir()
    save_file(tensors, tmp_path / "bf16" / "model.safetensors")
    cfg = {"model_type": "gpt_oss", "swiglu_limit": 5.0, "num_experts_per_tok": 2}
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    loaded = moerunner.load_experts(tmp_path / "bf16", layer=0)
    w = loaded.weights
    assert w.gate_up_interleaved and loaded.activation.limit == 5.0
    assert torch.equal(w.w13, gate_up.bfloat16().transpose(1, 2))
    assert torch.equal(w.w2, down.bfloat16().transpose(1, 2))
    assert torch.equal(w.w13_bias, b13.bfloat16()) and torch.equal(w.w2_bias, b2.bfloat16())

    q13 = moerunner.quantize(gate_up.transpose(1, 2), "mxfp4")
    q2 = moerunner.quantize(down.transpose(1, 2), "mxfp4")
    packed = {
        prefix + "gate_up_proj_blocks": q13.data.reshape(E, 2 * I, H // 32, 16),
        prefix + "gate_up_proj_scales": q13.scale,
        prefix + "down_proj_blocks": q2.data.reshape(E, H, I // 32, 16),
        prefix + "down_proj_scales": q2.scale,
        prefix + "gate_up_proj_bias": b13.bfloat16(),
        prefix + "down_proj_bias": b2.bfloat16(),
    }
    save_file({k: v.contiguous() for k, v in packed.items()}, tmp_path / "mx.safetensors")
    mx = moerunner.load_experts(tmp_path / "mx.safetensors", layer=0, family="gpt_oss")
    assert mx.format == "mxfp4" and mx.weights.w13.scheme.name == "mxfp4"
    assert torch.equal(mx.weights.w13.dequantize(), q13.dequantize())
    assert mx.weights.w13_bias.dtype == torch.float32


def write_deepseek_fp8(path, layer: int, inter: int, hidden: int, gen) -> dict:
    """A DeepSeek-V3-style fp8 checkpoint of one layer's experts (per-expert e4m3 ``weight``
    and ``weight_scale_inv``); returns each projection's dequantized ``[E, N, K]``."""
    tensors, ref = {}, {}
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    for proj, (n, k) in shapes.items():
        q = moerunner.quantize(torch.randn(E, n, k, generator=gen), "fp8_block")
        ref[proj] = q.dequantize()
        for e in range(E):
            key = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            tensors[f"{key}.weight"], tensors[f"{key}.weight_scale_inv"] = q.data[e], q.scale[e]
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return ref


def test_deepseek_fp8_reuses_the_importer(tmp_path):
    gen = torch.Generator().manual_seed(4)
    # fp8 blocks are 128 rows: gate and up meet at a block edge
    ref = write_deepseek_fp8(tmp_path, 3, 128, 64, gen)
    loaded = moerunner.load_experts(tmp_path, layer=3, family="deepseek_v3")
    assert loaded.format == "fp8_block"
    d13 = loaded.weights.w13.dequantize()
    assert torch.equal(d13, torch.cat([ref["gate_proj"], ref["up_proj"]], dim=1))
    assert torch.equal(loaded.weights.w2.dequantize(), ref["down_proj"])


# ---------------------------------------------------------------- integer formats via the loader


def _pack(values, bits, axis, order=None):
    from tests.quant.test_quant_checkpoints_integer import pack

    return pack(values, bits, axis, order)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_integer_checkpoints_load_and_run(fmt, tmp_path):
    rng = np.random.default_rng(7)
    group, tensors, expected = 16, {}, {}
    awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
    for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        q = rng.integers(0, 16, (E, n, k))
        z = rng.integers(1, 16, (E, n, k // group))
        s = rng.uniform(0.01, 0.1, (E, n, k // group)).astype(np.float16)
        expected[proj] = (q - np.repeat(z, group, -1)) * np.repeat(s.astype(np.float64), group, -1)
        for e in range(E):
            key = f"model.layers.0.mlp.experts.{e}.{proj}."
            if fmt == "compressed-tensors":
                tensors[key + "weight_packed"] = _pack(q[e], 4, 1)
                tensors[key + "weight_zero_point"] = _pack(z[e], 4, 0)
                tensors[key + "weight_scale"] = torch.from_numpy(s[e])
                tensors[key + "weight_shape"] = torch.tensor([n, k])
            elif fmt == "gptq":
                tensors[key + "qweight"] = _pack(q[e].T, 4, 0)
                tensors[key + "qzeros"] = _pack(z[e].T - 1, 4, 1)
                tensors[key + "scales"] = torch.from_numpy(np.ascontiguousarray(s[e].T))
                tensors[key + "g_idx"] = torch.arange(k, dtype=torch.int32) // group
            else:
                tensors[key + "qweight"] = _pack(q[e].T, 4, 1, awq_order)
                tensors[key + "qzeros"] = _pack(z[e].T, 4, 1, awq_order)
                tensors[key + "scales"] = torch.from_numpy(np.ascontiguousarray(s[e].T))
    save_file(tensors, tmp_path / "model.safetensors")
    method = {"compressed-tensors": "compressed-tensors", "gptq": "gptq", "awq": "awq"}[fmt]
    config = {"model_type": "qwen3_moe", "quantization_config": {"quant_method": method}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = moerunner.load_experts(tmp_path, layer=0)
    assert loaded.format == fmt and loaded.weights.w13.scheme.name == f"int4_g{group}_zp"
    w13 = np.concatenate([expected["gate_proj"], expected["up_proj"]], axis=1)
    assert torch.equal(loaded.weights.w13.dequantize().double(), torch.from_numpy(w13))
    assert torch.equal(
        loaded.weights.w2.dequantize().double(), torch.from_numpy(expected["down_proj"])
    )
    x = torch.randn(5, H)
    topk = moerunner.select_experts(torch.randn(5, E), 2)
    out = moerunner.fused_moe(x, loaded.weights.w13, loaded.weights.w2, topk.weights, topk.ids)
    ref = moerunner.reference_moe(x, loaded.weights, topk.weights, topk.ids)
    assert_close(out, ref, FP32_BOUND)


# ---------------------------------------------------------------- errors


def test_missing_expert_names_the_key_and_file(tmp_path):
    tensors, *_ = mixtral_tensors()
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = {"model_type": "mixtral", "num_local_experts": E, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        moerunner.MoeInputError,
        match=r"'model\.layers\.0\.block_sparse_moe\.experts\.2\.w3\.weight' not found in "
        r".*model\.safetensors",
    ):
        moerunner.load_experts(tmp_path, layer=0)


def test_more_experts_than_the_config_says(tmp_path):
    tensors, *_ = mixtral_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = {"model_type": "mixtral", "num_local_experts": E - 1, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moerunner.MoeInputError, match=f"also holds expert {E - 1}"):
        moerunner.load_experts(tmp_path, layer=0)


def test_index_pointing_at_a_missing_shard(tmp_path):
    tensors, *_ = mixtral_tensors()
    write_sharded(tmp_path, tensors, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(moerunner.MoeInputError, match=r"model-00002-of-00002.*does not exist"):
        moerunner.load_experts(tmp_path, layer=0, family="mixtral")


def test_errors_name_what_is_accepted(tmp_path):
    tensors, *_ = mixtral_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(moerunner.MoeInputError, match="unknown MoE family 'llama'.*mixtral"):
        moerunner.load_experts(tmp_path, layer=0, family="llama")
    with pytest.raises(moerunner.MoeInputError, match="no config.json with a model_type"):
        moerunner.load_experts(tmp_path, layer=0)
    with pytest.raises(moerunner.MoeInputError, match=r"layer=5 is out of range.*layers 0\.\.0"):
        moerunner.load_experts(tmp_path, layer=5, family="mixtral")
    with pytest.raises(TypeError, match="layer must be an int"):
        moerunner.load_experts(tmp_path, layer="0", family="mixtral")
    with pytest.raises(moerunner.MoeInputError, match="does not exist"):
        moerunner.load_experts(tmp_path / "nope", layer=0, family="mixtral")
    with pytest.raises(TypeError, match="dtype must be"):
        moerunner.load_experts(tmp_path, layer=0, family="mixtral", dtype=torch.int8)
    assert set(FAMILIES) >= {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"}


def test_wrong_shapes_are_named(tmp_path):
    tensors, *_ = mixtral_tensors()
    tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"] = torch.zeros(H, I + 2)
    save_file(tensors, tmp_path / "a.safetensors")
    with pytest.raises(
        moerunner.MoeInputError, match=r"w2\.weight dtypes/shapes differ.*experts\.1\.w2\.weight is"
    ):
        moerunner.load_experts(tmp_path / "a.safetensors", layer=0, family="mixtral")
    tensors, *_ = mixtral_tensors()
    for e in range(E):
        tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"] = torch.zeros(H, I + 2)
    save_file(tensors, tmp_path / "b.safetensors")
    with pytest.raises(moerunner.MoeInputError, match="do not fit together"):
        moerunner.load_experts(tmp_path / "b.safetensors", layer=0, family="mixtral")


# ---------------------------------------------------------------- regressions (new-user probe)


def _qwen_tensors(num, gen, i=I, h=H):
    tensors = {}
    for e in range(num):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(
                shape, generator=gen
            )
    return tensors


def test_qwen_expert_count_under_transformers_5_name(tmp_path):
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts: a checkpoint
    missing its last expert loaded E - 1 experts silently (the count came from the files)."""
    gen = torch.Generator().manual_seed(7)
    save_file(_qwen_tensors(E - 1, gen), tmp_path / "model.safetensors")
    cfg = {"model_type": "qwen3_moe", "num_local_experts": E, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moerunner.MoeInputError, match=rf"experts\.{E - 1}\.gate_proj\.weight"):
        moerunner.load_experts(tmp_path, layer=0)


def _deepseek_v2_reference(logits, top_k, n_group, topk_group, scale, renormalize):
    """DeepSeek-V2's router in float64 (its own code: group-limited greedy ranks groups by
    their best softmax score; renormalise or scale, never both)."""
    scores = logits.double().softmax(-1)
    t, e = scores.shape
    if n_group:
        best = scores.view(t, n_group, e // n_group).max(-1).values
        keep = best.topk(topk_group, -1).indices
        mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, keep, True)
        scores = scores.masked_fill(~mask.repeat_interleave(e // n_group, 1), 0.0)
    weights, ids = scores.topk(top_k, -1)
    if renormalize:
        return weights / weights.sum(-1, keepdim=True), ids
    return weights * scale, ids


@pytest.mark.parametrize(
    "topk_method, norm", [("greedy", True), ("greedy", False), ("group_limited_greedy", False)]
)
def test_deepseek_v2_routing_follows_its_own_code(tmp_path, topk_method, norm):
    """norm_topk_prob with a scaling factor was loaded as both (renormalise, then scale:
    weights off by the factor); group-limited greedy came back as no routing at all."""
    gen = torch.Generator().manual_seed(8)
    e, k, groups, keep, scale = 8, 2, 4, 2, 16.0
    save_file(_qwen_tensors(e, gen), tmp_path / "model.safetensors")
    cfg = {
        "model_type": "deepseek_v2",
        "n_routed_experts": e,
        "num_experts_per_tok": k,
        "topk_method": topk_method,
        "norm_topk_prob": norm,
        "routed_scaling_factor": scale,
        "n_group": groups,
        "topk_group": keep,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    routing = moerunner.load_experts(tmp_path, layer=0).routing
    logits = torch.randn(64, e, generator=gen)
    grouped = topk_method == "group_limited_greedy"
    got = moerunner.select_experts(
        logits,
        k,
        scoring_func=routing.scoring_func,
        renormalize=routing.renormalize,
        num_expert_group=routing.num_expert_group,
        topk_group=routing.topk_group,
        routed_scaling_factor=routing.routed_scaling_factor,
        group_score=routing.group_score,
    )
    weights, ids = _deepseek_v2_reference(logits, k, groups if grouped else None, keep, scale, norm)
    order = got.ids.long().argsort(-1)
    assert torch.equal(got.ids.long().gather(1, order), ids.sort(-1).values)
    ref = weights.gather(1, ids.argsort(-1))
    torch.testing.assert_close(got.weights.double().gather(1, order), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("inter", [64, 192])
def test_fp8_block_experts_with_i_off_the_block_grid_load_padded(tmp_path, inter):
    """I not a multiple of the 128-row scale blocks: gate and up could not be stacked
    (ValueError from inside); now zero-padded to whole blocks, which is exact."""
    gen = torch.Generator().manual_seed(9)
    h, padded = 256, -(-inter // 128) * 128
    ref = write_deepseek_fp8(tmp_path, 0, inter, h, gen)
    loaded = moerunner.load_experts(tmp_path, layer=0, family="deepseek_v3")
    w13, w2 = loaded.weights.w13.dequantize(), loaded.weights.w2.dequantize()
    assert w13.shape == (E, 2 * padded, h) and w2.shape == (E, h, padded)
    assert torch.equal(w13[:, :inter], ref["gate_proj"])
    assert torch.equal(w13[:, padded : padded + inter], ref["up_proj"])
    assert torch.equal(w2[:, :, :inter], ref["down_proj"])
    assert not w13[:, inter:padded].any() and not w13[:, padded + inter :].any()
    assert not w2[:, :, inter:].any()


def test_nvfp4_gate_and_up_with_different_global_scales(tmp_path):
    from tests.quant.test_quant_checkpoints import modelopt_expert

    gen = torch.Generator().manual_seed(10)
    tensors = {}
    for e in range(2):
        for proj, (n, k, gs) in {
            "gate_proj": (32, 64, 0.5),
            "up_proj": (32, 64, 0.25),  # not the gate's
            "down_proj": (64, 32, 0.5),
        }.items():
            parts, _ = modelopt_expert(n, k, gs, gen)
            for name, t in parts.items():
                tensors[f"model.layers.0.mlp.experts.{e}.{proj}.{name}"] = t
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(moerunner.MoeInputError, match="weight_scale_2.*rescale=True"):
        moerunner.load_experts(tmp_path, layer=0, family="qwen3_moe")
    loaded = moerunner.load_experts(tmp_path, layer=0, family="qwen3_moe", rescale=True)
    assert loaded.format == "nvfp4" and loaded.weights.w13.shape == (2, 64, 64)


def test_config_and_argument_errors_are_named(tmp_path):
    tensors, *_ = mixtral_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(moerunner.MoeInputError, match="config.json.*JSON list, not an object"):
        moerunner.load_experts(tmp_path, layer=0, family="mixtral")
    (tmp_path / "config.json").write_text("{bad json")
    with pytest.raises(moerunner.MoeInputError, match="config.json.*not valid JSON"):
        moerunner.load_experts(tmp_path, layer=0, family="mixtral")
    cfg = {"model_type": "mixtral", "num_local_experts": E, "num_experts_per_tok": E + 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moerunner.MoeInputError, match=rf"num_experts_per_tok={E + 1}"):
        moerunner.load_experts(tmp_path, layer=0)
    with pytest.raises(TypeError, match="rescale must be a bool"):
        moerunner.load_experts(tmp_path, layer=0, rescale="yes")
    if not torch.cuda.is_available():
        with pytest.raises(moerunner.MoeInputError, match="sees no CUDA device"):
            moerunner.load_experts(tmp_path, layer=0, device="cuda")


def test_e5m2_weights_and_a_lone_gpt_oss_bias_are_named(tmp_path):
    tensors, *_ = mixtral_tensors()
    tensors = {k: v.to(torch.float8_e5m2) for k, v in tensors.items()}
    save_file(tensors, tmp_path / "e5m2.safetensors")
    with pytest.raises(moerunner.MoeInputError, match=r"experts\.0\.w1\.weight has dtype"):
        moerunner.load_experts(tmp_path / "e5m2.safetensors", layer=0, family="mixtral")
    prefix = "model.layers.0.mlp.experts."
    gate_up, down = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    lone = {
        prefix + "gate_up_proj": gate_up,
        prefix + "down_proj": down,
        prefix + "gate_up_proj_bias": torch.randn(E, 2 * I),
    }
    save_file(lone, tmp_path / "oss.safetensors")
    with pytest.raises(moerunner.MoeInputError, match="down_proj_bias' not found"):
        moerunner.load_experts(tmp_path / "oss.safetensors", layer=0, family="gpt_oss")


# ---------------------------------------------------------------- regressions (loader probe)


def _write(folder, tensors, config=None, name="model.safetensors"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / name)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _fp8_tensors(shapes, gen, num=E):
    """DeepSeek-V3 fp8 tensors ``{proj: (N, K)}`` of ``num`` experts under layer 0."""
    tensors = {}
    for proj, (n, k) in shapes.items():
        q = moerunner.quantize(torch.randn(num, n, k, generator=gen), "fp8_block")
        for e in range(num):
            key = f"model.layers.0.mlp.experts.{e}.{proj}"
            tensors[f"{key}.weight"], tensors[f"{key}.weight_scale_inv"] = q.data[e], q.scale[e]
    return tensors


def test_gate_and_up_of_different_row_counts_are_refused(tmp_path):
    """Was loaded: only w13's row count (gate + up) was checked against 2I, so gate's surplus
    rows became up rows (plain and fp8). Now both keys are named with their shapes."""
    tensors, *_ = mixtral_tensors()
    prefix = "model.layers.0.block_sparse_moe.experts."
    for e in range(E):
        tensors[f"{prefix}{e}.w1.weight"] = torch.randn(I + 8, H)
        tensors[f"{prefix}{e}.w3.weight"] = torch.randn(I - 8, H)
    _write(tmp_path, tensors)
    with pytest.raises(
        moerunner.MoeInputError,
        match=rf"gate and up .*differ in shape: {prefix}0\.w1\.weight holds \[out, in\] = "
        rf"\[{I + 8}, {H}\] per expert, {prefix}0\.w3\.weight holds \[{I - 8}, {H}\]",
    ):
        moerunner.load_experts(tmp_path, layer=0, family="mixtral")
    gen = torch.Generator().manual_seed(20)
    fp8 = {"gate_proj": (384, 128), "up_proj": (128, 128), "down_proj": (128, 256)}
    _write(tmp_path, _fp8_tensors(fp8, gen, 2), name="fp8.safetensors")
    with pytest.raises(
        moerunner.MoeInputError,
        match=r"gate_proj\.weight holds \[out, in\] = \[384, 128\] per expert, "
        r".*up_proj\.weight holds \[128, 128\]",
    ):
        moerunner.load_experts(tmp_path / "fp8.safetensors", layer=0, family="deepseek_v3")


def _plain_qwen(over=None, num=E):
    tensors = _qwen_tensors(num, torch.Generator().manual_seed(21))
    tensors.update(over or {})
    return tensors


QWEN = "model.layers.0.mlp.experts."
MALFORMED = {  # the checkpoint, the message expected
    "up_proj [I, H + 1]": (
        lambda: _plain_qwen({f"{QWEN}{e}.up_proj.weight": torch.randn(I, H + 1) for e in range(E)}),
        rf"gate and up .*{QWEN}0\.gate_proj\.weight holds \[out, in\] = \[{I}, {H}\] .*"
        rf"{QWEN}0\.up_proj\.weight holds \[{I}, {H + 1}\]; both must be \[I, H\]",
    ),
    "gate_proj 3-D [1, I, H]": (
        lambda: _plain_qwen(
            {f"{QWEN}{e}.gate_proj.weight": torch.randn(1, I, H) for e in range(E)}
        ),
        rf"{QWEN}0\.gate_proj\.weight has shape \[1, {I}, {H}\]; a per-expert weight must be a "
        r"2-D \[out, in\] matrix",
    ),
    "down_proj 1-D": (
        lambda: _plain_qwen({f"{QWEN}{e}.down_proj.weight": torch.randn(H * I) for e in range(E)}),
        rf"{QWEN}0\.down_proj\.weight has shape \[{H * I}\]; a per-expert weight must be a 2-D",
    ),
    "expert 0's gate bf16, the others fp8": (
        lambda: {
            **_fp8_tensors(
                {"gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)},
                torch.Generator().manual_seed(22),
            ),
            f"{QWEN}0.gate_proj.weight": torch.randn(128, 64).bfloat16(),
        },
        rf"{QWEN}1\.gate_proj\.weight is torch\.float8_e4m3fn \[128, 64\], "
        rf"{QWEN}0\.gate_proj\.weight is torch\.bfloat16 \[128, 64\]",
    ),
    "expert 2's down bf16, the others fp8": (
        lambda: {
            **_fp8_tensors(
                {"gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)},
                torch.Generator().manual_seed(23),
            ),
            f"{QWEN}2.down_proj.weight": torch.randn(64, 128).bfloat16(),
        },
        rf"{QWEN}2\.down_proj\.weight is torch\.bfloat16 \[64, 128\], "
        rf"{QWEN}0\.down_proj\.weight is torch\.float8_e4m3fn \[64, 128\]",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_expert_tensors_are_named(case, tmp_path):
    """Were RuntimeErrors from inside torch.cat / torch.stack (or a bare unpacking
    ValueError), naming no key."""
    build, match = MALFORMED[case]
    _write(tmp_path, build(), {"model_type": "qwen3_moe", "num_experts": E})
    with pytest.raises(moerunner.MoeInputError, match=match):
        moerunner.load_experts(tmp_path, layer=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_truncated_file_is_named(sharded, tmp_path):
    """Was safetensors' own SafetensorError (not a ValueError), naming no file."""
    from safetensors import SafetensorError

    tensors, *_ = mixtral_tensors()
    if sharded:
        write_sharded(tmp_path, tensors, shards=2)
        file = tmp_path / "model-00002-of-00002.safetensors"
    else:
        file = _write(tmp_path, tensors) / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(
        moerunner.MoeInputError, match=rf"{file.name}' cannot be read as a safetensors file"
    ) as caught:
        moerunner.load_experts(tmp_path, layer=0, family="mixtral")
    assert isinstance(caught.value.__cause__, SafetensorError)


def test_importer_errors_name_the_keys(tmp_path):
    """Were the importer's messages alone ("weight_scale_inv: per-expert tensors differ in
    dtype/shape: [...]"), not saying which projection or expert."""
    gen = torch.Generator().manual_seed(24)
    shapes = {"gate_proj": (256, 256), "up_proj": (256, 256), "down_proj": (256, 256)}
    tensors = _fp8_tensors(shapes, gen)
    tensors[f"{QWEN}2.down_proj.weight_scale_inv"] = torch.full((2, 1), 1e-2)
    _write(tmp_path, tensors, name="one.safetensors")
    with pytest.raises(
        moerunner.MoeInputError,
        match=rf"{QWEN}2\.down_proj\.weight_scale_inv is torch\.float32 \[2, 1\], "
        rf"{QWEN}0\.down_proj\.weight_scale_inv is torch\.float32 \[2, 2\]",
    ):
        moerunner.load_experts(tmp_path / "one.safetensors", layer=0, family="deepseek_v3")
    for e in range(E):  # every expert alike, but not the weight's grid: the importer refuses
        tensors[f"{QWEN}{e}.down_proj.weight_scale_inv"] = torch.full((2, 1), 1e-2)
    _write(tmp_path, tensors, name="all.safetensors")
    with pytest.raises(
        moerunner.MoeInputError,
        match=rf"{QWEN}\{{0\.\.{E - 1}\}}\.down_proj\.\*: weight_scale_inv: expected fp32",
    ):
        moerunner.load_experts(tmp_path / "all.safetensors", layer=0, family="deepseek_v3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_half_precision_block_scales_load_exactly(dtype, tmp_path):
    """Were refused (weight_scale_inv must be fp32), though upcasting them is exact. The
    reference: e4m3 * scale in float64 (exact in float32 too: 4 + 11 significant bits)."""
    gen = torch.Generator().manual_seed(25)
    inter, hidden = 128, 192  # K = 192: a partial 128-column block
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    tensors = _fp8_tensors(shapes, gen)
    for key in [k for k in tensors if k.endswith("weight_scale_inv")]:
        tensors[key] = (torch.rand(tensors[key].shape, generator=gen) * 0.05 + 1e-3).to(dtype)
    _write(tmp_path, tensors)
    loaded = moerunner.load_experts(tmp_path, layer=0, family="deepseek_v3")

    def reference(proj):
        w = torch.stack([tensors[f"{QWEN}{e}.{proj}.weight"] for e in range(E)]).double()
        s = torch.stack([tensors[f"{QWEN}{e}.{proj}.weight_scale_inv"] for e in range(E)])
        n, k = w.shape[1:]
        return w * s.double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[..., :k]

    w13 = torch.cat([reference("gate_proj"), reference("up_proj")], dim=1)
    assert loaded.format == "fp8_block" and loaded.weights.w13.scale.dtype == torch.float32
    assert torch.equal(loaded.weights.w13.dequantize().double(), w13)
    assert torch.equal(loaded.weights.w2.dequantize().double(), reference("down_proj"))


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
def test_gpt_oss_expert_count_is_checked_against_the_config(fmt, tmp_path):
    """Was: 3 experts stored, num_local_experts 5, loaded as 3 silently (the per-expert
    families refuse this)."""
    held, prefix = 3, "model.layers.0.mlp.experts."
    if fmt == "plain":
        tensors = {
            prefix + "gate_up_proj": torch.randn(held, H, 2 * I),
            prefix + "down_proj": torch.randn(held, I, H),
        }
        key, shape = "gate_up_proj", [held, H, 2 * I]
    else:
        q13 = moerunner.quantize(torch.randn(held, 2 * I, H), "mxfp4")
        q2 = moerunner.quantize(torch.randn(held, H, I), "mxfp4")
        tensors = {
            prefix + "gate_up_proj_blocks": q13.data.reshape(held, 2 * I, H // 32, 16),
            prefix + "gate_up_proj_scales": q13.scale,
            prefix + "down_proj_blocks": q2.data.reshape(held, H, I // 32, 16),
            prefix + "down_proj_scales": q2.scale,
        }
        key, shape = "gate_up_proj_blocks", [held, 2 * I, H // 32, 16]
    for counted in (held + 2, held - 1):
        _write(tmp_path, tensors, {"model_type": "gpt_oss", "num_local_experts": counted})
        with pytest.raises(
            moerunner.MoeInputError,
            match=rf"num_local_experts={counted}, but {prefix}{key} has shape "
            + re.escape(str(shape)),
        ):
            moerunner.load_experts(tmp_path, layer=0)
    _write(tmp_path, tensors, {"model_type": "gpt_oss", "num_local_experts": held})
    assert moerunner.load_experts(tmp_path, layer=0).num_experts == held


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's slot order of a word's 8 columns


def _awq_tensors(group, hidden=192, inter=96, seed=26):
    """AWQ (GEMM) tensors of E experts packed by AutoAWQ's rules with ceil(K / group) groups,
    and each projection's float64 value [E, N, K] (row k in group k // group)."""
    rng = np.random.default_rng(seed)
    tensors, expected = {}, {}
    for proj, (n, k) in (
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ):
        groups = -(-k // group)
        q, z = rng.integers(0, 16, (E, k, n)), rng.integers(0, 16, (E, groups, n))
        s = rng.uniform(0.01, 0.1, (E, groups, n)).astype(np.float16)
        rows = np.arange(k) // group
        expected[proj] = np.swapaxes((q - z[:, rows]) * s.astype(np.float64)[:, rows], 1, 2)
        for e in range(E):
            key = f"{QWEN}{e}.{proj}."
            tensors[key + "qweight"] = _pack(q[e], 4, 1, AWQ_ORDER)
            tensors[key + "qzeros"] = _pack(z[e], 4, 1, AWQ_ORDER)
            tensors[key + "scales"] = torch.from_numpy(s[e])
    return tensors, expected


@pytest.mark.parametrize("where", ["config.json", "quant_config.json"])
def test_awq_group_size_comes_from_the_config(where, tmp_path):
    """Was ignored: K = 192 with group_size 128 (two groups, the second one ragged) loaded as
    int4_g96, rows 96..127 in the wrong group; docs/quantization.md said it was refused."""

    def write(group, stated):
        tensors, expected = _awq_tensors(group)
        quant = {"quant_method": "awq", "bits": 4, "group_size": stated}
        if where == "quant_config.json":  # AutoAWQ's older export
            quant = {"zero_point": True, "q_group_size": stated, "w_bit": 4, "version": "GEMM"}
            (tmp_path / where).write_text(json.dumps(quant))
            config = {"model_type": "qwen3_moe", "num_experts": E}
        else:
            config = {"model_type": "qwen3_moe", "num_experts": E, "quantization_config": quant}
        _write(tmp_path, tensors, config)
        return expected

    write(128, 128)
    with pytest.raises(
        moerunner.MoeInputError,
        match=rf"{QWEN}\{{0\.\.{E - 1}\}}\.gate_proj\.\*: group size 128 does not divide K=192",
    ):
        moerunner.load_experts(tmp_path, layer=0)
    expected = write(96, 96)  # two whole groups of 96, stated: loads exactly
    loaded = moerunner.load_experts(tmp_path, layer=0)
    assert loaded.format == "awq" and loaded.weights.w13.scheme.name == "int4_g96_zp"
    w13 = np.concatenate([expected["gate_proj"], expected["up_proj"]], axis=1)
    assert torch.equal(loaded.weights.w13.dequantize().double(), torch.from_numpy(w13))
    assert torch.equal(
        loaded.weights.w2.dequantize().double(), torch.from_numpy(expected["down_proj"])
    )
    write(96, 64)  # the stated group size does not make the stored scales' group count
    with pytest.raises(moerunner.MoeInputError, match="group size 64 makes 3 groups of K=192"):
        moerunner.load_experts(tmp_path, layer=0)


def test_deepseek_v2_group_limited_routing_is_what_the_docs_say(tmp_path):
    """docs/checkpoints.md said top_k and routing were None for DeepSeek-V2's group-limited
    top-k; load_experts returns both. The docs' example is checked against it."""
    from pathlib import Path

    gen = torch.Generator().manual_seed(27)
    _write(
        tmp_path,
        _qwen_tensors(8, gen),
        {
            "model_type": "deepseek_v2",
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 16.0,
            "norm_topk_prob": False,
        },
    )
    loaded = moerunner.load_experts(tmp_path, layer=0)
    example = moerunner.RoutingConfig("softmax", False, 4, 2, 16.0, group_score="max")
    assert loaded.top_k == 2 and loaded.routing == example
    doc = (Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text()
    assert 'e.g. `RoutingConfig("softmax", False, 4, 2, 16.0, group_score="max")`' in doc
    assert "or for DeepSeek-V2's group-limited top-k" not in doc


@pytest.mark.parametrize(
    ("family", "fields", "match"),
    [
        ("deepseek_v3", {"n_group": "1", "topk_group": 1}, "n_group must be an int, got '1'"),
        ("deepseek_v3", {"routed_scaling_factor": "2.5x"}, "routed_scaling_factor must be a num"),
        ("deepseek_v3", {"routed_scaling_factor": [2.5]}, "routed_scaling_factor must be a num"),
        ("deepseek_v3", {"routed_scaling_factor": 0}, "routed_scaling_factor must be finite and"),
        ("deepseek_v3", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ("qwen3_moe", {"num_experts_per_tok": True}, "num_experts_per_tok must be an int, got T"),
        ("qwen3_moe", {"num_experts_per_tok": 2.0}, "num_experts_per_tok must be an int, got 2"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method must be 'greedy' or 'group_"),
        ("deepseek_v2", {"topk_method": "group_limited_greedy"}, "needs n_group and topk_group"),
    ],
)
def test_config_fields_of_the_wrong_type_or_value_are_named(family, fields, match, tmp_path):
    """config.json's routing fields were read unchecked: a string n_group or scaling factor
    raised Python's own comparison / conversion errors, a factor 0 became 1, top_k true was
    taken as 1, an unknown DeepSeek-V2 topk_method as greedy, and group-limited greedy
    without groups ran ungrouped."""
    gen = torch.Generator().manual_seed(9)
    save_file(_qwen_tensors(4, gen), tmp_path / "model.safetensors")
    count = "num_experts" if family == "qwen3_moe" else "n_routed_experts"
    cfg = {"model_type": family, count: 4, "num_experts_per_tok": 2, **fields}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moerunner.MoeInputError, match=re.escape(match)):
        moerunner.load_experts(tmp_path, layer=0)


def test_a_device_this_torch_cannot_use_and_a_bad_index_entry_are_named(tmp_path):
    tensors, *_ = mixtral_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    for device in ("mps", "xpu", "hpu", "cuda:7" if torch.cuda.device_count() < 8 else "mps"):
        if device != "mps" or not torch.backends.mps.is_available():
            with pytest.raises(moerunner.MoeInputError, match=r"device="):
                moerunner.load_experts(tmp_path, layer=0, family="mixtral", device=device)
    index = {"weight_map": dict.fromkeys(tensors, 1)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(moerunner.MoeInputError, match=r"maps .* to 1, not a file name"):
        moerunner.load_experts(tmp_path / "model.safetensors.index.json", layer=0, family="mixtral")
