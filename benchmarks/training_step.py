"""One MoE layer's training step (forward + backward) on moerunner against transformers'
own experts, side by side in one process.

The step is the experts call and the backward of a fixed linear loss over its output, with
gradients for the hidden states, the routing weights and both expert weights (what a layer
of a model being fine-tuned computes). Implementations:

- ``moerunner``: ``fused_moe`` in grad mode, default options (the differentiable path: two
  grouped GEMMs on the CPU and CUDA where they can read the rows, else a GEMM pair per
  expert hit);
- ``moerunner-grouped``: the same with ``TorchOptions.grouped_mm`` naming this device and
  dtype (the inference path's grouped GEMMs too);
- ``moerunner-per-expert``: the same with neither ``grouped_mm`` nor ``grouped_training``
  (one GEMM pair per expert hit, the form of rows the grouped GEMM cannot read);
- ``grouped_mm`` / ``eager``: transformers' experts module of the preset's family with that
  experts implementation (``moerunner.bench.baselines``), on the same weights.

Every implementation is first checked against autograd of the float64 reference (output and
the hidden states' gradient, the dtype's bound), then all are timed: on the CPU in
interleaved rounds (``time_interleaved_cpu``), on CUDA with events around each step
(``time_cases``, eager: a step's backward is not captured) and again with ten steps queued
back to back between synchronisations (``time_steps_queued``: a training loop's rate, where
the host queues ahead; the first measure also counts the device idling while each step's
first kernels are queued). Each row gives the median and the spread (min - max) and the
ratio of medians to ``grouped_mm``. Shapes are the presets'
divided by ``--scale`` in H and I (16 by default on the CPU, 1 on a GPU).

    python benchmarks/training_step.py [--presets qwen3-30b-a3b ...] [--tokens 256 1024]
        [--dtypes bf16] [--scale 16] [--impls moerunner ...] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

import moerunner
from moerunner.backends.torch_native import TorchBackend, TorchOptions
from moerunner.bench.baselines import build_baseline
from moerunner.bench.presets import get_preset
from moerunner.bench.sweep import draw_routing, make_weights
from moerunner.bench.timing import time_steps, time_steps_queued
from moerunner.testing import DTYPE_BOUND, compare

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("moerunner", "moerunner-grouped", "moerunner-per-expert", "grouped_mm", "eager")
CASES = 3  # routings and inputs per point, taken in turn


def _registry(options: TorchOptions) -> moerunner.Registry:
    registry = moerunner.default_registry().copy()
    registry.register_backend(TorchBackend(options), replace=True)
    return registry


def _steps(shape, dtype, device, tokens: int, seed: int, impls) -> tuple[dict, list]:
    """Per implementation, ``step(i)``: case ``i``'s forward and backward; and the cases."""
    weights = make_weights(shape, dtype, device, seed)
    w13 = weights["w13"].requires_grad_()
    w2 = weights["w2"].requires_grad_()
    gen = torch.Generator().manual_seed(seed + 1)  # (drawn on the CPU: the same on any device)
    cases = []
    for _ in range(CASES):
        topk = draw_routing(tokens, shape, "uniform", gen, 1.0)
        x = torch.randn(tokens, shape.hidden_size, generator=gen).to(device, dtype)
        ids = topk.ids.long().to(device)  # (transformers one-hots them)
        tw = topk.weights.to(device, dtype)
        cases.append((x.requires_grad_(), tw.requires_grad_(), ids))
    proj = torch.linspace(-1, 1, shape.hidden_size, device=device, dtype=torch.float32)
    grouped = _registry(TorchOptions(grouped_mm=frozenset({(device.type, dtype)})))
    per_expert = _registry(TorchOptions(grouped_mm=frozenset(), grouped_training=frozenset()))

    def moerunner_step(registry=None):
        def run(i):
            x, tw, ids = cases[i]
            out = moerunner.fused_moe(x, w13, w2, tw, ids, backend="torch", registry=registry)
            (out.float() * proj).sum().backward()
            return out

        return run

    def baseline_step(impl):
        # (trainable: the module's weights get gradients, as moerunner's w13 and w2 do;
        # before 2026-12-06 23:55 UTC they were frozen: the baselines skipped those gradients)
        module_run, _ = build_baseline(shape, impl, w13, w2, trainable=True)

        def run(i):
            x, tw, ids = cases[i]
            out = module_run(x, ids, tw)
            (out.float() * proj).sum().backward()
            return out

        return run

    makers = {
        "moerunner": moerunner_step,
        "moerunner-grouped": lambda: moerunner_step(grouped),
        "moerunner-per-expert": lambda: moerunner_step(per_expert),
        "grouped_mm": lambda: baseline_step("grouped_mm"),
        "eager": lambda: baseline_step("eager"),
    }
    return {impl: makers[impl]() for impl in impls}, [w13, w2, cases]


