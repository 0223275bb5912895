# Checkpoint import: tensors written in each published layout with safetensors, read back.

import pytest
import torch
from safetensors.torch import save_file

from moerunner.quant import codecs, quantize
from moerunner.quant.checkpoints import (
    cat_rows,
    deepseek_fp8_experts_from_safetensors,
    gpt_oss_experts_from_safetensors,
    import_deepseek_fp8,
    import_gpt_oss_mxfp4,
    import_modelopt_nvfp4,
    modelopt_nvfp4_experts_from_safetensors,
)

PREFIX = "model.layers.0.mlp.experts."


def gpt_oss_layer(e=2, i=32, h=64):
    """Float weights in moerunner order (gate rows then up rows) and the checkpoint tensors."""
    torch.manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h)
    interleaved = torch.stack([gate_up[:, :i], gate_up[:, i:]], dim=2).reshape(e, 2 * i, h)
    down = torch.randn(e, h, i)
    q13, q2 = quantize(interleaved, "mxfp4"), quantize(down, "mxfp4")
    tensors = {
        PREFIX + "gate_up_proj_blocks": q13.data.reshape(e, 2 * i, h // 32, 16).contiguous(),
        PREFIX + "gate_up_proj_scales": q13.scale.contiguous(),
        PREFIX + "down_proj_blocks": q2.data.reshape(e, h, i // 32, 16).contiguous(),
        PREFIX + "down_proj_scales": q2.scale.contiguous(),
        PREFIX + "gate_up_proj_bias": torch.randn(e, 2 * i).bfloat16(),
        PREFIX + "down_proj_bias": torch.randn(e, h).bfloat16(),
    }
    return tensors, q13, q2


def test_gpt_oss_mxfp4_matches_transformers_decoding(tmp_path):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    tensors, q13, q2 = gpt_oss_layer()
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    layer = gpt_oss_experts_from_safetensors(path, PREFIX)
    assert layer["gate_up_interleaved"] and layer["w13"].shape == (2, 64, 64)
    for ours, proj in ((layer["w13"], "gate_up_proj"), (layer["w2"], "down_proj")):
        # transformers decodes to its [E, in, out] parameter: our [E, out, in] transposed.
        theirs = mxfp4.convert_moe_packed_tensors(
            tensors[PREFIX + proj + "_blocks"],
            tensors[PREFIX + proj + "_scales"],
            dtype=torch.float32,
        )
        assert torch.equal(ours.dequantize().transpose(1, 2), theirs)
    assert torch.equal(layer["w13"].dequantize(), q13.dequantize())
    assert layer["w13_bias"].dtype == torch.float32


def test_gpt_oss_deinterleave_gives_gate_then_up(tmp_path):
    tensors, q13, _ = gpt_oss_layer()
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    layer = gpt_oss_experts_from_safetensors(path, PREFIX, deinterleave=True)
    d, ref = layer["w13"].dequantize(), q13.dequantize()
    assert torch.equal(d[:, :32], ref[:, 0::2]) and torch.equal(d[:, 32:], ref[:, 1::2])
    bias = tensors[PREFIX + "gate_up_proj_bias"].float()
    assert torch.equal(layer["w13_bias"][:, :32], bias[:, 0::2])
    assert not layer["gate_up_interleaved"]


def test_gpt_oss_hand_byte_and_shape_errors():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x21  # low nibble (element 0) = 0.5, high nibble (element 1) = 1.0
    qw = import_gpt_oss_mxfp4(blocks, torch.tensor([[[128]]], dtype=torch.uint8))
    assert qw.dequantize()[0, 0, :3].tolist() == [1.0, 2.0, 0.0]  # times 2^(128 - 127)
    with pytest.raises(ValueError, match="blocks/scales"):
        import_gpt_oss_mxfp4(blocks, torch.zeros(1, 1, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scheme must be an MXFP4 scheme"):
        import_gpt_oss_mxfp4(blocks, torch.zeros(1, 1, 1, dtype=torch.uint8), scheme="nvfp4")


def test_deepseek_fp8_blocks(tmp_path):
    torch.manual_seed(1)
    e, i, h = 2, 256, 200  # H = 200: the last 128-column block is partial (ceil grid)
    tensors, ref = {}, {}
    for x in range(e):
        for proj, (n, k) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
            w = codecs.encode_e4m3(torch.randn(n, k) * 100)
            s = torch.rand((n + 127) // 128, (k + 127) // 128) + 0.5
            tensors[f"{PREFIX}{x}.{proj}.weight"] = w
            tensors[f"{PREFIX}{x}.{proj}.weight_scale_inv"] = s
            # independent dequantization: every element times its block's multiplier
            full = torch.empty(n, k)
            for r in range(n):
                for c0 in range(0, k, 128):
                    full[r, c0 : c0 + 128] = s[r // 128, c0 // 128]
            ref[x, proj] = w.float() * full
    path = tmp_path / "ds.safetensors"
    save_file(tensors, path)
    layer = deepseek_fp8_experts_from_safetensors([path], PREFIX, e)
    assert layer["w13"].scheme.name == "fp8_block" and layer["w13"].scale.shape == (e, 4, 2)
    for x in range(e):
        d13 = layer["w13"].dequantize()[x]
        assert torch.equal(d13[:i], ref[x, "gate_proj"]) and torch.equal(d13[i:], ref[x, "up_proj"])
        assert torch.equal(layer["w2"].dequantize()[x], ref[x, "down_proj"])
    with pytest.raises(ValueError, match="paths: tensor 'model.layers.0.mlp.experts.2.gate_proj"):
        deepseek_fp8_experts_from_safetensors(path, PREFIX, e + 1)


def test_readers_name_a_missing_or_damaged_file(tmp_path):
    """The importers' reader let FileNotFoundError and safetensors' own error (naming no
    file) through, where ``load_experts`` names the file."""
    from moerunner.errors import MoeInputError
    from moerunner.quant.checkpoints import load_prefixed

    missing = tmp_path / "nope.safetensors"
    with pytest.raises(MoeInputError, match="nope.safetensors' is not a file"):
        deepseek_fp8_experts_from_safetensors(missing, PREFIX, 2)
    damaged = tmp_path / "cut.safetensors"
    save_file({"x": torch.zeros(64)}, damaged)
    damaged.write_bytes(damaged.read_bytes()[:20])
    with pytest.raises(MoeInputError, match="cut.safetensors' cannot be read as a safetensors"):
        load_prefixed(damaged, "model.")


def test_deepseek_gate_up_not_block_aligned_is_rejected():
    w8 = codecs.encode_e4m3(torch.randn(1, 100, 128))
    with pytest.raises(ValueError, match="weight_scale_inv: expected fp32"):
        import_deepseek_fp8(w8, torch.ones(1, 1, 2))
    w = quantize(torch.randn(1, 100, 128), "fp8_block")
    with pytest.raises(ValueError, match="parts: scheme 'fp8_block' shares a scale per 128 rows"):
        cat_rows([w, w])


def modelopt_expert(n, k, global_scale, gen):
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    block = torch.randint(1, 64, (n, k // 16), generator=gen).float()
    block = block.to(torch.float8_e4m3fn).float()  # e4m3 values >= 1: halving them is exact
    return {
        "weight": codecs.pack_nibbles(codes),
        "weight_scale": block.to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(global_scale),
        "input_scale": torch.tensor(0.25),
    }, codecs.decode_e2m1(codes) * block.repeat_interleave(16, dim=1) * global_scale


def test_modelopt_nvfp4(tmp_path):
    gen = torch.Generator().manual_seed(2)
    e, i, h = 2, 32, 64
    tensors, ref = {}, {}
    for x in range(e):
        for proj, (n, k, gs) in {
            "gate_proj": (i, h, 2.0**-6),
            "up_proj": (i, h, 2.0**-7),  # differs from gate: joining needs rescale=True
            "down_proj": (h, i, 2.0**-5),
        }.items():
            t, ref[x, proj] = modelopt_expert(n, k, gs, gen)
            tensors.update({f"{PREFIX}{x}.{proj}.{key}": v for key, v in t.items()})
    path = tmp_path / "nvfp4.safetensors"
    save_file(tensors, path)
    with pytest.raises(ValueError, match="parts: per-expert global_scale differs"):
        modelopt_nvfp4_experts_from_safetensors(path, PREFIX, e)
    layer = modelopt_nvfp4_experts_from_safetensors(
        path, PREFIX, e, scheme="nvfp4_a4", rescale=True
    )
    w13, w2 = layer["w13"], layer["w2"]
    assert w13.global_scale.tolist() == [2.0**-6] * e and w13.input_scale.tolist() == [0.25] * e
    for x in range(e):
        # the up part's e4m3 block scales are halved exactly, so the rescale is lossless here
        expect = torch.cat([ref[x, "gate_proj"], ref[x, "up_proj"]])
        assert torch.equal(w13.dequantize()[x], expect)
        assert torch.equal(w2.dequantize()[x], ref[x, "down_proj"])
    w16 = modelopt_nvfp4_experts_from_safetensors(path, PREFIX, e, rescale=True)["w2"]
    assert w16.input_scale is None and w16.scheme.name == "nvfp4"


def test_modelopt_inconsistent_tensors():
    gen = torch.Generator().manual_seed(3)
    t, _ = modelopt_expert(16, 64, 1.0, gen)
    with pytest.raises(ValueError, match=r"weight_scale: expected e4m3 \[N, K/16\]"):
        import_modelopt_nvfp4([t["weight"]], [t["weight_scale"][:, :2]], [t["weight_scale_2"]])
    with pytest.raises(ValueError, match="weight_scale must have dtype torch.float8_e4m3fn"):
        import_modelopt_nvfp4([t["weight"]], [t["weight_scale"].float()], [t["weight_scale_2"]])
    with pytest.raises(ValueError, match="weight: per-expert tensors differ"):
        import_modelopt_nvfp4([t["weight"], t["weight"][:8]], [t["weight_scale"]] * 2, [1.0] * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deepseek_fp8_half_precision_scales_are_upcast_exactly(dtype):
    # Was refused ("weight_scale_inv must have dtype torch.float32"), though the upcast is
    # exact and the integer importers take fp16 / bf16 scales. e4m3 (4 significant bits)
    # times a bf16 / fp16 scale (8 / 11) fits float32's 24: the float64 product is exact.
    gen = torch.Generator().manual_seed(6)
    e, n, k = 2, 200, 300  # partial last blocks both ways
    w8 = codecs.encode_e4m3(torch.randn(e, n, k, generator=gen))
    s = (torch.rand(e, 2, 3, generator=gen) * 0.05 + 1e-3).to(dtype)
    qw = import_deepseek_fp8(list(w8), list(s))
    full = s.double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    assert qw.scale.dtype == torch.float32
    assert torch.equal(qw.dequantize().double(), w8.double() * full)
    with pytest.raises(ValueError, match=r"weight_scale_inv must have dtype torch\.float32, "):
        import_deepseek_fp8(w8, torch.ones(e, 2, 3, dtype=torch.int32))


def test_per_expert_lists_name_the_first_expert_that_differs():
    # Was: the set of (dtype, shape) pairs, without saying which expert is off.
    w = quantize(torch.randn(3, 128, 128), "fp8_block")
    scales = [w.scale[0], w.scale[1], w.scale[2].bfloat16()]
    with pytest.raises(
        ValueError,
        match=r"weight_scale_inv: per-expert tensors differ in dtype/shape: "
        r"weight_scale_inv\[2\] is torch\.bfloat16 \[1, 1\], weight_scale_inv\[0\] is "
        r"torch\.float32 \[1, 1\]",
    ):
        import_deepseek_fp8(list(w.data), scales)
