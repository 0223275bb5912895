"""A transformers model quantized by ``quantize_experts`` saves and loads its quantized experts.

The round trip is checked for bit-identical logits: a fresh model of the same config (other
random weights) on which ``quantize_experts(model, scheme)`` was called loads the saved state
and must compute exactly what the saved model computed. How close the quantized model is to
the float one is tested in test_transformers.py (``test_quantize_experts_at_load_time``).
"""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("transformers")

import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner.errors import MoeInputError  # noqa: E402
from moerunner.held_quantized import scheme_from_tensor  # noqa: E402
from moerunner.integrations._hf_experts import HOLDER, held_weights  # noqa: E402

from ._tiny_models import build  # noqa: E402

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(11))


def _quantized(family: str, scheme: str, seed: int = 0):
    model = build(family, seed=seed)
    mt.use_moerunner(model)
    mt.quantize_experts(model, scheme)
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _save(state: dict, how: str, tmp_path):
    if how == "safetensors":
        from safetensors.torch import load_file, save_file

        save_file(state, tmp_path / "model.safetensors")
        return load_file(tmp_path / "model.safetensors")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize(
    ("family", "scheme", "how"),
    [
        ("qwen3_moe", "fp8_block", "safetensors"),
        ("qwen3_moe", "int4_g32", "torch.save"),
        ("gpt_oss", "mxfp4", "safetensors"),  # transposed, interleaved, biased experts
        ("gpt_oss", "nvfp4", "torch.save"),  # a global scale as well
    ],
)
def test_quantized_model_state_dict_round_trip_is_bit_identical(family, scheme, how, tmp_path):
    model = _quantized(family, scheme)
    expected = _logits(model)
    state = model.state_dict()
    layers = [path for path, _ in mt.experts_modules(model)]
    assert len(layers) == 2
    for path in layers:
        assert state[f"{path}.{HOLDER}.w13_qdata"].shape[0] == 8  # E quantized experts
        assert scheme_from_tensor(state[f"{path}.{HOLDER}.w2_scheme"]).name == scheme
        for name in ("gate_up_proj", "down_proj"):
            assert state[f"{path}.{name}"].numel() == 0  # the float weights are released
    fresh = _quantized(family, scheme, seed=7)
    assert not torch.equal(_logits(fresh), expected)  # other weights: the load must matter
    result = fresh.load_state_dict(_save(state, how, tmp_path))
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(fresh), expected)
    for (_, mine), (_, theirs) in zip(
        mt.experts_modules(fresh), mt.experts_modules(model), strict=True
    ):
        for w in ("w13", "w2"):
            a, b = getattr(held_weights(mine), w), getattr(held_weights(theirs), w)
            assert a.scheme == b.scheme
            assert all(torch.equal(a.tensors()[f], t) for f, t in b.tensors().items())


@pytest.mark.parametrize("scheme", ["fp8_block", "int4_g32_zp", "bf16"])
def test_gpt_oss_experts_quantized_in_their_stored_layout_save_with_safetensors(scheme, tmp_path):
    """GPT-OSS quantized in its stored layout (``relayout=False``: experts [E, in, out], read
    through transposed views): the held codes are contiguous, so ``save_file`` takes
    the state dict (it refused the codes' transposed strides), and loading it back gives
    the same logits."""
    model, fresh = build("gpt_oss"), build("gpt_oss", seed=7)
    for m in (model, fresh):
        mt.use_moerunner(m, relayout=False)
        mt.quantize_experts(m, scheme)
    expected = _logits(model)
    result = fresh.load_state_dict(_save(model.state_dict(), "safetensors", tmp_path))
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(fresh), expected)


def test_loading_another_scheme_or_float_weights_names_the_fix():
    state = _quantized("qwen3_moe", "fp8_block").state_dict()
    other = _quantized("qwen3_moe", "int4_g32", seed=1)
    with pytest.raises(MoeInputError, match=r"scheme 'fp8_block' but this model's in 'int4_g32'"):
        other.load_state_dict(state)
    float_state = build("qwen3_moe", seed=2).state_dict()
    with pytest.raises(MoeInputError, match="holds float w13 .*load it into a float model"):
        other.load_state_dict(float_state)


