# Named ranges for profiler traces, opened only while a profiler records.
#
# An open ``torch.profiler.record_function`` scope makes every op inside it pay for the
# profiler's callbacks even when nothing records (about 0.2 us per op on CPU, a few percent
# of a decode call whose grouped GEMM issues a thousand small ops), so stages are named only
# when a trace is being taken.

from __future__ import annotations

import contextlib

import torch


def trace_range(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler is enabled, else a no-op context."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
