"""Host cost per call of the path users call: select_experts, fused_moe and the MoE layer.

On a GPU the host (Python, argument checks, kernel launches) can cost more than the device
work of a decode step, so this measures both, per call, for eager back-to-back calls:

- ``host``: wall time of ``--calls`` calls in a row without a final synchronisation, divided
  by the calls (the host's own cost while the GPU keeps up: the loop enqueues fewer
  launches than the launch queue holds);
- ``sync``: the same loop ending with ``torch.cuda.synchronize()`` (what a caller waits for);
- ``device``: CUDA events around the loop, with the GPU held in a spin kernel while the host
  enqueues the calls, so they run back to back: the device time without host gaps.

Rows: ``select_experts`` with the torch path and with the Triton routing kernel (GPU),
``fused_moe`` with and without the expert-id check, the ``MoE`` layer, and (with
transformers installed) one transformers experts call on the same weights through
moerunner's experts function and through transformers' grouped_mm, at T = 1 and 32
on the Qwen3-30B-A3B and DeepSeek-V3 shapes (``moerunner.bench.presets``; DeepSeek-V3 with
its routing: sigmoid + bias, 8 groups / top 4, scale 2.5). A bare ``torch.add`` row calibrates
the host's speed. Each measurement is repeated ``--repeats`` times: min / median / max.

On a CPU everything is host work (torch backend); ``--shrink`` divides H and I (default 16
on CPU, 1 on GPU; such rows are named ``preset/N``) so the expert rows run in seconds;
routing shapes stay the model's.

    python benchmarks/host_cost.py [--presets qwen3-30b-a3b deepseek-v3] [--tokens 1 32]
        [--calls 50] [--repeats 7] [--dtype bf16] [--shrink N] [--threads N] [--json PATH]

On a CPU shared with other work, pass ``--threads 1``: torch's OpenMP threads waiting for a
busy core made the CPU expert rows 100x slower in one measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import moerunner  # noqa: E402
from moerunner.bench.presets import PRESETS, get_preset  # noqa: E402
from moerunner.cli import _common  # noqa: E402

# Routing of each preset (select_experts keyword arguments); others: softmax, renormalised.
ROUTING = {
    "deepseek-v3": dict(
        scoring_func="sigmoid",
        renormalize=True,
        num_expert_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _routing(name: str) -> dict:
    return dict(ROUTING.get(name, dict(renormalize=True)))


def layer_config(preset: str, shape=None) -> moerunner.MoeConfig:
    """The ``MoE`` layer config of ``preset`` with its routing (``ROUTING``); ``shape``: the
    preset's shape as given (e.g. shrunk), else the preset's own."""
    shape = get_preset(preset) if shape is None else shape
    routing = _routing(preset)
    return moerunner.MoeConfig(
        shape.num_experts,
        shape.hidden_size,
        shape.intermediate_size,
        shape.top_k,
        activation=shape.activation,
        bias=shape.bias,
        gate_up_interleaved=shape.gate_up_interleaved,
        routing=moerunner.RoutingConfig(
            scoring_func=routing.get("scoring_func", "softmax"),
            renormalize=routing["renormalize"],
            num_expert_group=routing.get("num_expert_group"),
            topk_group=routing.get("topk_group"),
            routed_scaling_factor=routing.get("routed_scaling_factor", 1.0),
            correction_bias=routing.get("scoring_func") == "sigmoid",
        ),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_and_sync(fn, calls: int, device: torch.device) -> tuple[float, float]:
    """Seconds per call: loop without a final sync, and with it."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    t2 = time.perf_counter()
    return (t1 - t0) / calls, (t2 - t0) / calls


