"""Regressions of a probe of ahead-of-time use (torch.export, torch.func) on the CPU, torch
backend; every output against the eager call of the same module, whose own agreement with
the float64 reference the layer tests check."""

from __future__ import annotations

import io
import re

import pytest
import torch
from torch.export import Dim, export

import moerunner
from moerunner import MoeInputError

E, H, I, K = 8, 32, 32, 2
TOKENS = Dim("T", min=1, max=512)


def _layer(**routing) -> moerunner.MoE:
    torch.manual_seed(0)
    cfg = moerunner.MoeConfig(E, H, I, K, routing=moerunner.RoutingConfig(**routing))
    return moerunner.MoE(cfg, backend="torch").eval()


def test_an_exported_layer_with_grouped_routing_takes_an_empty_batch():
    """Traced for T > 0, the grouped top-k reshaped its expert mask to ``[T, -1]``, which
    has no answer at T = 0: the exported program raised where the eager call returns
    ``[0, H]``."""
    layer = _layer(scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
    with torch.no_grad():
        ep = export(layer, (torch.randn(4, H), torch.randn(4, E)),
                    dynamic_shapes=({0: TOKENS}, {0: TOKENS}))  # fmt: skip
        assert ep.module()(torch.randn(0, H), torch.randn(0, E)).shape == (0, H)
        x, logits = torch.randn(3, H), torch.randn(3, E)
        assert torch.equal(ep.module()(x, logits), layer(x, logits))


def test_topk_is_an_export_argument_and_result():
    """A layer built from weights takes ``topk=``; export refused the TopK argument
    ("Unsupported input type"), and an exported select_experts could not return one."""
    torch.manual_seed(1)
    weights = moerunner.ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    layer = moerunner.MoE.from_weights(weights, backend="torch")
    x, logits = torch.randn(5, H), torch.randn(5, E)
    topk = moerunner.select_experts(logits, K)
    with torch.no_grad():
        ep = export(layer, (x,), {"topk": topk})
        want = layer(x, topk=topk)
        assert torch.equal(ep.module()(x, topk=topk), want)
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        buffer.seek(0)
        assert torch.equal(torch.export.load(buffer).module()(x, topk=topk), want)

    class Route(torch.nn.Module):
        def forward(self, logits):
            return moerunner.select_experts(logits, K)

    routed = export(Route(), (logits,)).module()(logits)
    assert isinstance(routed, moerunner.TopK)
    assert torch.equal(routed.ids, topk.ids) and torch.equal(routed.weights, topk.weights)


def test_vmap_over_the_experts_is_refused_by_name():
    """It failed inside PyTorch ("Cannot access data pointer of Tensor that doesn't have
    storage", "Cannot access storage of BatchedTensorImpl")."""
    from torch.func import functional_call, stack_module_state, vmap

    layer = _layer()
    x, logits = torch.randn(5, H), torch.randn(5, E)
    w13, w2 = layer.w13.detach(), layer.w2.detach()
    with torch.no_grad():
        with pytest.raises(MoeInputError, match="MoE: hidden_states is batched by torch.func"):
            vmap(layer)(torch.randn(3, 5, H), torch.randn(3, 5, E))
        with pytest.raises(MoeInputError, match="fused_moe: hidden_states is batched"):
            vmap(lambda b: moerunner.fused_moe_from_logits(b, logits, w13, w2, K))(
                torch.randn(3, 5, H)
            )
        params, buffers = stack_module_state([layer, _layer()])
        with pytest.raises(MoeInputError, match="MoE: w13 is batched.*once per model"):
            vmap(lambda p, b: functional_call(layer, (p, b), (x, logits)))(params, buffers)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(w13_order="up_gate"), "w13_order='up_gate'"),
        (dict(activation="swiglu_oai", swiglu_beta=0.5), "swiglu_beta != 1"),
    ],
)
def test_non_strict_export_names_what_the_custom_op_cannot_take(kwargs, named):
    """Traced without dynamo, such a call ran its eager code on the tracer's fake tensors
    ("Cannot access data pointer of Tensor", "unhashable type: non-nested SymInt")."""
    torch.manual_seed(2)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)

    class Call(torch.nn.Module):
        def forward(self, x, logits):
            topk = moerunner.select_experts(logits, K)
            return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, **kwargs)

    inputs = (torch.randn(4, H), torch.randn(4, E))
    for dynamic in (None, ({0: TOKENS}, {0: TOKENS})):
        with pytest.raises(MoeInputError, match=f"non-strict torch.export.*{re.escape(named)}"):
            export(Call(), inputs, dynamic_shapes=dynamic, strict=False)
    # torch.compile still runs it, eagerly behind a graph break
    compiled = torch.compile(Call(), backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), Call()(*inputs))


def test_eager_calls_on_fake_tensors_say_how_to_trace_them():
    """They failed on a data-dependent read (``DataDependentOutputException``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, logits = torch.randn(5, H), torch.randn(5, E)
        topk = moerunner.select_experts(logits, K)
        w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
        with pytest.raises(MoeInputError, match="fused_moe: hidden_states is a fake tensor"):
            moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)
        layer = moerunner.MoE(moerunner.MoeConfig(E, H, I, K), backend="torch")
        with pytest.raises(MoeInputError, match="MoE: hidden_states is a fake.*torch.export"):
            layer(x, logits)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_traces_fused_moe_as_the_custom_op(mode):
    """A real-mode trace recorded the example's expert row counts as constants: replayed on
    other routing it was silently wrong (99 off); fake and symbolic traces were refused.
    Traced by make_fx, fused_moe is the custom op, whatever the routing replayed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from moerunner import ExpertWeights, reference_moe
    from moerunner.testing import DTYPE_BOUND, assert_close

    def experts(x, logits, w13, w2):
        topk = moerunner.select_experts(logits, K)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)

    torch.manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5
    graph = make_fx(experts, tracing_mode=mode)(torch.randn(6, H), torch.randn(6, E), w13, w2)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "moerunner.fused_experts.default" in targets
    tokens = 9 if mode == "symbolic" else 6  # (real and fake traces fix T)
    x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
    topk = moerunner.select_experts(logits, K)
    expected = reference_moe(x, ExpertWeights(w13, w2), topk.weights, topk.ids)
    assert_close(graph(x, logits, w13, w2), expected, DTYPE_BOUND[torch.float32])


