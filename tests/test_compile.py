"""torch.compile(fullgraph=True) of the MoE layer on CPU, against eager; the custom ops."""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import ops
from moerunner.quant import quantize
from moerunner.testing import assert_close
from moerunner.weights import ExpertWeights


def test_layer_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    cfg = moerunner.MoeConfig(
        8,
        32,
        24,
        2,
        activation=moerunner.Activation("swiglu_oai"),
        bias=True,
        gate_up_interleaved=True,
        routing=moerunner.RoutingConfig(renormalize=True),
    )
    layer = moerunner.MoE(cfg)
    with torch.no_grad():
        layer.w13_bias.normal_()
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in (5, 0, 3):
        x, logits = torch.randn(tokens, 32), torch.randn(tokens, 8)
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=1e-5, atol=1e-5)


def test_fused_experts_op_passes_opcheck():
    x, w13, w2 = torch.randn(4, 16), torch.randn(3, 16, 16), torch.randn(3, 16, 8)
    topk = moerunner.select_experts(torch.randn(4, 3), 2)
    torch.library.opcheck(
        torch.ops.moerunner.fused_experts.default,
        (x, w13, w2, topk.weights, topk.ids, None, None, "silu", None, None, False, "torch"),
        test_utils=("test_schema", "test_faketensor"),
    )


def _quantized_layer(scheme: str) -> moerunner.MoE:
    torch.manual_seed(0)
    cfg = moerunner.MoeConfig(8, 64, 32, 2, routing=moerunner.RoutingConfig(renormalize=True))
    return moerunner.MoE(cfg).quantize_(scheme)


@pytest.mark.parametrize("scheme", ["fp8_channel", "mxfp4"])
def test_quantized_layer_compiles_fullgraph_and_matches_eager(scheme):
    torch._dynamo.reset()
    layer = _quantized_layer(scheme)
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in (5, 0, 3):
        x, logits = torch.randn(tokens, 64), torch.randn(tokens, 8)
        out = compiled(x, logits)
        assert out.shape == (tokens, 64)
        torch.testing.assert_close(out, layer(x, logits), rtol=1e-5, atol=1e-5)
    # The op found the layer's own QuantizedWeight objects (no rebuild, no second prepare).
    for qw in (layer.quantized.w13, layer.quantized.w2):
        (entry,) = qw.data._moerunner_op_memo.values()
        assert entry() is qw  # held weakly: the weight holds its data (memo.seed_memo)


def _op_args(x, w13, w2, topk, act="silu"):
    return (
        x,
        ops.quantized_tensors(w13),
        ops.quantized_tensors(w2),
        w13.scheme.name,
        list(w13.shape),
        w2.scheme.name,
        list(w2.shape),
        topk.weights,
        topk.ids,
        None,
        None,
        act,
        None,
        None,
        False,
        "torch",
    )


# opcheck copies and perturbs its inputs with ops that fp8 storage lacks on CPU: schemes
# without fp8 tensors here (fp8 runs in the compile tests); these cover the optional fields.
@pytest.mark.parametrize("scheme", ["int8_w8a16", "int8_static", "int4_g32_zp"])
def test_fused_experts_quantized_op_passes_opcheck(scheme):
    x = torch.randn(4, 32)
    static = {"input_scale": 0.05} if scheme.endswith("static") else {}
    w13 = quantize(torch.randn(3, 64, 32), scheme, **static)
    w2 = quantize(torch.randn(3, 32, 32), scheme, **static)
    topk = moerunner.select_experts(torch.randn(4, 3), 2)
    torch.library.opcheck(
        torch.ops.moerunner.fused_experts_quantized.default,
        _op_args(x, w13, w2, topk),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_quantized_op_rebuilds_once_and_follows_in_place_edits():
    x = torch.randn(5, 32)
    w13 = quantize(torch.randn(4, 64, 32), "int8_w8a16")
    w2 = quantize(torch.randn(4, 32, 32), "int8_w8a16")
    topk = moerunner.select_experts(torch.randn(5, 4), 2)
    args = _op_args(x, w13, w2, topk)
    first = torch.ops.moerunner.fused_experts_quantized(*args)
    torch.testing.assert_close(first, moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids))
    rebuilt = list(w13.data._moerunner_op_memo.values())
    torch.ops.moerunner.fused_experts_quantized(*args)
    assert list(w13.data._moerunner_op_memo.values()) == rebuilt  # same object
    with torch.no_grad():
        w2.scale.mul_(2.0)  # an in-place edit of one component must be seen
    edited = torch.ops.moerunner.fused_experts_quantized(*args)
    torch.testing.assert_close(edited, 2.0 * first, rtol=1e-5, atol=1e-5)


