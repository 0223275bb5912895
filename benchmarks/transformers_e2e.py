"""End-to-end transformers benchmark: prefill and decode tokens/s per experts implementation.

Builds a random model with real per-layer shapes (Qwen3-30B-A3B, GPT-OSS-120B) but only a few
layers and a reduced vocabulary, then times, for each experts implementation (transformers'
"eager" loop, its "grouped_mm", and moerunner), one prefill forward of ``batch x prompt``
tokens and ``decode_steps`` single-token steps over a KV cache. Before timing, the prefill
logits of every implementation are compared with eager's (max |d| / max |ref|).

    python benchmarks/transformers_e2e.py --out results_dir            # GPU, real shapes
    python benchmarks/transformers_e2e.py --tiny --device cpu          # a quick CPU check

Prints a compact table last; writes ``transformers_e2e.json`` (with the environment) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import moerunner.integrations.transformers as mt
from moerunner.bench.presets import get_preset


def _moe_dims(preset: str, experts_key: str, inter_key: str) -> dict:
    """The MoE layer's H, I, E and k under a transformers config's names, from the project's
    one preset table (``moerunner.bench.presets``)."""
    s = get_preset(preset)
    return {
        "hidden_size": s.hidden_size,
        inter_key: s.intermediate_size,
        experts_key: s.num_experts,
        "num_experts_per_tok": s.top_k,
    }


# Real per-layer shapes: the MoE dimensions from the presets, the rest (attention, the dense
# MLP size) from the published configs; vocab reduced (LM head is not the subject).
SHAPES = {
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            **_moe_dims("qwen3-30b-a3b", "num_experts", "moe_intermediate_size"),
            intermediate_size=6144,
            norm_topk_prob=True,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    "gpt-oss-120b": (
        "gpt_oss",
        dict(
            **_moe_dims("gpt-oss-120b", "num_local_experts", "intermediate_size"),
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
        ),
    ),
}
TINY = {
    "qwen3-30b-a3b": dict(
        hidden_size=64,
        moe_intermediate_size=32,
        intermediate_size=64,
        num_experts=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "gpt-oss-120b": dict(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def build_model(name: str, layers: int, vocab: int, tiny: bool, dtype, device):
    """Random model of preset ``name`` with ``layers`` decoder layers on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = SHAPES[name]
    kwargs = {**kwargs, **(TINY[name] if tiny else {})}
    kwargs.update(
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    if model_type == "gpt_oss":
        kwargs["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2) + [
            "sliding_attention"
        ] * (layers % 2)
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and p.dim() == 1:
                continue
            # Routers start at zero in some families: random values give realistic loads.
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(model, ids, repeats: int) -> float:
    """Median seconds of one forward over ``ids`` (no cache)."""
    samples = []
    for _ in range(repeats + 1):
        _sync(ids.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
        _sync(ids.device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def time_decode(model, ids, steps: int) -> float:
    """Seconds per decode step (batch of single tokens) after a prefill of ``ids``."""
    from transformers import DynamicCache

    with torch.no_grad():
        try:
            cache = DynamicCache(config=model.config)
        except TypeError:  # older transformers 5.x
            cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        for i in range(steps + 2):
            if i == 2:  # two warm-up steps
                _sync(ids.device)
                t0 = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        _sync(ids.device)
    return (time.perf_counter() - t0) / steps


def measure(model, shape, impl, registered, prompt, decode_prompt, ref, args):
    """One implementation's row: logits error vs the first implementation, prefill, decode."""
    model.set_experts_implementation(registered)
    with torch.no_grad():
        logits = model(prompt[:1, :256]).logits.float()
    if ref is None:
        ref = logits
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    prefill_s = time_prefill(model, prompt, args.repeats)
    decode_s = time_decode(model, decode_prompt, args.decode_steps)
    row = {
        "shape": shape,
        "impl": impl,
        "layers": args.layers,
        "prefill_tokens": prompt.numel(),
        "prefill_tok_s": prompt.numel() / prefill_s,
        "decode_batch": decode_prompt.shape[0],
        "decode_tok_s": decode_prompt.shape[0] / decode_s,
        "max_rel_vs_first": err,
    }
    print(
        f"[{shape}] {impl:<16} prefill {row['prefill_tok_s']:>10.0f} tok/s  "
        f"decode {row['decode_tok_s']:>8.1f} tok/s  err {err:.2e}",
        flush=True,
    )
    return row, ref


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    impls = args.impls.split(",")
    names = {}
    for impl in impls:  # "moerunner:triton" -> a name bound to that backend
        base, _, backend = impl.partition(":")
        names[impl] = mt.register(f"moerunner_{backend}", backend=backend) if backend else base
    results = {"args": vars(args), "rows": []}
    for name in args.shapes.split(","):
        t0 = time.perf_counter()
        model = build_model(name, args.layers, args.vocab, args.tiny, dtype, device)
        print(f"[{name}] built in {time.perf_counter() - t0:.1f}s", flush=True)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=gen).to(device)
        decode_prompt = prompt[: args.decode_batch, : args.decode_prompt]
        ref = None
        for impl in impls:
            try:
                row, ref = measure(model, name, impl, names[impl], prompt, decode_prompt, ref, args)
            except Exception as exc:  # noqa: BLE001  (one failing implementation: keep going)
                row = {"shape": name, "impl": impl, "error": f"{type(exc).__name__}: {exc}"}
                print(f"[{name}] {impl} failed: {row['error']}", flush=True)
            results["rows"].append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def table(results: dict) -> str:
    """Compact table with speedups against the first implementation of each shape."""
    lines = [
        f"{'shape':<15}{'impl':<17}{'prefill tok/s':>14}{'x':>7}{'decode tok/s':>14}{'x':>7}"
        f"{'err':>10}"
    ]
    base: dict[str, dict] = {}
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"{r['shape']:<15}{r['impl']:<17}failed: {r['error'][:60]}")
            continue
        b = base.setdefault(r["shape"], r)
        lines.append(
            f"{r['shape']:<15}{r['impl']:<17}{r['prefill_tok_s']:>14.0f}"
            f"{r['prefill_tok_s'] / b['prefill_tok_s']:>7.2f}{r['decode_tok_s']:>14.1f}"
            f"{r['decode_tok_s'] / b['decode_tok_s']:>7.2f}{r['max_rel_vs_first']:>10.2e}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-120b")
    p.add_argument(
        "--impls",
        default="eager,grouped_mm,moerunner",
        help="comma list; 'moerunner:BACKEND' pins a moerunner backend (default: auto)",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4, help="prefill batch")
    p.add_argument("--prompt", type=int, default=1024, help="prefill tokens per sequence")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, for a CPU check")
    p.add_argument("--out", default=None, help="directory for transformers_e2e.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompt, args.batch, args.decode_prompt = min(args.prompt, 64), 2, 16
        args.decode_batch = min(args.decode_batch, 2)
    results = run(args)
    from moerunner.bench.report import environment

    results["environment"] = environment(torch.device(args.device))
    results["args"]["out"] = "OUT" if args.out else None  # no machine paths in results
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "transformers_e2e.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))


if __name__ == "__main__":
    main()
