"""Expert placement and tensor-parallel sharding, on one process (no group needed).

Tensor parallelism is checked by summing the shards' outputs, which is what the all-reduce of
the standard dispatcher does. Tolerance: fp32, the shards' sum only reorders GEMM2's
reduction over I, so 1e-5 of the output scale; against the float64 reference 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from moerunner import ExpertWeights, MoeInputError, fused_moe, reference_moe
from moerunner.dispatch.expert_map import (
    ExpertPlacement,
    append_shared_slots,
    shard_expert_weights,
)
from moerunner.dispatch.tensor_parallel import intermediate_shard, shard_intermediate
from moerunner.routing import TopK


def test_contiguous_and_permuted_tables():
    p = ExpertPlacement.contiguous(8, 4)
    assert p.global_ids(2) == [4, 5]
    assert p.expert_map(1).tolist() == [-1, -1, 0, 1, -1, -1, -1, -1]
    q = ExpertPlacement.from_permutation([3, 0, 2, 1], 2)
    assert q.global_ids(0) == [3, 0] and q.global_ids(1) == [2, 1]
    dest, local = q.routing_table(0)
    assert dest.tolist() == [0, 1, 1, 0] and local.tolist() == [1, 1, 0, 0]
    assert p.fingerprint() != ExpertPlacement.contiguous(8, 2).fingerprint()


def test_shared_experts_are_local_slots_on_every_rank():
    p = ExpertPlacement.from_owners([0, 0, 0, 1], 2, num_shared=1)
    assert p.global_ids(0) == [0, 1, 2, 4] and p.global_ids(1) == [3, 4]
    for rank in (0, 1):
        dest, local = p.routing_table(rank)
        assert dest[4] == rank and local[4] == p.num_local(rank) - 1
    topk = TopK(torch.rand(3, 2), torch.tensor([[0, 3]] * 3, dtype=torch.int32))
    extended = append_shared_slots(topk, p, weight=torch.tensor([1.0, 2.0, 3.0]))
    assert extended.ids[:, 2].tolist() == [4, 4, 4]
    assert extended.weights[:, 2].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: ExpertPlacement.contiguous(6, 4), "not divisible by world_size=4"),
        (lambda: ExpertPlacement.from_permutation([0, 0, 1, 2], 2), "permutation"),
        (lambda: ExpertPlacement.from_owners([0, 2], 2), "owners must be ranks in [0, 2)"),
        (lambda: ExpertPlacement((0, 0), (0, 0), 1), "local ids of rank 0"),
    ],
)
def test_placement_errors(build, words):
    with pytest.raises(MoeInputError, match=words.replace("[", r"\[").replace(")", r"\)")):
        build()


def test_shard_expert_weights_picks_local_slots():
    w = ExpertWeights(
        torch.arange(3.0)[:, None, None].expand(3, 4, 2).clone(), torch.zeros(3, 2, 2)
    )
    p = ExpertPlacement.from_owners([1, 0], 2, num_shared=1)
    local = shard_expert_weights(w, p, 0)
    assert local.w13[:, 0, 0].tolist() == [1.0, 2.0]  # routed expert 1, then shared expert 2


def test_shard_expert_weights_quantized():
    from moerunner.quant import quantize

    w13 = torch.randn(4, 64, 32)
    w = ExpertWeights(quantize(w13, "fp8_channel"), quantize(torch.randn(4, 32, 32), "fp8_channel"))
    local = shard_expert_weights(w, ExpertPlacement.from_permutation([2, 0, 3, 1], 2), 1)
    assert local.w13.shape == (2, 64, 32)
    assert torch.equal(local.w13.dequantize(), w.w13.dequantize()[[3, 1]])


def test_intermediate_shards_cover_i():
    from moerunner.bench.presets import PRESETS

    nemotron_i = PRESETS["nemotron-h"].intermediate_size  # 961 per rank at TP 8
    assert [intermediate_shard(nemotron_i, r, 8) for r in (0, 7)] == [(0, 961), (6727, 961)]
    assert [intermediate_shard(10, r, 4)[1] for r in range(4)] == [3, 3, 2, 2]


@pytest.mark.parametrize(
    "activation, interleaved, bias",
    [
        ("silu", False, True),
        ("swiglu_oai", True, True),
        ("relu2", False, False),
    ],
)
@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_sum_equals_unsharded(activation, interleaved, bias, tp):
    g = torch.Generator().manual_seed(tp)
    e, h, i, t, k = 4, 32, 37, 9, 2  # 37 / tp is never 16-aligned: every shard is padded
    gated = activation != "relu2"
    rows = 2 * i if gated else i
    w = ExpertWeights(
        torch.randn(e, rows, h, generator=g) * h**-0.5,
        torch.randn(e, h, i, generator=g) * i**-0.5,
        torch.randn(e, rows, generator=g) if bias else None,
        torch.randn(e, h, generator=g) if bias else None,
        interleaved,
    )
    x = torch.randn(t, h, generator=g)
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k].to(torch.int32)
    tw = torch.rand(t, k, generator=g)

    def run(weights):
        return fused_moe(
            x,
            weights.w13,
            weights.w2,
            tw,
            ids,
            activation=activation,
            w13_bias=weights.w13_bias,
            w2_bias=weights.w2_bias,
            gate_up_interleaved=weights.gate_up_interleaved,
            backend="torch",
        )

    shards = [shard_intermediate(w, activation, r, tp) for r in range(tp)]
    longest = -(-i // tp)
    assert {s.w2.shape[2] for s in shards} == {-(-longest // 16) * 16}  # one padded size
    total = sum(run(s) for s in shards)
    want = run(w)
    scale = want.abs().max().item()
    assert (total - want).abs().max().item() <= 1e-5 * scale
    ref = reference_moe(x, w, tw, ids, activation)
    assert (total.double() - ref).abs().max().item() <= 1e-4 * scale
