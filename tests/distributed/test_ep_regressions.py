"""Expert-parallel faults found by trying the layers as a user would (2 CPU ranks, gloo),
each against the float64 reference of the whole layer (``reference_moe``).

- The standard dispatcher added every shared expert once per rank (each rank holds them and
  sees every token; the all-reduce summed the copies).
- Given routing whose shapes did not fit the tokens ran silently (wrong outputs on every
  rank); it is now refused on the rank that passed it, and every rank raises.
- Ranks built with different activations ran without an error.
- A rank whose weights could not be placed (5 experts over 2 ranks) raised alone, and the
  other waited in the layer's first collective until the group's timeout.
"""

from __future__ import annotations

import pytest
import torch

from moerunner import ExpertWeights, reference_moe
from moerunner.routing import TopK
from moerunner.testing import assert_close, error_bound

from .worlds import run_world

E, H, I, K, T = 4, 32, 16, 2, 6


def _weights(num: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    return ExpertWeights(
        torch.randn(num, 2 * I, H, generator=g), torch.randn(num, H, I, generator=g)
    )


def _outcome(fn):
    try:
        return {"out": fn(), "error": None}
    except Exception as exc:  # noqa: BLE001  (the test checks which ranks raise, and how)
        return {"out": None, "error": (type(exc).__name__, str(exc))}


def scenarios(rank: int, world: int) -> dict:
    from moerunner.dispatch.expert_map import ExpertPlacement, append_shared_slots
    from moerunner.distributed_moe import ExpertParallelMoE

    results = {}
    g = torch.Generator().manual_seed(7)  # every rank the same tokens (standard dispatch)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    topk = TopK(torch.rand(T, K, generator=g), ids)
    placement = ExpertPlacement.contiguous(E, world, num_shared=1)
    shared_topk = append_shared_slots(topk, placement, 0.5)
    weights = _weights(E + 1)
    for dispatcher in ("standard", "all_to_all"):
        moe = ExpertParallelMoE.from_global(
            weights, placement=placement, dispatcher=dispatcher, backend="torch"
        )
        with torch.no_grad():
            results[f"shared/{dispatcher}"] = _outcome(lambda m=moe: m(x, shared_topk))
    moe = ExpertParallelMoE.from_global(_weights(E), dispatcher="standard", backend="torch")
    bad = TopK(topk.weights[:3], topk.ids[:3]) if rank == 1 else topk
    with torch.no_grad():
        results["short_routing"] = _outcome(lambda: moe(x, bad))
        results["after"] = _outcome(lambda: moe(x, topk))  # the group still works
    act = ["silu", "gelu"][rank % 2]
    results["activation"] = _outcome(
        lambda: ExpertParallelMoE.from_global(
            _weights(E), dispatcher="all_to_all", backend="torch", activation=act
        )
    )
    uneven = _weights(E + (1 if rank == 1 else 0))  # rank 1 loaded another checkpoint
    results["uneven_build"] = _outcome(
        lambda: ExpertParallelMoE.from_global(uneven, dispatcher="all_to_all", backend="torch")
    )
    results["inputs"] = (x, topk, shared_topk)
    return results


@pytest.fixture(scope="module")
def results():
    return run_world(scenarios, 2, collective_timeout_s=10.0, deadline_s=120.0)


@pytest.mark.parametrize("dispatcher", ["standard", "all_to_all"])
def test_shared_expert_counted_once(results, dispatcher):
    x, _, shared_topk = results[0]["inputs"]
    ref = reference_moe(x, _weights(E + 1), shared_topk.weights, shared_topk.ids)
    for rank, r in enumerate(results):
        got = r[f"shared/{dispatcher}"]
        assert got["error"] is None, (rank, got["error"])
        assert_close(got["out"], ref, error_bound(torch.float32, False), what=f"rank {rank}")


def test_routing_that_does_not_fit_the_tokens_is_refused_on_every_rank(results):
    messages = {r["short_routing"]["error"] for r in results}
    assert len(messages) == 1
    (error,) = messages
    assert error is not None and error[0] == "RankFailedError"
    assert "failed on rank 1" in error[1] and "topk_ids has T=3 rows" in error[1]
    x, topk, _ = results[0]["inputs"]
    ref = reference_moe(x, _weights(E), topk.weights, topk.ids)
    for r in results:
        assert_close(r["after"]["out"], ref, error_bound(torch.float32, False), what="after")


def test_ranks_with_different_activations_refuse_to_build(results):
    for rank, r in enumerate(results):
        error = r["activation"]["error"]
        assert error is not None, f"rank {rank} built a layer unlike the other rank's"
        assert "layout" in error[1] and "activation" in error[1], error


def test_a_build_failing_on_one_rank_fails_on_every_rank(results):
    for rank, r in enumerate(results):
        error = r["uneven_build"]["error"]
        assert error is not None and error[0] == "RankFailedError", (rank, error)
        assert "failed on rank 1" in error[1] and "not divisible" in error[1], error