def test_quantized_op_names_bad_arguments():
    x = torch.randn(2, 32)
    w13 = quantize(torch.randn(2, 64, 32), "fp8_channel")
    w2 = quantize(torch.randn(2, 32, 32), "fp8_channel")
    topk = moerunner.select_experts(torch.randn(2, 2), 1)
    args = list(_op_args(x, w13, w2, topk))
    args[1] = args[1][:3]
    with pytest.raises(ValueError, match="w13"):
        torch.ops.moerunner.fused_experts_quantized(*args)
    args = list(_op_args(x, w13, w2, topk))
    args[6] = [2, 32]
    with pytest.raises(ValueError, match="w2_shape"):
        torch.ops.moerunner.fused_experts_quantized(*args)


def test_transposed_op_reads_views_and_passes_opcheck():
    x = torch.randn(4, 16)
    w13_t, w2_t = torch.randn(3, 16, 24), torch.randn(3, 12, 16)  # [E, in, out]
    topk = moerunner.select_experts(torch.randn(4, 3), 2)
    args = (x, w13_t, w2_t, topk.weights, topk.ids, None, None, "silu", None, None, False, "torch")
    out = torch.ops.moerunner.fused_experts_transposed(*args)
    ref = moerunner.fused_moe(
        x,
        w13_t.transpose(1, 2).contiguous(),
        w2_t.transpose(1, 2).contiguous(),
        topk.weights,
        topk.ids,
    )
    torch.testing.assert_close(out, ref)
    (views,) = w13_t._moerunner_op_memo.values()
    # Views of the given storage, no copy; made once per source tensor, not per call.
    assert views[0].untyped_storage().data_ptr() == w13_t.untyped_storage().data_ptr()
    assert views[1].untyped_storage().data_ptr() == w2_t.untyped_storage().data_ptr()
    torch.ops.moerunner.fused_experts_transposed(*args)
    (again,) = w13_t._moerunner_op_memo.values()
    assert again[0] is views[0] and again[1] is views[1]
    torch.library.opcheck(
        torch.ops.moerunner.fused_experts_transposed.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("scheme", [None, "int8_w8a16"])
def test_layer_from_weights_compiles_fullgraph_with_pre_routed_calls(scheme):
    torch._dynamo.reset()
    torch.manual_seed(1)
    w13, w2 = torch.randn(6, 48, 32) * 0.2, torch.randn(6, 32, 24) * 0.2
    if scheme is not None:
        w13, w2 = quantize(w13, scheme), quantize(w2, scheme)
    layer = moerunner.MoE.from_weights(moerunner.ExpertWeights(w13, w2))
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in (4, 0):
        x = torch.randn(tokens, 32)
        topk = moerunner.select_experts(torch.randn(tokens, 6), 2)
        out = compiled(x, topk=topk)
        assert out.shape == (tokens, 32)
        torch.testing.assert_close(out, layer(x, topk=topk), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", [None, "fp8_channel"])
def test_compiled_calls_prepare_the_weights_once(prepares, scheme):
    """Under ``torch.compile`` (no grad) the op gets the layer's own parameters, not an alias
    made per call, so what the runner memoises on them holds: compiled calls of several
    sizes prepare the weights once (biases included: their identities key the memo too)."""
    torch._dynamo.reset()
    cfg = moerunner.MoeConfig(8, 64, 32, 2, bias=True, routing=moerunner.RoutingConfig())
    layer = moerunner.MoE(cfg)
    if scheme is not None:
        layer.quantize_(scheme)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for tokens in (5, 3, 7, 5, 3):
            x, logits = torch.randn(tokens, 64), torch.randn(tokens, 8)
            torch.testing.assert_close(compiled(x, logits), layer(x, logits))
    assert len(prepares) == 1


def test_grad_mode_flips_keep_one_prepared_form_each(prepares):
    """Eager calls with grad mode off run on the parameters (the objects compiled calls get),
    with it on through the custom op on the same parameters (the experts train): the weights
    are prepared once however the calls alternate, and with grad mode off (prepared state is
    never part of autograd)."""
    layer = moerunner.MoE(moerunner.MoeConfig(8, 64, 32, 2, bias=True))
    x, logits = torch.randn(5, 64), torch.randn(5, 8)
    outs = []
    for call in range(6):
        with torch.set_grad_enabled(call % 2 == 0):
            outs.append(layer(x, logits))
    assert prepares == [False]
    assert [o.requires_grad for o in outs] == [True, False] * 3
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0])


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_ops_backward_matches_the_float64_reference(transposed, activation):
    """The plain ops' registered backward (``ops.fused_experts_backward``: the torch backend's
    differentiable path recomputed on a thread that records autograd) against autograd of
    the float64 reference, for every argument that takes a gradient. fp32 sums in another
    order than the float64 reference: 1e-5 of each gradient's magnitude."""
    gen = torch.Generator().manual_seed(7)
    E, T, H, I = 4, 6, 16, 12
    x64 = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w13_64 = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64) / 4
    w2_64 = torch.randn(E, H, I, generator=gen, dtype=torch.float64) / 3
    b13_64 = torch.randn(E, 2 * I, generator=gen, dtype=torch.float64) / 4
    b2_64 = torch.randn(E, H, generator=gen, dtype=torch.float64) / 4
    topk = moerunner.select_experts(torch.randn(T, E, generator=gen), 2)
    wts64 = topk.weights.double()
    alpha, limit = (1.702, 7.0) if activation == "swiglu_oai" else (None, None)
    act = moerunner.Activation(activation, alpha=alpha, limit=limit)
    leaves64 = [t.clone().requires_grad_(True) for t in (x64, w13_64, w2_64, b13_64, b2_64, wts64)]
    x, w13, w2, b13, b2, wts = leaves64
    ref = moerunner.reference_moe(x, ExpertWeights(w13, w2, b13, b2), wts, topk.ids, act)
    probe = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((ref * probe).sum(), leaves64)

    leaves = [t.detach().float().requires_grad_(True) for t in leaves64]
    x, w13, w2, b13, b2, wts = leaves
    if transposed:  # the op takes the weights stored [E, in, out] (GPT-OSS)
        a, b = (w.detach().transpose(1, 2).contiguous().requires_grad_(True) for w in (w13, w2))
        leaves[1:3] = [a, b]
        op, weights = torch.ops.moerunner.fused_experts_transposed, (a, b)
    else:
        op, weights = torch.ops.moerunner.fused_experts, (w13, w2)
    args = (topk.ids, b13, b2, activation, alpha, limit, False, "torch")
    out = op(x, *weights, wts, *args)
    assert out.requires_grad
    got = torch.autograd.grad((out * probe.float()).sum(), leaves)
    names = ["hidden_states", "w13", "w2", "w13_bias", "w2_bias", "topk_weights"]
    for name, g, w in zip(names, got, want, strict=True):
        if transposed and name in ("w13", "w2"):
            g = g.transpose(1, 2)  # the gradient of the stored [E, in, out] tensor
        assert_close(g, w, 1e-5, what=f"d/d {name}")


