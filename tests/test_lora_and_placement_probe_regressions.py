"""Regression tests of a probe of LoRA, the expert placement and the peer shims.

Each test names the finding it pins: a scale finite in float64 but not in float32 (LoRA
computes in float32), a ``LoraDelta`` whose adapter ids do not fit the call, a scaling tensor
on another device, a ``StandardDispatcher`` built from a placement with shared experts, ranks
outside the placement, a shared-slot weight of the wrong shape, and peer arguments read as
truth values or ids of a float dtype. Results are compared with the float64 reference.
"""

from __future__ import annotations

import json

import pytest
import torch

import moerunner
from moerunner import MoeInputError
from moerunner.compat import sglang, vllm
from moerunner.dispatch.expert_map import (
    ExpertPlacement,
    append_shared_slots,
    shard_expert_weights,
)
from moerunner.dispatch.standard import StandardDispatcher
from moerunner.hooks import MoeHooks
from moerunner.lora import LoraDelta, MoeLoraWeights, lora_hooks
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights

E, H, I, L, R, T = 4, 32, 16, 2, 4, 5


def _lora_call(scaling):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), 2)
    factors = (
        torch.randn(L, E, R, H, generator=g),
        torch.randn(L, E, 2 * I, R, generator=g),
        torch.randn(L, E, R, I, generator=g),
        torch.randn(L, E, H, R, generator=g),
    )
    return x, w13, w2, topk, MoeLoraWeights(*factors, scaling)


@pytest.mark.parametrize(
    "scaling",
    [torch.tensor([1e300, 1.0], dtype=torch.float64), 1e39, -1e39],
    ids=["float64-tensor", "number", "negative-number"],
)
def test_a_scale_beyond_float32_is_refused(scaling):
    """Finite in float64 but inf in float32, where the hooks compute: the tensor gave NaN
    rows, the number a RuntimeError from inside torch."""
    x, w13, w2, topk, lora = _lora_call(scaling)
    with pytest.raises(MoeInputError, match="lora scaling must be finite, and in float32"):
        hooks = lora_hooks(lora, torch.tensor([0, 1, -1, 0, 1]))
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=hooks)


def test_an_alpha_beyond_float32_is_refused_at_load_naming_the_file(tmp_path):
    """An adapter_config with lora_alpha 1e300 loaded (scaling inf) and failed later,
    naming neither the file nor the field."""
    from safetensors.torch import save_file

    from moerunner.lora_checkpoints import MoeModelShape, load_peft_adapters

    shape = MoeModelShape(num_experts=2, hidden_size=8, intermediate_size=4)
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 1e300, "target_modules": ["gate_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.mlp.experts"
    tensors = {}
    for e in range(2):
        tensors[f"{prefix}.{e}.gate_proj.lora_A.weight"] = torch.randn(2, 8)
        tensors[f"{prefix}.{e}.gate_proj.lora_B.weight"] = torch.randn(4, 2)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(MoeInputError, match=r"adapter_config\.json.*lora_alpha") as caught:
        load_peft_adapters(str(folder), shape, layer=0)
    assert "finite in float32" in str(caught.value)


@pytest.mark.parametrize("ids", [torch.tensor([0, 1, 0]), torch.tensor([], dtype=torch.int64)])
def test_lora_delta_with_adapter_ids_of_another_call_is_named(ids):
    """A LoraDelta built by hand with fewer ids than the call's tokens raised an IndexError
    from its row lookup; its ids now give the hooks their token count."""
    x, w13, w2, topk, lora = _lora_call(0.5)
    hooks = MoeHooks(gate_up=LoraDelta(lora, ids, "w13"), down=LoraDelta(lora, ids, "w2"))
    assert hooks.num_tokens == ids.shape[0]
    with pytest.raises(MoeInputError, match=f"hooks were made for {ids.shape[0]} tokens"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=hooks)
    with pytest.raises(MoeInputError, match="holds data of 3 tokens"):
        MoeHooks(gate_up=LoraDelta(lora, torch.tensor([0, 1, 0]), "w13"), num_tokens=5)


def test_lora_delta_built_by_hand_matches_lora_hooks():
    """The hooks a user builds from two LoraDeltas run as lora_hooks' do (the check above
    does not refuse the right count)."""
    x, w13, w2, topk, lora = _lora_call(0.5)
    ids = torch.tensor([0, 1, -1, 0, 1])
    by_hand = MoeHooks(gate_up=LoraDelta(lora, ids, "w13"), down=LoraDelta(lora, ids, "w2"))
    got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=by_hand)
    want = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=lora_hooks(lora, ids))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_scaling_tensor_on_a_device_the_factors_cannot_read_is_named():
    """A meta-device scaling tensor beside CPU factors failed copying out of meta."""
    _, _, _, _, lora = _lora_call(torch.ones(L, device="meta"))
    with pytest.raises(MoeInputError, match="lora scaling is on meta"):
        lora_hooks(lora, torch.tensor([0, 1, -1, 0, 1]))


