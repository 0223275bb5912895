"""Expert-parallel faults found by trying the layers as a user would (2 CPU ranks, gloo),
each against the float64 reference of the whole layer (``reference_moe``).

- The standard dispatcher added every shared expert once per rank (each rank holds them and
  sees every token; the all-reduce summed the copies).
- Given routing whose shapes did not fit the tokens ran silently (wrong outputs on every
  rank); it is now refused on the rank that passed it, and every rank raises.
- Ranks built with different activations ran without an error.
- A rank whose weights could not be placed (5 experts over 2 ranks) raised alone, and the
  other waited in the layer's first collective until the group's timeout.
- ``ExpertParallelMoE`` held its experts as plain attributes: its ``state_dict`` was empty.
- ``MoE(config, placement=...)`` with shared experts in its placement, called with router
  logits, never ran them (its routing had no shared slots); given routing without them is
  now refused, and so is such routing given to an ``ExpertParallelMoE`` with the all_to_all
  dispatcher (its header exchange sees that no rank's ids reach the shared ones).
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
            if dispatcher == "all_to_all":  # routing without the shared slots
                results["shared/no_slots"] = _outcome(lambda m=moe: m(x, topk))
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
    built = ExpertParallelMoE.from_global(_weights(E), dispatcher="all_to_all", backend="torch")
    other = ExpertParallelMoE.from_global(
        ExpertWeights(torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)),
        dispatcher="all_to_all",
        backend="torch",
    )
    other.load_state_dict(built.state_dict())  # this rank's shard
    with torch.no_grad():
        results["state_keys"] = sorted(built.state_dict())
        results["loaded"] = _outcome(lambda: other(x, topk))
    results["inputs"] = (x, topk, shared_topk)
    results.update(_routed_layer_with_shared(rank, world, x, placement))
    return results


def _routed_layer_with_shared(rank, world, x, placement) -> dict:
    """``MoE(config, placement)`` routing its own logits, with one shared expert."""
    from moerunner import MoE, MoeConfig
    from moerunner.dispatch.expert_map import shard_expert_weights

    results = {}
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(11))
    cfg = MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    local = shard_expert_weights(_weights(E + 1), placement, rank)
    for dispatcher in ("standard", "all_to_all"):
        moe = MoE(cfg, backend="torch", dispatcher=dispatcher, placement=placement)
        with torch.no_grad():
            moe.w13.copy_(local.w13)
            moe.w2.copy_(local.w2)
            results[f"routed_shared/{dispatcher}"] = _outcome(lambda m=moe: m(x, logits))
            given = TopK(*_softmax_topk(logits))  # the routed slots alone
            results[f"given_no_shared/{dispatcher}"] = _outcome(lambda m=moe, t=given: m(x, topk=t))
    results["logits"] = logits
    return results


def _softmax_topk(logits):
    """float64 softmax top-k (the config's routing: softmax, no renormalisation)."""
    probs = logits.double().softmax(dim=-1)
    w, ids = probs.topk(K, dim=-1)
    return w.float(), ids.to(torch.int32)


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


@pytest.mark.parametrize("dispatcher", ["standard", "all_to_all"])
def test_a_routing_layer_runs_its_placements_shared_experts(results, dispatcher):
    x = results[0]["inputs"][0]
    w, ids = _softmax_topk(results[0]["logits"])
    shared_w = torch.ones(T, 1)
    shared_ids = torch.full((T, 1), E, dtype=torch.int32)  # the shared expert's global id
    ref = reference_moe(
        x, _weights(E + 1), torch.cat([w, shared_w], 1), torch.cat([ids, shared_ids], 1)
    )
    for rank, r in enumerate(results):
        got = r[f"routed_shared/{dispatcher}"]
        assert got["error"] is None, (rank, got["error"])
        assert_close(got["out"], ref, error_bound(torch.float32, False), what=f"rank {rank}")


@pytest.mark.parametrize("dispatcher", ["standard", "all_to_all"])
def test_given_routing_without_the_shared_slots_is_refused(results, dispatcher):
    errors = {r[f"given_no_shared/{dispatcher}"]["error"] for r in results}
    assert len(errors) == 1, errors  # every rank failed its own check alike: each raises it
    (error,) = errors
    assert error is not None and error[0] == "MoeInputError", error
    assert "append_shared_slots" in error[1], error


def test_an_expert_parallel_layers_state_is_its_shard(results):
    x, topk, _ = results[0]["inputs"]
    ref = reference_moe(x, _weights(E), topk.weights, topk.ids)
    for rank, r in enumerate(results):
        assert r["state_keys"] == ["w13", "w2"], r["state_keys"]
        assert r["loaded"]["error"] is None, (rank, r["loaded"]["error"])
        assert_close(r["loaded"]["out"], ref, error_bound(torch.float32, False), what=f"{rank}")


def test_routing_without_the_shared_slots_is_refused_by_all_to_all(results):
    errors = {r["shared/no_slots"]["error"] for r in results}
    assert len(errors) == 1, errors  # the same on every rank
    (error,) = errors
    assert error is not None and error[0] == "MoeInputError", error
    assert "no shared-expert slots" in error[1] and "append_shared_slots" in error[1], error


def _bigger_world(rank: int, world: int) -> dict:
    from moerunner import MoE, MoeConfig
    from moerunner.dispatch.expert_map import ExpertPlacement

    placement = ExpertPlacement.contiguous(E, 2 * world)  # made for twice the group
    out = {}
    for dispatcher in ("standard", "all_to_all"):
        out[dispatcher] = _outcome(
            lambda d=dispatcher: MoE(
                MoeConfig(E, H, I, K), dispatcher=d, placement=placement, backend="torch"
            )
        )["error"]
    return out


def test_a_placement_for_more_ranks_than_the_group_is_refused_on_every_rank():
    """The standard dispatcher took a placement made for 4 ranks on a group of 2: the experts
    of ranks 2 and 3 belonged to nobody and their share of the output was missing (no
    error; all_to_all and masked refused). Every rank now raises the same error."""
    results = run_world(_bigger_world, world_size=2)
    for rank_result in results:
        for dispatcher in ("standard", "all_to_all"):
            kind, message = rank_result[dispatcher]
            assert kind == "MoeInputError", (dispatcher, kind, message)
            assert "placement is for world_size=4 but the process group has 2 ranks" in message