def test_plain_ops_pass_opcheck_with_their_autograd():
    x, w13, w2 = torch.randn(4, 16), torch.randn(3, 16, 16), torch.randn(3, 16, 8)
    topk = moerunner.select_experts(torch.randn(4, 3), 2)
    tail = (topk.ids, None, None, "silu", None, None, False, "torch")
    for op, weights in (
        (torch.ops.moerunner.fused_experts.default, (w13, w2)),
        (torch.ops.moerunner.fused_experts_transposed.default, (w13.mT, w2.mT)),
    ):
        leaves = [t.clone().requires_grad_(True) for t in (x, *weights, topk.weights)]
        torch.library.opcheck(
            op,
            (leaves[0], leaves[1], leaves[2], leaves[3], *tail),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def _user_weights(scheme: str | None):
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(8, 32, 24, generator=g), torch.randn(8, 24, 16, generator=g)
    if scheme is not None:
        w13, w2 = quantize(w13, scheme), quantize(w2, scheme)
    return w13, w2


@pytest.mark.parametrize("scheme", [None, "int8"])
def test_fused_moe_in_a_users_compiled_function_one_graph_for_every_t(scheme):
    """A user's function that routes and calls ``fused_moe`` compiles with fullgraph (the call
    becomes the custom op: the backend choice reads files the tracer cannot follow) and, with
    dynamic shapes, once for every T (it compiled per T)."""
    torch._dynamo.reset()
    w13, w2 = _user_weights(scheme)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def moe(x, logits):
        topk = moerunner.select_experts(logits, 2, renormalize=True)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)

    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend=counting)
    with torch.no_grad():
        for tokens in (3, 5, 7, 0):
            x, logits = torch.randn(tokens, 24), torch.randn(tokens, 8)
            torch.testing.assert_close(compiled(x, logits), moe(x, logits), rtol=0, atol=0)
            if tokens == 7:
                assert len(graphs) == 1
    assert len(graphs) == 2  # PyTorch specialises sizes 0 and 1


