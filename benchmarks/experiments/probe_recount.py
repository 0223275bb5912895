"""Re-count a bad-input and fault probe of the library: run each probe, classify its outcome.

Probes are the kinds a new user tries: bad shapes, dtypes and devices, values (NaN, inf,
zero or negative scales), out-of-range expert ids, memory layouts, CLI arguments and faults
on one rank of a 2-process gloo world. Each has an expectation: ``error`` (the input is
wrong) or ``value`` (the input is valid; the result is compared with ``reference_moe``).

Outcomes:

- ``clear``: a ``ValueError`` / ``TypeError`` (``moerunner.errors`` types included) whose
  message names the argument (the probe's words), or a CLI usage error without a traceback;
- ``correct``: a valid input's result within ``moerunner.testing.error_bound`` of the
  reference (non-finite where the reference is, for NaN / inf inputs);
- ``silent``: a wrong result without an error (a bad input accepted, or a valid one wrong);
- ``internal``: any other exception, an error not naming the argument, or a CLI traceback;
- ``crash``: the process running the probe died.

In-process probes run in a child process (restarted after a crash), one JSON line each.

    python benchmarks/experiments/probe_recount.py --out cpu-probe-recount-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

OUTCOMES = ("clear", "correct", "silent", "internal", "crash")


@dataclass
class Probe:
    name: str
    category: str
    expect: str  # "error" or "value"
    run: object = field(repr=False)  # () -> (out, ref) for "value"; raises for "error"
    words: tuple[str, ...] = ()  # an error message must contain one of these


# -- in-process probes ------------------------------------------------------------------------


def _problem(tokens=6, hidden=32, inter=16, experts=4, top_k=2, dtype=None, seed=0):
    import torch

    import moerunner

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    tk = moerunner.select_experts(torch.randn(tokens, experts, generator=g), top_k)
    return x, w13, w2, tk.weights, tk.ids


def _fused(backend="torch", **change):
    """A fused_moe call on the base problem with some arguments replaced."""

    def run():
        import moerunner

        x, w13, w2, tw, ids = _problem()
        args = {"x": x, "w13": w13, "w2": w2, "tw": tw, "ids": ids}
        kw = {"backend": backend}
        for key, value in change.items():
            value = value(args) if callable(value) else value
            if key in args:
                args[key] = value
            else:
                kw[key] = value
        return moerunner.fused_moe(
            args["x"], args["w13"], args["w2"], args["tw"], args["ids"], **kw
        )

    return run


def _value(backend="torch", dtype=None, layout=None, **problem_kw):
    """A valid call (optionally laid out differently) and its float64 reference."""

    def run():
        import moerunner

        x, w13, w2, tw, ids = _problem(dtype=dtype, **problem_kw)
        if layout is not None:
            x, w13, w2, tw, ids = layout(x, w13, w2, tw, ids)
        out = moerunner.fused_moe(x, w13, w2, tw, ids, backend=backend)
        ref = moerunner.reference_moe(x, moerunner.ExpertWeights(w13, w2), tw, ids)
        return out, ref

    return run


def _layouts():
    def transposed(x, *rest):
        return (x.t().contiguous().t(), *rest)

    def sliced(x, *rest):
        big = x.new_zeros(x.shape[0], 2 * x.shape[1])
        big[:, ::2] = x
        return (big[:, ::2], *rest)

    def expanded(x, w13, w2, tw, ids):
        return x[:1].expand_as(x), w13, w2, tw[:1].expand_as(tw), ids[:1].expand_as(ids)

    def weights_transposed(x, w13, w2, tw, ids):
        return x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, tw, ids

    def routing_transposed(x, w13, w2, tw, ids):
        return x, w13, w2, tw.t().contiguous().t(), ids.t().contiguous().t()

    return {
        "transposed_x": transposed,
        "sliced_x": sliced,
        "expanded_x_and_routing": expanded,
        "weights_column_major": weights_transposed,
        "routing_column_major": routing_transposed,
    }


def _with(tensor_fn):
    return lambda args: tensor_fn(args)


def _ids_with(value, dtype=None):
    def make(args):
        ids = args["ids"].clone() if dtype is None else args["ids"].to(dtype)
        ids[0, 0] = value
        return ids

    return make


def _quantize_with_scale(scheme, value):
    """A QuantizedWeight built from a quantized one's tensors with one scale replaced."""

    def run():
        import torch

        import moerunner

        q = moerunner.quantize(torch.randn(2, 32, 64), scheme)
        bad = q.scale.clone()
        bad.view(-1)[0] = value
        return moerunner.quant.QuantizedWeight(q.scheme, q.shape, q.data, bad)

    return run


