"""CPU: the ``torch`` backend vs transformers' eager experts loop and its grouped_mm experts.

Same weights, same process, fresh routing per repetition: Qwen3-30B-A3B's MoE shape (E=128,
k=8, H=2048, I=768) at T = 1, 32, 512 in fp32 and bf16, reported against this CPU's measured
copy bandwidth and matmul peak. Run it in a fresh process (timings right after large
allocations are inflated) on an otherwise idle machine; the JSON records the load average.

    python benchmarks/cpu_torch_vs_transformers.py [--out benchmarks/results] [extra bench flags]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moerunner.cli.bench import main as bench_main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args, extra = parser.parse_known_args()
    stem = args.out / f"cpu-torch-vs-transformers-{time.strftime('%Y-%m-%d')}"
    return bench_main(
        [
            "--preset",
            "qwen3-30b-a3b",
            "--tokens",
            "1,32,512",
            "--schemes",
            "fp32,bf16",
            "--backends",
            "torch",
            "--baselines",
            "eager,grouped_mm",
            "--routing",
            "uniform",
            "--device",
            "cpu",
            "--min-time",
            "1.0",
            "--json",
            f"{stem}.json",
            "--md",
            f"{stem}.md",
            "--png",
            f"{stem}.png",
            *extra,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