def test_fused_moe_in_a_users_compiled_function_trains():
    torch._dynamo.reset()
    w13, w2 = (w.requires_grad_() for w in _user_weights(None))
    x, logits = torch.randn(6, 24), torch.randn(6, 8)

    def moe(x, logits):
        topk = moerunner.select_experts(logits, 2)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch")

    grads = []
    for fn in (torch.compile(moe, fullgraph=True), moe):
        fn(x, logits).square().sum().backward()
        grads.append((w13.grad.clone(), w2.grad.clone()))
        w13.grad = w2.grad = None
    for compiled, eager in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(w13_order="up_gate"),
        dict(activation="swiglu_oai", swiglu_beta=0.5),
        dict(apply_router_weight_on_input=True),  # traced: the input scaled beside the op
    ],
    ids=["up_gate", "swiglu_beta", "weight_on_input"],
)
def test_fused_moe_options_the_op_does_not_take_run_eagerly_in_compiled_code(kwargs):
    """What the custom op's schema does not carry runs eagerly (a graph break): the same
    result as an eager call; under fullgraph the error says what runs eagerly and why."""
    torch._dynamo.reset()
    w13, w2 = _user_weights(None)

    def moe(x, logits):
        topk = moerunner.select_experts(logits, 1)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, **kwargs)

    x, logits = torch.randn(3, 24), torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(moe)(x, logits), moe(x, logits), rtol=0, atol=0)
        if "apply_router_weight_on_input" in kwargs:
            torch.compile(moe, fullgraph=True)(x, logits)  # no break: traced as is
            return
        torch._dynamo.reset()
        with pytest.raises(Exception, match="runs eagerly") as caught:
            torch.compile(moe, fullgraph=True)(x, logits)
    assert "w13_order='up_gate', swiglu_beta" in str(caught.value)


def test_routing_and_swiglu_arguments_trace_with_dynamic_shapes_and_changing_floats():
    """Host checks of float arguments (math.isfinite, hasattr __float__) and of a CPU
    correction bias's values (a data-dependent read) broke fullgraph tracing: under
    ``dynamic=True`` a float argument is symbolic, and a float that changes between calls
    is made symbolic at the recompile. Traced, they are not read (eager calls check them)."""
    torch._dynamo.reset()
    w13, w2 = _user_weights(None)
    bias = torch.randn(8)

    def moe(x, logits, alpha, scale):
        topk = moerunner.select_experts(
            logits, 2, scoring_func="sigmoid", renormalize=True, correction_bias=bias,
            num_expert_group=4, topk_group=2, routed_scaling_factor=scale,
        )  # fmt: skip
        return moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai", swiglu_alpha=alpha
        )

    for dynamic in (True, None):
        compiled = torch.compile(moe, fullgraph=True, dynamic=dynamic)
        with torch.no_grad():
            for tokens, alpha, scale in ((3, 1.702, 2.5), (5, 1.5, 1.0), (7, 1.3, 2.0)):
                x, logits = torch.randn(tokens, 24), torch.randn(tokens, 8)
                torch.testing.assert_close(
                    compiled(x, logits, alpha, scale), moe(x, logits, alpha, scale),
                    rtol=1e-5, atol=1e-6,
                )  # fmt: skip