def _routing_probe(**kw):
    def run():
        import torch

        import moerunner

        return moerunner.select_experts(torch.randn(6, 8), 2, **kw)

    return run


def _correction_bias_nan():
    import torch

    b = torch.zeros(8)
    b[3] = float("nan")
    return _routing_probe(scoring_func="sigmoid", correction_bias=b)


def _layer_probe(build_kw=None, call=None):
    def run():
        import torch

        import moerunner

        cfg = moerunner.MoeConfig(num_experts=8, hidden_size=32, intermediate_size=16, top_k=2)
        layer = moerunner.MoE(cfg, **(build_kw or {}))
        x, logits = torch.randn(5, 32), torch.randn(5, 8)
        return layer(*(call(x, logits) if call else (x, logits)))

    return run


def in_process_probes(with_triton: bool) -> list[Probe]:
    import torch

    probes: list[Probe] = []
    backends = ["torch"] + (["triton"] if with_triton else [])
    for b in backends:
        add = probes.append
        # shapes
        add(
            Probe(
                f"{b}/x_1d", "shapes", "error", _fused(b, x=lambda a: a["x"][0]), ("hidden_states",)
            )
        )
        add(
            Probe(
                f"{b}/x_wrong_H",
                "shapes",
                "error",
                _fused(b, x=lambda a: a["x"][:, :-1]),
                ("hidden", "H"),
            )
        )
        add(
            Probe(
                f"{b}/w2_wrong_E", "shapes", "error", _fused(b, w2=lambda a: a["w2"][:-1]), ("w2",)
            )
        )
        add(
            Probe(
                f"{b}/w2_wrong_I",
                "shapes",
                "error",
                _fused(b, w2=lambda a: a["w2"][..., :-1]),
                ("w2", "I"),
            )
        )
        add(
            Probe(
                f"{b}/w13_odd_rows",
                "shapes",
                "error",
                _fused(b, w13=lambda a: a["w13"][:, :-1]),
                ("w13",),
            )
        )
        add(
            Probe(
                f"{b}/ids_wrong_T",
                "shapes",
                "error",
                _fused(b, ids=lambda a: a["ids"][:-1]),
                ("topk_ids", "topk"),
            )
        )
        add(
            Probe(
                f"{b}/weights_wrong_k",
                "shapes",
                "error",
                _fused(b, tw=lambda a: a["tw"][:, :1]),
                ("topk_weights", "topk"),
            )
        )
        add(
            Probe(
                f"{b}/bias_wrong_shape",
                "shapes",
                "error",
                _fused(b, w13_bias=torch.zeros(3, 5)),
                ("w13_bias",),
            )
        )
        add(Probe(f"{b}/T0", "shapes", "value", _value(b, tokens=0)))
        add(Probe(f"{b}/T1", "shapes", "value", _value(b, tokens=1)))
        add(Probe(f"{b}/k_equals_E", "shapes", "value", _value(b, top_k=4)))
        add(Probe(f"{b}/I1", "shapes", "value", _value(b, inter=1)))
        add(Probe(f"{b}/H_unaligned", "shapes", "value", _value(b, hidden=33, inter=17)))
        add(
            Probe(
                f"{b}/top_k_0",
                "shapes",
                "value",
                _value(
                    b,
                    top_k=1,
                    layout=lambda x, w13, w2, tw, ids: (x, w13, w2, tw[:, :0], ids[:, :0]),
                ),
            )
        )
        # dtypes
        add(
            Probe(
                f"{b}/x_int",
                "dtypes",
                "error",
                _fused(b, x=lambda a: a["x"].int()),
                ("hidden_states", "dtype"),
            )
        )
        add(
            Probe(
                f"{b}/x_fp64",
                "dtypes",
                "error",
                _fused(b, x=lambda a: a["x"].double()),
                ("hidden_states", "dtype", "float64"),
            )
        )
        add(
            Probe(
                f"{b}/w13_other_dtype",
                "dtypes",
                "error",
                _fused(b, w13=lambda a: a["w13"].half()),
                ("w13", "dtype"),
            )
        )
        add(
            Probe(
                f"{b}/ids_float",
                "dtypes",
                "error",
                _fused(b, ids=lambda a: a["ids"].float()),
                ("topk_ids",),
            )
        )
        add(
            Probe(
                f"{b}/weights_int",
                "dtypes",
                "error",
                _fused(b, tw=lambda a: a["tw"].int()),
                ("topk_weights",),
            )
        )
        add(Probe(f"{b}/x_list", "dtypes", "error", _fused(b, x=[[1.0]]), ("hidden_states",)))
        add(Probe(f"{b}/fp16", "dtypes", "value", _value(b, dtype=torch.float16)))
        if b == "torch":
            add(Probe(f"{b}/bf16", "dtypes", "value", _value(b, dtype=torch.bfloat16)))
        # devices
        for which in ("w2", "tw", "ids"):
            add(
                Probe(
                    f"{b}/{which}_on_meta",
                    "devices",
                    "error",
                    _fused(b, **{which: lambda a, w=which: a[w].to("meta")}),
                    ({"tw": "topk_weights", "ids": "topk_ids"}.get(which, which),),
                )
            )
        add(
            Probe(
                f"{b}/x_on_meta",
                "devices",
                "error",
                _fused(b, x=lambda a: a["x"].to("meta")),
                ("hidden_states",),
            )
        )
        # values
        add(
            Probe(
                f"{b}/nan_in_x",
                "values",
                "value",
                _value(
                    b, layout=lambda x, *r: (x.index_fill(0, torch.tensor([0]), float("nan")), *r)
                ),
            )
        )
        add(
            Probe(
                f"{b}/inf_in_x",
                "values",
                "value",
                _value(
                    b, layout=lambda x, *r: (x.index_fill(0, torch.tensor([1]), float("inf")), *r)
                ),
            )
        )
        add(
            Probe(
                f"{b}/swiglu_alpha_nan",
                "values",
                "error",
                _fused(b, activation="swiglu_oai", swiglu_alpha=float("nan")),
                ("swiglu_alpha",),
            )
        )
        add(
            Probe(
                f"{b}/swiglu_alpha_str",
                "values",
                "error",
                _fused(b, activation="swiglu_oai", swiglu_alpha="x"),
                ("swiglu_alpha",),
            )
        )
        add(
            Probe(
                f"{b}/activation_unknown",
                "values",
                "error",
                _fused(b, activation="tanh"),
                ("activation",),
            )
        )
        # ids
        for name, value in (("E", 4), ("E_plus_3", 7), ("minus_2", -2), ("int32_max", 2**31 - 1)):
            add(
                Probe(
                    f"{b}/id_{name}", "ids", "error", _fused(b, ids=_ids_with(value)), ("topk_ids",)
                )
            )
        add(
            Probe(
                f"{b}/id_2pow32_int64",
                "ids",
                "error",
                _fused(b, ids=_ids_with(2**32 + 1, torch.int64)),
                ("topk_ids",),
            )
        )
        add(
            Probe(
                f"{b}/minus_one_ids",
                "ids",
                "value",
                _value(
                    b,
                    layout=lambda x, w13, w2, tw, ids: (
                        x,
                        w13,
                        w2,
                        tw,
                        ids.index_fill(1, torch.tensor([0]), -1),
                    ),
                ),
            )
        )
        # layouts
        for name, layout in _layouts().items():
            add(Probe(f"{b}/{name}", "layouts", "value", _value(b, layout=layout)))
        add(Probe(f"{b}/backend_unknown", "values", "error", _fused("nosuch"), ("backend",)))
    # quantization scale values (torch backend; the weight object is the same for triton)
    for scheme in ("fp8_channel", "int8", "fp8_block"):
        for name, value in (("zero", 0.0), ("negative", -1.0), ("nan", float("nan"))):
            probes.append(
                Probe(
                    f"quant/{scheme}_scale_{name}",
                    "values",
                    "error",
                    _quantize_with_scale(scheme, value),
                    ("scale",),
                )
            )
    probes.append(
        Probe(
            "quant/unknown_scheme",
            "values",
            "error",
            lambda: __import__("moerunner").quantize(torch.randn(2, 8, 32), "fp7"),
            ("scheme",),
        )
    )
    probes.append(
        Probe(
            "quant/mxfp4_K_48",
            "shapes",
            "error",
            lambda: __import__("moerunner").quantize(torch.randn(2, 8, 48), "mxfp4"),
            ("K", "multiple"),
        )
    )
    # routing
    probes.append(
        Probe(
            "routing/nan_correction_bias",
            "values",
            "error",
            _correction_bias_nan(),
            ("correction_bias",),
        )
    )
    probes.append(
        Probe(
            "routing/top_k_above_E",
            "shapes",
            "error",
            lambda: __import__("moerunner").select_experts(torch.randn(4, 3), 5),
            ("top_k",),
        )
    )
    probes.append(
        Probe(
            "routing/bias_list",
            "dtypes",
            "error",
            _routing_probe(correction_bias=[0.0] * 8),
            ("correction_bias",),
        )
    )
    probes.append(
        Probe(
            "routing/num_expert_group_float",
            "dtypes",
            "error",
            _routing_probe(num_expert_group=2.0, topk_group=1),
            ("num_expert_group",),
        )
    )
    # the layer
    probes.append(
        Probe(
            "layer/router_logits_too_few",
            "shapes",
            "error",
            _layer_probe(call=lambda x, lg: (x, lg[:, :4])),
            ("router_logits",),
        )
    )
    probes.append(
        Probe(
            "layer/hidden_wrong_H",
            "shapes",
            "error",
            _layer_probe(call=lambda x, lg: (x[:, :-1], lg)),
            ("hidden_states",),
        )
    )
    probes.append(
        Probe(
            "layer/dispatcher_unknown",
            "values",
            "error",
            _layer_probe(build_kw={"dispatcher": "nosuch"}),
            ("dispatcher",),
        )
    )
    probes.append(
        Probe(
            "layer/backend_unknown",
            "values",
            "error",
            _layer_probe(build_kw={"backend": "nosuch"}),
            ("backend",),
        )
    )
    return probes


