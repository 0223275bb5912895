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


def _held(m: moerunner.MoE) -> dict:
    """Every buffer by name: the tensor object and a copy of its values."""
    return {n: (t, t.clone()) for n, t in m.named_buffers()}


def _assert_unchanged(m: moerunner.MoE, held: dict, out: torch.Tensor) -> None:
    for name, (tensor, values) in held.items():
        now = m.get_buffer(name)
        assert now is tensor and torch.equal(now.view(torch.uint8), values.view(torch.uint8))
    for w in ("w13", "w2"):
        assert getattr(m.quantized, w).data is m.get_buffer(f"{w}_qdata")
    assert torch.equal(outputs(m), out)


WRONG_DTYPES = {  # scheme, key, a wrong tensor from the right one, expected dtype in the error
    "fp8 data as its uint8 bytes": ("fp8_block", "w13_qdata", lambda t: t.view(torch.uint8)),
    "e8m0 codes as the float scales they mean": (
        "mxfp4",
        "w13_scale",
        lambda t: torch.exp2(t.float() - 127),
    ),
    "fp32 scales rounded to bf16": ("fp8_channel", "w2_scale", lambda t: t.bfloat16()),
    "int4 zero points as int64": ("int4_g32_zp", "w13_zero_point", lambda t: t.long()),
    "a scale of another shape": ("fp8_channel", "w2_scale", lambda t: t[:, :-1].clone()),
}


@pytest.mark.parametrize("case", sorted(WRONG_DTYPES))
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("with_scheme", [True, False])
def test_a_tensor_of_another_dtype_or_shape_is_refused_by_key(case, assign, with_scheme):
    """Was: copy_ cast it silently (fp8 bytes read as values, e8m0 codes as floats: outputs
    off by ~1), assign=True replaced the buffer and failed later, a shape mismatch copied the
    other tensors first. Now refused before anything is copied or replaced."""
    scheme, key, wrong = WRONG_DTYPES[case]
    state = layer(0, scheme).state_dict()
    state[key] = wrong(state[key])
    if not with_scheme:  # the tensors are loaded all the same without the *_scheme entries
        del state["w13_scheme"], state["w2_scheme"]
    target = layer(1, scheme)
    held, out = _held(target), outputs(target)
    mine = target.get_buffer(key)
    match = (
        rf"{key} is {state[key].dtype} {list(state[key].shape)}, but scheme '{scheme}' holds it "
        rf"as {mine.dtype} {list(mine.shape)}".replace("[", r"\[").replace("]", r"\]")
    )
    with pytest.raises(moerunner.MoeInputError, match=match):
        target.load_state_dict(state, strict=with_scheme, assign=assign)
    _assert_unchanged(target, held, out)


@pytest.mark.parametrize("assign", [False, True])
def test_a_loaded_zero_point_outside_the_codes_is_refused(assign):
    """Was accepted: an int4 zero point of 200 (codes 0..15) shifted its group of weights."""
    state = layer(0, "int4_g32_zp").state_dict()
    state["w2_zero_point"] = state["w2_zero_point"].clone()
    state["w2_zero_point"][2, 5, 0] = 200
    target = layer(1, "int4_g32_zp")
    held, out = _held(target), outputs(target)
    with pytest.raises(
        moerunner.MoeInputError,
        match=r"w2_zero_point: zero points .* must lie in \[0, 15\].*got 200 at index \[2, 5, 0\]"
        r".*left as they were",
    ):
        target.load_state_dict(state, assign=assign)
    _assert_unchanged(target, held, out)
