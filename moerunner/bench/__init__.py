"""Benchmarks: model presets, roofline accounting, honest timing, baselines and reports.

``moerunner bench`` (``moerunner/cli/bench.py``) is the front door; this package holds the
parts: ``presets`` (real MoE shapes), ``roofline`` (measured ceilings, per-row bytes and
flops), ``timing`` (medians on rotated inputs, CUDA graphs), ``baselines`` (transformers'
experts modules), ``sweep`` (the rows) and ``report`` (table, JSON, PNG, markdown).
"""

from .presets import GPU_REPORT_PRESETS, PRESETS, BenchShape, get_preset, parse_shape
from .roofline import DeviceCeilings, RowCost, load_or_measure, row_cost
from .sweep import BenchConfig, Row, Sweep, fill_speedups

__all__ = [
    "GPU_REPORT_PRESETS",
    "PRESETS",
    "BenchConfig",
    "BenchShape",
    "DeviceCeilings",
    "Row",
    "RowCost",
    "Sweep",
    "fill_speedups",
    "get_preset",
    "load_or_measure",
    "parse_shape",
    "row_cost",
]
