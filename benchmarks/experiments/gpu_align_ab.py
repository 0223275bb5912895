# The expert alignment of this checkout against the one of another commit, in one process: each
# one-program (or multi-program) alignment launched 50 times in a CUDA graph, median of 7
# replays per launch, and whether both give the same layout.
#
#   python benchmarks/experiments/gpu_align_ab.py --old ad1aa75
#
# The old ``_align.py`` is read with ``git show REV:moerunner/backends/triton/_align.py`` and
# loaded beside the current one (its relative imports made absolute), so both run with this
# checkout's launcher. Records: nvidia-h100-align-sorted-2026-12-07.txt.

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from moerunner.backends.triton import TritonOptions, _align  # noqa: E402

PATH = "moerunner/backends/triton/_align.py"


def load_old(rev: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:{PATH}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    source = source.replace("from . import", "from moerunner.backends.triton import")
    source = source.replace("from ._launch import", "from moerunner.backends.triton._launch import")
    source = source.replace("from .options import", "from moerunner.backends.triton.options import")
    module = types.ModuleType(f"_align_{rev}")
    module.__file__ = str(ROOT / f"_align_{rev}.py")  # Triton reads kernels' source lines
    Path(module.__file__).write_text(source)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def per_launch(fn, launches: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return sorted(times)[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="commit whose alignment is the baseline")
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 128, 256])
    rows = [1, 8, 32, 64, 128, 256, 512, 1024, 2048]
    ap.add_argument("--rows", type=int, nargs="+", default=rows)
    ap.add_argument("--block-m", type=int, default=16)
    args = ap.parse_args()
    old = load_old(args.old)
    dev = torch.device("cuda")
    opts = TritonOptions(pdl=False)
    bm = args.block_m
    print("E rows  old_us  new_us  old/new  equal")
    try:
        for E in args.experts:
            for rows in args.rows:
                k = min(8, E)
                ids = torch.rand(max(1, rows // k), E, device=dev).topk(k, dim=1).indices
                ids = ids.to(torch.int32).reshape(-1)[:rows].contiguous()
                cap = _align.max_padded_rows(rows, E, bm)
                got = {}
                for name, mod in (("old", old), ("new", _align)):
                    s = torch.full((cap,), -7, dtype=torch.int32, device=dev)
                    b = torch.full((cap // bm,), -7, dtype=torch.int32, device=dev)
                    n = torch.empty(1, dtype=torch.int32, device=dev)

                    def fn(mod=mod, ids=ids, E=E, s=s, b=b, n=n):
                        mod.align_rows(ids, E, bm, s, b, n, options=opts)

                    us = per_launch(fn)
                    used = int(n.item())
                    got[name] = (us, s[:used].tolist(), b[: used // bm].tolist(), used)
                same = got["old"][1:] == got["new"][1:]
                o, w = got["old"][0], got["new"][0]
                print(f"{E:4d} {rows:5d} {o:7.1f} {w:7.1f} {o / w:7.2f}  {same}", flush=True)
    finally:
        Path(old.__file__).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