def test_make_fx_of_the_layer_is_refused_by_name():
    """The layer's eager forward reads its routing on the host; make_fx recorded it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = _layer()
    with pytest.raises(MoeInputError, match="MoE: traced by make_fx.*torch.export"):
        make_fx(layer)(torch.randn(6, H), torch.randn(6, E))


def _experts_problem():
    torch.manual_seed(0)
    x = torch.randn(6, H)
    w13, w2 = torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5
    return x, w13, w2, moerunner.select_experts(torch.randn(6, E), K)


def test_forward_mode_tangents_are_refused_by_name():
    """Forward-mode AD failed inside PyTorch on the eager GEMMs ('mm_out ... out= function'),
    and the custom ops dropped the tangent silently (the transformers integration's JVP
    lacked the experts' part)."""
    import torch.autograd.forward_ad as fwAD

    x, w13, w2, topk = _experts_problem()
    v = torch.randn_like(x)

    def experts(x):
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)

    with pytest.raises(MoeInputError, match="fused_moe: hidden_states carries a forward-mode"):
        torch.func.jvp(experts, (x,), (v,))
    with fwAD.dual_level(), pytest.raises(MoeInputError, match="topk_weights carries"):
        moerunner.fused_moe(x, w13, w2, fwAD.make_dual(topk.weights, topk.weights), topk.ids)
    with fwAD.dual_level(), pytest.raises(MoeInputError, match="MoE: hidden_states carries"):
        _layer()(fwAD.make_dual(x, v), torch.randn(6, E))
    # a tangent on the router logits alone reaches the experts as the routing weights'
    logits = torch.randn(6, E)
    with torch.no_grad(), fwAD.dual_level():
        with pytest.raises(MoeInputError, match="the experts: topk_weights carries"):
            _layer()(x, fwAD.make_dual(logits, torch.randn_like(logits)))
    # reverse mode through torch.func: the eager differentiable path
    grad = torch.func.grad(lambda x: experts(x).square().sum())(x)
    leaf = x.clone().requires_grad_()
    experts(leaf).square().sum().backward()
    torch.testing.assert_close(grad, leaf.grad)


def test_transformers_experts_under_func_transforms():
    """Forward mode failed inside PyTorch's grouped GEMM; reverse mode through torch.func
    takes the eager differentiable path, as autograd does."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from moerunner.integrations import transformers as mt
    from moerunner.integrations.tiny_models import tiny_config

    torch.manual_seed(0)
    config = tiny_config("qwen3_moe")
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    mt.use_moerunner(model)
    embeds = torch.randn(1, 4, model.config.hidden_size)

    def logits(e):
        return model(inputs_embeds=e).logits.square().sum()

    with pytest.raises(MoeInputError, match="the experts: hidden_states carries a forward-mode"):
        torch.func.jvp(logits, (embeds,), (torch.randn_like(embeds),))
    leaf = embeds.clone().requires_grad_()
    logits(leaf).backward()
    torch.testing.assert_close(torch.func.grad(logits)(embeds), leaf.grad)


def test_func_transforms_over_the_layers_custom_op_are_refused_by_name():
    """A layer on a backend other than torch trains through the custom op: torch.func.grad
    failed there with PyTorch's 'must override the setup_context staticmethod'. The check
    runs before any kernel."""
    triton_pkg = pytest.importorskip("moerunner.backends.triton")
    if not triton_pkg.interpreted() and not torch.cuda.is_available():
        pytest.skip("no triton runtime")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    layer = moerunner.MoE(moerunner.MoeConfig(E, H, I, K), backend="triton", device=device)
    x, logits = torch.randn(6, H, device=device), torch.randn(6, E, device=device)
    with pytest.raises(MoeInputError, match="custom op: hidden_states is a tensor of a torch.func"):
        torch.func.grad(lambda x: layer(x, logits).sum())(x)


def test_make_fx_traces_the_transformers_experts_as_the_custom_op():
    """The integration ran its eager path under make_fx, recording the routing's row counts:
    the graph replayed on other input was silently wrong (1e-3 on logits of 0.6)."""
    pytest.importorskip("transformers")
    from torch.fx.experimental.proxy_tensor import make_fx
    from transformers import AutoModelForCausalLM

    from moerunner.integrations import transformers as mt
    from moerunner.integrations.tiny_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("qwen3_moe"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    mt.use_moerunner(model)

    def logits(e):
        return model(inputs_embeds=e).logits

    shape = (1, 5, model.config.hidden_size)
    with torch.no_grad():
        graph = make_fx(logits)(torch.randn(shape))
        targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
        assert any(t.startswith("moerunner.fused_experts") for t in targets)
        other = torch.randn(shape)
        torch.testing.assert_close(graph(other), logits(other), rtol=1e-5, atol=1e-5)
