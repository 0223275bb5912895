"""Routing and the experts' alignment in one launch (``TritonOptions.route_align_max_tokens``)
against the two launches, on a model preset's MoE layer (bf16, the preset's routing).

- ``eager``: back-to-back calls of the ``MoE`` layer, whose eager calls replay a layer step
  (``backends.triton._step``), once with the fusion on (``--bound`` tokens) and once off,
  alternating repeats in one process; per call: host time, host + sync, and device time
  (``host_cost.measure``). The launches of each step are counted.
- ``graph``: the call's launches captured in a CUDA graph (``--graph-calls`` calls per graph),
  fused (``_step.routed_sequence``) against the ordinary sequence (the routing kernel, then
  ``experts.fused_standard``); replay time per call by CUDA events.

Both variants' outputs are checked equal first. Needs a CUDA GPU with Triton.

    python benchmarks/experiments/gpu_route_align.py [--presets qwen3-30b-a3b deepseek-v3]
        [--tokens 1 8 32] [--bound 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import moerunner  # noqa: E402


def _layer(preset: str, bound: int):
    """The preset's bf16 layer and two runners: fusion on (``bound``) and off."""
    from host_cost import layer_config

    from moerunner.backends.triton import TritonBackend, TritonOptions

    cfg = layer_config(preset)
    dev = torch.device("cuda")
    with torch.device(dev):
        layer = moerunner.MoE(cfg, backend="triton", dtype=torch.bfloat16, device=dev).eval()
    if layer.correction_bias is not None:
        layer.correction_bias.normal_(0, 0.05)
    registry = moerunner.default_registry().copy()
    runners = {}
    for name, max_tokens in (("fused", bound), ("unfused", 0)):
        options = TritonOptions(route_align_max_tokens=max_tokens)
        registry.register_backend(TritonBackend(options, name=f"triton-{name}"))
        runners[name] = moerunner.MoeRunner(f"triton-{name}", registry=registry)
    return layer, runners


def _graph_us(fn, calls: int, repeats: int) -> dict:
    """Replay time per call of a CUDA graph of ``calls`` calls of ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return dict(min=min(times), median=statistics.median(times), max=max(times))


def _rows(preset: str, args) -> list[dict]:
    from moerunner.memo import DerivedCache

    layer, runners = _layer(preset, args.bound)
    steps = {name: DerivedCache() for name in runners}  # a step key does not name the runner
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in args.tokens:
        rows.append(_row(layer, runners, steps, tokens, gen, args))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _row(layer, runners, steps, tokens, gen, args) -> dict:
    from host_cost import measure

    from moerunner.backends.triton import _routing, _step, experts
    from moerunner.dispatch.formats import STANDARD

    def use(name):
        layer.runner, layer._steps = runners[name], steps[name]

    dev = torch.device("cuda")
    cfg = layer.config
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, device=dev).bfloat16()
    logits = torch.randn(tokens, cfg.num_experts, generator=gen, device=dev).bfloat16()
    outs, launches, prepared = {}, {}, {}
    with torch.inference_mode():
        for name in runners:
            use(name)
            for _ in range(6):  # compile, record the plans, make the step
                outs[name] = layer(x, logits).clone()
            step = layer._steps.get(layer._step_key(x, logits))
            assert isinstance(step, _step.LayerStep), f"{name}: no layer step was made"
            launches[name] = len(step.plan.launches)
            prepared[name] = layer._prepared(x, layer.expert_weights(), STANDARD)
    torch.cuda.synchronize()
    same = torch.equal(outs["fused"], outs["unfused"])
    row = dict(preset=args.preset_name, tokens=tokens, same_output=same, launches=launches)
    eager = {name: [] for name in runners}
    with torch.inference_mode():
        for _ in range(args.repeats):  # alternate, so drift hits both alike
            for name in runners:
                use(name)
                eager[name].append(measure(lambda: layer(x, logits), args.calls, 1, dev))
    row["eager_median_us"] = {
        name: {
            part: statistics.median(m[part]["median"] for m in ms)
            for part in ("host_us", "sync_us", "device_us")
        }
        for name, ms in eager.items()
    }
    routing = layer._routing_kwargs()
    top_k = routing.pop("top_k")
    bias = routing.pop("correction_bias", None)
    out = torch.empty_like(x)
    weights = torch.empty(tokens, top_k, device=dev)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=dev)
    fused_p, plain_p = prepared["fused"], prepared["unfused"]

    def fused():
        _step.routed_sequence(x, logits, bias, routing, top_k, fused_p, out, weights, ids)

    def ordinary():
        tk = _routing.route(logits, top_k, correction_bias=bias, **routing)
        experts.fused_standard(x, tk.weights, tk.ids, plain_p)

    graph = {}
    with torch.inference_mode():
        if _step.fuses_routing_and_alignment(tokens, top_k, logits.shape[-1], fused_p.options):
            graph["fused"] = _graph_us(fused, args.graph_calls, args.repeats)
        graph["unfused"] = _graph_us(ordinary, args.graph_calls, args.repeats)
    row["graph_us"] = graph
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--bound", type=int, default=32, help="route_align_max_tokens when on")
    parser.add_argument("--calls", type=int, default=50, help="eager calls per timing")
    parser.add_argument("--graph-calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for preset in args.presets:
        args.preset_name = preset
        rows.extend(_rows(preset, args))
        torch.cuda.empty_cache()
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        moerunner=moerunner.__version__,
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    )
    if args.json is not None:
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