def _check(steps: dict, leaves, dtype) -> dict:
    """Each implementation's output and hidden-state gradient against float64 autograd."""
    w13, w2, cases = leaves
    x, tw, ids = cases[0]
    x64 = x.detach().double().requires_grad_()
    ref = moerunner.reference_moe(
        x64, moerunner.ExpertWeights(w13.detach().double(), w2.detach().double()), tw.double(),
        ids,
    )  # fmt: skip
    proj = torch.linspace(-1, 1, ref.shape[1], device=ref.device, dtype=torch.float64)
    (ref * proj).sum().backward()
    errors = {}
    for impl, step in steps.items():
        x.grad = None
        out = step(0)
        value, grad = compare(out, ref.detach()), compare(x.grad, x64.grad)
        bound = DTYPE_BOUND[dtype]
        errors[impl] = {"out": value.max_rel, "dx": grad.max_rel}
        if value.max_rel > bound or grad.max_rel > bound or value.nonfinite or grad.nonfinite:
            raise AssertionError(f"{impl}: out {value}, dx {grad} (bound {bound})")
    return errors


def _print(rows) -> None:
    """The table: per step with a synchronisation after each (and on CUDA queued back to
    back), median, spread (min-max) and the ratio of medians to grouped_mm's."""
    queued = bool(rows) and "queued_ms" in rows[0]
    head = (
        f"{'shape':<22} {'dtype':<5} {'T':>5} {'impl':<20} {'ms':>9} {'min-max':>17} {'x gmm':>6}"
    )
    print(head + (f" {'queued ms':>10} {'min-max':>17} {'x gmm':>6}" if queued else ""))
    for r in rows:
        spread = f"{r['min_ms']:.2f}-{r['max_ms']:.2f}"
        line = (f"{r['shape']:<22} {r['dtype']:<5} {r['T']:>5} {r['impl']:<20} {r['ms']:>9.2f} "
                f"{spread:>17} {r['vs_grouped_mm']:>6.2f}")  # fmt: skip
        if queued:
            spread = f"{r['queued_min_ms']:.2f}-{r['queued_max_ms']:.2f}"
            line += f" {r['queued_ms']:>10.2f} {spread:>17} {r['queued_vs_grouped_mm']:>6.2f}"
        print(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    p.add_argument("--scale", type=int, default=None, help="divide H and I (CPU 16, GPU 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
        help="implementations to time (grouped_mm, the ratios' base, always runs)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="folder for the JSON record")
    args = p.parse_args(argv)
    impls = [i for i in IMPLS if i in args.impls or i == "grouped_mm"]
    device = torch.device(args.device)
    scale = args.scale or (1 if device.type == "cuda" else 16)
    rows = []
    for name in args.presets:
        full = get_preset(name)
        shape = dataclasses.replace(
            full,
            name=f"{name}/{scale}" if scale > 1 else name,
            hidden_size=full.hidden_size // scale,
            intermediate_size=full.intermediate_size // scale,
        )
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for tokens in args.tokens:
                steps, leaves = _steps(shape, dtype, device, tokens, len(rows), impls)
                errors = _check(steps, leaves, dtype)
                timings = time_steps(steps, CASES, device)
                queued = time_steps_queued(steps, CASES, device) if device.type == "cuda" else {}
                base = timings["grouped_mm"].seconds
                for impl in impls:
                    t = timings[impl]
                    rows.append({
                        "shape": shape.name, "E": shape.num_experts, "H": shape.hidden_size,
                        "I": shape.intermediate_size, "k": shape.top_k, "dtype": dtype_name,
                        "T": tokens, "impl": impl, "ms": t.seconds * 1e3,
                        "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3, "samples": t.samples,
                        "vs_grouped_mm": base / t.seconds, "max_rel_err": errors[impl],
                    })  # fmt: skip
                    if queued:
                        q, q_base = queued[impl], queued["grouped_mm"].seconds
                        rows[-1].update({
                            "queued_ms": q.seconds * 1e3, "queued_min_ms": q.min_s * 1e3,
                            "queued_max_ms": q.max_s * 1e3,
                            "queued_vs_grouped_mm": q_base / q.seconds,
                        })  # fmt: skip
    _print(rows)
    if args.out:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        record = {
            "argv": sys.argv, "device": name, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "rows": rows,
        }  # fmt: skip
        slug = "cpu"
        if device.type == "cuda":
            slug = next((f"nvidia-{g.lower()}" for g in ("H100", "H200") if g in name), "cuda")
        out = Path(args.out) / f"{slug}-training-step-{record['date']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
