"""Expert-parallel checks on GPUs (NCCL): backend equivalence and CUDA-graph capture.

    torchrun --nproc-per-node 2 benchmarks/ep_gpu_check.py --backends triton,torch --json out.json
    torchrun --nproc-per-node 1 benchmarks/ep_gpu_check.py --backends ""   # graph capture only

1. Every dispatcher (standard by ownership, standard tensor-parallel with I padded to 16,
   all_to_all, masked) x every backend named, bf16, small shapes, one rank with T = 0:
   each rank's output against the single-process run of the same backend on its tokens, and
   against the float64 ``reference_moe``.
2. The masked dispatcher in ``on_overflow="flag"`` mode captured in a CUDA graph and replayed
   on new inputs: dispatch -> a stand-in expert (y = 2x) -> combine, and the whole layer step
   with each runner backend of ``--graph-backends``; each replay equal to the eager step and
   to the expected output, the overflow flag read after the replay. One line per capture:
   ``GRAPH CAPTURE masked/<backend>: PASS|FAIL (...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moerunner import Activation, ExpertWeights, MoeRunner, reference_moe
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.expert_map import ExpertPlacement
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.dispatch.masked import MaskedDispatcher
from moerunner.distributed_moe import ExpertParallelMoE
from moerunner.routing import TopK

E, H, I, K = 16, 256, 200, 4  # I / 2 = 100: not 16-aligned, tensor parallel pads to 112
# bf16 output: a few ulps (2^-8 relative) of the largest value; 2 % flags a real error.
TOLERANCE = 2e-2


def tokens_of(rank: int, world: int, count: int, device):
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(count, H, generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(count, E, generator=g, device=device).argsort(1)[:, :K].to(torch.int32)
    return x, TopK(torch.rand(count, K, generator=g, device=device), ids)


def rel(got, want) -> float:
    if want.numel() == 0:
        return 0.0
    return (
        (got.double().cpu() - want.double().cpu()).abs().max()
        / want.double().abs().max().clamp(min=1e-6)
    ).item()


def equivalence(backend: str, rank: int, world: int, device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    weights = ExpertWeights(
        (torch.randn(E, 2 * I, H, generator=g, device=device) * H**-0.5).to(torch.bfloat16),
        (torch.randn(E, H, I, generator=g, device=device) * I**-0.5).to(torch.bfloat16),
    )
    counts = [37, 0, 5, 64][:world] if world > 1 else [37]
    x, topk = tokens_of(rank, world, counts[rank], device)
    everyone = [tokens_of(r, world, counts[r], device) for r in range(world)]
    all_x = torch.cat([p[0] for p in everyone])
    all_topk = TopK(
        torch.cat([p[1].weights for p in everyone]), torch.cat([p[1].ids for p in everyone])
    )
    runner = MoeRunner(backend)
    spec = weights.spec(Activation("silu"))
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)

    def single(xx, tk):
        return runner.run(StandardDispatchOutput(hidden_states=xx, topk=tk), prepared)

    rows = []
    cases = [
        ("all_to_all", {}, x, topk),
        ("masked", {"capacity": 64}, x, topk),
        ("standard", {}, all_x, all_topk),
        ("standard_tp", {"shard": "intermediate", "dispatcher": "standard"}, all_x, all_topk),
    ]
    for name, kw, xx, tk in cases:
        kw = dict(kw)
        kw.setdefault("dispatcher", name)
        try:
            moe = ExpertParallelMoE.from_global(weights, backend=backend, **kw)
            out = moe(xx, tk)
            want = single(xx, tk)
            ref = reference_moe(xx, weights, tk.weights, tk.ids, "silu")
            e1, e2 = rel(out, want), rel(out, ref)
            rows.append(
                {
                    "check": "equivalence",
                    "backend": backend,
                    "dispatcher": name,
                    "rank": rank,
                    "T": xx.shape[0],
                    "rel_err_vs_single": e1,
                    "rel_err_vs_ref64": e2,
                    "ok": e1 <= TOLERANCE and e2 <= TOLERANCE,
                }
            )
        except Exception as exc:  # reported in the table; the run goes on
            rows.append(
                {
                    "check": "equivalence",
                    "backend": backend,
                    "dispatcher": name,
                    "rank": rank,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}"[:300],
                }
            )
    return rows


def graph_capture(rank: int, world: int, device, backend: str) -> dict:
    """Masked flag mode captured in one CUDA graph and replayed on new inputs.

    ``backend="stand-in"``: dispatch -> y = 2x -> combine (the exchange alone); otherwise the
    whole layer step, ``ExpertParallelMoE.forward`` with that runner backend (dispatch ->
    grouped experts through the masked format -> combine).
    """
    placement = ExpertPlacement.contiguous(E, world)
    x, topk = tokens_of(rank, world, 24, device)
    static_x, static_w, static_ids = x.clone(), topk.weights.clone(), topk.ids.clone()
    g = torch.Generator(device=device).manual_seed(0)
    weights = ExpertWeights(
        (torch.randn(E, 2 * I, H, generator=g, device=device) * H**-0.5).to(torch.bfloat16),
        (torch.randn(E, H, I, generator=g, device=device) * I**-0.5).to(torch.bfloat16),
    )
    record = {"check": "cuda_graph_masked", "backend": backend, "rank": rank}
    try:
        if backend == "stand-in":
            disp = MaskedDispatcher(placement, 64, H, on_overflow="flag")

            def layer(xx, tk):
                d = disp.dispatch(xx, tk)
                return disp.combine(d.hidden_states * 2, d), d.overflow

            def expected(xx, tk):
                return (2 * xx.float() * tk.weights.sum(1, keepdim=True)).to(torch.bfloat16)
        else:
            moe = ExpertParallelMoE.from_global(
                weights, dispatcher="masked", capacity=64, on_overflow="flag", backend=backend
            )

            def layer(xx, tk):
                return moe(xx, tk), moe.last_overflow

            def expected(xx, tk):
                return reference_moe(xx, weights, tk.weights, tk.ids, "silu")

        def step():
            return layer(static_x, TopK(static_w, static_ids))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: kernels compiled, workspaces allocated
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, overflow = step()
        record["captured"] = True
        x2, topk2 = tokens_of(rank + 7, world, 24, device)
        static_x.copy_(x2)
        static_w.copy_(topk2.weights)
        static_ids.copy_(topk2.ids)
        graph.replay()
        torch.cuda.synchronize()
        eager, _ = layer(x2, topk2)
        e_eager, e_want = rel(out, eager), rel(out, expected(x2, topk2))
        record.update(
            rel_err_vs_eager=e_eager,
            rel_err_vs_expected=e_want,
            overflow_after_replay=bool(overflow),
            ok=e_eager <= TOLERANCE and e_want <= TOLERANCE and not bool(overflow),
        )
    except Exception as exc:  # reported; the other captures still run
        record.update(
            captured=record.get("captured", False),
            ok=False,
            error=f"{type(exc).__name__}: {exc}"[:300],
        )
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", default="triton,torch", help="equivalence; '' skips it")
    p.add_argument(
        "--graph-backends",
        default="stand-in,torch,triton",
        help="masked CUDA-graph captures: stand-in expert and/or runner backends",
    )
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()  # without CUDA: gloo on CPU, a smoke test of the script
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = []
    for backend in filter(None, args.backends.split(",")):
        rows += equivalence(backend, rank, world, device)
    if cuda:
        for backend in filter(None, args.graph_backends.split(",")):
            rows.append(graph_capture(rank, world, device, backend))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        everything = [r for part in gathered for r in part]
        for r in everything:
            print(json.dumps(r))
        env = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "world": world,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        print(json.dumps(env), "all ok:", all(r["ok"] for r in everything))
        captures = [r for r in everything if r["check"] == "cuda_graph_masked"]
        for backend in dict.fromkeys(r["backend"] for r in captures):
            mine = [r for r in captures if r["backend"] == backend]
            verdict = "PASS" if all(r["ok"] for r in mine) else "FAIL"
            detail = "; ".join(
                r.get("error") or f"rank {r['rank']} err {r['rel_err_vs_expected']:.1e}"
                for r in mine
            )
            print(f"GRAPH CAPTURE masked/{backend}: {verdict} ({detail})")
        if cuda and not captures:
            print("GRAPH CAPTURE: none requested")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "rows": everything}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
