"""Expert-parallel dispatchers on gloo (2 and 4 CPU processes) against the single-process run.

One world per size runs every scenario (spawning is the expensive part); each test below
checks one scenario's per-rank results. Expected values are the single-process ``MoeRunner``
on all tokens with the full weights (the "same output" the dispatchers must reproduce) and
the float64 ``reference_moe``.

Tolerances (fp32): the distributed run does the same fp32 products per expert as the single
process; only the order of the per-token weighted sum may differ, so 1e-5 of the output's
scale bounds it (fp32 epsilon 1.2e-7 times a few terms, with margin). Against the float64
reference, fp32 GEMMs over H=32 / I=40 stay within 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch

from moerunner import Activation, ExpertWeights, MoeRunner, reference_moe
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.expert_map import ExpertPlacement, append_shared_slots
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.routing import TopK

from .worlds import run_world

E, H, I, K = 8, 32, 40, 3
TOKENS = {2: [5, 0], 4: [5, 0, 7, 3]}  # tokens per rank; rank 1 has none
SILU = Activation("silu")


def make_case(
    world: int, seed: int = 0, *, shared: int = 0, skew: bool = False, all_empty: bool = False
):
    """Full weights [E + shared] and each rank's tokens and routing (global ids)."""
    g = torch.Generator().manual_seed(seed)
    n = E + shared
    weights = ExpertWeights(
        torch.randn(n, 2 * I, H, generator=g) * H**-0.5, torch.randn(n, H, I, generator=g) * I**-0.5
    )
    per_rank = []
    for tokens in TOKENS[world]:
        tokens = 0 if all_empty else tokens
        x = torch.randn(tokens, H, generator=g)
        ids = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K]
        if skew:  # every token's first slot on expert 0: one expert takes all the load
            ids = torch.where(ids == 0, ids[:, :1], ids)
            ids[:, 0] = 0
        topk = TopK(weights=torch.rand(tokens, K, generator=g), ids=ids.to(torch.int32))
        per_rank.append((x, topk))
    return weights, per_rank


def single_process(weights: ExpertWeights, x: torch.Tensor, topk: TopK) -> torch.Tensor:
    """The single-process run the distributed ones must equal."""
    runner = MoeRunner("torch")
    spec = weights.spec(SILU)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(StandardDispatchOutput(hidden_states=x, topk=topk), prepared)


def _with_shared(topk: TopK, placement: ExpertPlacement) -> TopK:
    return append_shared_slots(topk, placement, weight=0.5)


# -- what every rank runs -------------------------------------------------------------------


def _run(name, fn):
    try:
        return {"out": fn(), "error": None}
    except Exception as exc:  # recorded; the tests assert which scenarios must raise
        return {"out": None, "error": (type(exc).__name__, str(exc))}


