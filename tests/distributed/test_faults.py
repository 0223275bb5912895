"""Faults on one rank of an expert-parallel world (gloo, 2 and 4 CPU processes).

Rank 1 alone gets bad input (wrong H, an out-of-range id, an unsupported dtype, a dtype its
weights do not have) or an exception inside its expert computation. Every rank must then
raise the same error type with a message naming rank 1, quickly (collectives time out after
10 s, the world after 90 s, so a hang fails the test instead of blocking CI), and the group
must stay usable: a correct step afterwards matches the reference on every rank.

Each world runs every scenario (spawning is the expensive part); the tests check one
scenario's per-rank outcomes. Tolerance of the closing correct step: fp32 GEMMs over
H = 16 / I = 24 stay within 1e-4 of the float64 reference (as in test_expert_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from moerunner import ExpertWeights, reference_moe
from moerunner.routing import TopK
from moerunner.testing import assert_close

from .worlds import run_world

E, H, I, K, T = 8, 16, 24, 2, 5
KINDS = {  # dispatcher name and keyword arguments of each layer kind
    "standard": ("standard", {}),
    "all_to_all": ("all_to_all", {}),
    "masked_raise": ("masked", {"capacity": 32, "on_overflow": "raise"}),
    "masked_flag": ("masked", {"capacity": 32, "on_overflow": "flag"}),
}
FAULTS = ("wrong_shape", "out_of_range_id", "wrong_dtype", "other_dtype", "expert_raises")


def _case(rank: int, kind: str):
    g = torch.Generator().manual_seed(11)
    weights = ExpertWeights(
        torch.randn(E, 2 * I, H, generator=g) * H**-0.5,
        torch.randn(E, H, I, generator=g) * I**-0.5,
    )
    # standard: every rank passes the same tokens; the others: each rank its own.
    g.manual_seed(100 if kind == "standard" else 100 + rank)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    return weights, x, TopK(torch.rand(T, K, generator=g), ids)


def _outcome(fn):
    try:
        return {"out": fn(), "error": None}
    except Exception as exc:  # noqa: BLE001  (the tests check which scenarios raise, and how)
        return {"out": None, "error": (type(exc).__name__, str(exc))}


def _faulty_inputs(fault: str, rank: int, x: torch.Tensor, topk: TopK):
    if rank != 1:
        return x, topk
    if fault == "wrong_shape":
        return torch.randn(T, H + 1), topk
    if fault == "out_of_range_id":
        ids = topk.ids.clone()
        ids[0, 0] = E + 3
        return x, TopK(topk.weights, ids)
    if fault == "wrong_dtype":
        return x.double(), topk
    if fault == "other_dtype":  # accepted by the library, not by these fp32 weights
        return x.half(), topk
    return x, topk


def _bf16_first(rank: int, world: int):
    """A bf16 routed layer's very first call, with rank 1's hidden size wrong."""
    from moerunner import MoE, MoeConfig
    from moerunner.dispatch.expert_map import ExpertPlacement

    layer = MoE(
        MoeConfig(E, H, I, K),
        dtype=torch.bfloat16,
        backend="torch",
        dispatcher="masked",
        placement=ExpertPlacement.contiguous(E, world),
        capacity=32,
    )
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, H + (1 if rank == 1 else 0), generator=g).bfloat16()
    with torch.no_grad():
        return layer(x, torch.randn(4, E, generator=g))


def scenarios(rank: int, world: int) -> dict:
    from moerunner.distributed_moe import ExpertParallelMoE

    results = {}
    for kind, (dispatcher, kw) in KINDS.items():
        weights, x, topk = _case(rank, kind)
        moe = ExpertParallelMoE.from_global(weights, dispatcher=dispatcher, backend="torch", **kw)
        if kind == "all_to_all":  # a failure in the layer's very first call (see the test)
            bad_x, _ = _faulty_inputs("wrong_shape", rank, x, topk)
            results[f"{kind}/first_call"] = _outcome(lambda bx=bad_x, m=moe, t=topk: m(bx, t))
        if kind == "masked_raise":  # the same in a bf16 layer, whose stand-in was fp32
            results["masked_bf16/first_call"] = _outcome(lambda r=rank, w=world: _bf16_first(r, w))
        results[f"{kind}/warmup"] = _outcome(lambda m=moe, x=x, t=topk: m(x, t))
        for fault in FAULTS:
            bad_x, bad_topk = _faulty_inputs(fault, rank, x, topk)
            if fault == "expert_raises" and rank == 1:
                original = moe.runner.run

                def broken(*args, **kwargs):
                    raise RuntimeError("injected expert failure")

                moe.runner.run = broken
            results[f"{kind}/{fault}"] = _outcome(
                lambda bx=bad_x, bt=bad_topk, m=moe: (m(bx, bt), m.last_overflow)
            )
            if fault == "expert_raises" and rank == 1:
                moe.runner.run = original
        # Every rank bf16 with fp32 weights: the experts could not take the rows (an
        # internal "Expected out tensor to have dtype float" before); a TypeError instead.
        if kind != "masked_flag":  # (flag mode carries rows in the wire dtype)
            results[f"{kind}/all_bf16"] = _outcome(lambda m=moe, x=x, t=topk: m(x.bfloat16(), t))
        if kind == "standard":  # every rank must pass the same tokens; rank 1 passes fewer
            for rows in (3, 0):
                mine = rows if rank == 1 else T
                part = TopK(topk.weights[:mine], topk.ids[:mine])
                results[f"standard/T{rows}"] = _outcome(lambda m=moe, x=x[:mine], t=part: m(x, t))
            # ... and the same routing: rank 1 routes with k + 1 (was a finite wrong sum)
            wider = TopK(
                torch.cat([topk.weights, topk.weights[:, :1]], 1),
                torch.cat([topk.ids, (topk.ids[:, :1] + 1) % E], 1),
            )
            mine = wider if rank == 1 else topk
            results["standard/top_k"] = _outcome(lambda m=moe, x=x, t=mine: m(x, t))
        # The group is still aligned: a correct step on every rank.
        results[f"{kind}/after"] = _outcome(lambda m=moe, x=x, t=topk: m(x, t))
        results[f"{kind}/input"] = (x, topk)

    # Dispatchers used directly: one rank's input fails the dispatcher's own checks.
    from moerunner.dispatch.all_to_all import AllToAllDispatcher
    from moerunner.dispatch.expert_map import ExpertPlacement
    from moerunner.dispatch.masked import MaskedDispatcher

    placement = ExpertPlacement.contiguous(E, world)
    _, x, topk = _case(rank, "all_to_all")
    one_d = x[0] if rank == 1 else x
    results["direct/all_to_all"] = _outcome(
        lambda: AllToAllDispatcher(placement).dispatch(one_d, topk)
    )
    results["direct/masked_raise"] = _outcome(
        lambda: MaskedDispatcher(placement, 32, H).dispatch(one_d, topk)
    )
    # "flag" mode (no host reads): rank 1 raised at once and the others waited forever in the
    # header exchange. Identity experts: a good rank's combine is x * sum of its weights.
    flagged = MaskedDispatcher(placement, 32, H, on_overflow="flag", dtype=torch.float32)

    def flag_step(dispatcher, rows):
        seen = {}
        try:
            out = dispatcher.dispatch(rows, topk)
            seen["overflow"] = bool(out.overflow)
            seen["combined"] = dispatcher.combine(out.hidden_states.clone(), out)
        except Exception as exc:  # noqa: BLE001
            seen["error"] = (type(exc).__name__, str(exc))
        return seen

    results["direct/masked_flag"] = flag_step(flagged, one_d)
    results["direct/masked_flag_after"] = flag_step(flagged, x)
    wrong_h = torch.randn(T, H + 1) if rank == 1 else x
    results["direct/masked_flag_h"] = flag_step(flagged, wrong_h)
    # Without a constructor dtype the first call agrees on one (a host read): every rank
    # raises there.
    first = MaskedDispatcher(placement, 32, H, on_overflow="flag")
    results["direct/masked_flag_first"] = _outcome(lambda: first.dispatch(one_d, topk))
    results["direct/masked_flag_first_after"] = flag_step(first, x)
    results["direct/input"] = (x, topk)

    # Construction: rank 1's placement disagrees with its layer (a local check).
    def build():
        from moerunner import MoE
        from moerunner.dispatch.expert_map import shard_expert_weights

        bad = ExpertPlacement.contiguous(E + world if rank == 1 else E, world)
        return MoE.from_weights(
            shard_expert_weights(_case(rank, "all_to_all")[0], placement, rank),
            num_experts=E,
            dispatcher="all_to_all",
            placement=bad,
            backend="torch",
        )

    results["construct/placement"] = _outcome(build)

    # Construction: an argument the layer (or the masked dispatcher) checks itself, invalid
    # on rank 1 alone. Rank 1 raised at once and the others waited in the consistency
    # exchange until the process group timed out.
    from moerunner import MoE, MoeConfig

    cfg = MoeConfig(E, H, I, K)
    bad = rank == 1
    for name, kwargs in (
        ("dtype", {"dispatcher": "all_to_all", "dtype": torch.float64 if bad else None}),
        ("backend", {"dispatcher": "all_to_all", "backend": "nope" if bad else "torch"}),
        (
            "on_overflow",
            {"dispatcher": "masked", "capacity": 32, "on_overflow": "drop" if bad else "raise"},
        ),
        ("capacity", {"dispatcher": "masked", "capacity": 0 if bad else 32}),
    ):
        results[f"construct/{name}"] = _outcome(
            lambda kw=kwargs: MoE(cfg, placement=placement, **kw)
        )
    results["construct/direct_masked"] = _outcome(
        lambda: MaskedDispatcher(placement, 0 if bad else 32, H)
    )

    # distributed.failing_together: a block that raises on rank 1 only.
    from moerunner.distributed import failing_together

    def block():
        with failing_together(None, "loading shards"):
            if rank == 1:
                raise OSError("shard file missing")
        return "ok"

    results["helper/failing_together"] = _outcome(block)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world(request):
    results = run_world(scenarios, request.param, collective_timeout_s=10.0, deadline_s=90.0)
    return request.param, results


def _assert_named_failure(results, key, words=()):
    """Every rank raised RankFailedError naming rank 1 (and only rank 1)."""
    messages = set()
    for rank, r in enumerate(results):
        error = r[key]["error"]
        assert error is not None, f"rank {rank} returned for {key}"
        assert error[0] == "RankFailedError", (rank, key, error)
        assert "failed on rank 1 (" in error[1], (rank, key, error[1])
        for word in words:
            assert word in error[1], (rank, key, word, error[1])
        messages.add(error[1])
    assert len(messages) == 1, f"{key}: ranks raised different messages: {messages}"


SYNCING = ("standard", "all_to_all", "masked_raise")


@pytest.mark.parametrize("kind", SYNCING)
@pytest.mark.parametrize(
    "fault, words",
    [
        ("wrong_shape", ("MoeInputError", f"last dim must be H={H}")),
        ("wrong_dtype", ("BackendUnavailableError", "float64")),
        ("expert_raises", ("RuntimeError: injected expert failure",)),
    ],
)
def test_one_rank_fails_every_rank_raises(world, kind, fault, words):
    _, results = world
    _assert_named_failure(results, f"{kind}/{fault}", words)


def test_other_dtype_on_one_rank(world):
    """fp16 hidden states on rank 1, fp32 weights and fp32 elsewhere: rank 1's own dtype
    check, carried by the all_to_all and masked ("raise") dispatchers' header exchange (it was
    their collective "dtype differs" check, which did not say which rank was wrong); "flag"
    mode converts rank 1's rows to the wire dtype (fp32) and back, a correct result
    (tests/test_probe_regressions.py D5)."""
    _, results = world
    for kind in ("all_to_all", "masked_raise"):
        _assert_named_failure(results, f"{kind}/other_dtype", ("rank 1: TypeError", "float16"))
    for rank, r in enumerate(results):
        assert r["masked_flag/other_dtype"]["error"] is None, (rank, r["masked_flag/other_dtype"])


def test_every_rank_in_another_dtype_than_the_weights_is_a_type_error(world):
    _, results = world
    for rank, r in enumerate(results):
        for kind in ("standard", "all_to_all", "masked_raise"):
            error = r[f"{kind}/all_bf16"]["error"]
            assert error is not None and error[0] == "TypeError", (rank, kind, error)
            assert "bfloat16" in error[1] and "float32" in error[1], error[1]


def test_standard_dispatch_with_another_token_count_on_one_rank(world):
    # Was: gloo aborted both processes (T = 5 and 3) or rank 0 waited forever (T = 4 and 0)
    # in the combine's all_reduce.
    _, results = world
    for rows in (3, 0):
        for rank, r in enumerate(results):
            error = r[f"standard/T{rows}"]["error"]
            assert error is not None and error[0] == "MoeInputError", (rank, rows, error)
            assert "T differs across ranks" in error[1] and f"rank 1: {rows}" in error[1]


def test_other_dtype_on_one_rank_standard(world):
    _, results = world
    _assert_named_failure(results, "standard/other_dtype", ("rank 1: TypeError",))


def test_out_of_range_id_on_one_rank(world):
    _, results = world
    # standard: rank 1 alone finds the id (its dispatch maps ids locally).
    _assert_named_failure(
        results, "standard/out_of_range_id", ("rank 1: MoeInputError", "standard dispatch")
    )
    # all_to_all and masked: the dispatchers' collective id check, naming rank 1's value.
    for rank, r in enumerate(results):
        for kind in ("all_to_all", "masked_raise"):
            error = r[f"{kind}/out_of_range_id"]["error"]
            assert error is not None and error[0] == "MoeInputError", (rank, kind, error)
            assert "expert ids must be" in error[1], error[1]


@pytest.mark.parametrize("fault", ["wrong_shape", "wrong_dtype", "expert_raises"])
def test_flag_mode_failing_rank_raises_others_finish(world, fault):
    """masked on_overflow="flag" reads nothing on the host: rank 1 raises after the step's
    exchanges, the others finish the step (no hang). The tokens rank 1's experts served come
    back as NaN (they came back as if those experts had output zero: a silently wrong
    result); every other token equals the reference."""
    size, results = world
    from moerunner.dispatch.expert_map import ExpertPlacement

    failed_experts = list(ExpertPlacement.contiguous(E, size).global_ids(1))
    for rank, r in enumerate(results):
        outcome = r[f"masked_flag/{fault}"]
        if rank == 1:
            assert outcome["error"] is not None and outcome["error"][0] == "RankFailedError"
            assert "failed on rank 1" in outcome["error"][1]
            continue
        assert outcome["error"] is None, (rank, outcome["error"])
        if fault != "expert_raises":  # failed before dispatch: the step's flag tells everyone
            assert bool(outcome["out"][1]), f"rank {rank}: the failed step was not flagged"
        out = outcome["out"][0]
        weights, _, _ = _case(rank, "masked_flag")
        x, topk = r["masked_flag/input"]
        served = torch.isin(topk.ids.long(), torch.tensor(failed_experts)).any(dim=1)
        assert torch.equal(torch.isnan(out).any(dim=1), served), (rank, served)
        if bool((~served).any()):
            ref = reference_moe(x[~served], weights, topk.weights[~served], topk.ids[~served])
            assert_close(out[~served], ref, 1e-4, what=f"rank {rank} unaffected tokens")


def test_flag_mode_out_of_range_id_is_flagged(world):
    _, results = world
    for rank, r in enumerate(results):
        outcome = r["masked_flag/out_of_range_id"]
        assert outcome["error"] is None, (rank, outcome["error"])
        assert bool(outcome["out"][1]), f"rank {rank}: overflow flag not set"


@pytest.mark.parametrize("kind", list(KINDS))
def test_group_usable_after_faults(world, kind):
    _, results = world
    for rank, r in enumerate(results):
        outcome = r[f"{kind}/after"]
        assert outcome["error"] is None, (rank, kind, outcome["error"])
        weights, _, _ = _case(rank, kind)
        x, topk = r[f"{kind}/input"]
        ref = reference_moe(x, weights, topk.weights, topk.ids)
        assert_close(outcome["out"], ref, 1e-4, what=f"rank {rank} {kind}")


def test_failure_in_the_first_call_all_to_all(world):
    """Before any good call the failing rank cannot know the top-k the others send with: its
    stand-in had the layer's top_k 1, and every rank raised the header check's "top_k
    differs across ranks" instead of the cause. The failure now rides in the header
    exchange (``dispatch(..., failure=)``)."""
    _, results = world
    _assert_named_failure(
        results, "all_to_all/first_call", ("rank 1: MoeInputError: hidden_states last dim",)
    )


def test_failure_in_the_first_call_of_a_bf16_masked_layer_names_the_real_error(world):
    # Was: the failing rank's stand-in batch was fp32, so every rank got "hidden dtype
    # differs across ranks" instead of rank 1's own error.
    _, results = world
    for rank, r in enumerate(results):
        error = r["masked_bf16/first_call"]["error"]
        assert error is not None and error[0] == "RankFailedError", (rank, error)
        assert "rank 1: MoeInputError: hidden_states last dim" in error[1], error[1]


def test_good_calls_between_faults(world):
    _, results = world
    for rank, r in enumerate(results):
        for kind in KINDS:
            assert r[f"{kind}/warmup"]["error"] is None, (rank, kind, r[f"{kind}/warmup"])


@pytest.mark.parametrize("kind", ["all_to_all", "masked_raise"])
def test_direct_dispatcher_local_check(world, kind):
    _, results = world
    _assert_named_failure(results, f"direct/{kind}", ("hidden_states must be a 2-D tensor",))


@pytest.mark.parametrize("case", ["masked_flag", "masked_flag_h"])
def test_direct_flag_dispatcher_local_check(world, case):
    """Rank 1's input fails its own checks: it takes part in the step with an empty batch and
    raises ``RankFailedError`` in ``combine``, after the exchange; every rank's overflow flag is
    set and the other ranks' results are correct; the next good step is clean."""
    _, results = world
    cause = "2-D tensor" if case == "masked_flag" else f"dispatcher was built for H={H}"
    for rank, r in enumerate(results):
        step, after = r[f"direct/{case}"], r["direct/masked_flag_after"]
        assert step["overflow"] is True, (rank, step)
        x, topk = r["direct/input"]
        expected = x * topk.weights.sum(1, keepdim=True)
        if rank == 1:
            assert step["error"][0] == "RankFailedError", step
            assert "failed on rank 1" in step["error"][1] and cause in step["error"][1], step
        else:
            assert "error" not in step, (rank, step)
            assert_close(step["combined"], expected, 1e-6, what=f"rank {rank} flagged step")
        assert after["overflow"] is False and "error" not in after, (rank, after)
        assert_close(after["combined"], expected, 1e-6, what=f"rank {rank} next step")


