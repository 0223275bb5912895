"""Expert-parallel scaling: per-rank dispatch / experts / combine times over EP sizes.

Launch with torchrun (one process per GPU; NCCL on GPUs, gloo on CPUs):

    torchrun --nproc-per-node 8 benchmarks/ep_scaling.py --presets deepseek-v3,qwen3-235b-a22b \
        --ep-sizes 1,2,4,8 --tokens 16,256,4096 --schemes bf16,fp8_block --json out.json
    # CPU check of the script itself, scaled-down shapes:
    torchrun --nproc-per-node 8 benchmarks/ep_scaling.py --shrink 64 --tokens 4,32 \
        --schemes bf16,fp8_block --allow-emulated --iters 2

Every rank builds the same full weights (one seed) and its own tokens (seed + rank). EP = n
runs on ranks 0..n-1 (a subgroup), with experts placed contiguously; EP = 1 is the
single-device run of the full layer on each rank's own tokens, which is also the reference
every EP output is checked against (same backend, same tokens). Per stage the median over
``--iters`` steps is kept; a step is as slow as its slowest rank, so the step time is the
maximum over ranks of the per-rank sum. Scaling efficiency against EP = m is
``t(EP=m) / t(EP=n)``: tokens per second per GPU relative to EP = m (each rank always
handles ``T`` tokens). ``--shrink s`` divides H and I by s (E and k stay) for CPU checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moerunner import ExpertWeights, MoeRunner, select_experts
from moerunner.backends.base import MoeProblem
from moerunner.bench.expert_parallel import (
    TimingBudget,
    full_weights,
    masked_capacity,
    measure_layer,
    slowest_rank,
)
from moerunner.bench.presets import get_preset
from moerunner.config import Activation
from moerunner.dispatch.expert_map import ExpertPlacement, shard_expert_weights
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.distributed import init_world
from moerunner.distributed_moe import StageTimer
from moerunner.errors import BackendUnavailableError

# bf16 outputs: EP and single-device runs round the same fp32 sums once, but may add the
# k slots in a different order and the kernels may tile differently: a few bf16 ulps of the
# largest output (2^-8 = 0.4 %) are expected; 2 % flags a real error.
TOLERANCE = 2e-2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="deepseek-v3,qwen3-235b-a22b")
    p.add_argument("--ep-sizes", default="", help="comma list; default 1, 2, 4.. up to world")
    p.add_argument("--dispatchers", default="all_to_all,masked")
    p.add_argument("--tokens", default="16,256,4096", help="tokens per rank")
    p.add_argument("--schemes", default="bf16,fp8_block")
    p.add_argument("--backend", default="auto")
    p.add_argument(
        "--allow-emulated",
        action="store_true",
        help="run quantized schemes on the emulating torch backend too",
    )
    p.add_argument("--dist-backend", default="", help="gloo: CPU ranks even where CUDA is")
    p.add_argument("--shrink", type=int, default=1, help="divide H and I by this (CPU checks)")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=2.0,
        help="masked capacity = factor x expected rows per expert + 16",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write all rows here (rank 0)")
    p.add_argument(
        "--cross-backend",
        default="",
        help="also run the single-device layer on this backend; its difference to the chosen "
        "backend is the EP = 1 row's rel err",
    )
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_weights(shape, shrink: int, scheme: str, device, seed: int) -> ExpertWeights:
    """Full-layer weights, identical on every rank (``--shrink`` divides H and I)."""
    h, i = shape.hidden_size // shrink, max(shape.intermediate_size // shrink, 1)
    small = dataclasses.replace(shape, hidden_size=h, intermediate_size=i)
    return full_weights(small, scheme, torch.bfloat16, device, seed)


def make_tokens(shape, hidden: int, tokens: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)
    logits = torch.randn(tokens, shape.num_experts, generator=g, device=device)
    return x, select_experts(logits, shape.top_k, renormalize=True)


def median_stages(step, warmup: int, iters: int, device, group) -> dict[str, float]:
    """Median ms per stage of ``step(timer)`` (barrier before each step aligns the ranks)."""
    for _ in range(warmup):
        step(None)
    samples: dict[str, list[float]] = {}
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        timer = StageTimer(device)
        step(timer)
        for k, v in timer.result().items():
            samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def cross_check(args, weights, spec, dispatched, reference) -> float:
    """Relative difference of the single-device output to another backend's (0 if none)."""
    if not args.cross_backend or dispatched.hidden_states.shape[0] == 0:
        return 0.0
    other = MoeRunner(args.cross_backend)
    problem = MoeProblem.of(dispatched.hidden_states, weights, spec, "standard")
    try:
        prepared = other.prepare(weights, problem, spec)
    except BackendUnavailableError:
        return float("nan")
    return rel_error(reference, other.run(dispatched, prepared))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    scale = want.float().abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