def _lora_case(L=2, r=4, scaling="tensor", quantized=None):
    from moerunner.lora import MoeLoraWeights

    g = torch.Generator().manual_seed(0)
    E, H, I = 4, 32, 16
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    if quantized is not None:
        w13, w2 = quantize(w13, quantized), quantize(w2, quantized)
    shapes = ((L, E, r, H), (L, E, 2 * I, r), (L, E, r, I), (L, E, H, r))
    factors = [torch.randn(*s, generator=g).requires_grad_() for s in shapes]
    scale = torch.tensor([0.5, 2.0]).requires_grad_() if scaling == "tensor" else 0.75
    return w13, w2, MoeLoraWeights(*factors, scaling=scale), g


@pytest.mark.parametrize("scaling", ["tensor", "number"])
@pytest.mark.parametrize("quantized", [None, "int8"])
def test_lora_hooks_compile_fullgraph_and_train_as_eager(scaling, quantized):
    """``fused_moe`` with the hooks of ``lora_hooks`` traces as the custom op with the LoRA
    arguments (one graph, fullgraph): output and the gradients of the factors, a scaling
    tensor and the hidden states as an eager call's, over plain and quantized experts
    (QLoRA: frozen)."""
    from moerunner.lora import lora_hooks

    torch._dynamo.reset()
    w13, w2, lora, g = _lora_case(scaling=scaling, quantized=quantized)
    trained = [lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b]
    if scaling == "tensor":
        trained.append(lora.scaling)
    x = torch.randn(7, 32, generator=g).requires_grad_()
    logits = torch.randn(7, 4, generator=g)
    adapters = torch.tensor([0, 1, -1, 0, 1, 1, -1])
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def moe(x, logits, adapters):
        topk = moerunner.select_experts(logits, 2)
        hooks = lora_hooks(lora, adapters)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=hooks)

    results = []
    for fn in (torch.compile(moe, fullgraph=True, backend=counting), moe):
        out = fn(x, logits, adapters)
        out.square().sum().backward()
        results.append((out.detach(), x.grad.clone(), *(t.grad.clone() for t in trained)))
        for t in (x, *trained):
            t.grad = None
    assert len(graphs) == 1
    for compiled, eager in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # serving: no backward, the chosen backend's forward
        no_grad = torch.compile(moe, fullgraph=True)(x, logits, adapters)
    torch.testing.assert_close(no_grad, results[1][0], rtol=1e-5, atol=1e-5)


def test_lora_hooks_compile_with_an_empty_batch_and_without_adapters():
    """T = 0 and every adapter id -1 through the traced LoRA call: the base experts' output,
    zero factor gradients."""
    from moerunner.lora import lora_hooks

    torch._dynamo.reset()
    w13, w2, lora, g = _lora_case()

    def moe(x, logits, adapters):
        topk = moerunner.select_experts(logits, 2)
        return moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, hooks=lora_hooks(lora, adapters)
        )

    compiled = torch.compile(moe, fullgraph=True)
    for tokens in (0, 3):
        x, logits = torch.randn(tokens, 32, generator=g), torch.randn(tokens, 4, generator=g)
        out = compiled(x, logits, torch.full((tokens,), -1))
        topk = moerunner.select_experts(logits, 2)
        with torch.no_grad():
            base = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)
        torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        assert all(not t.grad.any() for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b))


