"""transformers' MoE routers on moerunner's routing (``fuse_routers``,
``use_moerunner(routers=True)``), on tiny random models of every family.

The reference is each router's own forward (transformers' code) on the same input: the same
logits bits, the same experts per token (slot order aside), weights equal to the output
dtype's rounding (fp32: both sides round once from float32 / float64 math of one formula,
a few ulps), the same dtypes. Whole-model outputs use test_transformers.py's fp32 bound.
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

pytest.importorskip("transformers")

import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner.integrations import _hf_routers  # noqa: E402
from moerunner.testing import assert_close  # noqa: E402

from ._tiny_models import FAMILIES, Recorder, build, compiled_static_generate  # noqa: E402

FP32_MAX_REL = 1e-5


def _ids(batch=2, length=9, seed=5):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _routers(model):
    for _, block in model.named_modules():
        found = _hf_routers.block_router(block) if hasattr(block, "experts") else None
        if found is not None:
            yield found[1]


def _router_inputs(model, ids):
    """{router: the hidden states it was called with} over one forward of ``model``."""
    seen = {}

    def keep(module, args, out):  # (a hook that returns a value replaces the output)
        seen.setdefault(module, args[0].clone())

    hooks = [r.register_forward_hook(keep) for r in _routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def _same_routing(got, want, weights_rtol):
    (g_logits, g_w, g_ids), (w_logits, w_w, w_ids) = got, want
    assert g_logits.dtype == w_logits.dtype and torch.equal(g_logits, w_logits)
    assert g_w.dtype == w_w.dtype and g_ids.dtype == w_ids.dtype
    g_sorted, g_order = g_ids.sort(dim=-1)
    w_sorted, w_order = w_ids.sort(dim=-1)
    assert torch.equal(g_sorted, w_sorted)
    torch.testing.assert_close(
        g_w.gather(1, g_order).double(),
        w_w.gather(1, w_order).double(),
        rtol=weights_rtol,
        atol=1e-7,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_routers_route_as_their_own_forward(family, monkeypatch):
    model = build(family)
    verdicts = mt.fuse_routers(model)
    routers = list(_routers(model))
    assert routers and all(v is None for v in verdicts.values()), verdicts
    assert len(verdicts) == len(routers)
    calls = []
    real = _hf_routers.select_experts
    monkeypatch.setattr(
        _hf_routers, "select_experts", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    inputs = _router_inputs(model, _ids())
    assert len(calls) == len(routers)  # every router ran through select_experts
    for router, x in inputs.items():
        with torch.no_grad():
            _same_routing(router(x), type(router).forward(router, x), weights_rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_with_fused_routers_and_moerunner_experts_matches_transformers(family):
    model = build(family)
    eager = copy.deepcopy(model)
    mt.use_moerunner(model, backend="torch", routers=True)
    assert all("forward" in r.__dict__ for r in _routers(model))
    ids = _ids()
    with torch.no_grad():
        assert_close(model(ids).logits, eager(ids).logits, max_rel=FP32_MAX_REL)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_routers_keep_their_output_dtypes(family):
    """Qwen3-MoE and GPT-OSS hand their experts bf16 weights, DeepSeek-V3 fp32 ones; all
    int64 ids. bf16 weights: one bf16 rounding apart at most."""
    model = build(family, dtype=torch.bfloat16)
    assert all(v is None for v in mt.fuse_routers(model).values())
    for router, x in _router_inputs(model, _ids()).items():
        with torch.no_grad():
            got, want = router(x), type(router).forward(router, x)
        assert got[1].dtype == want[1].dtype and got[2].dtype == want[2].dtype == torch.int64
        want_dtype = torch.float32 if family == "deepseek_v3" else torch.bfloat16
        assert got[1].dtype == want_dtype
        # Exact logit ties are common in bf16: the same experts only where no tie decides.
        ties = (want[0].float().sort(-1).values.diff(dim=-1) == 0).any(-1)
        keep = ~ties
        if family == "deepseek_v3":  # fp32 logits: no ties
            assert not ties.any()
        trimmed = tuple(t[keep] for t in got), tuple(t[keep] for t in want)
        _same_routing(*trimmed, weights_rtol=2**-7)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_routers_follow_the_model_to_another_dtype(family, dtype):
    """Fused in fp32, then ``model.to(dtype)``: each router's outputs keep following its own
    forward (before: the recipe fixed fp32 logits and weights, which an fp32 probe could not
    tell apart from the input's dtype)."""
    model = build(family)
    assert all(v is None for v in mt.fuse_routers(model).values())
    model.to(dtype)
    for router, x in _router_inputs(model, _ids()).items():
        with torch.no_grad():
            got, want = router(x), type(router).forward(router, x)
        assert [t.dtype for t in got] == [t.dtype for t in want], family
        keep = ~(want[0].float().sort(-1).values.diff(dim=-1) == 0).any(-1)
        rtol = 1e-6 if want[1].dtype == torch.float32 else 2 * torch.finfo(want[1].dtype).eps
        _same_routing(tuple(t[keep] for t in got), tuple(t[keep] for t in want), rtol)


def test_a_router_with_a_hooked_or_unmaterialised_forward_keeps_it():
    """A forward already replaced on the instance (accelerate's hooks of offloaded or
    device-mapped models) is neither replaced nor removed (before: fusing dropped it and
    ``enable=False`` deleted it); weights on the meta device are refused with a reason."""
    model = build("mixtral")
    gate0, gate1 = model.model.layers[0].mlp.gate, model.model.layers[1].mlp.gate
    calls = []

    def hooked(hidden_states):
        calls.append(1)
        return type(gate0).forward(gate0, hidden_states)

    gate0.forward = hooked
    verdicts = mt.fuse_routers(model)
    assert "replaced on the instance" in verdicts["model.layers.0.mlp.gate"]
    assert verdicts["model.layers.1.mlp.gate"] is None
    mt.fuse_routers(model, enable=False)
    assert gate0.forward is hooked and "forward" not in gate1.__dict__
    with torch.no_grad():
        model(_ids())
    assert calls
    with torch.device("meta"):
        unmaterialised = type(gate1)(model.config)
    assert "meta device" in _hf_routers.find_recipe(unmaterialised)


def test_a_call_with_more_arguments_runs_the_routers_own_forward():
    """A router whose forward takes more than the hidden states (a temperature) is fused; a
    call that passes them runs its own forward (before: a TypeError)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    class TempRouter(MixtralTopKRouter):
        def forward(self, hidden_states, temperature=1.0):
            logits, weights, ids = super().forward(hidden_states)
            if temperature != 1.0:
                weights = torch.softmax(logits.float() / temperature, -1).gather(1, ids)
            return logits, weights, ids

    model = build("mixtral")
    router = TempRouter(model.config)
    router.load_state_dict(model.model.layers[0].mlp.gate.state_dict())
    model.model.layers[0].mlp.gate = router
    assert mt.fuse_routers(model)["model.layers.0.mlp.gate"] is None
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        got = router(x, temperature=2.0)
        want = TempRouter.forward(router, x, temperature=2.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_disabling_restores_the_routers_own_forward():
    model = build("deepseek_v3")
    mt.fuse_routers(model)
    verdicts = mt.fuse_routers(model, enable=False)
    assert list(verdicts.values()) == [None]
    assert all("forward" not in r.__dict__ for r in _routers(model))


class _DoubledRouter(torch.nn.Module):
    """A router whose weights are twice softmax's: nothing moerunner computes."""

    def __init__(self, num_experts=8, hidden=32, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.weight = torch.nn.Parameter(torch.randn(num_experts, hidden))

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        values, ids = torch.softmax(logits.float(), -1).topk(self.top_k, dim=-1)
        return logits, values * 2, ids


class _LogitsOnlyRouter(_DoubledRouter):
    def forward(self, hidden_states):
        return torch.nn.functional.linear(hidden_states, self.weight)


@pytest.mark.parametrize(
    "router, reason",
    [
        (_DoubledRouter(), "no routing moerunner computes reproduces"),
        (_LogitsOnlyRouter(), "does not return \\(logits, weights, ids\\)"),
        (torch.nn.Linear(32, 8), "plain linear layer"),
    ],
    ids=["other-weights", "logits-only", "plain-linear"],
)
def test_a_router_moerunner_cannot_reproduce_keeps_its_forward(router, reason):
    model = build("mixtral")
    block = model.model.layers[0].mlp
    block.gate = router
    verdicts = mt.fuse_routers(model)
    assert verdicts["model.layers.0.mlp.gate"] is not None
    assert re.search(reason, verdicts["model.layers.0.mlp.gate"]), verdicts
    assert "forward" not in router.__dict__
    assert verdicts["model.layers.1.mlp.gate"] is None
    mt.fuse_routers(model, enable=False)
    refused = r"1 router\(s\) keep their own forward:\n  model.layers.0"
    with pytest.warns(UserWarning, match=refused):
        mt.use_moerunner(model, routers=True)
    assert "forward" in model.model.layers[1].mlp.gate.__dict__


def test_training_runs_the_routers_own_forward():
    """The routing kernel has no backward: with gradients needed the router's own forward
    runs, and the router weights get transformers' gradients."""
    model, twin = build("qwen3_moe"), build("qwen3_moe")
    mt.fuse_routers(model)
    ids = _ids()
    grads = []
    for m in (model, twin):
        m.train()
        m(ids).logits.float().square().mean().backward()
        grads.append([r.weight.grad.clone() for r in _routers(m)])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


def test_compiled_static_generate_with_fused_routers():
    model = build("deepseek_v3", implementation="moerunner")
    mt.fuse_routers(model)
    recorder = Recorder()
    eager, compiled = compiled_static_generate(model, _ids(length=6), 4, recorder)
    assert torch.equal(eager, compiled)
    assert recorder.moerunner_calls() and all(n >= 1 for n in recorder.moerunner_calls())


def test_copies_route_on_their_own_router():
    model = build("deepseek_v3")
    mt.fuse_routers(model)
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for m in (twin, loaded):
        for router in _routers(m):
            assert router.__dict__["forward"].router() is router
    with torch.no_grad():  # the copy's router weights, not the original's
        next(iter(_routers(twin))).weight.mul_(-1)
        assert not torch.equal(twin(_ids()).logits, model(_ids()).logits)


def test_bad_flags_are_named():
    model = build("mixtral")
    with pytest.raises(TypeError, match="enable must be a bool"):
        mt.fuse_routers(model, enable=1)
    with pytest.raises(TypeError, match="routers must be True or False"):
        mt.use_moerunner(model, routers="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_gpu_fused_routers_run_the_kernel_without_host_syncs(family, monkeypatch):
    """On CUDA the fused router is one routing-kernel launch, with no device-to-host sync,
    and a compiled model calls it as the graph node ``moerunner::route``."""
    from moerunner.backends.triton import _routing

    model = build(family, dtype=torch.bfloat16, implementation="moerunner").cuda()
    mt.fuse_routers(model)
    inputs = _router_inputs(model, _ids().cuda())
    calls = []
    real = _routing.route
    monkeypatch.setattr(_routing, "route", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr("moerunner.routing._TRITON_ROUTE", [_routing.route])
    for router, x in inputs.items():
        with torch.no_grad():
            router(x)  # compiled and cached outside the checks
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = router(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = type(router).forward(router, x)
        keep = ~(want[0].float().sort(-1).values.diff(dim=-1) == 0).any(-1)
        rtol = 1e-6 if want[1].dtype == torch.float32 else 2**-7
        _same_routing(tuple(t[keep] for t in got), tuple(t[keep] for t in want), rtol)
    assert len(calls) == 2 * len(inputs)
    recorder = Recorder()
    eager, compiled = compiled_static_generate(model, _ids(length=6).cuda(), 4, recorder)
    assert torch.equal(eager, compiled)
    targets = {str(n.target) for gm in recorder.graphs for n in gm.graph.nodes}
    assert "moerunner.route" in targets, sorted(t for t in targets if "moerunner" in t)
