"""Expert-parallel benchmark rows: one layer's dispatch / experts / combine over a group.

Stages 2-4 through ``ExpertParallelMoE``, timed per stage with ``time_stages`` (a barrier
before each step, so ``dispatch`` includes waiting for the slowest rank, as in serving).
Contract: every function taking a ``group`` is collective: all ranks call it in the same
order with the same shapes and options, and each returns the same verdict on every rank (a
failure that every rank raises, such as a masked capacity overflow, becomes a row note, not a
hang). ``measure_layer`` is the one timing path for ``moerunner bench --ep-size`` and
``benchmarks/ep_scaling.py``; ``slowest_rank`` is the one rule for reducing per-rank times:
per stage the maximum over ranks, and the step is the slowest rank's sum.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..dispatch.expert_map import ExpertPlacement, shard_expert_weights
from ..distributed import all_gather_ints, collective_device, rank_and_size
from ..distributed_moe import DISPATCHERS, STAGES, ExpertParallelMoE, time_stages
from ..errors import CapacityOverflowError
from ..routing import TopK
from ..weights import ExpertWeights
from .presets import BenchShape
from .report import align_table, fmt_cell
from .sweep import (
    BenchConfig,
    Row,
    accuracy_bound,
    act_dtype_for,
    check_against_reference,
    draw_routing,
    make_weights,
    quantize_layer,
)

__all__ = [
    "EpOptions",
    "EpRow",
    "full_weights",
    "LayerTiming",
    "TimingBudget",
    "masked_capacity",
    "measure_layer",
    "run_ep_sweep",
    "slowest_rank",
    "table",
    "to_json",
]


@dataclass(frozen=True)
class TimingBudget:
    """How long one layer is timed: ``iters`` steps, or (``None``) enough steps for
    ``min_time_s`` of the slowest rank's warm step time, between 3 and ``max_reps``."""

    warmup: int = 2
    iters: int | None = None
    min_time_s: float = 0.2
    max_reps: int = 200


@dataclass(frozen=True)
class EpOptions:
    """What the expert-parallel rows add to a ``BenchConfig``; ``eval(repr())`` rebuilds it.

    ``capacity_factor``: masked capacity = factor x the expected rows per expert + 16,
    rounded up to 16 (``masked_capacity``).
    """

    ep_size: int
    dispatchers: tuple[str, ...] = ("all_to_all",)
    capacity_factor: float = 2.0
    warmup: int = 2


@dataclass
class LayerTiming:
    """One rank's outcome of ``measure_layer`` (``error`` empty when it ran)."""

    stages_ms: dict[str, float] = field(default_factory=dict)
    output: torch.Tensor | None = None
    backend: str | None = None
    error: str = ""


@dataclass
class EpRow(Row):
    """A bench ``Row`` of an expert-parallel layer: ``time_us`` is the slowest rank's step;
    per-stage columns are maxima over ranks; errors are the worst rank's."""

    ep_size: int = 1
    dispatcher: str = ""
    capacity: int | None = None
    dispatch_us: float = float("nan")
    experts_us: float = float("nan")
    combine_us: float = float("nan")


def masked_capacity(
    ep_size: int, tokens: int, top_k: int, num_experts: int, factor: float = 2.0
) -> int:
    """Rows per local expert for the masked dispatcher: ``factor`` x the rows an expert
    expects under uniform routing, plus 16, rounded up to 16; at most every token of the
    group (no expert can receive more)."""
    expected = ep_size * tokens * top_k / num_experts
    capacity = 16 * math.ceil((factor * expected + 16) / 16)
    return max(1, min(ep_size * tokens, capacity))


def _agree(ok: bool, group) -> bool:
    """True on every rank when every rank passed ``ok``."""
    flag = torch.tensor([0 if ok else 1], device=collective_device(group))
    return int(all_gather_ints(flag, group).sum()) == 0


def _max_over_ranks(value: float, group) -> float:
    """The largest ``value`` (non-negative, microsecond resolution) of any rank."""
    mine = torch.tensor([int(value * 1e6)], device=collective_device(group))
    return float(all_gather_ints(mine, group).max()) / 1e6


