# MoE LoRA with several adapters in one batch (moerunner.lora, through moerunner.hooks):
# the cost over the same call without adapters, of the hooked sequence alone (hooks that do
# nothing), and of the LoRA deltas in their PyTorch form instead of the triton backend's
# kernels (moerunner.backends.triton.lora), at decode and prefill token counts.
#
#   python benchmarks/experiments/moe_lora.py --preset qwen3-30b-a3b --tokens 1,16,256,4096
#   python benchmarks/experiments/moe_lora.py --preset cpu-small --device cpu --tokens 1,16
#
# Shapes come from moerunner.bench.presets (--shrink N divides H and I by N for CPU runs);
# tokens are spread over --adapters adapters of rank --rank, a fifth of them without one.
# Prints a table (milliseconds per call, median; CUDA-graph replay on a GPU where capture
# works) with the ratio lora / plain and the kernels' row layout (each row its own block, or
# rows grouped by (adapter, expert) pair), and writes --json. With the triton backend also
# the sequence the LoRA call ran (path: "fused", its deltas inside the fused kernel sequence,
# or "hooked") and, where that is the fused one, the same call through the hooked sequence
# (TritonOptions(lora_in_sequence=False)).

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

import moerunner  # noqa: E402
from moerunner.backends.triton import TritonBackend, TritonOptions, register  # noqa: E402
from moerunner.backends.triton.lora import groups_rows, sequence_lora  # noqa: E402
from moerunner.backends.triton.options import DEFAULT_OPTIONS  # noqa: E402
from moerunner.bench.presets import PRESETS, get_preset  # noqa: E402
from moerunner.bench.timing import time_cases  # noqa: E402
from moerunner.config import Activation  # noqa: E402
from moerunner.hooks import MoeHooks  # noqa: E402
from moerunner.lora import MoeLoraWeights, lora_hooks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--no-pytorch-form", action="store_true", help="skip the deltas' PyTorch form")
    ap.add_argument("--shrink", type=int, default=1, help="divide H and I by this")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = get_preset(args.preset)
    h = max(16, shape.hidden_size // args.shrink)
    i = max(16, shape.intermediate_size // args.shrink)
    e, k, act = shape.num_experts, shape.top_k, Activation(shape.activation)
    rows = 2 * i if act.gated else i
    r, n_ad = args.rank, args.adapters
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size, scale):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

    w13, w2 = rand(e, rows, h, scale=h**-0.5), rand(e, h, i, scale=i**-0.5)
    lora = MoeLoraWeights(
        rand(n_ad, e, r, h, scale=h**-0.5),
        rand(n_ad, e, rows, r, scale=r**-0.5),
        rand(n_ad, e, r, i, scale=i**-0.5),
        rand(n_ad, e, h, r, scale=r**-0.5),
        2.0,
    )
    hooked_backend = None
    if args.backend == "triton":
        hooked_backend = "triton-lora-hooked"
        register(
            TritonBackend(TritonOptions(lora_in_sequence=False), name=hooked_backend),
            replace=True,
        )
    out_rows = []
    print(
        f"{'T':>6} {'layout':>10} {'plain ms':>9} {'no-op hooks':>11} {'lora ms':>9} "
        f"{'pytorch form':>12} {'lora/plain':>10} {'lora/no-op':>10} {'path':>6} "
        f"{'hooked ms':>9} {'hooked/plain':>12}"
    )
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = rand(tokens, h, scale=1.0)
        topk = moerunner.select_experts(torch.randn(tokens, e, generator=g).to(device), k)
        adapter_ids = (torch.arange(tokens, device=device) % (n_ad + n_ad // 3 + 1)).clamp(max=n_ad)
        adapter_ids = torch.where(adapter_ids == n_ad, -1, adapter_ids)
        lora_kernels = lora_hooks(lora, adapter_ids)
        # The same deltas as plain callables: every backend calls their PyTorch form.
        up, down = lora_kernels.gate_up, lora_kernels.down
        variants = {
            "plain": None,
            "noop_hooks": MoeHooks(gate_up=lambda h_, x_, r_: h_, down=lambda y_, a_, r_: y_),
            "lora": lora_kernels,
            "lora_pytorch_form": MoeHooks(
                gate_up=lambda *a, up=up: up(*a), down=lambda *a, down=down: down(*a)
            ),
        }
        if args.no_pytorch_form:
            del variants["lora_pytorch_form"]
        path = "-"
        if args.backend == "triton":
            in_sequence = sequence_lora(lora_kernels, tokens * k, k, DEFAULT_OPTIONS)
            path = "fused" if in_sequence is not None else "hooked"
            if in_sequence is not None:
                variants["lora_hooked"] = lora_kernels
        times = {}
        for name, hooks in variants.items():
            backend = hooked_backend if name == "lora_hooked" else args.backend

            def run(_i, hooks=hooks, x=x, topk=topk, backend=backend):
                return moerunner.fused_moe(
                    x, w13, w2, topk.weights, topk.ids, activation=act, backend=backend,
                    check_ids=False, hooks=hooks,
                )  # fmt: skip

            with torch.no_grad():
                times[name] = time_cases(run, 1, device)
        plain, noop, lo = (times[n].seconds for n in ("plain", "noop_hooks", "lora"))
        form = times.get("lora_pytorch_form")
        grouped = groups_rows(tokens * k, n_ad * e, DEFAULT_OPTIONS)
        layout = "grouped" if grouped else "row-blocks"
        form_ms = f"{form.seconds * 1e3:>12.3f}" if form is not None else f"{'-':>12}"
        hooked = times.get("lora_hooked")
        hooked_cols = (
            f"{hooked.seconds * 1e3:>9.3f} {hooked.seconds / plain:>11.2f}x"
            if hooked is not None
            else f"{'-':>9} {'-':>12}"
        )
        print(
            f"{tokens:>6} {layout:>10} {plain * 1e3:>9.3f} {noop * 1e3:>11.3f} {lo * 1e3:>9.3f} "
            f"{form_ms} {lo / plain:>9.2f}x {lo / noop:>9.2f}x {path:>6} {hooked_cols}"
        )
        out_rows.append(
            {
                "tokens": tokens,
                **{f"{n}_s": t.seconds for n, t in times.items()},
                **{f"{n}_mode": t.mode for n, t in times.items()},
                **{f"{n}_iqr_pct": t.iqr_pct for n, t in times.items()},
                "lora_over_plain": lo / plain,
                "lora_over_noop_hooks": lo / noop,
                "lora_layout": layout,
                "lora_path": path,
                "shape": [e, h, i, k],
                "rank": r,
                "adapters": n_ad,
                "preset": args.preset,
                "shrink": args.shrink,
                "backend": args.backend,
                "dtype": str(dtype),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "triton": triton.__version__,
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out_rows, indent=1))


if __name__ == "__main__":
    main()