# -- classification ---------------------------------------------------------------------------


def classify(probe: Probe) -> tuple[str, str]:
    import torch

    from moerunner.testing import compare, error_bound

    try:
        result = probe.run()
    except (ValueError, TypeError) as exc:
        text = f"{type(exc).__name__}: {exc}"
        if probe.words and not any(w.lower() in str(exc).lower() for w in probe.words):
            return "internal", "error does not name the argument: " + text[:300]
        return "clear", text[:300]
    except Exception as exc:  # noqa: BLE001  (an internal error is an outcome here)
        return "internal", f"{type(exc).__name__}: {str(exc)[:300]}"
    if probe.expect == "error":
        return "silent", "accepted without an error"
    out, ref = result
    if out.shape != ref.shape:
        return "silent", f"shape {list(out.shape)} vs reference {list(ref.shape)}"
    o, r = out.double().cpu(), ref.double()
    same_nonfinite = torch.equal(~torch.isfinite(o), ~torch.isfinite(r))
    if not same_nonfinite:
        return "silent", "non-finite elements differ from the reference"
    finite = torch.isfinite(r)
    if finite.any():
        report = compare(o[finite], r[finite])
        bound = error_bound(out.dtype, False)
        if report.max_rel > bound:
            return "silent", f"max rel error {report.max_rel:.3g} > {bound:g}"
    return "correct", ""