def run(args) -> list[dict]:
    if "standard" in args.dispatchers.split(","):
        raise SystemExit(
            "--dispatchers: standard needs the same tokens on every rank, and this script gives "
            "each rank its own; time it with torchrun ... -m moerunner bench --ep-size N "
            "--dispatcher standard"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    ep_sizes = _ints(args.ep_sizes) or [n for n in (1, 2, 4, 8, 16, 32) if n <= world]
    groups = {n: dist.new_group(list(range(n))) for n in ep_sizes if 1 < n <= world}
    act = Activation("silu")
    rows = _Rows(verbose=rank == 0)
    for preset in args.presets.split(","):
        shape = get_preset(preset)
        for scheme in args.schemes.split(","):
            weights = build_weights(shape, args.shrink, scheme, device, args.seed)
            spec = weights.spec(act)
            probe = torch.empty(0, weights.hidden_size, device=device, dtype=torch.bfloat16)
            single = MoeRunner(args.backend)
            try:
                prepared = single.prepare(
                    weights, MoeProblem.of(probe, weights, spec, "standard"), spec
                )
            except BackendUnavailableError as exc:
                rows.append({"preset": preset, "scheme": scheme, "skipped": str(exc)[:200]})
                continue
            if scheme != "bf16" and single.backend == "torch" and not args.allow_emulated:
                rows.append(
                    {
                        "preset": preset,
                        "scheme": scheme,
                        "skipped": "only the emulating torch backend serves it",
                    }
                )
                continue
            base = {
                "preset": preset,
                "scheme": scheme,
                "backend": single.backend,
                "E": shape.num_experts,
                "H": weights.hidden_size,
                "I": spec.intermediate_size,
                "k": shape.top_k,
            }
            shards = {}  # ep -> (placement, this rank's experts), cut once per weights
            for ep in groups:
                if rank < ep:
                    placement = ExpertPlacement.contiguous(shape.num_experts, ep)
                    shards[ep] = (placement, shard_expert_weights(weights, placement, rank))
            for tokens in _ints(args.tokens):
                x, topk = make_tokens(
                    shape, weights.hidden_size, tokens, device, args.seed + 1000 * (rank + 1)
                )
                dispatched = StandardDispatchOutput(hidden_states=x, topk=topk)
                reference = single.run(dispatched, prepared)
                if 1 in ep_sizes:

                    def one(timer, d=dispatched, run_one=single.run, w=prepared):
                        with timer("experts") if timer else _null():
                            run_one(d, w)

                    stages = median_stages(one, args.warmup, args.iters, device, None)
                    rows.append(
                        {
                            **base,
                            "T": tokens,
                            "ep": 1,
                            "dispatcher": "single",
                            "rank": rank,
                            "stages": stages,
                            "rel_err": cross_check(args, weights, spec, dispatched, reference),
                        }
                    )
                for ep, group in groups.items():
                    if rank < ep:
                        placement, local = shards[ep]
                        for kind in args.dispatchers.split(","):
                            rows.append(
                                {
                                    **base,
                                    "T": tokens,
                                    "ep": ep,
                                    "dispatcher": kind,
                                    "rank": rank,
                                    **measure(
                                        args,
                                        kind,
                                        local,
                                        placement,
                                        group,
                                        x,
                                        topk,
                                        reference,
                                        tokens,
                                        shape,
                                        device,
                                    ),
                                }
                            )
                    dist.barrier()
            weights = prepared = shards = None  # free before the next preset's weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def measure(args, kind, local, placement, group, x, topk, reference, tokens, shape, device):
    ep = placement.world_size
    layer = {"dispatcher": kind, "backend": args.backend, "dtype": torch.bfloat16}
    if kind == "masked":
        layer["capacity"] = masked_capacity(
            ep, tokens, shape.top_k, shape.num_experts, args.capacity_factor
        )
    budget = TimingBudget(warmup=args.warmup, iters=args.iters)
    timing = measure_layer(local, placement, group, x, topk, layer=layer, budget=budget)
    if timing.error:
        return {"skipped": timing.error[:200], "capacity": layer.get("capacity")}
    return {
        "stages": timing.stages_ms,
        "rel_err": rel_error(timing.output, reference),
        "capacity": layer.get("capacity"),
        "ep_backend": timing.backend,
    }


class _Rows(list):
    """Rows; rank 0 also prints each as it comes, so a run cut short still reports."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def append(self, row: dict) -> None:
        super().append(row)
        if self.verbose:
            print("row", json.dumps(row), flush=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (preset, scheme, dispatcher, ep, T): slowest rank's stages, efficiency."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "stages" in r:
            key = (r["preset"], r["scheme"], r["T"], r["ep"], r["dispatcher"])
            groups.setdefault(key, []).append(r)
    lines = []
    for key, rs in groups.items():
        slow = max(rs, key=lambda r: sum(r["stages"].values()))
        stages, step_ms = slowest_rank([r["stages"] for r in rs])
        lines.append(
            {
                "preset": key[0],
                "scheme": key[1],
                "T": key[2],
                "ep": key[3],
                "dispatcher": key[4],
                "backend": slow.get("ep_backend", slow["backend"]),
                "step_ms": step_ms,
                **{f"{s}_ms": v for s, v in stages.items()},
                "max_rel_err": max(r["rel_err"] for r in rs),
                "ranks": len(rs),
            }
        )
    by_key = {
        (ln["preset"], ln["scheme"], ln["T"], ln["ep"]): ln
        for ln in lines
        if ln["dispatcher"] in ("single", "all_to_all")
    }
    for ln in lines:
        for m in (1, 2):
            ref = by_key.get((ln["preset"], ln["scheme"], ln["T"], m))
            if ref is not None and ln["ep"] > m:
                ln[f"eff_vs_ep{m}"] = ref["step_ms"] / ln["step_ms"]
        ln["check"] = "ok" if ln["max_rel_err"] <= TOLERANCE else "FAIL"
    return lines


def print_table(lines: list[dict]) -> None:
    head = (
        "preset",
        "scheme",
        "T/rank",
        "EP",
        "dispatcher",
        "backend",
        "dispatch",
        "experts",
        "combine",
        "step ms",
        "eff/EP1",
        "eff/EP2",
        "rel err",
        "check",
    )
    print(" | ".join(head))
    for ln in sorted(
        lines, key=lambda ln: (ln["preset"], ln["scheme"], ln["T"], ln["ep"], ln["dispatcher"])
    ):
        cells = (
            ln["preset"],
            ln["scheme"],
            ln["T"],
            ln["ep"],
            ln["dispatcher"],
            ln["backend"],
            f"{ln['dispatch_ms']:.3f}",
            f"{ln['experts_ms']:.3f}",
            f"{ln['combine_ms']:.3f}",
            f"{ln['step_ms']:.3f}",
            f"{ln.get('eff_vs_ep1', float('nan')):.2f}",
            f"{ln.get('eff_vs_ep2', float('nan')):.2f}",
            f"{ln['max_rel_err']:.2e}",
            ln["check"],
        )
        print(" | ".join(str(c) for c in cells))


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and args.dist_backend != "gloo"
    init_world("cuda" if use_cuda else "cpu", int(os.environ.get("LOCAL_RANK", "0")))
    if not use_cuda:
        torch.set_num_threads(1)
    started = time.time()
    rows = run(args)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        everything = [r for part in gathered for r in part]
        lines = summarize(everything)
        print_table(lines)
        for r in everything:
            if "skipped" in r and r.get("rank", 0) == 0:
                print(
                    f"skipped: {r['preset']} {r['scheme']} {r.get('dispatcher', '')} "
                    f"T={r.get('T', '')}: {r['skipped']}"
                )
        env = {
            "world": dist.get_world_size(),
            "dist_backend": dist.get_backend(),
            "device": torch.cuda.get_device_name() if use_cuda else "cpu",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.time() - started, 1),
            "argv": sys.argv[1:],
        }
        print(json.dumps(env))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "summary": lines, "rows": everything}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
