"""Property-based fuzz of every backend the registry holds, against the float64 reference.

Nothing here names a scheme, activation, dispatch format or backend: each drawn case picks
from what the registry declares (``Capabilities``, ``SchemeSupport``, ``Registry.paths``,
``Registry.dispatchers``), so a new backend, scheme or format is fuzzed without edits here.

A case: shapes (T from 0, k above E as on an expert-parallel shard, H and I unaligned),
routing (random, skewed, all on one expert, -1 slots, repeated experts when k > E), a scheme
pair, activation, biases and gate/up order the backend claims, a dispatch format and path,
and the layouts of the hidden states and routing tensors (transposed, sliced,
non-contiguous, stride-0 expanded). Expected values come from ``reference_moe`` with the
format's bound from ``moerunner.testing.error_bound``.

Profiles (``MOERUNNER_FUZZ_PROFILE``, read here at the test edge): ``ci`` (default:
derandomized, bounded to run on every change on the CPU) and ``gpu`` (more and larger cases,
bf16, on CUDA; the test is marked ``gpu``). Each test prints the number of examples run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import moerunner  # noqa: E402
from moerunner.backends.base import MoeProblem  # noqa: E402
from moerunner.dispatch.base import DispatchSetup  # noqa: E402
from moerunner.dispatch.formats import (  # noqa: E402
    MASKED,
    PERMUTED,
    STANDARD,
    MaskedDispatchOutput,
    PermutedDispatchOutput,
)
from moerunner.errors import MoeInputError  # noqa: E402
from moerunner.quant import get_scheme  # noqa: E402
from moerunner.quant.families import codec_of  # noqa: E402
from moerunner.routing import TopK  # noqa: E402
from moerunner.testing import assert_close, error_bound  # noqa: E402

# -- profiles ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """Examples per backend (compiled, and run by Triton's CPU interpreter) and shape caps."""

    compiled: int
    interpreted: int
    max_tokens: int
    max_experts: int
    max_hidden: int
    max_inter: int


settings.register_profile(
    "ci",
    derandomize=True,  # the same cases on every run: CI failures reproduce
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("MOERUNNER_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "gpu"):
    raise ValueError(f"MOERUNNER_FUZZ_PROFILE must be 'ci' or 'gpu', got {PROFILE!r}")
BUDGETS = {
    # Measured on 2 CPU cores shared with other jobs (load ~4.5): 67 s for this file, torch
    # 150 examples in 58 s, triton (interpreted) 24 in 8 s.
    "ci": Budget(compiled=150, interpreted=24, max_tokens=9, max_experts=5, max_hidden=40,
                 max_inter=24),
    "gpu": Budget(compiled=400, interpreted=0, max_tokens=300, max_experts=16, max_hidden=320,
                  max_inter=200),
}  # fmt: skip
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _available_backends() -> list[str]:
    registry = moerunner.default_registry()
    return [n for n, b in registry.backends.items() if b.available()[0]]


def _interpreted(backend: str) -> bool:
    # Triton without a GPU runs its CPU interpreter (tests/conftest.py): slow, and its bf16
    # arithmetic is wrong, so those backends get fewer, fp32/fp16 cases on the CPU.
    return INTERPRETED and backend.startswith("triton")


# -- single-process dispatch formats ------------------------------------------------------------


def _grouped(x, ids, experts, pad_rows, gen):
    """Rows of every (token, slot) with an id >= 0, grouped by expert, plus padding rows."""
    device = x.device
    x, ids = x.cpu(), ids.cpu()
    flat = ids.reshape(-1).long()
    keep = torch.nonzero(flat >= 0).reshape(-1)
    order = keep[torch.argsort(flat[keep], stable=True)]
    rows = x[order // max(ids.shape[1], 1)]
    counts = torch.bincount(flat[order], minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    padding = torch.randn(pad_rows, x.shape[1], generator=gen).to(x.dtype)
    expert_of_row = torch.cat([flat[order], torch.full((pad_rows,), -1, dtype=torch.int64)])
    return torch.cat([rows, padding]).to(device), offsets.to(device), expert_of_row


def _expected_rows(rows, weights, expert_of_row, activation):
    """Unweighted expert output of each row (zero for padding rows), float64."""
    ones = torch.ones(rows.shape[0], 1)
    return moerunner.reference_moe(rows.cpu(), weights, ones, expert_of_row[:, None], activation)


def run_standard(runner, prepared, x, weights, tw, ids, activation, case):
    """Through the registry's single-process standard dispatcher: dispatch, run, combine."""
    dispatcher = moerunner.default_registry().make_dispatcher(
        "standard", DispatchSetup(num_local_experts=case.experts, hidden_size=case.hidden)
    )
    dispatched = dispatcher.dispatch(x, TopK(tw, ids))
    out = dispatcher.combine(runner.run(dispatched, prepared), dispatched)
    return out, moerunner.reference_moe(x, weights, tw, ids, activation)


def run_permuted(runner, prepared, x, weights, tw, ids, activation, case):
    gen = torch.Generator().manual_seed(case.seed + 1)
    rows, offsets, expert_of_row = _grouped(x, ids, case.experts, case.pad_rows, gen)
    out = runner.run(PermutedDispatchOutput(rows, offsets), prepared)
    return out, _expected_rows(rows, weights, expert_of_row, activation)


def run_masked(runner, prepared, x, weights, tw, ids, activation, case):
    gen = torch.Generator().manual_seed(case.seed + 1)
    rows, offsets, expert_of_row = _grouped(x, ids, case.experts, 0, gen)
    rows, offsets = rows.cpu(), offsets.cpu()
    counts = (offsets[1:] - offsets[:-1]).to(torch.int32)
    capacity = int(counts.max()) + case.pad_rows
    # Padding rows past each expert's count are random: they must not leak into valid rows.
    hidden = torch.randn(case.experts, capacity, case.hidden, generator=gen).to(x.dtype)
    expected_ids = torch.full((case.experts, capacity), -1, dtype=torch.int64)
    for e in range(case.experts):
        n = int(counts[e])
        hidden[e, :n] = rows[int(offsets[e]) : int(offsets[e]) + n]
        expected_ids[e, :n] = e
    out = runner.run(MaskedDispatchOutput(hidden.to(x.device), counts.to(x.device)), prepared)
    flat = hidden.reshape(-1, case.hidden)
    expected = _expected_rows(flat, weights, expected_ids.reshape(-1), activation)
    return out, expected.reshape(hidden.shape)


# One builder per dispatch format; a registered format without one fails the test below.
FORMAT_RUNS = {STANDARD: run_standard, PERMUTED: run_permuted, MASKED: run_masked}


def _formats(backend: str) -> list[tuple[str, bool]]:
    """(format, force_permute) for every path the registry gives the backend."""
    registry = moerunner.default_registry()
    result = []
    for fmt, path in registry.paths(backend).items():
        result.append((fmt, False))
        if path == "fused" and registry.has_both_paths(fmt, backend):
            result.append((fmt, True))
    return result


def test_every_registered_format_has_a_builder():
    registry = moerunner.default_registry()
    formats = set(registry.permutes)
    for name in _available_backends():
        formats |= set(registry.paths(name))
    assert formats <= set(FORMAT_RUNS), f"fuzz these formats too: {formats - set(FORMAT_RUNS)}"


def test_single_process_dispatchers_are_the_ones_fuzzed():
    # Every registered dispatcher that builds without a process group is fuzzed here; the
    # others are expert-parallel (tests/distributed, tests/test_fuzz_faults.py).
    registry = moerunner.default_registry()
    single = []
    for name in registry.dispatchers:
        try:
            registry.make_dispatcher(name, DispatchSetup(num_local_experts=4, hidden_size=8))
        except MoeInputError:
            continue
        single.append(name)
    assert single == ["standard"], single


# -- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzCase:
    backend: str
    fmt: str
    force_permute: bool
    dtype: torch.dtype
    w13_scheme: str | None  # None: plain tensors of the hidden dtype
    w2_scheme: str | None
    activation: str
    bias: bool
    interleaved: bool
    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    routing: str
    x_layout: str
    routing_layout: str
    pad_rows: int
    seed: int


ROUTINGS = ("random", "skewed", "one_expert", "with_skips", "repeats")
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded")


def _round_up(value: int, multiple: int | None) -> int:
    return value if not multiple else max(multiple, -(-value // multiple) * multiple)


def _k_multiple(scheme: str | None) -> int | None:
    return None if scheme is None else codec_of(get_scheme(scheme)).k_multiple(get_scheme(scheme))


@st.composite
def fuzz_cases(draw, backend: str, device: str, budget: Budget):
    registry = moerunner.default_registry()
    caps = registry.backends[backend].capabilities
    dtypes = sorted(caps.dtypes, key=str)
    if device == "cpu" and _interpreted(backend):
        dtypes = [d for d in dtypes if d != torch.bfloat16]
    dtype = draw(st.sampled_from(dtypes))
    fmt, force_permute = draw(st.sampled_from(_formats(backend)))
    quantized = [n for n in caps.schemes.names() if get_scheme(n).is_quantized]
    if dtype != torch.float32:
        # Half-precision hidden states with a scheme that quantizes activations have no
        # justified bound yet: kernels quantize GEMM2's input after rounding it to the hidden
        # dtype, the reference before, and one rounding may move an element (or an MX block's
        # shared exponent) by a whole e4m3 / e2m1 quantum. Weight-only schemes are covered.
        quantized = [n for n in quantized if get_scheme(n).activation_format == "none"]
    w13_scheme = draw(st.one_of(st.none(), st.sampled_from(quantized)) if quantized else st.none())
    w2_scheme = w13_scheme
    if w13_scheme is not None and caps.schemes.mixed and draw(st.booleans()):
        w2_scheme = draw(st.sampled_from(quantized))
    activation = draw(st.sampled_from(sorted(caps.activations)))
    gated = moerunner.Activation(activation).gated
    bias = caps.biases and draw(st.booleans())
    interleaved = gated and caps.interleaved and draw(st.booleans())
    experts = draw(st.integers(1, budget.max_experts))
    many = st.integers(2, budget.max_tokens)
    tokens = draw(st.one_of(st.just(0), st.just(1), many, many))  # T = 0 and 1: a quarter
    top_k = draw(st.integers(1, experts + 2))  # k > E: an expert-parallel shard's slots
    # H is GEMM1's K and I GEMM2's: round up to the schemes' K groups (else quantize refuses).
    hidden = _round_up(draw(st.integers(1, budget.max_hidden)), _k_multiple(w13_scheme))
    inter = _round_up(draw(st.integers(1, budget.max_inter)), _k_multiple(w2_scheme))
    return FuzzCase(
        backend=backend,
        fmt=fmt,
        force_permute=force_permute,
        dtype=dtype,
        w13_scheme=w13_scheme,
        w2_scheme=w2_scheme,
        activation=activation,
        bias=bias,
        interleaved=interleaved,
        tokens=tokens,
        experts=experts,
        top_k=top_k,
        hidden=hidden,
        inter=inter,
        routing=draw(st.sampled_from(ROUTINGS)),
        x_layout=draw(st.sampled_from(LAYOUTS)),
        routing_layout=draw(st.sampled_from(LAYOUTS)),
        pad_rows=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def _laid_out(t: torch.Tensor, layout: str, gen: torch.Generator) -> torch.Tensor:
    """The same values as ``t`` ([R, C]) in another memory layout."""
    rows, cols = t.shape
    if layout == "transposed":
        return t.t().contiguous().t()
    if layout == "sliced":  # every other column of a wider, offset buffer
        big = torch.zeros(rows + 1, 2 * cols + 1, dtype=t.dtype)
        big[1:, 1::2] = t
        return big[1:, 1::2]
    if layout == "expanded" and rows > 0:  # stride 0 along rows: every row is the first one
        return t[:1].expand(rows, cols)
    return t


def _routing(case: FuzzCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t, e, k = case.tokens, case.experts, case.top_k
    if case.routing == "repeats" or k > e:  # slots may name one expert several times
        ids = torch.randint(0, e, (t, k), generator=gen)
    else:
        ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k]
    if case.routing == "skewed":
        ids[:, 0] = 0
    elif case.routing == "one_expert":
        ids[:] = e - 1
    elif case.routing == "with_skips":
        ids[::2, 0] = -1
        ids[:, -1] = torch.where(torch.rand(t, generator=gen) < 0.5, -1, ids[:, -1])
    weights = torch.rand(t, k, generator=gen)
    return weights, ids.to(torch.int32)


def _build(case: FuzzCase, device: str):
    gen = torch.Generator().manual_seed(case.seed)
    rows = (2 if moerunner.Activation(case.activation).gated else 1) * case.inter

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    x = rand(case.tokens, case.hidden).to(case.dtype)
    w13 = rand(case.experts, rows, case.hidden, scale=case.hidden**-0.5)
    w2 = rand(case.experts, case.hidden, case.inter, scale=case.inter**-0.5)
    b13 = rand(case.experts, rows, scale=0.1).to(case.dtype) if case.bias else None
    b2 = rand(case.experts, case.hidden, scale=0.1).to(case.dtype) if case.bias else None

    def weight(w, scheme, static_scale):
        if scheme is None:
            return w.to(case.dtype)
        s = get_scheme(scheme)
        # Static schemes carry a calibrated activation scale; any fixed value defines them.
        scale = (
            torch.full((case.experts,), static_scale) if s.activation_scales == "static" else None
        )
        return moerunner.quantize(w, s, input_scale=scale)

    weights = moerunner.ExpertWeights(
        weight(w13, case.w13_scheme, 0.02),
        weight(w2, case.w2_scheme, 0.005),
        b13,
        b2,
        case.interleaved,
    )
    tw, ids = _routing(case, gen)
    x = _laid_out(x, case.x_layout, gen)
    tw, ids = _laid_out(tw, case.routing_layout, gen), _laid_out(ids, case.routing_layout, gen)
    if device != "cpu":
        weights = moerunner.ExpertWeights(
            *(None if w is None else w.to(device) for w in (weights.w13, weights.w2, b13, b2)),
            case.interleaved,
        )
        x, tw, ids = x.to(device), tw.to(device), ids.to(device)
    return x, weights, tw, ids


def _bound(case: FuzzCase) -> float:
    quantizes = any(
        s is not None and get_scheme(s).activation_format != "none"
        for s in (case.w13_scheme, case.w2_scheme)
    )
    return error_bound(case.dtype, quantizes)


def _magnitude(case: FuzzCase, weights, tw: torch.Tensor) -> float:
    """Typical size of one output element before cancellation: the RMS of each expert's
    output on random tokens, times the largest sum of a token's routing weights.

    ``assert_close`` takes errors relative to at least this (its ``floor``). Rounding errors
    scale with the terms of each sum, not with the sum: one token and H = 1 can give an
    output far smaller than its terms, and a bound relative to that output alone would flag
    correct rounding. A wrong row, expert or layout still errs by the terms' size.
    """
    gen = torch.Generator().manual_seed(case.seed + 2)
    probe = torch.randn(8, case.hidden, generator=gen).to(case.dtype)
    rows = probe.repeat(case.experts, 1)
    ids = torch.arange(case.experts).repeat_interleave(8)[:, None]
    per_expert = moerunner.reference_moe(
        rows, weights, torch.ones(rows.shape[0], 1), ids, case.activation
    )
    routed = tw.detach().cpu().double().abs().sum(1).max().item() if tw.numel() else 1.0
    return per_expert.square().mean().sqrt().item() * max(routed, 1.0)


def check_case(case: FuzzCase, device: str) -> None:
    note(repr(case))
    x, weights, tw, ids = _build(case, device)
    act = moerunner.Activation(case.activation)
    spec = weights.spec(act)
    problem = MoeProblem.of(x, weights, spec, case.fmt)
    ok, reason = moerunner.default_registry().backends[case.backend].supports(problem)
    assume(ok)  # rare: the declared capabilities are what was drawn from
    runner = moerunner.MoeRunner(case.backend, force_permute=case.force_permute)
    prepared = runner.prepare(weights, problem, spec)
    run = FORMAT_RUNS[case.fmt]
    out, expected = run(runner, prepared, x, weights, tw, ids, case.activation, case)
    assert out.dtype == case.dtype and out.device.type == device
    floor = _magnitude(case, weights, tw)
    assert_close(out, expected, _bound(case), what=repr(case), floor=floor)


# -- tests ------------------------------------------------------------------------------------


def _fuzz(backend: str, device: str, budget: Budget, examples: int) -> int:
    count = 0

    @settings(settings.get_profile(PROFILE), max_examples=examples)
    @given(case=fuzz_cases(backend, device, budget))
    def run(case):
        nonlocal count
        count += 1
        check_case(case, device)

    run()
    return count


@pytest.mark.skipif(PROFILE != "ci", reason="the ci profile runs on the CPU")
@pytest.mark.parametrize("backend", _available_backends())
def test_fuzz_cpu(backend, record_property):
    budget = BUDGETS["ci"]
    examples = budget.interpreted if _interpreted(backend) else budget.compiled
    count = _fuzz(backend, "cpu", budget, examples)
    record_property("examples", count)
    print(f"fuzz {backend} on cpu: {count} examples")
    assert count > 0


@pytest.mark.gpu
@pytest.mark.timeout(3600)  # compiles a kernel variant per drawn scheme/shape: minutes
@pytest.mark.parametrize("backend", _available_backends())
def test_fuzz_gpu(backend, record_property):
    budget = BUDGETS["gpu"] if PROFILE == "gpu" else BUDGETS["ci"]
    if "cuda" not in moerunner.default_registry().backends[backend].capabilities.devices:
        pytest.skip(f"{backend} does not run on CUDA")
    count = _fuzz(backend, "cuda", budget, budget.compiled)
    record_property("examples", count)
    print(f"fuzz {backend} on cuda: {count} examples")
    assert count > 0