def child_main(start: int, with_triton: bool) -> None:
    """Run probes from ``start`` on, one JSON line each (the parent restarts after a crash)."""
    import torch

    torch.manual_seed(0)
    probes = in_process_probes(with_triton)
    for i in range(start, len(probes)):
        p = probes[i]
        print(json.dumps({"index": i, "start": True}), flush=True)
        outcome, detail = classify(p)
        print(
            json.dumps(
                {"index": i, "name": p.name, "category": p.category, "expect": p.expect,
                 "outcome": outcome, "detail": detail}
            ),
            flush=True,
        )  # fmt: skip


def run_in_children(with_triton: bool) -> list[dict]:
    env = dict(os.environ)
    if with_triton:
        env.setdefault("TRITON_INTERPRET", "1")
    names = [(p.name, p.category, p.expect) for p in in_process_probes(with_triton)]
    records: dict[int, dict] = {}
    start = 0
    while start < len(names):
        cmd = [sys.executable, __file__, "--child", str(start)]
        if with_triton:
            cmd.append("--triton")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        current = None
        for line in proc.stdout.splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("start"):
                current = rec["index"]
            else:
                records[rec["index"]] = rec
                current = None
        if proc.returncode == 0 and current is None:
            break
        crashed = current if current is not None else start
        name, category, expect = names[crashed]
        records[crashed] = {
            "index": crashed, "name": name, "category": category, "expect": expect,
            "outcome": "crash", "detail": f"exit code {proc.returncode}: {proc.stderr[-300:]}",
        }  # fmt: skip
        start = crashed + 1
    return [records[i] for i in sorted(records)]