def test_held_weights_move_and_keep_their_formats():
    model = _quantized("gpt_oss", "mxfp4")
    (_, experts), *_ = mt.experts_modules(model)
    before = {n: (b.dtype, b.clone()) for n, b in experts.get_submodule(HOLDER).named_buffers()}
    model.to(torch.bfloat16)  # converts the float parameters only
    after = dict(experts.get_submodule(HOLDER).named_buffers())
    assert {n: b.dtype for n, b in after.items()} == {n: d for n, (d, _) in before.items()}
    assert all(torch.equal(after[n], t) for n, (_, t) in before.items())
    assert experts.down_proj_bias.dtype == torch.bfloat16
    weights, _ = mt.expert_weights(experts)
    assert weights.w13 is held_weights(experts).w13  # rebuilt over the buffers
    assert weights.w13_bias.dtype == torch.bfloat16  # the module's current bias
    assert _logits(model).dtype == torch.bfloat16


def test_keep_float_weights_saves_the_float_weights_only():
    model = build("qwen3_moe")
    mt.use_moerunner(model)
    mt.quantize_experts(model, "fp8_block", keep_float_weights=True)
    state = model.state_dict()
    assert not any(HOLDER in key for key in state)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert mt.quantized_scheme(model.model.layers[0].mlp.experts) == "fp8_block"


def test_forward_follows_each_load_and_reuses_one_weights_object_between_loads():
    model = _quantized("qwen3_moe", "int4_g32")
    (_, experts), *_ = mt.experts_modules(model)
    first, _ = mt.expert_weights(experts)
    again, _ = mt.expert_weights(experts)
    assert again is first  # one object: the backend's prepared weights are reused
    states = [_quantized("qwen3_moe", "int4_g32", seed=s).state_dict() for s in (1, 2)]
    expected = []
    for state in states:
        other = _quantized("qwen3_moe", "int4_g32", seed=3)
        other.load_state_dict(state)
        expected.append(_logits(other))
    assert not torch.equal(expected[0], expected[1])
    for _ in range(2):  # load A, B, A, B into one model: each forward runs what was loaded
        for state, logits in zip(states, expected, strict=True):
            model.load_state_dict(state)
            assert torch.equal(_logits(model), logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_save_pretrained_of_released_experts_names_the_ways_that_work(family, tmp_path):
    """It failed inside transformers' checkpoint conversion ("chunk expects 'chunks' to be
    greater than 0", leaving a folder without weights), or for GPT-OSS wrote a folder that
    from_pretrained could not load."""
    model = _quantized(family, "fp8_block")
    with pytest.raises(MoeInputError, match="save_pretrained: .*keep_float_weights=True"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(MoeInputError, match="already holds quantized experts"):
        mt.quantize_experts(model, "fp8_block")  # (an internal ValueError / IndexError)
    kept = build(family)
    mt.use_moerunner(kept, backend="torch")
    mt.quantize_experts(kept, "fp8_block", keep_float_weights=True)
    kept.save_pretrained(tmp_path / "kept")  # float weights: transformers' format holds them
    with pytest.raises(MoeInputError, match="static scales"):
        mt.quantize_experts(build(family), "fp8_tensor_static")
    with pytest.raises(TypeError, match="keep_float_weights must be a bool"):
        mt.quantize_experts(build(family), "fp8_block", keep_float_weights="no")
    with pytest.raises(TypeError, match="enable must be a bool"):
        mt.fuse_shared_experts(build("qwen2_moe"), enable="no")


def test_an_experts_call_with_weights_that_do_not_fit_the_ids_is_named():
    model = build("qwen3_moe")
    mt.use_moerunner(model, backend="torch")
    experts = next(m for _, m in mt.experts_modules(model))
    hidden = torch.randn(4, experts.gate_up_proj.shape[-1])
    with torch.no_grad(), pytest.raises(MoeInputError, match=r"top_k_weights of shape \[4, 3\]"):
        experts(hidden, torch.tensor([[0, 1]] * 4), torch.rand(4, 3))  # (a reshape error)
