"""Regressions of a probe of the ``MoE`` module as a PyTorch user drives it (float64
references).

- With shared experts, a replaced routed ``w13`` of the same shape (``functional_call`` in a
  loop, a parametrization over an edited original, a new ``Parameter`` per step) could be
  served the joined expert table of the old weight: its memo key named the freed storage by
  ``id``, which the new storage may get (outputs 0.8-3.6 off).
- A quantized layer read the quantized weights built at ``quantize_`` / load time, not its
  buffers: a buffer assigned anew or substituted by ``functional_call`` was ignored.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moerunner
from moerunner import ExpertWeights, MoeInputError, reference_moe
from moerunner.testing import DTYPE_BOUND, assert_close

E, H, I, K, T = 4, 8, 4, 2, 3


def _reference(layer, x, logits, w13) -> torch.Tensor:
    """float64: softmax top-k routing (no renormalisation), the routed experts with ``w13``
    and the layer's w2, plus its one shared expert (no gate)."""
    w, ids = logits.double().softmax(-1).topk(K, dim=-1)
    routed = reference_moe(x, ExpertWeights(w13.detach(), layer.w2.detach()), w, ids)
    s13, s2 = layer.shared_w13.detach()[0].double(), layer.shared_w2.detach()[0].double()
    h = x.double() @ s13.T
    return routed + (F.silu(h[:, :I]) * h[:, I:]) @ s2.T


def test_a_replaced_routed_weight_with_shared_experts_is_never_served_stale():
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K,
                              shared_experts=moerunner.SharedExpertsConfig(1))  # fmt: skip
    layer = moerunner.MoE(cfg, backend="torch")
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    base = layer.w13.detach().clone()
    for step in range(4):  # a fresh tensor each step, the last one freed
        w13 = base * (step + 1)
        with torch.no_grad():
            out = torch.func.functional_call(layer, {"w13": w13}, (x, logits))
        assert_close(out, _reference(layer, x, logits, w13), DTYPE_BOUND[torch.float32],
                     what=f"functional_call step {step}")  # fmt: skip
    for step in range(4):
        layer.w13 = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g))
        with torch.no_grad():
            out = layer(x, logits)
        assert_close(out, _reference(layer, x, logits, layer.w13), DTYPE_BOUND[torch.float32],
                     what=f"new Parameter step {step}")  # fmt: skip


def test_a_quantized_layer_runs_its_current_buffers():
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=32, intermediate_size=32, top_k=K)
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(5, 32, generator=g), torch.randn(5, E, generator=g)

    def layer():
        torch.manual_seed(0)
        return moerunner.MoE(cfg, backend="torch").quantize_("fp8_channel")

    with torch.no_grad():
        edited = layer()
        edited.w2_scale.mul_(2.0)  # in place: seen through the shared tensors all along
        want = edited(x, logits)
        plain = layer()
        assert not torch.equal(plain(x, logits), want)
        doubled = plain.w2_scale * 2.0
        got = torch.func.functional_call(plain, {"w2_scale": doubled}, (x, logits))
        assert torch.equal(got, want)  # (was the unsubstituted output)
        assigned = layer()
        assigned.w2_scale = doubled.clone()
        assert torch.equal(assigned(x, logits), want)  # (the assignment was ignored)
        assigned.w2_scale = torch.zeros_like(doubled)
        with pytest.raises(MoeInputError, match="buffer w2_scale was replaced"):
            assigned(x, logits)


def test_training_an_extended_swiglu_on_another_backend_names_the_activation():
    """It raised the triton backend's "no backward: wrap the call in torch.no_grad()",
    which did not say that the activation was the cause or that backend='torch' trains it."""
    act = moerunner.Activation("swiglu_oai", beta=0.5)
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K,
                              activation=act)  # fmt: skip
    layer = moerunner.MoE(cfg, backend="triton")
    x, logits = torch.randn(T, H), torch.randn(T, E)
    with pytest.raises(MoeInputError, match="runs on the torch backend only"):
        layer(x, logits)