# -- CLI probes -------------------------------------------------------------------------------

CLI_PROBES = [
    # (name, arguments, expect)
    ("demo/tokens_negative", ["demo", "--tokens", "-5"], "error"),
    ("demo/hidden_negative", ["demo", "--hidden", "-8"], "error"),
    ("demo/hidden_zero", ["demo", "--hidden", "0"], "error"),
    ("demo/intermediate_zero", ["demo", "--intermediate", "0"], "error"),
    ("demo/repeats_zero", ["demo", "--repeats", "0"], "error"),
    ("demo/device_cuda", ["demo", "--device", "cuda"], "error"),
    ("demo/device_bogus", ["demo", "--device", "bogus"], "error"),
    ("check/tokens_negative", ["check", "--tokens", "-1"], "error"),
    ("check/experts_zero", ["check", "--experts", "0"], "error"),
    ("check/top_k_zero", ["check", "--top-k", "0"], "error"),
    ("check/top_k_99", ["check", "--top-k", "99"], "error"),
    ("check/hidden_zero", ["check", "--hidden", "0"], "error"),
    ("check/mxfp4_hidden_48", ["check", "--hidden", "48", "--scheme", "mxfp4"], "error"),
    ("check/device_cuda", ["check", "--device", "cuda"], "error"),
    ("bench/replay_missing", ["bench", "--replay", "/nonexistent/replay.json"], "error"),
    ("bench/device_bogus", ["bench", "--device", "bogus"], "error"),
    ("bench/threads_negative", ["bench", "--threads", "-2"], "error"),
    ("bench/zipf_negative", ["bench", "--zipf-exponent", "-1"], "error"),
    ("bench/min_time_negative", ["bench", "--min-time", "-1"], "error"),
    ("check/default", ["check"], "value"),
]


def run_cli_probes() -> list[dict]:
    records = []
    for name, args, expect in CLI_PROBES:
        proc = subprocess.run(
            [sys.executable, "-m", "moerunner", *args], capture_output=True, text=True, timeout=600
        )
        text = proc.stdout + proc.stderr
        if proc.returncode < 0:
            outcome, detail = "crash", f"signal {-proc.returncode}"
        elif "Traceback" in text:
            outcome, detail = "internal", text.strip().splitlines()[-1][:300]
        elif proc.returncode == 0:
            outcome = "correct" if expect == "value" else "silent"
            detail = "" if expect == "value" else "accepted"
        else:
            outcome, detail = "clear", text.strip().splitlines()[-1][:300] if text.strip() else ""
        records.append(
            {"name": "cli/" + name, "category": "cli", "expect": expect, "outcome": outcome,
             "detail": detail}
        )  # fmt: skip
    return records


# -- distributed faults -----------------------------------------------------------------------


