"""Dropped weights are freed by reference counting alone: nothing moerunner keeps on a weight
(its memo of prepared forms, the custom ops' rebuilt quantized weights) holds that weight.

A prepared form that held w13 would make a cycle only the garbage collector frees (late, and
not at all where the form held a view of w13: a view keeps its base alive from C++, where
the collector cannot follow; per-expert views of plain CPU weights did, so a dropped model
kept every expert). Each test runs with the collector off and checks that the weight died the
moment its last reference went.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import moerunner
from moerunner import MoE, MoeConfig, fused_moe
from moerunner.runner import prepared_memo
from moerunner.weights import ExpertWeights

E, H, I, T, K = 8, 32, 16, 5, 2
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(autouse=True)
def no_collector():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _routing(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    tw, ti = torch.topk(torch.randn(T, E, generator=g).softmax(-1), K)
    return x, tw, ti


def _weights(scheme: str | None):
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    if scheme is not None:
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    return w13, w2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheme", [None, "int8", "fp8_block"])
def test_fused_moe_weights_die_with_their_last_reference(mode, scheme):
    w13, w2 = _weights(scheme)
    x, tw, ti = _routing()
    with MODES[mode]():
        fused_moe(x, w13, w2, tw, ti, backend="torch")
    # The memo of prepared forms is on w13 (else this test would prove nothing).
    assert prepared_memo(ExpertWeights(w13, w2)) is not None
    ref13, ref2 = weakref.ref(w13), weakref.ref(w2)
    del w13, w2
    assert ref13() is None and ref2() is None


@pytest.mark.parametrize("mode", MODES)
def test_cpu_weights_storage_is_freed_after_a_call(mode):
    """The per-expert views the CPU path reads are made of an alias, not of w13: the storage
    of a dropped weight goes with it (it stayed: 40 reloads of a layer kept 40 copies)."""
    w13, w2 = _weights(None)
    x, tw, ti = _routing()
    with MODES[mode]():
        fused_moe(x, w13, w2, tw, ti, backend="torch")
    storage = weakref.ref(w13.untyped_storage())
    del w13, w2
    assert storage() is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheme", [None, "int8"])
def test_moe_layer_weights_die_with_the_layer(mode, scheme):
    layer = MoE(MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K))
    layer.requires_grad_(False)
    if scheme is not None:
        layer.quantize_(scheme)  # held as a QuantizedWeight whose tensors carry the ops' memo
    x, _, _ = _routing()
    with MODES[mode]():
        layer(x, torch.randn(T, E))
    weight = layer.w13 if scheme is None else layer.quantized.w13
    ref = weakref.ref(weight)
    del layer, weight
    assert ref() is None


def test_same_values_after_the_alias_and_after_an_in_place_edit():
    """The prepared form reads an alias of w13: same memory, same version counter, so an
    in-place edit is seen (prepared again) and the output matches a fresh weight's."""
    w13, w2 = _weights(None)
    x, tw, ti = _routing()
    with torch.no_grad():
        before = fused_moe(x, w13, w2, tw, ti, backend="torch")
        w13.mul_(2.0)
        after = fused_moe(x, w13, w2, tw, ti, backend="torch")
        fresh = fused_moe(x, w13.clone(), w2, tw, ti, backend="torch")
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)


def test_weights_that_train_still_get_gradients():
    """The alias is detached, but only the inference path reads it: a call that needs
    gradients runs the differentiable path on the weights themselves."""
    w13, w2 = (w.requires_grad_() for w in _weights(None))
    x, tw, ti = _routing()
    fused_moe(x, w13, w2, tw, ti, backend="torch").square().sum().backward()
    assert w13.grad is not None and w13.grad.abs().sum() > 0
    assert w2.grad is not None and w2.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_cuda_weights_memory_returns_when_they_are_dropped(backend, scheme):
    """On the GPU: a call (forms prepared and memoised), then the weights dropped, with the
    collector off: the allocator is back where it was before the weights existed. A first
    round on other weights makes what calls keep per device and shape (workspaces) and the
    id checks' buffers, which a call after a synchronisation reuses (it reads the completed
    checks before taking buffers)."""

    def one_round(seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        w13 = torch.randn(E, 2 * 128, 256, device="cuda", generator=g).bfloat16()
        w2 = torch.randn(E, 256, 128, device="cuda", generator=g).bfloat16()
        if scheme is not None:
            w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
        x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ti = torch.topk(torch.randn(T, E, device="cuda", generator=g).softmax(-1), K)
        with torch.inference_mode():
            out = fused_moe(x, w13, w2, tw, ti, backend=backend)
        assert torch.isfinite(out.float()).all()

    one_round(1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    one_round(2)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


# -- what layers and integrations keep beside the weights ----------------------------------


def _float_layer() -> MoE:
    return MoE(MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K))


@pytest.mark.parametrize("mode", MODES)
def test_quantize_frees_the_float_weights_earlier_calls_viewed(mode):
    """A call before ``quantize_`` left views of the float parameters in the layer's cache,
    so the float weights ``quantize_`` frees stayed for the life of the layer."""
    layer = _float_layer()
    x, _, _ = _routing()
    with MODES[mode]():
        layer(x, torch.randn(T, E))
    storage = weakref.ref(layer.w13.untyped_storage())
    layer.quantize_("int8")
    with MODES[mode]():
        layer(x, torch.randn(T, E))
    assert storage() is None


def test_replaced_parameters_are_not_kept_by_the_other_grad_mode():
    """Views of the old parameters cached for no-grad calls stayed while later calls ran
    with grad mode on (a frozen layer): a second copy of the experts."""
    layer = _float_layer().requires_grad_(False)
    x, _, _ = _routing()
    with torch.no_grad():
        layer(x, torch.randn(T, E))
    storage = weakref.ref(layer.w13.untyped_storage())
    fresh = {k: torch.randn_like(v) for k, v in layer.state_dict().items()}
    layer.load_state_dict(fresh, assign=True)
    layer(x, torch.randn(T, E))  # grad mode on, nothing requires grad
    assert storage() is None


def _tiny_model(family: str):
    from transformers import AutoModelForCausalLM

    from moerunner.integrations.tiny_models import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


def test_fused_shared_experts_model_dies_with_its_last_reference():
    """``use_moerunner(shared_experts=True)`` stored a bound method in each block, a cycle
    that kept every block and its experts after the model was dropped."""
    pytest.importorskip("transformers")
    from moerunner.integrations.transformers import use_moerunner

    model = use_moerunner(_tiny_model("qwen2_moe"), backend="torch", shared_experts=True)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 7)))
    experts = model.model.layers[0].mlp.experts
    storage = weakref.ref(experts.gate_up_proj.untyped_storage())
    del model, experts
    assert storage() is None


def test_quantize_experts_frees_the_float_experts_a_call_prepared():
    """After a float call, ``quantize_experts`` emptied the parameters but left the forms
    prepared from them on the parameters: the released memory stayed."""
    pytest.importorskip("transformers")
    from moerunner.integrations.transformers import quantize_experts, use_moerunner

    model = use_moerunner(_tiny_model("mixtral"), backend="torch")
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        model(ids)
    experts = model.model.layers[0].mlp.experts
    storage = weakref.ref(experts.gate_up_proj.untyped_storage())
    quantize_experts(model, "int8")
    with torch.no_grad():
        model(ids)
    del experts
    assert storage() is None