def scenarios(rank: int, world: int) -> dict:
    from moerunner.distributed_moe import ExpertParallelMoE

    results = {}
    weights, per_rank = make_case(world)
    x, topk = per_rank[rank]
    everyone_x = torch.cat([p[0] for p in per_rank])
    everyone_topk = TopK(
        torch.cat([p[1].weights for p in per_rank]), torch.cat([p[1].ids for p in per_rank])
    )
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(7))
    placements = {
        "contiguous": ExpertPlacement.contiguous(E, world),
        "permuted": ExpertPlacement.from_permutation(perm, world),
        # the last rank owns no expert; the others own uneven numbers
        "uneven": ExpertPlacement.from_owners([e % (world - 1) for e in range(E)], world),
    }

    def layer(dispatcher, placement, **kw):
        return ExpertParallelMoE.from_global(
            weights, placement=placement, dispatcher=dispatcher, backend="torch", **kw
        )

    for pname, placement in placements.items():
        results[f"all_to_all/{pname}"] = _run(
            pname, lambda p=placement: layer("all_to_all", p)(x, topk)
        )
        results[f"masked/{pname}"] = _run(
            pname, lambda p=placement: layer("masked", p, capacity=16)(x, topk)
        )
        results[f"standard/{pname}"] = _run(
            pname, lambda p=placement: layer("standard", p)(everyone_x, everyone_topk)
        )
    results["standard/tensor_parallel"] = _run(
        "tp",
        lambda: ExpertParallelMoE.from_global(
            weights, dispatcher="standard", shard="intermediate", backend="torch"
        )(everyone_x, everyone_topk),
    )

    def bf16_exact_combine():
        from moerunner.dispatch.all_to_all import AllToAllDispatcher

        wb = ExpertWeights(weights.w13.bfloat16(), weights.w2.bfloat16())
        moe = ExpertParallelMoE.from_global(wb, dispatcher="all_to_all", backend="torch")
        moe.dispatcher = AllToAllDispatcher(moe.placement, combine_dtype=torch.float32)
        return moe(x.bfloat16(), topk)

    results["all_to_all/bf16_fp32_combine"] = _run("bf16", bf16_exact_combine)

    def bf16_combine_argument():  # the layers' own argument for the same dispatcher
        from moerunner import MoE

        wb = ExpertWeights(weights.w13.bfloat16(), weights.w2.bfloat16())
        moe = ExpertParallelMoE.from_global(
            wb, dispatcher="all_to_all", backend="torch", combine_dtype=torch.float32
        )
        layer = MoE.from_weights(
            moe.weights, dispatcher="all_to_all", placement=moe.placement,
            combine_dtype=torch.float32, backend="torch", num_experts=E,
        )  # fmt: skip
        return moe(x.bfloat16(), topk), layer(x.bfloat16(), topk=topk), moe.dispatcher.combine_dtype

    results["all_to_all/bf16_combine_argument"] = _run("bf16", bf16_combine_argument)
    results["masked/combine_dtype"] = _run(
        "m32",
        lambda: ExpertParallelMoE.from_global(
            weights, dispatcher="masked", capacity=16, combine_dtype=torch.float32
        ),
    )
    results["all_to_all/combine_dtype_rank1"] = _run(  # one rank asks for another precision
        "a32",
        lambda: ExpertParallelMoE.from_global(
            weights, dispatcher="all_to_all", combine_dtype=torch.float32 if rank == 1 else None
        ),
    )

    def standard_bf16(reduce_dtype):
        from moerunner.dispatch.standard import StandardDispatcher

        wb = ExpertWeights(weights.w13.bfloat16(), weights.w2.bfloat16())
        moe = ExpertParallelMoE.from_global(wb, dispatcher="standard", backend="torch")
        moe.dispatcher = StandardDispatcher(
            moe.placement.expert_map(rank), moe.group, reduce_dtype=reduce_dtype
        )
        return moe(everyone_x.bfloat16(), everyone_topk)

    results["standard/bf16_fp32_reduce"] = _run("r32", lambda: standard_bf16(torch.float32))
    results["standard/bf16_hidden_reduce"] = _run("r16", lambda: standard_bf16(None))

    # Skewed load: every token's first slot on expert 0.
    skew_w, skew = make_case(world, seed=3, skew=True)
    sx, stopk = skew[rank]
    results["all_to_all/skewed"] = _run(
        "skew",
        lambda: ExpertParallelMoE.from_global(skew_w, dispatcher="all_to_all", backend="torch")(
            sx, stopk
        ),
    )
    results["masked/skewed"] = _run(
        "skew",
        lambda: ExpertParallelMoE.from_global(
            skew_w, dispatcher="masked", capacity=16, backend="torch"
        )(sx, stopk),
    )
    # Capacity 2 < the 5 to 15 rows expert 0 receives: raise on every rank, or flag.
    results["masked/overflow_raise"] = _run(
        "ovf",
        lambda: ExpertParallelMoE.from_global(
            skew_w, dispatcher="masked", capacity=2, backend="torch"
        )(sx, stopk),
    )

    def flagged():
        moe = ExpertParallelMoE.from_global(
            skew_w, dispatcher="masked", capacity=2, on_overflow="flag", backend="torch"
        )
        dispatched = moe.dispatcher.dispatch(sx, stopk)
        moe(sx, stopk)  # the layer records the step's flag instead of syncing on it
        ok = ExpertParallelMoE.from_global(
            skew_w, dispatcher="masked", capacity=16, on_overflow="flag", backend="torch"
        )
        return {
            "overflow": bool(dispatched.overflow),
            "layer_flag": bool(moe.last_overflow),
            "no_overflow": bool(ok.dispatcher.dispatch(sx, stopk).overflow),
            "shape": tuple(dispatched.hidden_states.shape),
        }

    results["masked/overflow_flag"] = _run("flag", flagged)

    # Shared expert fused as an extra local slot on every rank.
    sh_w, sh = make_case(world, seed=5, shared=1)
    shx, shtopk = sh[rank]
    sh_place = ExpertPlacement.contiguous(E, world, num_shared=1)
    for kind, kw in (("all_to_all", {}), ("masked", {"capacity": 16})):
        results[f"{kind}/shared_expert"] = _run(
            "shared",
            lambda k=kind, kw=kw: ExpertParallelMoE.from_global(
                sh_w, placement=sh_place, dispatcher=k, backend="torch", **kw
            )(shx, _with_shared(shtopk, sh_place)),
        )

    # T = 0 on every rank at once.
    _, empty = make_case(world, all_empty=True)
    ex, etopk = empty[rank]
    for kind, kw in (("all_to_all", {}), ("masked", {"capacity": 4})):
        results[f"{kind}/all_empty"] = _run(
            "empty",
            lambda k=kind, kw=kw: ExpertParallelMoE.from_global(
                weights, dispatcher=k, backend="torch", **kw
            )(ex, etopk),
        )

    # Misconfigured worlds: every rank must raise the same clear error, none may hang.
    odd = ExpertWeights(torch.zeros(world * 2 + 1, 2 * I, H), torch.zeros(world * 2 + 1, H, I))
    results["misconfig/indivisible"] = _run(
        "indiv",
        lambda: ExpertParallelMoE.from_global(odd, dispatcher="all_to_all", backend="torch"),
    )
    wide = torch.randn(x.shape[0], H + 8) if rank == world - 1 else x
    results["misconfig/hidden_all_to_all"] = _run(
        "h", lambda: layer("all_to_all", placements["contiguous"]).dispatcher.dispatch(wide, topk)
    )
    results["misconfig/capacity_masked"] = _run(
        "cap", lambda: layer("masked", placements["contiguous"], capacity=8 + rank)
    )
    mine = placements["permuted"] if rank == 0 else placements["contiguous"]
    results["misconfig/placement"] = _run("pl", lambda: layer("all_to_all", mine))
    narrow = ExpertWeights(
        weights.w13[:, :, : H - 8] if rank == 0 else weights.w13,
        weights.w2[:, : H - 8] if rank == 0 else weights.w2,
    )
    results["misconfig/weights_hidden"] = _run(
        "wh",
        lambda: ExpertParallelMoE.from_global(narrow, dispatcher="all_to_all", backend="torch"),
    )
    # After all those errors the group still works: one clean exchange at the end.
    results["after_errors"] = _run(
        "after", lambda: layer("all_to_all", placements["contiguous"])(x, topk)
    )
    return results


