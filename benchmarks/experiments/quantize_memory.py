"""Memory of quantizing and preparing one layer's experts, at model shapes.

quantize: DeepSeek-V3's w13 and w2 (preset ``deepseek-v3``, bf16 input) quantized to
fp8_block, mxfp4 and int4 (g128): peak transient memory (peak allocated minus input and
result) and time, with the default ``chunk_bytes`` and, with ``--unchunked``, with one chunk
of all experts (the former behaviour; an out-of-memory error is recorded as such).

prepare: GPT-OSS-120B's mxfp4 experts (preset ``gpt-oss-120b``) prepared for the triton
backend (fragment layout): memory held by the canonical weights, by them and the prepared
weights, and by the prepared weights alone once the canonical ones are dropped.

views (``--views``, GPU): GPT-OSS-120B bf16 experts stored as the model stores them
(``[E, H, 2I]`` / ``[E, I, H]``) run through canonical-shaped views (what the transformers
integration now feeds, no copy) against contiguous copies, on the torch and triton
backends: the time ratio is the speed cost of holding the experts once.

integration (``--integration``): the transformers integration's call of one GPT-OSS-120B
experts module (transformers' ``GptOssExperts``, bf16, experts implementation ``"moerunner"``)
on the torch and triton backends, with its parameters as stored (moerunner reads them through
views) and re-laid over contiguous canonical memory (``relayout_experts``, what
``use_moerunner`` does): time per call, the memory allocated in both layouts and the peak
while re-laying.

On a GPU memory is ``torch.cuda`` allocator statistics; on CPU (``--device cpu``, use
``--shrink``) it is counted per op by ``moerunner.memory`` (storages created by torch ops,
and storages reachable from the weights). ``--shrink S`` divides E by S and H, I by S
(rounded up to whole 128-wide groups), so the same script runs on a small machine.

    python benchmarks/experiments/quantize_memory.py --unchunked --views --out result.json
    python benchmarks/experiments/quantize_memory.py --device cpu --shrink 16
    python benchmarks/experiments/quantize_memory.py --schemes "" --skip-prepare --integration
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from moerunner.bench import presets
from moerunner.memory import AllocationTracker, storage_bytes
from moerunner.quant import QuantizedWeight, quantize
from moerunner.quant.weight import DEFAULT_CHUNK_BYTES
from moerunner.weights import ExpertWeights

GIB = 2**30


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def shapes(preset: str, shrink: int) -> dict[str, tuple[int, int, int]]:
    """{"w13": (E, 2I, H), "w2": (E, H, I)} of ``preset``, divided by ``shrink``."""
    s = presets.get_preset(preset)
    e = max(1, s.num_experts // shrink)
    h = _round_up(max(1, s.hidden_size // shrink), 128)
    i = _round_up(max(1, s.intermediate_size // shrink), 128)
    rows = 2 * i if s.gated else i
    return {"w13": (e, rows, h), "w2": (e, h, i)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _result_bytes(q: QuantizedWeight) -> int:
    return sum(t.untyped_storage().nbytes() for t in q.tensors().values())


def measure_quantize(shape, scheme: str, device: torch.device, chunk_bytes: int) -> dict:
    """Peak transient bytes and seconds of ``quantize`` of a bf16 ``shape`` weight."""
    w = torch.randn(shape, dtype=torch.bfloat16, device=device)
    row = {"shape": list(shape), "scheme": scheme, "chunk_bytes": chunk_bytes}
    row["input_gib"] = w.untyped_storage().nbytes() / GIB
    gc.collect()
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            q = quantize(w, scheme, chunk_bytes=chunk_bytes)
            _sync(device)
            row["seconds"] = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            start = time.perf_counter()
            with AllocationTracker() as tracker:
                q = quantize(w, scheme, chunk_bytes=chunk_bytes)
            row["seconds"] = time.perf_counter() - start
            peak = tracker.peak_bytes
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0]}"
        return row
    out = _result_bytes(q)
    row["result_gib"] = out / GIB
    row["transient_gib"] = (peak - out) / GIB
    return row


def _held(device: torch.device, *roots) -> int:
    if device.type == "cuda":
        gc.collect()
        _sync(device)
        return torch.cuda.memory_allocated(device)
    return storage_bytes(*roots)


def _random_mxfp4(shape, device: torch.device) -> QuantizedWeight:
    """Random packed e2m1 bytes and e8m0 codes near a checkpoint's (no quantize pass)."""
    e, n, k = shape
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8, device=device)
    return QuantizedWeight("mxfp4", shape, data, scale)


def measure_prepare(shrink: int, device: torch.device) -> dict:
    """Memory held around triton's prepare of GPT-OSS-120B mxfp4 experts."""
    from moerunner.backends.triton import TritonBackend
    from moerunner.config import Activation
    from moerunner.runner import prepare_for_backend

    shape = shapes("gpt-oss-120b", shrink)
    gc.collect()
    base = _held(device) if device.type == "cuda" else 0
    weights = ExpertWeights(
        _random_mxfp4(shape["w13"], device),
        _random_mxfp4(shape["w2"], device),
        gate_up_interleaved=True,
    )
    spec = weights.spec(Activation("swiglu_oai"))
    row = {"w13": list(shape["w13"]), "w2": list(shape["w2"])}
    row["canonical_gib"] = (_held(device, weights) - base) / GIB
    start = time.perf_counter()
    prepared = prepare_for_backend(TritonBackend(), weights, spec)
    _sync(device)
    row["prepare_seconds"] = time.perf_counter() - start
    row["canonical_and_prepared_gib"] = (_held(device, weights, prepared) - base) / GIB
    del weights
    row["prepared_after_dropping_canonical_gib"] = (_held(device, prepared) - base) / GIB
    return row