def test_other_hooks_run_eagerly_in_a_compiled_function():
    """Hooks that are not ``lora_hooks``' (a plain function here) are not the op's: compiled,
    they run eagerly (a graph break) with an eager call's output; under fullgraph the error
    says that such hooks run eagerly."""
    from moerunner.hooks import MoeHooks

    torch._dynamo.reset()
    w13, w2, _, g = _lora_case()
    hooks = MoeHooks(gate_up=lambda out, x, rows: out.mul_(2.0))
    x, logits = torch.randn(5, 32, generator=g), torch.randn(5, 4, generator=g)

    def moe(x, logits):
        topk = moerunner.select_experts(logits, 2)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=hooks)

    torch.testing.assert_close(torch.compile(moe)(x, logits), moe(x, logits), rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="runs eagerly") as caught:
        torch.compile(moe, fullgraph=True)(x, logits)
    assert "hooks other than those of lora_hooks" in str(caught.value)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_lora_hooks_compile_on_cuda_with_the_triton_forward(mode):
    """On CUDA in bf16 the traced LoRA call's forward runs the triton backend's LoRA kernels
    (``backend="auto"``), under inductor's CUDA graphs too (``reduce-overhead``: replayed
    with new values in the same buffers); against the float64 merged-weights reference of
    the CPU tests (bf16 bound), every step. Without grad (serving)."""
    from moerunner.lora import MoeLoraWeights, lora_hooks
    from moerunner.testing import DTYPE_BOUND

    torch._dynamo.reset()
    w13, w2, lora, g = _lora_case()
    dev, bf16 = "cuda", torch.bfloat16
    w13, w2 = w13.to(dev, bf16), w2.to(dev, bf16)
    factors = [t.detach().to(dev, bf16) for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)]
    scaling = lora.scaling.detach().to(dev)
    lora = MoeLoraWeights(*factors, scaling)

    def moe(x, logits, adapters):
        topk = moerunner.select_experts(logits, 2)
        return moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, hooks=lora_hooks(lora, adapters)
        )

    compiled = torch.compile(moe, fullgraph=True, mode=mode)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(6, 32, generator=g).to(dev, bf16)
            logits = torch.randn(6, 4, generator=g).to(dev)
            adapters = torch.tensor([0, 1, -1, 1, 0, step % 2 - 1], device=dev)
            out = compiled(x, logits, adapters).double()
            topk = moerunner.select_experts(logits, 2)
            want = torch.zeros(6, 32, dtype=torch.float64, device=dev)
            for a in (-1, 0, 1):
                rows = adapters == a
                d13 = d2 = 0.0
                if a >= 0:
                    s = float(scaling[a])
                    d13 = s * factors[1][a].double() @ factors[0][a].double()
                    d2 = s * factors[3][a].double() @ factors[2][a].double()
                merged = (w13.double() + d13, w2.double() + d2)
                ref = moerunner.reference_moe(
                    x.double(), ExpertWeights(*merged), topk.weights, topk.ids, "silu"
                )
                want[rows] = ref.to(dev)[rows]
            assert_close(out, want, 4 * DTYPE_BOUND[bf16], what=f"{mode} step {step}")


def test_backward_op_takes_the_needs_of_a_graph_compiled_before_lora():
    """PyTorch's compile caches keep backward graphs across library versions (their keys do
    not cover the op's code): one compiled before the ops took LoRA calls the backward op
    with six ``needs`` and no LoRA arguments; it gets those six gradients, not an
    IndexError (which the caches produced once here)."""
    x = torch.randn(4, 16, requires_grad=True)
    w13, w2 = torch.randn(3, 16, 16), torch.randn(3, 16, 8)
    topk = moerunner.select_experts(torch.randn(4, 3), 2)
    grad_out = torch.randn(4, 16)
    old = [True, False, False, True, False, False]
    grads = torch.ops.moerunner.fused_experts_backward(
        grad_out, x, w13, w2, topk.weights, topk.ids, None, None, "silu", None, None, False,
        False, old,
    )  # fmt: skip
    out = moerunner.fused_moe(x, w13, w2, topk.weights.requires_grad_(), topk.ids)
    want_x, want_w = torch.autograd.grad(out, (x, topk.weights), grad_out)
    torch.testing.assert_close(grads[0], want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[3], want_w, rtol=1e-5, atol=1e-5)
    assert all(g.numel() == 0 for i, g in enumerate(grads) if i not in (0, 3))
