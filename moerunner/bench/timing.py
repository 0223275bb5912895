"""Timing: medians after warm-up, on rotated inputs, with CUDA-graph replay where it applies.

``time_cases(run, n_cases, ...)`` times ``run(i)`` for rotating case indices ``i`` (each case
has its own freshly drawn routing and input, and its own weight copy when copies fit), so
consecutive repetitions do not find the same experts' weights in the cache.

Every ``Timing`` also carries the spread of its samples (min, quartiles, max), so a noisy
measurement can be told from a clean one.

- CPU: ``time.perf_counter`` around each call; median. ``time_interleaved_cpu`` times
  several implementations in alternating rounds (what the sweep uses on CPU).
- GPU, eager: CUDA events around each call; median.
- GPU, CUDA graph: all cases captured into one graph (after a warm-up pass on a side stream,
  as capture requires); events around each replay; median replay time / number of cases.
  A backend that cannot be captured (host synchronisation) is timed eagerly and says so.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Timing:
    """Median seconds per call, how many samples it took and how it was measured, and the
    spread of the samples (seconds per call: min, first and third quartile, max; NaN if
    unknown)."""

    seconds: float
    samples: int
    mode: str
    note: str = ""
    min_s: float = float("nan")
    q1_s: float = float("nan")
    q3_s: float = float("nan")
    max_s: float = float("nan")

    @property
    def iqr_pct(self) -> float:
        """Interquartile range as % of the median (NaN if unknown)."""
        if not self.seconds > 0:
            return float("nan")
        return 100.0 * (self.q3_s - self.q1_s) / self.seconds


def summarize(samples: list[float], mode: str, note: str = "", count: int | None = None) -> Timing:
    """A ``Timing`` of per-call seconds ``samples``: median and spread (``count``: samples
    to report, when one sample covers several calls)."""
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return Timing(
        statistics.median(ordered),
        len(ordered) if count is None else count,
        mode,
        note,
        ordered[0],
        q1,
        q3,
        ordered[-1],
    )


def _reps_for(estimate_s: float, min_time_s: float, min_reps: int, max_reps: int) -> int:
    """Samples enough for ``min_time_s`` seconds of calls of ``estimate_s`` each, at least
    ``min_reps`` and at most ``max_reps``: the cap wins (it bounds a run's length; fast calls
    reach it long before ``min_time_s``), so more samples of a fast call take a larger
    ``max_reps`` (``bench --max-reps``), not a larger ``min_time_s``."""
    if estimate_s <= 0:
        return max_reps
    return int(min(max_reps, max(min_reps, min_time_s / estimate_s)))


def _time_cpu(
    run: Callable[[int], object], n_cases: int, min_time_s: float, min_reps: int, max_reps: int
) -> Timing:
    """One implementation: ``time_interleaved_cpu``'s rounds with a single entry."""
    timing = time_interleaved_cpu(
        {0: run}, n_cases, min_time_s=min_time_s, min_reps=min_reps, max_reps=max_reps
    )[0]
    return replace(timing, mode="cpu perf_counter")