def measure_layer(
    local_weights: ExpertWeights,
    placement: ExpertPlacement,
    group,
    hidden_states: torch.Tensor,
    topk: TopK,
    *,
    layer: dict,
    budget: TimingBudget | None = None,
) -> LayerTiming:
    """Build ``ExpertParallelMoE(local_weights, placement, group, **layer)``, run it once
    (the returned ``output``, for the caller's check), then time its stages.

    Collective. ``layer`` holds the layer's keyword options (``dispatcher``, ``backend``,
    ``activation``, ``capacity``, ``dtype``). A capacity overflow, or any error raised while
    building or running the first step on some rank, ends the measurement on every rank with
    ``error`` set (that rank's message, or "failed on another rank").
    """
    budget = budget or TimingBudget()
    timing = LayerTiming()
    try:
        moe = ExpertParallelMoE(local_weights, placement, group, **layer)
        timing.backend = moe.runner.backend
        timing.output = moe(hidden_states, topk)
    except CapacityOverflowError as exc:
        timing.error = f"overflow: {exc}"
    except Exception as exc:  # noqa: BLE001  (reported as the row's note on every rank)
        timing.error = f"{type(exc).__name__}: {exc}"
    if not _agree(not timing.error, group):
        timing.error = (timing.error or "failed on another rank")[:300]
        return timing
    cuda = hidden_states.device.type == "cuda"
    step_s = 0.0
    for _ in range(max(budget.warmup, 1)):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        moe(hidden_states, topk)
        if cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - start
    iters = budget.iters
    if iters is None:
        slowest = max(_max_over_ranks(step_s, group), 1e-6)
        iters = int(min(max(math.ceil(budget.min_time_s / slowest), 3), budget.max_reps))
    timing.stages_ms = time_stages(moe, hidden_states, topk, warmup=0, iters=iters)
    return timing


