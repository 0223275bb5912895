"""A quantized MoE layer saves and loads through state_dict (torch.save and safetensors)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import moerunner

CFG = moerunner.MoeConfig(
    num_experts=4,
    hidden_size=64,
    intermediate_size=32,
    top_k=2,
    bias=True,
    routing=moerunner.RoutingConfig(renormalize=True),
)
SCHEMES = ["fp8_channel", "fp8_block", "mxfp4", "nvfp4", "int8", "int4_g32_zp", "int8_g32_zp"]


def layer(seed: int, scheme: str | None = None, **kw) -> moerunner.MoE:
    torch.manual_seed(seed)
    m = moerunner.MoE(CFG, backend="torch")
    with torch.no_grad():
        m.w13_bias.normal_()
        m.w2_bias.normal_()
    return m if scheme is None else m.quantize_(scheme, **kw)


def outputs(m: moerunner.MoE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, CFG.hidden_size, generator=gen)
    logits = torch.randn(7, CFG.num_experts, generator=gen)
    return m(x, logits)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("via", ["torch.save", "safetensors"])
def test_round_trip_is_bit_identical(scheme, via, tmp_path):
    source = layer(0, scheme)
    assert source.w13 is None and source.w2 is None  # float weights freed
    state = source.state_dict()
    assert "w13" not in state and "w2" not in state
    assert {"w13_qdata", "w13_scale", "w2_qdata", "w2_scale", "w13_scheme", "w13_bias"} <= set(
        state
    )
    if via == "torch.save":
        torch.save(state, tmp_path / "layer.pt")
        loaded = torch.load(tmp_path / "layer.pt", weights_only=True)
    else:
        save_file(state, tmp_path / "layer.safetensors")
        loaded = load_file(tmp_path / "layer.safetensors")
    target = layer(1, scheme)  # other random weights, same scheme
    assert not torch.equal(outputs(target), outputs(source))
    target.load_state_dict(loaded)
    assert torch.equal(outputs(target), outputs(source))
    for w in ("w13", "w2"):  # the runner's weights are the loaded buffers
        assert getattr(target.quantized, w).data is target.get_buffer(f"{w}_qdata")


def test_quantized_names_per_scheme():
    assert "w13_zero_point" in layer(0, "int4_g32_zp").state_dict()
    assert "w13_zero_point" not in layer(0, "mxfp4").state_dict()
    assert "w2_global_scale" in layer(0, "nvfp4").state_dict()


def test_keep_float_weights_keeps_the_float_state():
    m = layer(0, "fp8_channel", keep_float_weights=True)
    assert isinstance(m.w13, torch.nn.Parameter)
    assert set(m.state_dict()) == {"w13", "w2", "w13_bias", "w2_bias"}
    m.quantize_("mxfp4")  # the floats are still there to quantize from
    with pytest.raises(moerunner.MoeInputError, match="holds no float w13"):
        m.quantize_("fp8_channel")
    with pytest.raises(TypeError, match="keep_float_weights must be a bool"):
        layer(0).quantize_("fp8_channel", keep_float_weights=1)


def test_loading_into_a_float_layer_or_another_scheme_is_refused():
    state = layer(0, "int4_g32_zp").state_dict()
    with pytest.raises(moerunner.MoeInputError, match=r"quantized w13 \(scheme 'int4_g32_zp'\)"):
        layer(1).load_state_dict(state)
    with pytest.raises(moerunner.MoeInputError, match="scheme 'int4_g32_zp' but this layer's in"):
        layer(1, "int4_g32").load_state_dict(state)
    with pytest.raises(moerunner.MoeInputError, match="holds float w13"):
        layer(1, "int4_g32_zp").load_state_dict(layer(2).state_dict())


def test_a_loaded_bad_scale_is_refused():
    state = layer(0, "fp8_channel").state_dict()
    state["w2_scale"] = state["w2_scale"].clone()
    state["w2_scale"][1, 3] = float("nan")
    with pytest.raises(ValueError, match="scales must be finite"):
        layer(1, "fp8_channel").load_state_dict(state)


def test_dtype_and_device_moves_keep_the_quantized_formats():
    m = layer(0, "nvfp4").to(torch.float16)
    assert m.w13_bias.dtype == torch.float16
    assert m.get_buffer("w13_global_scale").dtype == torch.float32
    assert m.get_buffer("w13_scale").dtype == torch.float8_e4m3fn
    assert m.quantized.w13.scale is m.get_buffer("w13_scale")
    m = layer(0, "fp8_block").to("meta")
    assert m.quantized.w13.device.type == "meta"
    assert m.get_buffer("w13_scheme").device.type == "cpu"