def test_standard_map_puts_shared_experts_on_rank_zero_only():
    """``StandardDispatcher(placement.expert_map(rank))``, as the docs showed, computed the
    shared experts on every rank, and the combine added them once per rank (0.91 relative
    error at W = 2). Two ranks are simulated: their outputs, summed, are the all-reduce."""
    num_shared, world = 1, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E + num_shared, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E + num_shared, H, I, generator=g) * I**-0.5
    placement = ExpertPlacement.contiguous(E, world, num_shared=num_shared)
    routed = moerunner.select_experts(torch.randn(T, E, generator=g), 2)
    topk = append_shared_slots(routed, placement)
    weights = ExpertWeights(w13, w2)
    total = torch.zeros(T, H, dtype=torch.float64)
    for rank in range(world):
        local = placement.standard_map(rank)
        assert (local[E:] >= 0).all() == (rank == 0)
        dispatched = StandardDispatcher(local).dispatch(x, topk)
        mine = shard_expert_weights(weights, placement, rank)
        out = moerunner.fused_moe(
            x, mine.w13, mine.w2, dispatched.topk.weights, dispatched.topk.ids
        )
        total += out.double()
    want = moerunner.reference_moe(x.double(), weights, topk.weights, topk.ids, "silu")
    assert_close(total, want, DTYPE_BOUND[torch.float32] * world)


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_a_rank_outside_the_placement_is_refused(rank):
    """Ranks outside ``[0, world_size)`` gave an empty map and an empty shard (a rank that
    silently computes nothing)."""
    placement = ExpertPlacement.contiguous(4, 2)
    weights = ExpertWeights(torch.randn(4, 8, 4), torch.randn(4, 4, 4))
    for call in (
        lambda: placement.expert_map(rank),
        lambda: placement.standard_map(rank),
        lambda: placement.num_local(rank),
        lambda: placement.routing_table(rank),
        lambda: shard_expert_weights(weights, placement, rank),
    ):
        with pytest.raises(MoeInputError, match=r"rank must be in \[0, world_size=2\)"):
            call()
    with pytest.raises(TypeError, match="rank must be an int"):
        placement.expert_map(1.0)


@pytest.mark.parametrize("weight", [torch.ones(7), torch.ones(6, 3)], ids=["T+1", "S+1"])
def test_a_shared_slot_weight_of_the_wrong_shape_is_named(weight):
    placement = ExpertPlacement.contiguous(8, 2, num_shared=2)
    topk = moerunner.select_experts(torch.randn(6, 8), 2)
    with pytest.raises(MoeInputError, match=r"append_shared_slots: weight must be"):
        append_shared_slots(topk, placement, weight)
    for fine in (0.5, torch.ones(6), torch.ones(6, 2), torch.ones(6, 1)):
        assert append_shared_slots(topk, placement, fine).ids.shape == (6, 4)


