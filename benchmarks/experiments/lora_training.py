# A LoRA fine-tuning step of one MoE layer on the torch backend: the hooked sequence with one
# GEMM per expert hit (after a host read of the expert offsets) against the same sequence on
# two grouped GEMMs (the default where PyTorch's grouped GEMM serves the call: training on
# the CPU, CUDA bf16), side by side in one process.
#
#   python benchmarks/experiments/lora_training.py [--presets qwen3-30b-a3b mixtral-8x7b]
#       [--tokens 256 1024] [--dtypes fp32 bf16] [--rank 16] [--adapters 2] [--scale 16]
#       [--json out.json]
#
# The step: base experts frozen, the LoRA factors of every expert trained, the hidden states
# and routing weights too (a layer inside a model); forward with the adapters of each token
# (ids cycle through the adapters), backward of a fixed linear loss. Both forms are checked
# first against float64 autograd of the merged weights (output and the hidden states'
# gradient, the dtype's bound). Times: CPU interleaved rounds (median, min - max), CUDA events
# per step. Shapes are the presets' with H and I divided by --scale (16 on the CPU, 1 on a GPU).

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import moerunner  # noqa: E402
from moerunner.backends.torch_native import TorchBackend, TorchOptions  # noqa: E402
from moerunner.bench.presets import get_preset  # noqa: E402
from moerunner.bench.sweep import draw_routing, make_weights  # noqa: E402
from moerunner.bench.timing import time_steps  # noqa: E402
from moerunner.lora import MoeLoraWeights, lora_hooks  # noqa: E402
from moerunner.testing import DTYPE_BOUND, compare  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = 3
#: the per-expert form: no grouped GEMM anywhere
PER_EXPERT = TorchOptions(grouped_mm=frozenset(), grouped_training=frozenset())


def _registry(options: TorchOptions | None) -> moerunner.Registry | None:
    if options is None:
        return None
    registry = moerunner.default_registry().copy()
    registry.register_backend(TorchBackend(options), replace=True)
    return registry


def _case(shape, dtype, device, tokens, rank, adapters, seed):
    weights = make_weights(shape, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # (drawn on the CPU: the same on any device)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size

    def factor(*size, scale):
        t = torch.randn(adapters, e, *size, generator=gen) * scale
        return t.to(device, dtype).requires_grad_()

    lora = MoeLoraWeights(
        factor(rank, h, scale=h**-0.5), factor(2 * i, rank, scale=0.1),
        factor(rank, i, scale=i**-0.5), factor(h, rank, scale=0.1),
    )  # fmt: skip
    cases = []
    for _ in range(CASES):
        topk = draw_routing(tokens, shape, "uniform", gen, 1.0)
        x = torch.randn(tokens, h, generator=gen).to(device, dtype).requires_grad_()
        ids = torch.arange(tokens, device=device) % adapters
        tw = topk.weights.to(device, dtype).requires_grad_()
        cases.append((x, tw, topk.ids.to(device), ids))
    return weights["w13"], weights["w2"], lora, cases


def _reference(w13, w2, lora, case):
    """float64 output and hidden-state gradient (on the CPU): each adapter's tokens on
    merged weights."""
    x, tw, ids, adapters = case
    x64 = x.detach().double().cpu().requires_grad_()
    w13, w2, ids, adapters = w13.double().cpu(), w2.double().cpu(), ids.cpu(), adapters.cpu()
    out = 0

    def merged(w, b, a_, a):
        return w + b[a].detach().double().cpu() @ a_[a].detach().double().cpu()

    for a in range(lora.num_adapters):
        weights = moerunner.ExpertWeights(
            merged(w13, lora.w13_b, lora.w13_a, a), merged(w2, lora.w2_b, lora.w2_a, a)
        )
        mine = (adapters == a).double()[:, None]
        out = out + moerunner.reference_moe(x64, weights, tw.detach().double().cpu() * mine, ids)
    proj = torch.linspace(-1, 1, out.shape[1], dtype=torch.float64)
    (out * proj).sum().backward()
    return out.detach(), x64.grad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=2)
    p.add_argument("--scale", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    scale = args.scale or (1 if device.type == "cuda" else 16)
    rows = []
    print(f"{'shape':<22} {'dtype':<5} {'T':>5} {'form':<11} {'ms':>9} {'min-max':>17} "
          f"{'speedup':>8}")  # fmt: skip
    for name in args.presets:
        full = get_preset(name)
        shape = dataclasses.replace(
            full, name=f"{name}/{scale}" if scale > 1 else name,
            hidden_size=full.hidden_size // scale,
            intermediate_size=full.intermediate_size // scale,
        )  # fmt: skip
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for tokens in args.tokens:
                w13, w2, lora, cases = _case(
                    shape, dtype, device, tokens, args.rank, args.adapters, len(rows)
                )
                proj = torch.linspace(-1, 1, shape.hidden_size, device=device)

                def step(registry, w13=w13, w2=w2, lora=lora, cases=cases, proj=proj):
                    def run(i):
                        x, tw, ids, adapters = cases[i]
                        out = moerunner.fused_moe(
                            x, w13, w2, tw, ids, backend="torch", registry=registry,
                            hooks=lora_hooks(lora, adapters),
                        )  # fmt: skip
                        (out.float() * proj).sum().backward()
                        return out

                    return run

                steps = {"per-expert": step(_registry(PER_EXPERT)), "grouped": step(None)}
                ref, ref_dx = _reference(w13, w2, lora, cases[0])
                errors = {}
                for form, go in steps.items():
                    cases[0][0].grad = None
                    out = go(0)
                    value, grad = compare(out, ref), compare(cases[0][0].grad, ref_dx)
                    bound = DTYPE_BOUND[dtype]
                    if value.max_rel > bound or grad.max_rel > bound:
                        raise AssertionError(f"{form}: out {value}, dx {grad} (bound {bound})")
                    errors[form] = {"out": value.max_rel, "dx": grad.max_rel}
                timings = time_steps(steps, CASES, device)
                base = timings["per-expert"].seconds
                for form, t in timings.items():
                    row = {
                        "shape": shape.name, "E": shape.num_experts, "H": shape.hidden_size,
                        "I": shape.intermediate_size, "k": shape.top_k, "dtype": dtype_name,
                        "T": tokens, "rank": args.rank, "adapters": args.adapters, "form": form,
                        "ms": t.seconds * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3,
                        "samples": t.samples, "speedup_vs_per_expert": base / t.seconds,
                        "max_rel_err": errors[form],
                    }  # fmt: skip
                    rows.append(row)
                    spread = f"{row['min_ms']:.2f}-{row['max_ms']:.2f}"
                    print(f"{shape.name:<22} {dtype_name:<5} {tokens:>5} {form:<11} "
                          f"{row['ms']:>9.2f} {spread:>17} "
                          f"{row['speedup_vs_per_expert']:>7.2f}x")  # fmt: skip
    if args.json:
        record = {
            "argv": sys.argv, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rows": rows,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
