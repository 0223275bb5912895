"""Regressions of a probe of training setups (optimizers, gradient penalties, quantized
experts with kept float weights, autocast). Each failed on the code before its fix: a
weight that silently got no gradient, or PyTorch's own error where moerunner names the
cause. (The re-laid GPT-OSS layer under a fused optimizer is in
tests/integrations/test_transformers_relayout.py.)"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import MoeInputError

E, H, I, K, T = 4, 32, 32, 2, 5


def _layer(**kwargs) -> moerunner.MoE:
    torch.manual_seed(0)
    return moerunner.MoE(moerunner.MoeConfig(E, H, I, K), dtype=torch.float32, **kwargs)


def test_kept_float_weights_are_frozen_and_refused_if_trained():
    """quantize_(keep_float_weights=True) kept w13 / w2 requiring grad while every call
    computed with the quantized copy: after backward their .grad was None and an optimizer
    step left them as they were, silently."""
    layer = _layer(backend="torch").quantize_("int8_w8a16", keep_float_weights=True)
    assert not layer.w13.requires_grad and not layer.w2.requires_grad
    x = torch.randn(T, H, requires_grad=True)
    layer(x, torch.randn(T, E)).square().sum().backward()  # the input still trains
    assert x.grad is not None and x.grad.abs().sum() > 0
    layer.w13.requires_grad_(True)
    with pytest.raises(MoeInputError, match="layer's float w13 requires grad.*quantized copy"):
        layer(x, torch.randn(T, E))
    with torch.no_grad():  # inference reads the copy, as before
        assert torch.isfinite(layer(x, torch.randn(T, E))).all()


def test_transformers_kept_float_weights_are_frozen_and_refused_if_trained():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from moerunner.integrations import transformers as mt
    from moerunner.integrations.tiny_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.float32)
    mt.use_moerunner(model)
    mt.quantize_experts(model, "int8_w8a16", keep_float_weights=True)
    experts = [m for _, m in mt.experts_modules(model)]
    assert not any(e.gate_up_proj.requires_grad or e.down_proj.requires_grad for e in experts)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    model(ids).logits.sum().backward()  # the rest of the model trains
    experts[0].down_proj.requires_grad_(True)
    with pytest.raises(MoeInputError, match="model's float down_proj requires grad"):
        model(ids)


triton_pkg = pytest.importorskip("moerunner.backends.triton")
needs_triton = pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(), reason="no triton runtime"
)


@needs_triton
def test_double_backward_through_the_custom_op_is_refused_by_name():
    """A gradient penalty (create_graph=True) through a layer training on the custom op
    raised PyTorch's 'no autograd formula was registered' for the backward op."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = _layer(backend="triton", device=device)
    x = torch.randn(T, H, device=device, requires_grad=True)
    logits = torch.randn(T, E, device=device)
    (gx,) = torch.autograd.grad(layer(x, logits).square().sum(), x, create_graph=True)
    with pytest.raises(MoeInputError, match="backward through the backward.*backend='torch'"):
        gx.square().sum().backward()


def _experts64(x, w13, w2, weights, ids):
    """The experts in float64, written out per (token, slot): silu(gate) * up."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = (w13[e] @ x[t]).split(w13.shape[1] // 2)
            acc = acc + weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


def test_gradient_penalty_on_the_torch_backend_matches_float64():
    """The alternative the refusal names: double backward through fused_moe's differentiable
    path, against the same penalty's gradient in float64."""
    torch.manual_seed(1)
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5
    topk = moerunner.select_experts(torch.randn(T, E), K, renormalize=True)

    def penalty_grad(experts, dtype):
        xs = x.to(dtype).requires_grad_()
        (gx,) = torch.autograd.grad(experts(xs).square().sum(), xs, create_graph=True)
        (g2,) = torch.autograd.grad(gx.square().sum(), xs)
        return g2.double()

    got = penalty_grad(
        lambda xs: moerunner.fused_moe(xs, w13, w2, topk.weights, topk.ids, backend="torch"),
        torch.float32,
    )
    want = penalty_grad(
        lambda xs: _experts64(xs, w13.double(), w2.double(), topk.weights.double(), topk.ids),
        torch.float64,
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_autocast_inputs_of_another_dtype_name_autocast():
    layer = _layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.nn.Linear(H, H)(torch.randn(T, H))  # bf16 under autocast
        with pytest.raises(TypeError, match="torch.autocast does not cast the experts"):
            layer(x, torch.randn(T, E))
