"""The registry's extension axes and the one MoE module for all four stages."""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import MoE, MoeConfig, MoeInputError, RoutingConfig
from moerunner.dispatch.base import Dispatcher, DispatchSetup, weighted_row_sum
from moerunner.registry import Registry
from moerunner.testing import DTYPE_BOUND as TOLERANCE
from moerunner.testing import assert_close

CFG = MoeConfig(
    num_experts=6,
    hidden_size=32,
    intermediate_size=16,
    top_k=2,
    routing=RoutingConfig(renormalize=True),
)


def _layer(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(CFG, backend="torch", **kw)


def _reference(layer: MoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    topk = moerunner.select_experts(logits, CFG.top_k, renormalize=True)
    w = moerunner.ExpertWeights(layer.w13.detach(), layer.w2.detach())
    return moerunner.reference_moe(x, w, topk.weights, topk.ids)


def test_registering_a_second_backend_object_under_one_name_is_refused():
    registry = moerunner.default_registry().copy()
    torch_backend = registry.backends["torch"]
    registry.register_backend(torch_backend)  # the same object again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend(torch_backend.variant())
    registry.register_backend(torch_backend.variant(), replace=True)


def test_paths_are_derived_from_the_backend_object():
    registry = moerunner.default_registry().copy()
    only_core = registry.backends["torch"].variant(name="core_only", fused_ops={})
    registry.register_backend(only_core)
    assert registry.paths("core_only") == {f: "permute" for f in registry.permutes}
    assert registry.paths("torch")["standard"] == "fused"
    assert registry.has_both_paths("standard", "torch")
    assert not registry.has_both_paths("standard", "core_only")


def test_unknown_dispatcher_names_every_registered_one():
    with pytest.raises(MoeInputError, match="all_to_all.*masked.*standard"):
        MoE(CFG, dispatcher="nosuch")
    with pytest.raises(TypeError, match="dispatcher must be a str"):
        MoE(CFG, dispatcher=3)


def test_builtin_dispatchers_follow_the_protocol():
    registry = moerunner.default_registry()
    standard = registry.make_dispatcher(
        "standard", DispatchSetup(num_local_experts=4, hidden_size=8)
    )
    assert isinstance(standard, Dispatcher)
    assert standard.dispatch_format == "standard" and standard.accepts_quantized is False
    with pytest.raises(MoeInputError, match="needs an ExpertPlacement"):
        registry.make_dispatcher("all_to_all", DispatchSetup(num_local_experts=4, hidden_size=8))


def test_weighted_row_sum_against_a_loop():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(7, 5, generator=g)
    dest = torch.tensor([0, 2, 2, 1, 0, 2, 3])
    weight = torch.rand(7, generator=g)
    expected = torch.zeros(4, 5, dtype=torch.float64)
    for r in range(7):
        expected[dest[r]] += weight[r].double() * rows[r].double()
    assert_close(weighted_row_sum(rows, dest, weight, 4), expected, TOLERANCE[torch.float32])
    unweighted = weighted_row_sum(rows.bfloat16(), dest, None, 4)
    assert unweighted.dtype == torch.float32
    assert torch.equal(unweighted[3], rows[6].bfloat16().float())


def test_a_new_dispatcher_is_one_registry_entry():
    """A dispatcher registered by name is what the module runs: here one that records its
    calls around the standard one."""
    calls = []

    class Recording:
        def __init__(self, setup: DispatchSetup) -> None:
            self.inner = moerunner.default_registry().make_dispatcher("standard", setup)
            self.dispatch_format = self.inner.dispatch_format
            self.accepts_quantized = False

        def dispatch(self, hidden_states, topk):
            calls.append("dispatch")
            return self.inner.dispatch(hidden_states, topk)

        def combine(self, output, dispatch_output):
            calls.append("combine")
            return self.inner.combine(output, dispatch_output)

    registry = moerunner.default_registry().copy()
    registry.register_dispatcher("recording", Recording)
    torch.manual_seed(0)
    layer = MoE(CFG, backend="torch", dispatcher="recording", registry=registry)
    x, logits = torch.randn(5, 32), torch.randn(5, 6)
    with torch.no_grad():
        out = layer(x, logits)
    assert calls == ["dispatch", "combine"]
    assert_close(out, _reference(layer, x, logits), TOLERANCE[torch.float32])
    # A dispatched layer has no backward: in grad mode with trainable parameters it says so
    # (it used to detach the input and give no gradient at all, silently).
    with pytest.raises(MoeInputError, match="inference only"):
        layer(x, logits)


def test_layer_prepares_once_and_follows_weight_edits():
    layer = _layer()
    x, logits = torch.randn(5, 32), torch.randn(5, 6)
    prepares = []
    backend = layer.runner.registry.backends["torch"]
    original = backend.prepare_weights

    def counting(weights, spec):
        prepares.append(1)
        return original(weights, spec)

    backend.prepare_weights = counting
    try:
        with torch.no_grad():  # inference calls (in grad mode the layer trains, unprepared)
            first = layer(x, logits)
            second = layer(x, logits)
            assert len(prepares) == 1 and torch.equal(first, second)
            layer.w2.mul_(2)  # in place
            doubled = layer(x, logits)
            assert len(prepares) == 2
            assert_close(doubled, _reference(layer, x, logits), TOLERANCE[torch.float32])
            layer.w2 = torch.nn.Parameter(layer.w2.detach() * 0.5)  # replaced
            out = layer(x, logits)
        assert_close(out, _reference(layer, x, logits), TOLERANCE[torch.float32])
        assert len(prepares) == 3
    finally:
        del backend.prepare_weights


def test_layer_checks_router_width_and_routing_arguments():
    layer = _layer()
    x = torch.randn(4, 32)
    with pytest.raises(MoeInputError, match="last dim must be num_experts E=6, got 4"):
        layer(x, torch.randn(4, 4))
    with pytest.raises(MoeInputError, match="exactly one of router_logits and topk"):
        layer(x)
    topk = moerunner.select_experts(torch.randn(4, 6), 2)
    with pytest.raises(MoeInputError, match="exactly one"):
        layer(x, torch.randn(4, 6), topk=topk)
    with pytest.raises(TypeError, match="topk must be a TopK"):
        layer(x, topk=(topk.weights, topk.ids))


def test_pre_routed_calls_equal_routed_calls():
    layer = _layer()
    x, logits = torch.randn(6, 32), torch.randn(6, 6)
    topk = moerunner.select_experts(logits, 2, renormalize=True)
    assert torch.equal(layer(x, logits), layer(x, topk=topk))


@pytest.mark.parametrize("scheme", ["fp8_channel", "int8_w8a16"])
def test_layer_from_quantized_weights(scheme):
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 32, 24, generator=g) / 5, torch.randn(4, 24, 16, generator=g) / 4
    weights = moerunner.ExpertWeights(
        moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    )
    layer = MoE.from_weights(weights, backend="torch")
    x = torch.randn(5, 24, generator=g)
    topk = moerunner.select_experts(torch.randn(5, 4, generator=g), 2)
    expected = moerunner.fused_moe(
        x, weights.w13, weights.w2, topk.weights, topk.ids, backend="torch"
    )
    assert torch.equal(layer(x, topk=topk), expected)
    with pytest.raises(MoeInputError, match="without routing settings"):
        layer(x, torch.randn(5, 4))


def test_empty_batch_through_the_module():
    layer = _layer()
    out = layer(torch.randn(0, 32), torch.randn(0, 6))
    assert out.shape == (0, 32)
    out3 = layer(torch.randn(2, 0, 32), torch.randn(2, 0, 6))
    assert out3.shape == (2, 0, 32)


def test_expert_parallel_is_the_same_module():
    from moerunner.distributed_moe import ExpertParallelMoE

    assert issubclass(ExpertParallelMoE, MoE) and issubclass(MoE, torch.nn.Module)


def _ep_module_world(rank: int, world: int):
    from moerunner.dispatch.expert_map import ExpertPlacement

    torch.manual_seed(0)  # same weights and logits on every rank
    full = MoE(CFG, backend="torch")
    x, logits = torch.randn(8, 32), torch.randn(8, 6)
    expected = full(x, logits)
    placement = ExpertPlacement.contiguous(CFG.num_experts, world)
    results = {}
    for kind, kw in (("all_to_all", {}), ("masked", {"capacity": 32}), ("standard", {})):
        layer = MoE(CFG, backend="torch", dispatcher=kind, placement=placement, **kw)
        local = placement.global_ids(rank)
        with torch.no_grad():
            layer.w13.copy_(full.w13[local])
            layer.w2.copy_(full.w2[local])
        if kind == "standard":  # every rank passes every token; outputs are all-reduced
            with torch.no_grad():
                out = layer(x, logits)
        else:  # each rank passes its own half of the tokens
            half = slice(rank * 4, rank * 4 + 4)
            out = torch.zeros_like(expected)
            with torch.no_grad():
                out[half] = layer(x[half], logits[half])
            out = out[half]
            results[kind] = (out, expected[half])
            continue
        results[kind] = (out, expected)
    return results


def test_expert_parallel_through_the_module_in_a_gloo_world():
    from distributed.worlds import run_world

    for per_rank in run_world(_ep_module_world, 2):
        for kind, (out, expected) in per_rank.items():
            assert_close(out, expected, TOLERANCE[torch.float32], what=kind)


def test_registry_module_imports_no_backend():
    import ast
    import pathlib

    source = pathlib.Path(moerunner.registry.__file__).read_text()
    runtime_imports = []
    for node in ast.parse(source).body:  # top level only; TYPE_CHECKING blocks are skipped
        if isinstance(node, ast.ImportFrom):
            runtime_imports.append(node.module or "")
    assert not [m for m in runtime_imports if "backends" in m or "runner" in m], runtime_imports


def test_new_registry_is_empty_and_independent():
    r = Registry()
    assert r.backends == {} and r.dispatchers == {}


def test_copied_and_saved_layers_share_the_process_registry(monkeypatch, tmp_path):
    """``copy.deepcopy`` and ``torch.save`` of a layer used to copy the whole registry into
    it: a copied layer then missed later registrations, and with a ``variant`` backend
    registered (read-only fused ops) neither worked at all ("cannot pickle 'mappingproxy'").
    Now the copy shares the registry and a loaded layer uses the loading process's default
    registry, computing what the original computes."""
    import copy

    from moerunner.backend_table import BackendTable, Bucket, ShapeKey

    registry = moerunner.DEFAULT_REGISTRY
    variant = registry.backends["torch"].variant(name="variant-of-torch", fused_ops={})
    monkeypatch.setitem(registry.backends, "variant-of-torch", variant)
    torch.manual_seed(0)
    layer = MoE(MoeConfig(4, 16, 8, 2))
    x, logits = torch.randn(3, 16), torch.randn(3, 4)
    want = layer(x, logits)
    copied = copy.deepcopy(layer)
    assert copied.runner.registry is registry
    assert torch.equal(copied(x, logits), want)
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert loaded.runner.registry is registry
    assert torch.equal(loaded(x, logits), want)
    # A measured table (read-only mappings inside) pickles with its runner.
    key = ShapeKey("bfloat16", "bf16", "bf16", "silu", 4, 16, 8, 2)
    table = BackendTable("cpu", {key: (Bucket(None, 1, "torch", {"torch": 1.0}),)})
    runner = moerunner.MoeRunner(table=table)
    back = torch.load(_saved(runner, tmp_path), weights_only=False)
    assert back.table.entries == table.entries and back.registry is registry


def _saved(obj, tmp_path):
    path = tmp_path / "obj.pt"
    torch.save(obj, path)
    return path