def slowest_rank(per_rank: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """(per-stage maximum over ranks, the slowest rank's step = max of per-rank sums), in the
    unit given; ranks without times are ignored."""
    timed = [s for s in per_rank if s]
    if not timed:
        return {}, float("nan")
    stages = {name: max(s.get(name, 0.0) for s in timed) for name in STAGES}
    return stages, max(sum(s.values()) for s in timed)


# -- the CLI's sweep ------------------------------------------------------------------------


def _tokens(shape: BenchShape, config: BenchConfig, routing: str, tokens: int, slot: int, world):
    """This rank's tokens: ``world * T`` tokens drawn from one generator (the same expert
    popularity on every rank), slice ``slot`` of them (0 on every rank: shared tokens)."""
    gen = torch.Generator().manual_seed(config.seed * 7919 + tokens)
    topk = draw_routing(world * tokens, shape, routing, gen, config.zipf_exponent)
    x = torch.randn(world * tokens, shape.hidden_size, generator=gen)
    part = slice(slot * tokens, (slot + 1) * tokens)
    return x[part], TopK(topk.weights[part], topk.ids[part])


def full_weights(
    shape: BenchShape, scheme: str, dtype: torch.dtype, device, seed: int
) -> ExpertWeights:
    """The whole layer's weights (identical on every rank for one ``seed``), quantized to
    ``scheme`` a few experts at a time (static activation scales calibrated as the
    single-process sweep's are: ``quantize_layer``)."""
    w = make_weights(shape, dtype, device, seed)  # same seed: the same weights on every rank
    plain = ExpertWeights(w["w13"], w["w2"], w["w13_bias"], w["w2_bias"], shape.gate_up_interleaved)
    return quantize_layer(plain, shape, scheme, seed)


def run_ep_sweep(
    config: BenchConfig,
    options: EpOptions,
    group=None,
    progress: Callable[[EpRow], None] | None = None,
) -> list[EpRow]:
    """Every shape x scheme x dispatcher x backend x routing x T of ``config`` as an
    expert-parallel layer over ``group`` (contiguous placement over ``options.ep_size``
    ranks); the same rows, in the same order, on every rank.

    T is tokens per rank (all_to_all, masked: each rank its own; standard: the same T tokens
    on every rank). Each rank checks its output against ``reference_moe`` on its tokens.
    Backends: ``config.backends``, or ``"auto"`` (the runner's choice; the row names it).
    """
    import torch.distributed as dist

    rank, world = rank_and_size(group)
    if world != options.ep_size:
        raise ValueError(f"ep_size={options.ep_size} but the process group has {world} ranks")
    for kind in options.dispatchers:
        if kind not in DISPATCHERS:
            raise ValueError(f"dispatcher: unknown {kind!r}; accepted: {', '.join(DISPATCHERS)}")
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    budget = TimingBudget(options.warmup, None, config.min_time_s, config.max_reps)
    rows: list[EpRow] = []
    for shape in config.shapes:
        placement = ExpertPlacement.contiguous(shape.num_experts, world)
        for scheme in config.schemes_for(shape):
            dtype = act_dtype_for(scheme, config.dtype)
            full = full_weights(shape, scheme, dtype, device, config.seed)
            local = shard_expert_weights(full, placement, rank)
            for kind in options.dispatchers:
                for backend in config.backends or ("auto",):
                    for routing in config.routings:
                        for tokens in config.tokens:
                            row = _measure_row(
                                shape, scheme, dtype, kind, backend, routing, tokens,
                                (full, local, placement, group, config, options, budget),
                            )  # fmt: skip
                            rows.append(row)
                            if progress is not None:
                                progress(row)
            del full, local
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.barrier(group=group)
    return rows


def _measure_row(shape, scheme, dtype, kind, backend, routing, tokens, context) -> EpRow:
    import torch.distributed as dist

    full, local, placement, group, config, options, budget = context
    rank, world = rank_and_size(group)
    row = EpRow(
        shape.name,
        scheme,
        str(dtype).replace("torch.", ""),
        backend,
        routing,
        tokens,
        ep_size=world,
        dispatcher=kind,
    )
    device = full.device
    x, topk = _tokens(shape, config, routing, tokens, 0 if kind == "standard" else rank, world)
    x, topk = x.to(device, dtype), TopK(topk.weights.to(device), topk.ids.to(device))
    layer = {"dispatcher": kind, "backend": backend, "activation": shape.activation}
    layer["dtype"] = dtype
    if kind == "masked":
        row.capacity = masked_capacity(
            world, tokens, shape.top_k, shape.num_experts, options.capacity_factor
        )
        layer["capacity"] = row.capacity
    with torch.inference_mode():
        timing = measure_layer(local, placement, group, x, topk, layer=layer, budget=budget)
        err = (float("nan"), float("nan"), 0)
        if not timing.error and tokens:
            err = check_against_reference(
                timing.output, x, topk, full, shape, config.check_budget_bytes
            )
    mine = {"stages": timing.stages_ms, "err": err, "error": timing.error}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    if timing.error:
        row.status, row.note = "failed", timing.error[:200]
        if timing.error.startswith("overflow"):
            row.status = "skipped"
        return row
    stages, step_ms = slowest_rank([g["stages"] for g in gathered])
    row.dispatch_us, row.experts_us, row.combine_us = (stages[s] * 1e3 for s in STAGES)
    row.time_us = step_ms * 1e3
    if tokens:
        errs = [g["err"] for g in gathered if g["err"][2]]
        row.max_rel_err = max(e[0] for e in errs)
        row.rms_rel_err = max(e[1] for e in errs)
        row.checked_tokens = sum(e[2] for e in errs)
    if not tokens:
        row.status, row.note = "n/a", "T=0: no output to check"
    elif row.max_rel_err > accuracy_bound(scheme, dtype):
        row.status = "wrong"
    row.timing = "eager, barrier per step"
    row.impl = timing.backend or backend
    return row


# -- output -------------------------------------------------------------------------------


def table(rows: list[EpRow]) -> str:
    """Fixed-width text table, one line per row (the bench table's layout, stage columns)."""
    head = [
        "preset", "scheme", "impl", "routing", "T", "EP", "dispatcher", "dispatch us",
        "experts us", "combine us", "time us", "max err", "status",
    ]  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            [
                r.preset,
                r.scheme,
                r.impl,
                r.routing,
                str(r.tokens),
                str(r.ep_size),
                r.dispatcher,
                fmt_cell(r.dispatch_us, ".1f"),
                fmt_cell(r.experts_us, ".1f"),
                fmt_cell(r.combine_us, ".1f"),
                fmt_cell(r.time_us, ".1f"),
                fmt_cell(r.max_rel_err, ".1e"),
                r.status if r.status == "ok" else f"{r.status}: {r.note[:60]}",
            ]
        )
    return align_table(lines, left={0, 1, 2, 3, 6})


def to_json(
    path: Path,
    argv: list[str],
    config: BenchConfig,
    options: EpOptions,
    env: dict,
    rows: list[EpRow],
) -> dict:
    """Write the bench record (``report.SCHEMA``) with ``expert_parallel`` options added;
    ``ceilings`` is null (EP rows are not accounted against the roofline)."""
    from .report import SCHEMA, json_text

    record = {
        "schema": SCHEMA,
        "argv": list(argv),
        "config": repr(config),
        "expert_parallel": repr(options),
        "environment": env,
        "ceilings": None,
        "skipped_backends": {},
        "rows": [asdict(r) for r in rows],
    }
    text = json_text(record)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
        return record
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return record