def measure_views(device: torch.device, tokens=(1, 64, 1024, 4096)) -> list[dict]:
    """fused_moe on transposed views against contiguous weights: time and max difference."""
    import triton.testing

    import moerunner

    s = presets.get_preset("gpt-oss-120b")
    bf = torch.bfloat16
    w13_t = (
        torch.randn(s.num_experts, s.hidden_size, 2 * s.intermediate_size, dtype=bf, device=device)
        * 0.02
    )
    w2_t = (
        torch.randn(s.num_experts, s.intermediate_size, s.hidden_size, dtype=bf, device=device)
        * 0.02
    )
    views = (w13_t.transpose(1, 2), w2_t.transpose(1, 2))
    dense = tuple(v.contiguous() for v in views)
    rows = []
    for backend in ("torch", "triton"):
        for t in tokens:
            x = torch.randn(t, s.hidden_size, dtype=bf, device=device)
            topk = moerunner.select_experts(torch.randn(t, s.num_experts, device=device), s.top_k)

            def call(w, x=x, topk=topk, backend=backend):
                return moerunner.fused_moe(
                    x,
                    *w,
                    topk.weights,
                    topk.ids,
                    activation="swiglu_oai",
                    gate_up_interleaved=True,
                    backend=backend,
                )

            with torch.no_grad():
                a, b = call(views).float(), call(dense).float()
                ms_views = triton.testing.do_bench(lambda: call(views), warmup=5, rep=50)
                ms_dense = triton.testing.do_bench(lambda: call(dense), warmup=5, rep=50)
            rows.append(
                {
                    "backend": backend,
                    "tokens": t,
                    "views_ms": ms_views,
                    "contiguous_ms": ms_dense,
                    "ratio": ms_views / ms_dense,
                    "max_rel_diff": ((a - b).abs().max() / b.abs().max()).item(),
                }
            )
            print(json.dumps(rows[-1]))
    return rows


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=50)
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def measure_integration(device: torch.device, shrink: int, tokens=(1, 64, 1024, 4096)) -> dict:
    """A transformers GPT-OSS experts module called through the "moerunner" implementation,
    stored layout against re-laid: time per call and memory."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    import moerunner
    from moerunner.integrations import transformers as mt

    e, n, h = shapes("gpt-oss-120b", shrink)["w13"]
    s = presets.get_preset("gpt-oss-120b")
    config = GptOssConfig(
        hidden_size=h,
        intermediate_size=n // 2,
        num_local_experts=e,
        num_experts_per_tok=s.top_k,
        experts_implementation="moerunner",
    )
    with torch.device(device):
        experts = GptOssExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    memory = {}

    def allocated() -> int:
        if device.type == "cuda":
            return torch.cuda.memory_allocated(device)
        return storage_bytes(experts)

    memory["stored_bytes"] = allocated()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mt.relayout_experts(experts, "canonical")
    if device.type == "cuda":
        memory["relayout_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    memory["canonical_bytes"] = allocated()
    rows = []
    backends = ("torch", "triton") if device.type == "cuda" else ("torch",)
    for backend in backends:
        config.moerunner_backend = backend
        for t in tokens:
            x = torch.randn(t, h, dtype=torch.bfloat16, device=device)
            topk = moerunner.select_experts(torch.randn(t, e, device=device), s.top_k)
            row = {"backend": backend, "tokens": t}
            outs = {}
            for layout in ("stored", "canonical"):
                mt.relayout_experts(experts, layout)
                with torch.no_grad():
                    outs[layout] = experts(x, topk.ids, topk.weights).float()
                    row[f"{layout}_ms"] = _time_ms(
                        lambda x=x, topk=topk: experts(x, topk.ids, topk.weights), device
                    )
            row["speedup"] = row["stored_ms"] / row["canonical_ms"]
            a, b = outs["canonical"], outs["stored"]
            row["max_rel_diff"] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            rows.append(row)
            print(json.dumps(row))
    print(json.dumps(memory))
    return {"memory": memory, "calls": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shrink", type=int, default=1, help="divide E, H and I by this")
    parser.add_argument("--schemes", default="fp8_block,mxfp4,int4", help="comma-separated")
    parser.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES // 2**20)
    parser.add_argument(
        "--unchunked", action="store_true", help="also quantize all experts in one chunk"
    )
    parser.add_argument("--skip-prepare", action="store_true", help="only the quantize rows")
    parser.add_argument(
        "--views", action="store_true", help="also time transposed-view weights (GPU)"
    )
    parser.add_argument(
        "--integration",
        action="store_true",
        help="also time the transformers GPT-OSS experts call, stored against re-laid",
    )
    parser.add_argument("--out", help="write the rows to this JSON file")
    args = parser.parse_args()
    if args.shrink < 1:
        parser.error("--shrink must be >= 1")
    device = torch.device(args.device)
    torch.manual_seed(0)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shrink": args.shrink,
        "quantize": [],
    }
    chunks = [args.chunk_mib * 2**20] + ([2**62] if args.unchunked else [])
    for scheme in filter(None, args.schemes.split(",")):
        for name, shape in shapes("deepseek-v3", args.shrink).items():
            for chunk in chunks:
                row = {"weight": name, **measure_quantize(shape, scheme, device, chunk)}
                report["quantize"].append(row)
                print(json.dumps(row))
    if not args.skip_prepare:
        report["prepare"] = measure_prepare(args.shrink, device)
        print(json.dumps({"prepare": report["prepare"]}))
    if args.views:
        report["views"] = measure_views(device)
    if args.integration:
        report["integration"] = measure_integration(device, args.shrink)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
