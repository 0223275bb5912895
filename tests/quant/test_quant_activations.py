# Activation quantization per scheme: hand vectors, static scales, empty batches, agreement
# with the weight codecs (one rule per format), and argument errors.

import pytest
import torch

from moerunner.quant import (
    SCHEME_NAMES,
    QuantizedActivation,
    codecs,
    dequantize_activation,
    fake_quantize_activation,
    get_scheme,
    quantize,
    quantize_activation,
)


def test_fp8_token_dynamic_scale_and_zero_rows():
    x = torch.zeros(3, 8)
    x[0, :3] = torch.tensor([896.0, 17.0 * 2, -2.0])  # amax 896 -> scale 2; 34 / 2 = 17 -> 16
    x[2, 0] = -4.48
    qa = quantize_activation(x, "fp8_tensor")
    assert qa.scale.tolist() == [2.0, 1.0, pytest.approx(0.01)]
    assert qa.data.float()[0, :3].tolist() == [448.0, 16.0, -1.0]
    assert qa.data.float()[1].abs().sum() == 0  # all-zero token: scale 1, zeros stored
    assert fake_quantize_activation(x, "fp8_channel")[0, :3].tolist() == [896.0, 32.0, -2.0]


def test_fp8_token_static_scale_saturates():
    x = torch.tensor([[1.0, 300.0, -1000.0, 0.0]])
    qa = quantize_activation(x, "fp8_tensor_static", input_scale=torch.tensor(0.5))
    assert qa.scale.tolist() == [0.5]
    assert qa.data.float().tolist() == [[2.0, 448.0, -448.0, 0.0]]  # 600 and -2000 saturate
    per_row = quantize_activation(
        torch.ones(2, 4), "fp8_tensor", input_scale=torch.tensor([1.0, 0.25])
    )
    assert per_row.data.float()[:, 0].tolist() == [1.0, 4.0]


def test_fp8_group128_partial_last_group():
    x = torch.ones(2, 200)
    x[0, 130] = 448.0 * 4  # second group of token 0 has amax 1792 -> scale 4
    qa = quantize_activation(x, "fp8_block")
    assert qa.scale.shape == (2, 2)
    one_over_448 = torch.tensor(1.0 / 448).item()  # amax 1 / 448, rounded to float32
    assert qa.scale[0].tolist() == [one_over_448, 4.0] and qa.scale[1, 1].item() == one_over_448
    torch.testing.assert_close(dequantize_activation(qa, "fp8_block"), x, rtol=2**-4, atol=0)


def test_mxfp8_activation_matches_weight_codec():
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.logspace(-3, 3, 96)
    qa = quantize_activation(x, "mxfp8")
    qw = quantize(x[None], "mxfp8")
    assert torch.equal(qa.scale, qw.scale[0])
    assert torch.equal(qa.data.view(torch.uint8), qw.data[0].view(torch.uint8))
    assert torch.equal(fake_quantize_activation(x, "mxfp4_mxfp8"), qw.dequantize()[0])


@pytest.mark.parametrize(
    ("act_scheme", "weight_scheme"),
    [("fp8_tensor", "fp8_channel"), ("int8", "int8"), ("nvfp4_a4", "nvfp4")],
)
def test_per_token_formats_match_weight_codecs(act_scheme, weight_scheme):
    # A token quantized per row is exactly a one-row weight of its own expert (per-channel
    # scale; for nvfp4 the dynamic global scale is per row too).
    torch.manual_seed(1)
    x = torch.randn(7, 64) * 3
    x[3] *= 100  # a loud token must not change how the others are quantized
    assert torch.equal(
        fake_quantize_activation(x, act_scheme),
        quantize(x[:, None, :], weight_scheme).dequantize()[:, 0],
    )


def test_int8_token_hand_vector():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5], [0.0, 0.0, 0.0, 0.0]])
    qa = quantize_activation(x, "int8")
    assert qa.scale.tolist() == [1.0, 1.0]
    assert qa.data.tolist() == [[127, 0, 2, -2], [0, 0, 0, 0]]  # ties to even
    static = quantize_activation(x, "int8_static", input_scale=0.5)
    assert static.data.tolist()[0] == [127, 1, 3, -5]


def test_nvfp4_activation_static_global_scale():
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 3.0, 1.5
    qa = quantize_activation(x, "nvfp4_a4_static", input_scale=torch.tensor(2.0**-4))
    # block scale = (3 / 6) / 2^-4 = 8 and (1.5 / 6) / 2^-4 = 4, elements 3 / (8 * 2^-4) = 6.
    assert qa.global_scale.tolist() == [2.0**-4, 2.0**-4]
    assert qa.scale.float()[:, 0].tolist() == [8.0, 4.0]
    assert codecs.unpack_nibbles(qa.data)[:, 0].tolist() == [7, 7]
    assert torch.equal(dequantize_activation(qa, "nvfp4_a4_static"), x)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "int4", "int8_w8a16", "bf16"])
def test_weight_only_schemes_pass_activations_through(name):
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    qa = quantize_activation(x, name)
    assert qa.data is x and qa.scale is None and qa.global_scale is None
    out = fake_quantize_activation(x, name)
    assert out.dtype == torch.float32 and torch.equal(out, x.float())


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_empty_batch_and_fake_equals_dequantized(name):
    kwargs = {"input_scale": 0.05} if "static" in name else {}
    empty = fake_quantize_activation(torch.zeros(0, 128), name, **kwargs)
    assert empty.shape == (0, 128) and empty.dtype == torch.float32
    x = torch.randn(4, 128)
    qa = quantize_activation(x, name, **kwargs)
    assert isinstance(qa, QuantizedActivation)
    if get_scheme(name).quantizes_activations:
        for t in (qa.scale,) + ((qa.global_scale,) if qa.global_scale is not None else ()):
            assert t.shape[0] == 4
    assert torch.equal(fake_quantize_activation(x, name, **kwargs), dequantize_activation(qa, name))


def test_activation_errors_name_the_argument():
    x = torch.randn(2, 48)
    with pytest.raises(
        ValueError, match="x: activation format 'mxfp8' needs K to be a multiple of 32"
    ):
        quantize_activation(x, "mxfp8")
    with pytest.raises(ValueError, match="input_scale: activation format 'fp8_group128'"):
        quantize_activation(x, "fp8_block", input_scale=1.0)
    with pytest.raises(ValueError, match="input_scale: scheme 'int8_static' uses static"):
        quantize_activation(x, "int8_static")
    with pytest.raises(ValueError, match=r"input_scale must be a scalar or have shape \[M\]"):
        quantize_activation(x, "fp8_tensor", input_scale=torch.ones(3))
    with pytest.raises(ValueError, match="input_scale must be finite and > 0"):
        quantize_activation(x, "fp8_tensor", input_scale=0.0)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        quantize_activation(torch.randn(2, 3, 32), "fp8_tensor")
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_activation(torch.ones(2, 32, dtype=torch.int64), "fp8_tensor")