# -- the tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world(request):
    return request.param, run_world(scenarios, request.param)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not torch.isnan(got).any()
    scale = want.abs().max().item() if want.numel() else 1.0
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert err <= rtol * max(scale, 1e-6), f"max abs error {err:.3g} vs scale {scale:.3g}"


def _expect_per_rank(results, name, world, case_kw=None, shared=None):
    weights, per_rank = make_case(world, **(case_kw or {}))
    for rank, (x, topk) in enumerate(per_rank):
        record = results[rank][name]
        assert record["error"] is None, f"rank {rank}: {record['error']}"
        if shared is not None:
            topk = _with_shared(topk, shared)
        want = single_process(weights, x, topk) if x.shape[0] else torch.empty(0, H)
        _close(record["out"], want, 1e-5)
        ref = reference_moe(x, weights, topk.weights, topk.ids, SILU)
        _close(record["out"], ref, 1e-4)


@pytest.mark.parametrize("placement", ["contiguous", "permuted", "uneven"])
@pytest.mark.parametrize("kind", ["all_to_all", "masked"])
def test_token_exchange_equals_single_process(world, kind, placement):
    size, results = world
    _expect_per_rank(results, f"{kind}/{placement}", size)


@pytest.mark.parametrize(
    "name",
    ["standard/contiguous", "standard/permuted", "standard/uneven", "standard/tensor_parallel"],
)
def test_standard_ownership_and_tensor_parallel(world, name):
    size, results = world
    weights, per_rank = make_case(size)
    x = torch.cat([p[0] for p in per_rank])
    topk = TopK(
        torch.cat([p[1].weights for p in per_rank]), torch.cat([p[1].ids for p in per_rank])
    )
    want = single_process(weights, x, topk)
    for rank in range(size):
        assert results[rank][name]["error"] is None, results[rank][name]["error"]
        _close(results[rank][name]["out"], want, 1e-5)


def test_all_to_all_bf16_with_fp32_combine(world):
    # bf16 experts; partial sums travel back in fp32, so the only rounding left is the final
    # one, as in the single process: results within one bf16 ulp (2^-8) of the largest value.
    size, results = world
    weights, per_rank = make_case(size)
    wb = ExpertWeights(weights.w13.bfloat16(), weights.w2.bfloat16())
    for rank, (x, topk) in enumerate(per_rank):
        record = results[rank]["all_to_all/bf16_fp32_combine"]
        assert record["error"] is None, record["error"]
        assert record["out"].dtype == torch.bfloat16
        want = single_process(wb, x.bfloat16(), topk) if x.shape[0] else torch.empty(0, H)
        _close(record["out"], want.bfloat16(), 2**-8)