def test_direct_flag_dispatcher_first_call_fails_everywhere(world):
    """Before the wire dtype is known the first call reads the ranks' dtypes on the host, so
    there every rank raises the same error, and the dispatcher still works after."""
    _, results = world
    _assert_named_failure(results, "direct/masked_flag_first", ("2-D tensor",))
    for rank, r in enumerate(results):
        after = r["direct/masked_flag_first_after"]
        assert after["overflow"] is False and "error" not in after, (rank, after)


def test_construction_local_check(world):
    _, results = world
    _assert_named_failure(results, "construct/placement", ("routed experts but the layer",))


@pytest.mark.parametrize(
    "key, words",
    [
        ("construct/dtype", ("rank 1: TypeError: dtype must be one of",)),
        ("construct/backend", ("rank 1: BackendUnavailableError", "'nope'")),
        ("construct/on_overflow", ("rank 1: MoeInputError: on_overflow must be one of",)),
        ("construct/direct_masked", ("rank 1: MoeInputError: capacity must be a positive int",)),
    ],
)
def test_construction_argument_invalid_on_one_rank_is_no_hang(world, key, words):
    _, results = world
    _assert_named_failure(results, key, words)


def test_construction_capacity_differing_is_named_everywhere(world):
    _, results = world
    for rank, r in enumerate(results):
        error = r["construct/capacity"]["error"]
        assert error is not None and error[0] == "MoeInputError", (rank, error)
        assert "ranks disagree on capacity" in error[1], (rank, error)


def test_standard_dispatch_with_another_top_k_on_one_rank(world):
    # Was: no error; every rank returned the same finite, wrong sum (0.63 relative error).
    _, results = world
    for rank, r in enumerate(results):
        error = r["standard/top_k"]["error"]
        assert error is not None and error[0] == "MoeInputError", (rank, error)
        assert "top_k differs across ranks" in error[1] and f"rank 1: {K + 1}" in error[1]


def test_failing_together_helper(world):
    _, results = world
    _assert_named_failure(results, "helper/failing_together", ("OSError: shard file missing",))
