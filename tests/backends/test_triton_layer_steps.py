"""A layer's eager calls as one replay (``backends.triton._step``, ``MoE._step_key``).

After a layer's first calls of a shape, its routing and expert launches are replayed as one
joined plan. CPU tests check the joining and the layer's bookkeeping; GPU tests check that a
stepped call computes exactly what the ordinary path computes (``select_experts`` then
``fused_moe``: the same kernels with the same arguments, so bit for bit), that the step
follows weight edits, bias values, streams and graph capture, and that it never syncs.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

pytest.importorskip("triton")

import moerunner  # noqa: E402
from moerunner.backends.triton import _plan, _step  # noqa: E402


def test_join_maps_each_plans_roles_onto_the_joined_roles():
    calls = []

    def run(*args):
        calls.append(args)

    a_roles = (torch.zeros(2), torch.zeros(2))
    b_roles = (torch.zeros(2), torch.zeros(2), torch.zeros(2))
    a = _plan.LaunchPlan.build([(run, (), (a_roles[1], 5, a_roles[0]), ())], a_roles)
    b = _plan.LaunchPlan.build([(run, (), (b_roles[2], b_roles[0], b_roles[1]), (1,))], b_roles)
    joined = _plan.LaunchPlan.join([(a, (3, 0)), (b, (0, 1, 2))])
    roles = tuple(torch.zeros(2) for _ in range(4))
    joined.replay(roles)
    p = [t.data_ptr() for t in roles]
    assert calls == [(p[0], 5, p[3]), (p[2], p[0], p[1], 1)]


def _layer(device, **routing):
    cfg = moerunner.MoeConfig(
        16, 256, 128, 4, routing=moerunner.RoutingConfig(renormalize=True, **routing)
    )
    torch.manual_seed(0)
    return moerunner.MoE(cfg, backend="triton", dtype=torch.bfloat16, device=device).eval()


def test_a_cpu_layer_makes_no_steps_and_copies_start_without_any():
    layer = _layer("cpu")
    layer.runner = moerunner.MoeRunner("torch")
    x, logits = torch.randn(3, 256, dtype=torch.bfloat16), torch.randn(3, 16)
    with torch.no_grad():
        layer(x, logits)
    assert len(layer._steps) == 0
    layer._steps["k"] = lambda: None  # a step holds launchers: never copied or pickled
    assert len(copy.deepcopy(layer)._steps) == 0
    assert len(pickle.loads(pickle.dumps(layer))._steps) == 0


# -- GPU ------------------------------------------------------------------------------------

DEEPSEEK_ROUTING = dict(
    scoring_func="sigmoid",
    num_expert_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    correction_bias=True,
)


def _ordinary(layer, x, logits):
    """The layer's ordinary path, spelled out: routing, then the experts."""
    kwargs = layer._routing_kwargs()
    tk = moerunner.select_experts(logits, kwargs.pop("top_k"), **kwargs)
    w = layer.expert_weights()
    return moerunner.fused_moe(
        x, w.w13, w.w2, tk.weights, tk.ids, backend="triton", check_ids=False
    )


def _steps(layer):
    return [s for s in layer._steps.values() if isinstance(s, _step.LayerStep)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block"])
@pytest.mark.parametrize("routing", ["softmax", "deepseek"])
def test_stepped_calls_equal_the_ordinary_path(routing, scheme, tokens):
    dev = torch.device("cuda")
    layer = _layer(dev, **(DEEPSEEK_ROUTING if routing == "deepseek" else {}))
    if layer.correction_bias is not None:
        layer.correction_bias.normal_(0, 0.05)
    if scheme != "bf16":
        layer.quantize_(scheme)
    with torch.inference_mode():
        for call in range(6):  # compile, record the plans, make the step, replay it
            x = torch.randn(tokens, 256, device=dev, dtype=torch.bfloat16)
            logits = torch.randn(tokens, 16, device=dev, dtype=torch.bfloat16)
            got = layer(x, logits)
            want = _ordinary(layer, x, logits)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (routing, scheme, tokens, call)
    assert _steps(layer), "no step was made"


@pytest.mark.gpu
def test_a_step_follows_weight_edits_bias_values_streams_and_shapes():
    dev = torch.device("cuda")
    layer = _layer(dev, **DEEPSEEK_ROUTING)
    x = torch.randn(5, 256, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(5, 16, device=dev, dtype=torch.bfloat16)

    def check():
        got = layer(x, logits)
        want = _ordinary(layer, x, logits)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        return got

    with torch.no_grad():
        for _ in range(4):
            first = check()
        assert len(_steps(layer)) == 1
        layer.w13.mul_(0.5)  # in place: a new version, so a new key (the ordinary path)
        edited = check()
        assert not torch.equal(edited, first)
        for _ in range(3):
            check()
        layer.correction_bias.copy_(torch.linspace(-1, 1, 16, device=dev))  # read per replay
        for _ in range(3):
            check()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # another caller: steps of its own
            for _ in range(4):
                check()
        torch.cuda.current_stream().wait_stream(side)
        x = x[:3]
        logits = logits[:3]
        for _ in range(4):
            check()
    assert len(_steps(layer)) >= 3


@pytest.mark.gpu
def test_stepped_calls_do_not_sync_and_capture_into_a_graph():
    dev = torch.device("cuda")
    layer = _layer(dev, **DEEPSEEK_ROUTING)
    x = torch.randn(8, 256, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(8, 16, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(4):
            layer(x, logits)
        assert _steps(layer)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                layer(x, logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        want = _ordinary(layer, x, logits)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_grad_mode_with_trainable_weights_trains_instead_of_replaying():
    """With grad mode on and trainable weights the layer trains (the custom op: the triton
    forward, a backward recomputed on the torch backend): such calls make no step and
    replay none, and their forward computes what the ordinary path computes."""
    dev = torch.device("cuda")
    layer = _layer(dev)
    x = torch.randn(4, 256, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(4, 16, device=dev, dtype=torch.bfloat16)
    for _ in range(4):
        got = layer(x, logits)
    assert not _steps(layer) and layer.w13.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        want = _ordinary(layer, x, logits)
    torch.cuda.synchronize()
    assert torch.equal(got.detach(), want) and got.requires_grad