def time_interleaved_cpu(
    runs: dict[object, Callable[[int], object]],
    n_cases: int,
    *,
    min_time_s: float = 0.2,
    min_reps: int = 5,
    max_reps: int = 200,
) -> dict[object, Timing]:
    """CPU: median seconds per call of each ``runs[key](i)``, timed in interleaved rounds.

    Each round calls every implementation once, starting from a rotating position, so load
    from neighbours, frequency changes and allocator state fall on all of them alike: the
    ratios between them are what this protects. Calls take the cases in turn (call c runs
    case c mod ``n_cases``), so no call finds the experts of the call before it in the cache,
    and the rounds are a multiple of lcm(implementations, cases), so every implementation
    runs every case equally often. ``min_time_s`` is per implementation.
    """
    keys = list(runs)
    for key in keys:  # warm-up: allocator, lazy init, first touch of each case
        for i in range(n_cases):
            runs[key](i)
    t0 = time.perf_counter()
    for i, key in enumerate(keys):  # one warm round estimates the repetitions
        runs[key](i % n_cases)
    estimate = (time.perf_counter() - t0) / len(keys)
    period = math.lcm(len(keys), n_cases)
    rounds = _reps_for(estimate, min_time_s, min_reps, max_reps)
    rounds = period * max(1, min(math.ceil(rounds / period), max_reps // period))
    samples: dict[object, list[float]] = {key: [] for key in keys}
    call = 0
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            t0 = time.perf_counter()
            runs[key](call % n_cases)
            samples[key].append(time.perf_counter() - t0)
            call += 1
    return {key: summarize(v, "cpu perf_counter, interleaved") for key, v in samples.items()}


def _time_cuda_eager(
    run: Callable[[int], object],
    n_cases: int,
    min_time_s: float,
    min_reps: int,
    max_reps: int,
    note: str = "",
) -> Timing:
    for i in range(n_cases):  # warm-up: every case once (autotuning, caches, allocator)
        run(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(0)
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end) / 1e3
    samples = []
    for r in range(_reps_for(estimate, min_time_s, min_reps, max_reps)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(r % n_cases)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return summarize(samples, "cuda events, eager", note)


def _time_cuda_graph(
    run: Callable[[int], object], n_cases: int, min_time_s: float, min_reps: int, max_reps: int
) -> Timing:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_cases):
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_cases):
            run(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end) / 1e3
    samples = []
    for _ in range(_reps_for(estimate, min_time_s, min_reps, max_reps)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n_cases)
    del graph
    return summarize(
        samples, f"cuda graph replay of {n_cases} rotated calls", count=len(samples) * n_cases
    )


def time_cases(
    run: Callable[[int], object],
    n_cases: int,
    device: torch.device,
    *,
    cuda_graph: bool = True,
    min_time_s: float = 0.2,
    min_reps: int = 5,
    max_reps: int = 200,
) -> Timing:
    """Median seconds of one call of ``run(i)`` over rotated case indices ``i < n_cases``."""
    if device.type != "cuda":
        return _time_cpu(run, n_cases, min_time_s, min_reps, max_reps)
    if not cuda_graph:
        return _time_cuda_eager(run, n_cases, min_time_s, min_reps, max(min_reps, max_reps // 4))
    try:
        return _time_cuda_graph(
            run, n_cases, min_time_s, max(2, min_reps // n_cases + 1), max(2, max_reps // n_cases)
        )
    except Exception as exc:  # noqa: BLE001  (capture fails on host syncs: time eagerly instead)
        torch.cuda.synchronize()
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        return _time_cuda_eager(
            run,
            n_cases,
            min_time_s,
            min_reps,
            max(min_reps, max_reps // 4),
            note=f"graph capture failed ({reason})",
        )


def time_steps(
    steps: dict[object, Callable[[int], object]], n_cases: int, device: torch.device
) -> dict[object, Timing]:
    """Training steps (forward and backward, which graphs do not capture) side by side: on
    the CPU in interleaved rounds (``time_interleaved_cpu``), on CUDA with events around each
    eager step (``time_cases`` without graphs)."""
    if device.type == "cpu":
        return time_interleaved_cpu(steps, n_cases, min_time_s=0.5)
    return {k: time_cases(run, n_cases, device, cuda_graph=False) for k, run in steps.items()}


def time_steps_queued(
    steps: dict[object, Callable[[int], object]],
    n_cases: int,
    device: torch.device,
    per_rep: int = 10,
    reps: int = 5,
) -> dict[object, Timing]:
    """Training steps queued back to back: per sample, ``per_rep`` steps (case indices in
    turn) between two synchronisations, wall seconds per step; ``reps`` samples. The rate of
    a training loop whose host runs ahead of the device, where ``time_steps`` (a
    synchronisation after each step) also counts the device idling while each step's first
    kernels are queued. On the CPU the same loop (nothing to queue ahead)."""
    cuda = device.type == "cuda"
    out = {}
    for key, run in steps.items():
        for i in range(n_cases):  # warm-up: every case once
            run(i)
        samples = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for i in range(per_rep):
                run(i % n_cases)
            if cuda:
                torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - start) / per_rep)
        out[key] = summarize(samples, f"wall, {per_rep} steps queued back to back")
    return out