def _device(fn, calls: int, host_s: float) -> float:
    """Device seconds per call: the GPU spins while the host enqueues, then runs the calls
    back to back between two events."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    hz = getattr(props, "clock_rate", 2_000_000) * 1e3  # kHz in the properties
    cycles = int(min(2.0, 2 * host_s * calls + 2e-3) * hz)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def _stats(values: list[float]) -> dict:
    us = [v * 1e6 for v in values]
    return dict(min=min(us), median=statistics.median(us), max=max(us))


def measure(fn, calls: int, repeats: int, device: torch.device) -> dict:
    for _ in range(3):  # compile, cache, allocate
        fn()
    _sync(device)
    host, synced, dev = [], [], []
    for _ in range(repeats):
        h, s = _host_and_sync(fn, calls, device)
        host.append(h)
        synced.append(s)
        if device.type == "cuda":
            dev.append(_device(fn, calls, h))
    row = dict(host_us=_stats(host), sync_us=_stats(synced))
    if dev:
        row["device_us"] = _stats(dev)
    return row


def _rows_for(preset: str, tokens: list[int], args, device: torch.device, dtype: torch.dtype):
    shape = get_preset(preset)
    if args.shrink > 1:
        shape = replace(
            shape,
            name=f"{shape.name}/{args.shrink}",
            hidden_size=max(16, shape.hidden_size // args.shrink),
            intermediate_size=max(16, shape.intermediate_size // args.shrink),
        )
    e, h, k = shape.num_experts, shape.hidden_size, shape.top_k
    routing = _routing(preset)
    cfg = layer_config(preset, shape)
    with torch.device(device):
        layer = moerunner.MoE(cfg, backend=args.backend, dtype=dtype, device=device)
    bias = layer.correction_bias
    if bias is not None:
        bias.normal_(0, 0.05)
    w13, w2 = layer.w13.detach(), layer.w2.detach()
    gen = torch.Generator(device=device).manual_seed(0)
    route_kw = dict(routing, correction_bias=bias)
    backends = ["torch"] + (["triton"] if device.type == "cuda" and _has_triton() else [])
    experts = _transformers_experts(layer)
    for t in tokens:
        x = torch.randn(t, h, generator=gen, device=device).to(dtype)
        logits = torch.randn(t, e, generator=gen, device=device).to(dtype)
        topk = moerunner.select_experts(logits, k, **route_kw)
        cases = {}
        for b in backends:
            cases[f"select_experts[{b}]"] = partial(
                moerunner.select_experts, logits, k, backend=b, **route_kw
            )
        for check in (True, False):
            cases[f"fused_moe[{args.backend}, check_ids={check}]"] = partial(
                moerunner.fused_moe,
                x,
                w13,
                w2,
                topk.weights,
                topk.ids,
                backend=args.backend,
                check_ids=check,
            )
        cases[f"MoE layer[{args.backend}]"] = partial(layer, x, logits)
        cases.update(_transformers_cases(experts, x, topk, args.backend))
        for op, fn in cases.items():
            with torch.inference_mode():
                row = measure(fn, args.calls, args.repeats, device)
            yield dict(preset=shape.name, tokens=t, op=op, **row)
    moerunner.check_errors()


def _transformers_experts(layer: moerunner.MoE):
    """A transformers experts module (Qwen3-MoE's class: gate_up_proj ``[E, 2I, H]``,
    down_proj ``[E, H, I]``, SiLU) holding the layer's weights, or None without
    transformers: the unit its experts functions are called on."""
    try:
        from transformers import AutoConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError:
        return None
    cfg = layer.config
    hf_cfg = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.intermediate_size,
        num_experts=cfg.num_experts,
        hidden_act="silu",
    )
    experts = Qwen3MoeExperts(hf_cfg).to(device=layer.w13.device, dtype=layer.w13.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(layer.w13)
        experts.down_proj.copy_(layer.w2)
    return experts


def _transformers_cases(experts, x, topk, backend: str) -> dict:
    """One transformers experts call (what a model's MoE block calls per layer) through
    moerunner's experts function and through transformers' own grouped_mm, with the routing
    as transformers' routers give it: int64 ids (``torch.topk``) and weights in the model's
    dtype."""
    if experts is None:
        return {}
    topk = moerunner.TopK(weights=topk.weights.to(x.dtype), ids=topk.ids.long())
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import moerunner.integrations.transformers as mt

    ours = mt.make_experts_forward(backend)
    cases = {
        f"transformers experts[moerunner {backend}]": partial(
            ours, experts, x, topk.ids, topk.weights
        )
    }
    theirs = ALL_EXPERTS_FUNCTIONS.get("grouped_mm")
    if theirs is not None:
        cases["transformers experts[grouped_mm]"] = partial(
            theirs, experts, x, topk.ids, topk.weights
        )
    return cases


def _has_triton() -> bool:
    try:
        from moerunner.backends.triton import _routing  # noqa: F401
    except ImportError:
        return False
    return True


def _fmt(cell: dict | None) -> str:
    if cell is None:
        return f"{'-':>23}"
    return f"{cell['min']:7.1f} {cell['median']:7.1f} {cell['max']:7.1f}"


def print_table(rows: list[dict]) -> None:
    head = f"{'preset':<20} {'T':>4} {'op':<38} "
    sub = "min     med     max"
    print(head + f"{'host us':^23} {'host+sync us':^23} {'device us':^23}")
    print(" " * len(head) + " ".join(f"{sub:>23}" for _ in range(3)))
    for r in rows:
        print(
            f"{r['preset']:<20} {r['tokens']:>4} {r['op']:<38} "
            f"{_fmt(r['host_us'])} {_fmt(r['sync_us'])} {_fmt(r.get('device_us'))}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--presets", nargs="+", choices=sorted(PRESETS), default=["qwen3-30b-a3b", "deepseek-v3"]
    )
    parser.add_argument("--tokens", nargs="+", type=_common.int_type(1), default=[1, 32])
    parser.add_argument(
        "--calls", type=_common.int_type(1), default=50, help="back-to-back calls per timing"
    )
    parser.add_argument("--repeats", type=_common.int_type(1), default=7)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--backend", default="auto", help="fused_moe / MoE backend")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shrink", type=_common.int_type(1), default=None, help="divide H and I (CPU: 16)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument(
        "--threads",
        type=_common.int_type(1),
        default=None,
        help="torch CPU threads (a loaded CPU: use 1)",
    )
    args = parser.parse_args(argv)
    if args.json is not None:  # before any timing
        if args.json.exists() and not args.json.is_file():
            parser.error(f"--json {args.json}: exists and is not a file")
        _common.check_writable_dir(parser, "--json", args.json.parent, shown=args.json)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _common.resolve_device(parser, args.device)
    if args.shrink is None:
        args.shrink = 1 if device.type == "cuda" else 16
    dtype = DTYPES[args.dtype]

    base = torch.zeros(16, device=device)
    rows = [
        dict(
            preset="-",
            tokens=0,
            op="torch.add (calibration)",
            **measure(lambda: torch.add(base, 1.0), args.calls, args.repeats, device),
        )
    ]
    for preset in args.presets:
        rows.extend(_rows_for(preset, args.tokens, args, device, dtype))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print_table(rows)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        torch=torch.__version__,
        moerunner=moerunner.__version__,
        dtype=args.dtype,
        calls=args.calls,
        repeats=args.repeats,
        backend=args.backend,
        shrink=args.shrink,
        threads=torch.get_num_threads(),
    )
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