def test_combine_dtype_argument_of_the_layers(world):
    """``combine_dtype=torch.float32`` on ``ExpertParallelMoE`` and ``MoE.from_weights`` builds
    the same dispatcher as assigning one by hand: bit-equal outputs."""
    size, results = world
    for rank in range(size):
        by_hand = results[rank]["all_to_all/bf16_fp32_combine"]
        record = results[rank]["all_to_all/bf16_combine_argument"]
        assert record["error"] is None, record["error"]
        ep_out, layer_out, wire = record["out"]
        assert wire == torch.float32
        assert torch.equal(ep_out, by_hand["out"]) and torch.equal(layer_out, by_hand["out"])


def test_combine_dtype_refused_by_masked_and_checked_across_ranks(world):
    size, results = world
    for rank in range(size):
        error = results[rank]["masked/combine_dtype"]["error"]
        assert error is not None and "option of the 'all_to_all' dispatcher" in error[1], error
        error = results[rank]["all_to_all/combine_dtype_rank1"]["error"]
        assert error == ("MoeInputError", error[1]) and "disagree on combine_dtype" in error[1]


def test_standard_bf16_reduces_in_fp32(world):
    # Default fp32 reduction: each rank weights and sums its unweighted bf16 expert rows in
    # fp32 and the all-reduce adds fp32 partials, so the result is the single process's fp32
    # sum rounded once; only the order of fp32 additions differs (a rounding flip at most:
    # one bf16 ulp, 2^-7 of the value). Summing bf16-rounded partials (reduce_dtype=None)
    # adds one rounding per rank (about 2^-8 each), so it is held to a looser 2^-6.
    size, results = world
    weights, per_rank = make_case(size)
    wb = ExpertWeights(weights.w13.bfloat16(), weights.w2.bfloat16())
    x = torch.cat([p[0] for p in per_rank]).bfloat16()
    topk = TopK(
        torch.cat([p[1].weights for p in per_rank]), torch.cat([p[1].ids for p in per_rank])
    )
    want = single_process(wb, x, topk)
    for rank in range(size):
        exact, rounded = (results[rank][f"standard/bf16_{n}_reduce"] for n in ("fp32", "hidden"))
        assert exact["error"] is None and rounded["error"] is None, (exact, rounded)
        assert exact["out"].dtype == rounded["out"].dtype == torch.bfloat16
        _close(exact["out"], want, 2**-7)
        _close(rounded["out"], want, 2**-6)
        if rank:  # every rank holds the same sum
            assert torch.equal(exact["out"], results[0]["standard/bf16_fp32_reduce"]["out"])


@pytest.mark.parametrize("kind", ["all_to_all", "masked"])
def test_skewed_load(world, kind):
    size, results = world
    _expect_per_rank(results, f"{kind}/skewed", size, {"seed": 3, "skew": True})


@pytest.mark.parametrize("kind", ["all_to_all", "masked"])
def test_shared_expert_as_local_slot(world, kind):
    size, results = world
    _expect_per_rank(
        results,
        f"{kind}/shared_expert",
        size,
        {"seed": 5, "shared": 1},
        shared=ExpertPlacement.contiguous(E, size, num_shared=1),
    )


@pytest.mark.parametrize("kind", ["all_to_all", "masked"])
def test_every_rank_empty(world, kind):
    size, results = world
    for rank in range(size):
        record = results[rank][f"{kind}/all_empty"]
        assert record["error"] is None, record["error"]
        assert record["out"].shape == (0, H)


def test_masked_overflow_raises_on_every_rank(world):
    size, results = world
    for rank in range(size):
        error = results[rank]["masked/overflow_raise"]["error"]
        assert error is not None and error[0] == "CapacityOverflowError", error
        assert "capacity is 2" in error[1]


def test_masked_overflow_flag_without_sync(world):
    size, results = world
    for rank in range(size):
        out = results[rank]["masked/overflow_flag"]["out"]
        want = {
            "overflow": True,
            "layer_flag": True,
            "no_overflow": False,
            "shape": (E // size, 2, H),
        }
        assert out == want, out


@pytest.mark.parametrize(
    "name, words",
    [
        ("misconfig/indivisible", "not divisible by world_size"),
        ("misconfig/hidden_all_to_all", "hidden size H differs across ranks"),
        ("misconfig/capacity_masked", "ranks disagree on capacity"),
        ("misconfig/placement", "ranks disagree on placement"),
        ("misconfig/weights_hidden", "ranks disagree on hidden_size"),
    ],
)
def test_misconfigured_world_fails_on_every_rank(world, name, words):
    size, results = world
    for rank in range(size):
        error = results[rank][name]["error"]
        assert error is not None and error[0] == "MoeInputError", (rank, error)
        assert words in error[1], (rank, error[1])


def test_group_usable_after_errors(world):
    size, results = world
    _expect_per_rank(results, "after_errors", size)