def _peer_call():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, H, generator=g)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    weights, ids, _ = vllm.fused_topk(x, torch.randn(3, E, generator=g), 1, False)
    return x, w1, w2, weights, ids


@pytest.mark.parametrize("flag", ["inplace", "apply_router_weight_on_input"])
@pytest.mark.parametrize("value", ["yes", 1, torch.tensor(True)])
def test_peer_flags_must_be_bools(flag, value):
    """``inplace=1`` and ``apply_router_weight_on_input="yes"`` were taken as truth values
    (``is_act_and_mul="False"`` was already refused)."""
    x, w1, w2, weights, ids = _peer_call()
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        vllm.fused_experts(x, w1, w2, weights, ids, **{flag: value})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, "int32"])
def test_vllm_fused_topk_takes_integer_index_types_only(dtype):
    x = torch.randn(3, H)
    with pytest.raises(TypeError, match="indices_type must be None or an integer torch.dtype"):
        vllm.fused_topk(x, torch.randn(3, E), 2, True, indices_type=dtype)
    _, ids, _ = vllm.fused_topk(x, torch.randn(3, E), 2, True, indices_type=torch.int64)
    assert ids.dtype == torch.int64


def test_static_activation_scales_must_be_floating_as_every_other_scale():
    """``a1_scale=torch.tensor([1])`` was converted where an int ``w1_scale`` was refused."""
    x, w1, w2, weights, ids = _peer_call()
    fp8 = torch.float8_e4m3fn
    with pytest.raises(TypeError, match="a1_scale must be a floating tensor"):
        vllm.fused_experts(
            x.to(torch.bfloat16),
            w1.to(fp8),
            w2.to(fp8),
            weights,
            ids,
            use_fp8_w8a8=True,
            w1_scale=torch.ones(E),
            w2_scale=torch.ones(E),
            a1_scale=torch.tensor([1]),
        )


def test_sglang_routing_names_one_dimensional_router_logits():
    """1-D logits were reported as a token-count mismatch ('router_logits 8 rows')."""
    with pytest.raises(MoeInputError, match=r"router_logits must be a 2-D floating tensor"):
        sglang.select_experts(torch.randn(5, 16), torch.randn(8), sglang.TopKConfig(top_k=2))


def test_adapter_paths_given_as_bytes_and_a_null_peft_type_are_named(tmp_path):
    """A bytes path was iterated as a sequence ("adapters[0] ... got 47"); ``"peft_type":
    null`` was reported as 'NONE', a value the file does not hold."""
    from moerunner.lora_checkpoints import MoeModelShape, load_peft_adapters

    shape = MoeModelShape(num_experts=2, hidden_size=8, intermediate_size=4)
    with pytest.raises(TypeError, match=r"adapters must be a folder .* got b'/tmp/x'"):
        load_peft_adapters(b"/tmp/x", shape, layer=0)
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = {"peft_type": None, "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(MoeInputError, match="peft_type None; only LORA adapters are read"):
        load_peft_adapters(str(folder), shape, layer=0)


def test_append_shared_slots_names_arguments_of_the_wrong_type():
    """A string weight, routing as a tuple and no placement raised from inside torch or as
    AttributeErrors."""
    placement = ExpertPlacement.contiguous(8, 2, num_shared=2)
    topk = moerunner.select_experts(torch.randn(3, 8), 2)
    with pytest.raises(TypeError, match="weight must be a number or a tensor"):
        append_shared_slots(topk, placement, "x")
    with pytest.raises(TypeError, match="topk must be a TopK"):
        append_shared_slots((topk.weights, topk.ids), placement)
    with pytest.raises(TypeError, match="placement must be an ExpertPlacement"):
        append_shared_slots(topk, None)


def test_owners_may_be_numpy_integers():
    np = pytest.importorskip("numpy")
    placement = ExpertPlacement.from_owners(np.array([0, 0, 1, 1]), 2)
    assert placement.owner == (0, 0, 1, 1)
    assert all(type(r) is int for r in placement.owner)
