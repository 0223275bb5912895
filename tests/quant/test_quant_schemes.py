# Scheme values: names resolve, repr round-trips, properties, invalid values are rejected.

import pytest

from moerunner.quant import ACTIVATION_FORMATS, SCHEME_NAMES, QuantScheme, get_scheme

REQUIRED = [
    "bf16", "fp16", "fp32", "fp8_tensor", "fp8_channel", "fp8_block", "mxfp8", "mxfp4",
    "mxfp4_mxfp8", "nvfp4", "nvfp4_a4", "int8", "int8_w8a16", "int4", "int4_g32", "int4_g64",
    "int4_zp",
]  # fmt: skip


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_repr_round_trips_through_eval(name):
    scheme = get_scheme(name)
    assert eval(repr(scheme), {"QuantScheme": QuantScheme}) == scheme
    assert get_scheme(scheme) is scheme
    assert scheme.activation_format in ACTIVATION_FORMATS


def test_required_names_and_their_properties():
    assert set(REQUIRED) <= set(SCHEME_NAMES)
    act = {n: get_scheme(n).activation_format for n in REQUIRED}
    assert act["fp8_tensor"] == act["fp8_channel"] == "fp8_token"
    assert act["fp8_block"] == "fp8_group128" and act["mxfp8"] == act["mxfp4_mxfp8"] == "mxfp8"
    assert act["nvfp4_a4"] == "nvfp4" and act["int8"] == "int8_token"
    for weight_only in ("mxfp4", "nvfp4", "int8_w8a16", "int4", "bf16"):
        assert act[weight_only] == "none"
    assert not get_scheme("bf16").is_quantized and get_scheme("mxfp4").is_quantized
    int4 = get_scheme("int4")
    assert int4.group_size == 128 and not int4.zero_point and int4.packed
    assert get_scheme("int4_zp").zero_point and get_scheme("int4_g32").group_size == 32
    assert get_scheme("fp8_block").block_shape == (128, 128)
    assert get_scheme("nvfp4").has_global_scale and not get_scheme("mxfp4").has_global_scale


def test_parametrised_int4_names():
    s = get_scheme("int4_g256_zp")
    assert s.group_size == 256 and s.zero_point
    assert get_scheme(" FP8_Block ") == get_scheme("fp8_block")


def test_unknown_name_lists_accepted_names():
    with pytest.raises(ValueError, match=r"scheme: unknown quantization scheme 'int3'.*mxfp4"):
        get_scheme("int3")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int4_g33'"):
        get_scheme("int4_g33")
    with pytest.raises(TypeError, match="scheme must be a QuantScheme or a scheme name"):
        get_scheme(4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"weight_format": "e5m2"}, "weight_format"),
        ({"weight_format": "e4m3", "scale_format": "none"}, "scale_format='none'"),
        ({"weight_format": "int4", "scale_format": "fp32", "granularity": "group"}, "block_shape"),
        ({"weight_format": "bf16", "zero_point": True}, "zero_point"),
        ({"weight_format": "bf16", "activation_scales": "static"}, "activation_scales"),
        ({"weight_format": "bf16", "activation_format": "fp4"}, "activation_format"),
    ],
)
def test_invalid_scheme_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuantScheme(name="x", **kwargs)
