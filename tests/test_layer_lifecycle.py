"""The MoE layer over its life: built under inference_mode, trained, edited in ways PyTorch's
version counter does not count, quantized with biases replaced, compiled with shared
experts, materialised from the meta device, sharing parameters with other layers. Each
output is checked against the float64 reference of the weights the layer holds at that
moment (``moerunner.reference_moe``); fp32 calls sum in another order: the fp32 bound."""

from __future__ import annotations

import warnings

import pytest
import torch
from cases import interpreted_triton

import moerunner
from moerunner import MoE, MoeConfig, MoeInputError, SharedExpertsConfig, TopK
from moerunner.testing import DTYPE_BOUND, assert_close

E, H, I, K, T = 6, 32, 16, 2, 7
BOUND = DTYPE_BOUND[torch.float32]


def _config(**kw) -> MoeConfig:
    return MoeConfig(E, H, I, K, routing=moerunner.RoutingConfig(renormalize=True), **kw)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)


def _reference(layer: MoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """float64: the layer's routing, its experts as they are now (quantized ones dequantized
    by the reference), plus its shared experts as dense MLPs."""
    topk = moerunner.select_experts(logits.detach(), K, renormalize=True)
    if layer.quantized is not None:
        q = layer.quantized
        weights = moerunner.ExpertWeights(q.w13, q.w2, layer.w13_bias, layer.w2_bias)
    else:
        weights = moerunner.ExpertWeights(layer.w13, layer.w2, layer.w13_bias, layer.w2_bias)
    weights = moerunner.ExpertWeights(
        _d(weights.w13), _d(weights.w2), _d(weights.w13_bias), _d(weights.w2_bias)
    )
    out = moerunner.reference_moe(x.detach(), weights, topk.weights, topk.ids)
    if layer.shared_w13 is not None:
        s = layer.shared_w13.shape[0]
        dense = moerunner.ExpertWeights(_d(layer.shared_w13), _d(layer.shared_w2))
        ones = torch.ones(T, s, dtype=torch.float64)
        out = out + moerunner.reference_moe(x.detach(), dense, ones, torch.arange(s).expand(T, s))
    return out


def _d(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def test_a_layer_built_under_inference_mode_runs():
    # Its parameters are inference tensors, which keep no version counter.
    with torch.inference_mode():
        plain = MoE(_config(), backend="torch")
        shared = MoE(_config(shared_experts=SharedExpertsConfig(1)), backend="torch")
        kept = MoE(_config(bias=True), backend="torch").quantize_(
            "int8_w8a16", keep_float_weights=True
        )
    x, logits = _inputs(1)
    for layer in (plain, shared, kept):
        for mode in (torch.inference_mode, torch.no_grad):
            with mode():
                out = layer(x, logits)
            assert_close(out, _reference(layer, x, logits), BOUND)


def test_weights_changed_after_edits_the_version_counter_does_not_count():
    # Writes through .data (and fused optimizers' steps) leave the version counter as it
    # was; weights_changed() makes the layer prepare its (shared) experts again.
    x, logits = _inputs(2)
    layer = MoE(_config(shared_experts=SharedExpertsConfig(1)), backend="torch")
    with torch.no_grad():
        layer(x, logits)  # the weights are prepared
        for p in (layer.w13, layer.w2, layer.shared_w13):
            p.data.mul_(-2.0)
        layer.weights_changed()
        out = layer(x, logits)
    assert_close(out, _reference(layer, x, logits), BOUND)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_a_fused_optimizer_step_is_seen_without_weights_changed(optimizer):
    # PyTorch's fused steps leave the version counter as it was; moerunner's post-step hook
    # counts them, so the prepared (shared) experts and the kept quantized copy follow.
    x, logits = _inputs(13)
    shared = MoE(_config(shared_experts=SharedExpertsConfig(1)), backend="torch")
    kept = MoE(_config(), backend="torch").quantize_("int8_w8a16", keep_float_weights=True)
    for layer in (shared, kept):
        with torch.no_grad():
            before = layer(x, logits)  # caches made
        for p in layer.parameters():
            p.grad = torch.ones_like(p)
        optimizer(layer.parameters(), lr=0.5, fused=True).step()
        with torch.no_grad():
            out = layer(x, logits)
        assert not torch.equal(out, before)
        assert_close(out, _reference(layer, x, logits), BOUND)


def test_the_kept_quantized_copy_follows_weights_changed():
    x, logits = _inputs(3)
    layer = MoE(_config(), backend="torch").quantize_("int8_w8a16", keep_float_weights=True)
    before = layer.quantized.w13
    with torch.no_grad():
        layer(x, logits)
        layer.w13.data.mul_(-2.0)
        layer.weights_changed()
        out = layer(x, logits)
    assert layer.quantized.w13 is not before
    float_layer = MoE(_config(), backend="torch")
    float_layer.load_state_dict(layer.state_dict())
    # int8 per-channel weights: the quantized call against the float weights' reference.
    assert_close(out, _reference(float_layer, x, logits), 2e-2)


def test_a_replaced_bias_of_a_quantized_layer_is_used():
    x, logits = _inputs(4)
    for keep in (False, True):
        layer = MoE(_config(bias=True), backend="torch").quantize_(
            "int8_w8a16", keep_float_weights=keep
        )
        with torch.no_grad():
            layer(x, logits)
            layer.w2_bias = torch.nn.Parameter(torch.full((E, H), 5.0), requires_grad=False)
            out = layer(x, logits)
            assert_close(out, _reference(layer, x, logits), BOUND)
            layer.w13_bias.data = torch.randn(E, 2 * I)
            out = layer(x, logits)
        assert_close(out, _reference(layer, x, logits), BOUND)


def test_float_weights_assigned_to_a_quantized_layer_are_refused():
    x, logits = _inputs(5)
    layer = MoE(_config(), backend="torch").quantize_("int8_w8a16")
    with torch.no_grad():
        layer(x, logits)
    layer.w13 = torch.nn.Parameter(torch.zeros(E, 2 * I, H))
    with pytest.raises(MoeInputError, match="float w13 / w2 were assigned"), torch.no_grad():
        layer(x, logits)


def test_fullgraph_compile_with_shared_experts():
    torch._dynamo.reset()
    x, logits = _inputs(6)
    layer = MoE(_config(shared_experts=SharedExpertsConfig(1)), backend="torch")
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(x, logits)
    assert_close(out, _reference(layer, x, logits), BOUND)


def test_meta_layer_quantized_then_materialised_and_loaded():
    source = MoE(_config(bias=True), backend="torch").quantize_("int8_w8a16")
    with torch.device("meta"):
        target = MoE(_config(bias=True), backend="torch")
    target.quantize_("int8_w8a16")
    target.to_empty(device="cpu")  # uninitialised memory: not read until loaded
    target.load_state_dict(source.state_dict())
    x, logits = _inputs(7)
    with torch.no_grad():
        assert torch.equal(target(x, logits), source(x, logits))


def test_layers_sharing_parameters_prepare_them_once_without_a_warning():
    first = MoE(_config(), backend="torch")
    others = [MoE(_config(), backend="torch") for _ in range(2)]
    for other in others:
        other.w13, other.w2 = first.w13, first.w2
        other.requires_grad_(False)
    first.requires_grad_(False)
    x, logits = _inputs(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [layer(x, logits) for layer in (first, *others)]  # grad mode on
    for out in outs:
        assert torch.equal(out, outs[0])


def _f64_leaves(layer: MoE, x: torch.Tensor, logits: torch.Tensor):
    leaves = [t.detach().double().requires_grad_(True) for t in (x, logits, layer.w13, layer.w2)]
    lx, ll, l13, l2 = leaves
    scores = torch.softmax(ll, dim=-1)
    w, ids = scores.topk(K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = moerunner.reference_moe(lx, moerunner.ExpertWeights(l13, l2), w, ids)
    return leaves, ref


def test_training_through_the_layer_gives_every_gradient():
    # Was: x and the experts' weights were detached, so w13.grad / w2.grad stayed None and
    # x.grad held only the router's path.
    layer = MoE(_config(), backend="torch")
    x, logits = _inputs(9)
    x.requires_grad_(True)
    logits.requires_grad_(True)
    out = layer(x, logits)
    assert out.requires_grad
    leaves, ref = _f64_leaves(layer, x, logits)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * probe).sum().backward()
    want = torch.autograd.grad((ref * probe.double()).sum(), leaves)
    for name, got, w in zip(
        ("x", "logits", "w13", "w2"), (x, logits, layer.w13, layer.w2), want, strict=True
    ):
        assert got.grad is not None, name
        assert_close(got.grad, w, 1e-5, what=name)
    # An optimizer step moves the output to what the new weights give.
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    with torch.no_grad():
        assert_close(layer(x, logits), _reference(layer, x, logits), BOUND)


def test_training_with_shared_experts_and_pre_routed_calls():
    layer = MoE(_config(shared_experts=SharedExpertsConfig(1, gate=False)), backend="torch")
    x, logits = _inputs(10)
    topk = moerunner.select_experts(logits, K, renormalize=True)
    out = layer(x, topk=TopK(weights=topk.weights, ids=topk.ids))
    out.square().sum().backward()
    for p in (layer.w13, layer.w2, layer.shared_w13, layer.shared_w2):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)
    with torch.no_grad():
        assert_close(out, _reference(layer, x, logits), BOUND)


def test_a_layer_from_weights_trains_the_weights_it_was_given():
    source = MoE(_config(), backend="torch")
    w13 = torch.nn.Parameter(source.w13.detach().clone())
    w2 = torch.nn.Parameter(source.w2.detach().clone())
    layer = MoE.from_weights(moerunner.ExpertWeights(w13, w2), backend="torch")
    x, logits = _inputs(12)
    topk = moerunner.select_experts(logits, K, renormalize=True)
    out = layer(x, topk=topk)
    assert out.requires_grad
    out.square().sum().backward()
    ref13, ref2 = (t.detach().double().requires_grad_(True) for t in (w13, w2))
    ref = moerunner.reference_moe(x, moerunner.ExpertWeights(ref13, ref2), topk.weights, topk.ids)
    ref.square().sum().backward()
    assert_close(w13.grad, ref13.grad, 1e-5, what="w13")
    assert_close(w2.grad, ref2.grad, 1e-5, what="w2")


def test_quantized_layers_run_in_grad_mode_and_pass_gradients_on():
    """A quantized layer whose input requires grad (a layer of a model trained around frozen
    quantized experts) raised "no backward"; the gradient now reaches the input and the
    router's logits, as autograd of the float64 reference on the dequantized weights gives
    (int8_w8a16 is weight-only: fp32 bound), eagerly, compiled and on triton."""
    layer = MoE(_config(bias=True), backend="torch").quantize_("int8_w8a16")
    assert not layer.w13_bias.requires_grad  # quantize_ froze what the call still reads
    x, logits = _inputs(11)
    out = layer(x, logits)  # grad mode on, nothing requires grad: runs without a graph
    assert not out.requires_grad
    assert_close(out, _reference(layer, x, logits), BOUND)
    got = [t.clone().requires_grad_() for t in (x, logits)]
    want = [t.double().requires_grad_() for t in (x, logits)]
    proj = torch.linspace(-1, 1, H, dtype=torch.float64)
    (layer(*got).double() * proj).sum().backward()
    q = layer.quantized
    topk = moerunner.select_experts(want[1], K, renormalize=True)
    weights = moerunner.ExpertWeights(q.w13, q.w2, _d(layer.w13_bias), _d(layer.w2_bias))
    ref = moerunner.reference_moe(want[0], weights, topk.weights, topk.ids)
    (ref * proj).sum().backward()
    for name, g, w in zip(("x", "router logits"), got, want, strict=True):
        assert_close(g.grad, w.grad, BOUND, what=name)
    # compiled (the quantized custom op's backward), and on triton where it runs (its
    # forward, the backward recomputed on the torch backend): the same gradients
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    others = [("compiled", compiled)]
    if interpreted_triton():
        triton = MoE(_config(bias=True), backend="triton").quantize_("int8_w8a16")
        triton.load_state_dict(layer.state_dict())
        others.append(("triton", triton))
    for name, other in others:
        again = [t.clone().requires_grad_() for t in (x, logits)]
        (other(*again).double() * proj).sum().backward()
        for what, g, w in zip(("x", "router logits"), again, want, strict=True):
            assert_close(g.grad, w.grad, BOUND, what=f"{name}: {what}")


def test_quantized_layer_biases_trained_again_get_their_gradients():
    """``quantize_`` freezes the biases; a user who turns their gradients back on got None
    (the held quantized weights kept detached copies), eager and compiled. The calls now read
    the bias parameters themselves: their gradients are the float64 reference's."""
    layer = MoE(_config(bias=True), backend="torch").quantize_("int8_w8a16")
    for b in (layer.w13_bias, layer.w2_bias):
        b.requires_grad_()
    x, logits = _inputs(12)
    proj = torch.linspace(-1, 1, H, dtype=torch.float64)
    q, topk = layer.quantized, moerunner.select_experts(logits, K, renormalize=True)
    b13, b2 = (b.detach().double().requires_grad_() for b in (layer.w13_bias, layer.w2_bias))
    ref = moerunner.reference_moe(
        x.double(), moerunner.ExpertWeights(q.w13, q.w2, b13, b2), topk.weights, topk.ids
    )
    (ref * proj).sum().backward()
    torch._dynamo.reset()
    for name, call in (("eager", layer), ("compiled", torch.compile(layer, backend="aot_eager"))):
        layer.zero_grad()
        (call(x, logits).double() * proj).sum().backward()
        assert_close(layer.w13_bias.grad, b13.grad, BOUND, what=f"{name}: w13 bias")
        assert_close(layer.w2_bias.grad, b2.grad, BOUND, what=f"{name}: w2 bias")


# -- GPU: the triton forward trains too ------------------------------------------------------


def _gpu_layer(**kw) -> MoE:
    torch.manual_seed(0)
    cfg = MoeConfig(16, 256, 128, 4, routing=moerunner.RoutingConfig(renormalize=True), **kw)
    return MoE(cfg, backend="triton", dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_training_a_triton_layer_on_the_gpu_after_its_steps_exist():
    """Inference calls first (they make the layer's eager step), then a call that needs
    gradients: it must not replay the step (no graph) but run the custom op, whose forward is
    the triton kernels and whose backward recomputes on the torch backend. bf16 forward and
    backward each round like a bf16 call: twice the bf16 bound for the gradients."""
    layer = _gpu_layer()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(33, 256, device="cuda", generator=g).bfloat16()
    logits = torch.randn(33, 16, device="cuda", generator=g)
    with torch.no_grad():
        first = [layer(x, logits) for _ in range(3)]
    assert len(layer._steps) > 0  # the inference calls made a step
    xg, lg = x.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    out = layer(xg, lg)
    assert out.requires_grad
    assert torch.equal(out.detach(), first[-1])  # the same triton forward
    probe = torch.randn(out.shape, device="cuda", generator=g)
    (out.float() * probe).sum().backward()
    cpu = [t.detach().cpu() for t in (x, logits, layer.w13, layer.w2)]
    leaves = [t.double().requires_grad_(True) for t in cpu]
    lx, ll, l13, l2 = leaves
    w, ids = torch.softmax(ll, dim=-1).topk(4, dim=-1)
    ref = moerunner.reference_moe(lx, moerunner.ExpertWeights(l13, l2), w / w.sum(-1, True), ids)
    want = torch.autograd.grad((ref * probe.cpu().double()).sum(), leaves)
    got = (xg.grad, lg.grad, layer.w13.grad, layer.w2.grad)
    for name, gr, wt in zip(("x", "logits", "w13", "w2"), got, want, strict=True):
        assert_close(gr.cpu(), wt, 2 * DTYPE_BOUND[torch.bfloat16], what=name)


@pytest.mark.gpu
def test_a_quantized_gpu_layer_moves_without_reading_its_scales():
    """Moving or casting a quantized layer rebuilds its weights over the moved buffers
    without reading the scales (no device sync), and the moved layer computes the same."""
    layer = MoE(_config(bias=True), backend="auto").quantize_("int8_w8a16")
    layer.to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.to(torch.bfloat16)  # the quantized buffers keep their dtypes
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x, logits = _inputs(12)
    with torch.no_grad():
        got = layer(x.cuda().bfloat16(), logits.cuda())
    assert_close(
        got.float().cpu(), _reference(layer, x.bfloat16(), logits), DTYPE_BOUND[torch.bfloat16]
    )