def _world_child(rank, world, port, out_dir):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=10),
    )  # fmt: skip
    from moerunner import ExpertWeights
    from moerunner.distributed_moe import ExpertParallelMoE
    from moerunner.routing import TopK

    g = torch.Generator().manual_seed(3)
    weights = ExpertWeights(
        torch.randn(8, 32, 16, generator=g) / 4, torch.randn(8, 16, 16, generator=g) / 4
    )
    x = torch.randn(5, 16, generator=g)
    topk = TopK(
        torch.rand(5, 2, generator=g), torch.randint(0, 8, (5, 2), generator=g, dtype=torch.int32)
    )
    results = {}
    for kind, kw in (("standard", {}), ("all_to_all", {}), ("masked", {"capacity": 32})):
        moe = ExpertParallelMoE.from_global(weights, dispatcher=kind, backend="torch", **kw)
        moe(x, topk)
        faults = {
            "wrong_H": (torch.randn(5, 17), topk),
            "dtype_fp64": (x.double(), topk),
            "id_out_of_range": (
                x,
                TopK(topk.weights, topk.ids.index_fill(1, torch.tensor([0]), 11)),
            ),
            "dtype_fp16": (x.half(), topk),
        }
        for fault, bad in faults.items():
            try:
                moe(*(bad if rank == 1 else (x, topk)))
                results[f"{kind}/{fault}"] = ("ok", "")
            except (ValueError, TypeError, RuntimeError) as exc:
                results[f"{kind}/{fault}"] = (type(exc).__name__, str(exc)[:300])
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run_distributed_probes() -> list[dict]:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from moerunner import errors

    clear_types = {"ValueError", "TypeError"} | {
        n for n in dir(errors) if isinstance(getattr(errors, n), type)
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_world_child, args=(2, port, out_dir), nprocs=2, start_method="fork")
        except Exception as exc:  # noqa: BLE001  (a rank died: recorded below)
            died = str(exc)[:300]
        else:
            died = ""
        per_rank = []
        for rank in range(2):
            path = os.path.join(out_dir, f"{rank}.json")
            per_rank.append(json.load(open(path)) if os.path.exists(path) else None)
    if any(r is None for r in per_rank):
        return [{"name": "distributed/world", "category": "distributed", "expect": "error",
                 "outcome": "crash", "detail": died}]  # fmt: skip
    records = []
    for key in per_rank[0]:
        outcomes = [r[key] for r in per_rank]
        expect = (
            "value" if key.endswith("dtype_fp16") and not key.startswith("standard") else "error"
        )
        types = {o[0] for o in outcomes}
        if "ok" in types:
            outcome = "silent" if expect == "error" else "correct"
            if types != {"ok"}:
                outcome = "internal"
        elif len(types) == 1 and types <= clear_types and all("rank" in o[1] for o in outcomes):
            # A RankFailedError carries the failing rank's own error: clear only if that is.
            wrapped = {
                o[1].split("rank 1: ", 1)[-1].split(":", 1)[0]
                for o in outcomes
                if o[0] == "RankFailedError"
            }
            outcome = "clear" if wrapped <= clear_types else "internal"
        else:
            outcome = "internal"
        detail = " | ".join(f"{t}: {m}" for t, m in outcomes)
        records.append({"name": "distributed/" + key, "category": "distributed", "expect": expect,
                        "outcome": outcome, "detail": detail})  # fmt: skip
    return records


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the records and counts to this JSON file")
    parser.add_argument("--no-triton", action="store_true", help="skip the triton probes")
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI probes")
    parser.add_argument("--no-distributed", action="store_true", help="skip the gloo world")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--triton", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child_main(args.child, args.triton)
        return
    started = time.time()
    records = run_in_children(with_triton=not args.no_triton)
    if not args.no_cli:
        records += run_cli_probes()
    if not args.no_distributed:
        records += run_distributed_probes()
    counts = Counter(r["outcome"] for r in records)
    by_category: dict[str, Counter] = {}
    for r in records:
        by_category.setdefault(r["category"], Counter())[r["outcome"]] += 1
    print(f"{'category':<12} {'tried':>5} " + " ".join(f"{o:>8}" for o in OUTCOMES))
    for cat, c in sorted(by_category.items()):
        print(f"{cat:<12} {sum(c.values()):>5} " + " ".join(f"{c[o]:>8}" for o in OUTCOMES))
    print(f"{'total':<12} {len(records):>5} " + " ".join(f"{counts[o]:>8}" for o in OUTCOMES))
    for r in records:
        if r["outcome"] in ("silent", "internal", "crash"):
            print(f"  {r['outcome']:<8} {r['name']}: {r['detail'][:200]}")
    if args.out:
        import torch

        import moerunner

        with open(args.out, "w") as f:
            json.dump(
                {
                    "argv": sys.argv,
                    "torch": torch.__version__,
                    "moerunner": moerunner.__version__,
                    "seconds": round(time.time() - started, 1),
                    "counts": {o: counts[o] for o in OUTCOMES},
                    "tried": len(records),
                    "by_category": {k: dict(v) for k, v in by_category.items()},
                    "records": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
