"""The benchmark sweep: shapes x schemes x routings x token counts x backends and baselines.

For each row it draws fresh inputs (random hidden states, random routing: uniform or
Zipf-skewed over the experts), runs the backend once and checks the output against
``moerunner.reference_moe`` (float64) on a sub-sample of tokens whose experts fit a memory
budget, then times it on rotated cases and accounts the row against the roofline
(``roofline.row_cost``). Every scheme of one hidden dtype runs on the same weights, routing
and inputs at each (routing, T) as that dtype's baselines, which run once (for quantized
schemes they run the unquantized weights: they have no low-precision path). On CPU all
implementations of one (routing, T), the baselines and every scheme's backends, are timed
together in interleaved rounds (``timing.time_interleaved_cpu``), so their ratios are not
skewed by load or memory drift between them; on GPU each is timed alone
(``timing.time_cases``). Schemes with static activation scales get scales calibrated on the
unquantized layer (``calibrate_input_scales``), as a checkpoint's are.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..backends.base import MoeProblem
from ..config import Activation
from ..dispatch.formats import STANDARD, StandardDispatchOutput
from ..reference import reference_moe
from ..routing import TopK
from ..runner import MoeRunner, Registry, default_registry
from ..testing import error_bound
from ..weights import ExpertWeights
from .baselines import build_baseline
from .presets import BenchShape
from .roofline import DeviceCeilings, compute_format, floor_seconds, row_cost, scheme_of
from .timing import Timing, time_cases, time_interleaved_cpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROUTINGS = ("uniform", "zipf")


def accuracy_bound(scheme: str, dtype: torch.dtype) -> float:
    """Max relative error (max |out - ref| / max |ref|) a row of ``scheme`` with ``dtype``
    hidden states may have: the bound ``moerunner check`` holds every backend to
    (``moerunner.testing.error_bound``), so tune cannot choose a backend check would fail."""
    from ..quant import get_scheme

    s = get_scheme(scheme)
    return error_bound(dtype, s.is_quantized and s.activation_format != "none")


@dataclass(frozen=True)
class BenchConfig:
    """Everything a sweep depends on; ``eval(repr(config))`` rebuilds it (BenchShape in scope)."""

    shapes: tuple[BenchShape, ...]
    tokens: tuple[int, ...] = (1, 16, 64, 256, 1024)
    schemes: tuple[str, ...] = ("bf16",)
    backends: tuple[str, ...] | None = None  # None: every backend available here
    baselines: tuple[str, ...] = ("eager", "grouped_mm")
    routings: tuple[str, ...] = ("uniform",)
    dtype: str = "bf16"
    device: str = "cpu"
    cuda_graph: bool = True
    graph_max_tokens: int = 256
    min_time_s: float = 0.2
    max_reps: int = 200
    rotations: int = 4
    rotation_bytes: int = 256 << 20
    check_budget_bytes: int = 2 << 30
    zipf_exponent: float = 1.2
    seed: int = 0
    # (preset name, schemes) pairs: schemes run for that preset only (e.g. its checkpoint format)
    extra_schemes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def schemes_for(self, shape: BenchShape) -> tuple[str, ...]:
        """``schemes`` plus the extra schemes of this preset."""
        extra = [s for name, schemes in self.extra_schemes if name == shape.name for s in schemes]
        return tuple(dict.fromkeys(self.schemes + tuple(extra)))


@dataclass
class Row:
    """One measured (or skipped) row."""

    preset: str
    scheme: str
    dtype: str
    impl: str  # backend name, or "baseline:eager" / "baseline:grouped_mm"
    routing: str
    tokens: int
    # ok | wrong | untuned (right, but the backend's kernels ran untuned: PreparedWeights.untuned)
    # | n/a (T=0: timed, nothing to check) | skipped | failed
    status: str = "ok"
    note: str = ""
    experts_hit: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    time_us: float = float("nan")
    tflops: float = float("nan")
    gbps: float = float("nan")
    floor_us: float = float("nan")
    pct_roofline: float = float("nan")
    speedup: dict[str, float] = field(default_factory=dict)
    max_rel_err: float = float("nan")
    rms_rel_err: float = float("nan")
    checked_tokens: int = 0
    timing: str = ""
    samples: int = 0
    # spread of the timing samples: interquartile range as % of the median, min and max
    spread_pct: float = float("nan")
    min_us: float = float("nan")
    max_us: float = float("nan")


def _plain_scheme(dtype: torch.dtype) -> str:
    """The plain scheme of weights held in ``dtype`` ("fp16" for float16)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def act_dtype_for(scheme: str, dtype: str) -> torch.dtype:
    """Activation dtype of a row: the scheme's own for plain schemes, else ``dtype``."""
    return DTYPES.get(scheme, DTYPES[dtype])


def problem_of(shape: BenchShape, scheme: str, dtype: torch.dtype, device_type: str) -> MoeProblem:
    """The problem a sweep's weights of ``shape`` in ``scheme`` pose with ``dtype`` hidden
    states (standard format)."""
    return MoeProblem(
        device_type=device_type,
        dtype=dtype,
        w13_scheme=scheme,
        activation=shape.activation,
        dispatch_format=STANDARD,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts,
        has_bias=shape.bias,
        interleaved=shape.gate_up_interleaved,
    )


def draw_routing(
    num_tokens: int, shape: BenchShape, kind: str, gen: torch.Generator, zipf_exponent: float
) -> TopK:
    """Fresh top-k routing: k distinct experts per token, positive weights summing to 1.

    ``uniform``: every expert equally likely; ``zipf``: expert of popularity rank r drawn with
    probability proportional to 1 / r^s (ranks shuffled), the skew real routers show.
    """
    e = shape.num_experts
    if kind == "uniform":
        log_p = torch.zeros(e)
    elif kind == "zipf":
        ranks = torch.randperm(e, generator=gen).double() + 1
        log_p = (-zipf_exponent * ranks.log()).float()
    else:
        raise ValueError(f"routing: unknown {kind!r}; accepted: {', '.join(ROUTINGS)}")
    # Gumbel top-k draws k distinct experts without replacement with these probabilities.
    u = torch.rand(num_tokens, e, generator=gen).clamp_(1e-12, 1 - 1e-7)
    keys = log_p[None, :] - torch.log(-torch.log(u))
    ids = keys.topk(shape.top_k, dim=1).indices
    logits = torch.randn(num_tokens, shape.top_k, generator=gen)
    return TopK(weights=torch.softmax(logits, dim=1), ids=ids.to(torch.int32))


def make_weights(
    shape: BenchShape, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor | None]:
    """Random canonical weights drawn on ``device``, scaled by 1/sqrt(fan-in) (outputs O(1))."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int, fan_in: int) -> torch.Tensor:
        out = torch.empty(size, dtype=dtype, device=device)
        for e in range(size[0]):  # one expert at a time: no fp32 copy of the whole tensor
            out[e] = torch.randn(size[1:], generator=gen, device=device).mul_(fan_in**-0.5)
        return out

    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    w = {
        "w13": rand(e, shape.w13_rows, h, fan_in=h),
        "w2": rand(e, h, i, fan_in=i),
        "w13_bias": None,
        "w2_bias": None,
    }
    if shape.bias:
        w["w13_bias"] = (0.1 * torch.randn(e, shape.w13_rows, generator=gen, device=device)).to(
            dtype
        )
        w["w2_bias"] = (0.1 * torch.randn(e, h, generator=gen, device=device)).to(dtype)
    return w


def quantize_chunked(
    weight: torch.Tensor,
    scheme: str,
    chunk: int = 8,
    input_scale: torch.Tensor | None = None,
):
    """``moerunner.quantize`` a few experts at a time (bounded fp32 temporaries);
    ``input_scale``: fp32 ``[E]`` static activation scales (``calibrate_input_scales``)."""
    from ..quant import QuantizedWeight, quantize

    parts = [
        quantize(
            weight[s : s + chunk].float(),
            scheme,
            input_scale=None if input_scale is None else input_scale[s : s + chunk],
        )
        for s in range(0, weight.shape[0], chunk)
    ]
    fields = {f: torch.cat([p.tensors()[f] for p in parts]) for f in parts[0].tensors()}
    return QuantizedWeight.from_tensors(parts[0].scheme, tuple(weight.shape), fields)


def quantize_layer(
    plain: ExpertWeights, shape: BenchShape, scheme: str, seed: int
) -> ExpertWeights:
    """``plain`` (unquantized) with w13 and w2 quantized to ``scheme`` (itself for a plain
    dtype); a scheme with static activation scales gets them calibrated on a batch drawn
    from ``seed`` (``calibrate_input_scales``: ``quantize`` needs them, and without them its
    rows could not run at all)."""
    if scheme in DTYPES:
        return plain
    s13 = s2 = None
    if scheme_of(scheme).activation_scales == "static":
        x, topk = calibration_batch(shape, plain.w13.dtype, plain.w13.device, seed)
        s13, s2 = calibrate_input_scales(plain, Activation(shape.activation), scheme, x, topk)
    return replace(
        plain,
        w13=quantize_chunked(plain.w13, scheme, input_scale=s13),
        w2=quantize_chunked(plain.w2, scheme, input_scale=s2),
    )


def calibration_batch(
    shape: BenchShape,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    rows_per_expert: int = 64,
) -> tuple[torch.Tensor, TopK]:
    """Hidden states to calibrate static activation scales on: drawn as the rows' are
    (standard normal, in ``dtype``), routed round robin so that every expert gets
    ``rows_per_expert`` rows (a token's k slots name k consecutive experts, distinct as
    k <= E), with equal routing weights."""
    e, k = shape.num_experts, shape.top_k
    tokens = math.ceil(rows_per_expert * e / k)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, shape.hidden_size, generator=gen, device=device).to(dtype)
    ids = (torch.arange(tokens * k, device=device) % e).view(tokens, k).to(torch.int32)
    return x, TopK(torch.full((tokens, k), 1.0 / k, device=device), ids)


def calibrate_input_scales(
    weights: ExpertWeights, act: Activation, scheme: str, x: torch.Tensor, topk: TopK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static activation scales of ``scheme`` (fp32 ``[E]``: w13's input, w2's input) for
    the unquantized ``weights``, calibrated on the hidden states ``x`` routed by ``topk``.

    As a checkpoint's scales are calibrated: the unquantized layer runs the batch (the torch
    backend, with hooks reading each GEMM's input rows: ``moerunner.hooks``) and an expert's
    scale is the largest of its rows' dynamic scales (the scheme's own rule:
    ``quantize_activation`` of its dynamic form), so no calibration row saturates. An expert
    the batch does not reach gets the largest scale of the others.
    """
    from ..hooks import MoeHooks
    from ..quant.activations import quantize_activation

    dynamic = replace(scheme_of(scheme), activation_scales="dynamic")
    scales = [torch.zeros(weights.num_experts, device=x.device) for _ in range(2)]

    def observe(scale: torch.Tensor):
        def hook(out: torch.Tensor, rows_in: torch.Tensor, rows) -> torch.Tensor:
            seen = rows.expert >= 0
            q = quantize_activation(rows_in[seen], dynamic)
            per_row = q.scale if q.global_scale is None else q.global_scale
            scale.scatter_reduce_(0, rows.expert[seen].long(), per_row.float(), "amax")
            return out

        return hook

    spec = weights.spec(act)
    runner = MoeRunner("torch")
    with torch.inference_mode():
        prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, STANDARD), spec)
        hooks = MoeHooks(gate_up=observe(scales[0]), down=observe(scales[1]))
        runner.run(StandardDispatchOutput(x, topk), prepared, hooks=hooks)
    s13, s2 = (torch.where(s > 0, s, s.max()) for s in scales)
    return s13, s2


def _select_experts(w, index: torch.Tensor):
    if isinstance(w, torch.Tensor):
        return w[index.to(w.device)]
    from ..quant import QuantizedWeight

    fields = {f: t[index.to(t.device)] for f, t in w.tensors().items()}
    return QuantizedWeight.from_tensors(w.scheme, (len(index),) + tuple(w.shape[1:]), fields)


def check_against_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    topk: TopK,
    weights: ExpertWeights,
    shape: BenchShape,
    budget_bytes: int,
) -> tuple[float, float, int]:
    """(max rel err, rms rel err, tokens checked) on tokens whose experts fit ``budget_bytes``.

    The reference is computed in float64 on the CPU on only the experts those tokens hit.
    """
    ids = topk.ids.cpu()
    per_expert = 8 * (shape.w13_rows + shape.intermediate_size) * shape.hidden_size
    chosen: list[int] = []
    hit: set[int] = set()
    for t in range(ids.shape[0]):
        new = hit | set(ids[t].tolist())
        if chosen and len(new) * per_expert > budget_bytes:
            break
        chosen.append(t)
        hit = new
    tokens = torch.tensor(chosen)
    experts = torch.tensor(sorted(hit))
    remap = torch.full((shape.num_experts,), -1, dtype=torch.int64)
    remap[experts] = torch.arange(len(experts))
    sub = ExpertWeights(
        _select_experts(weights.w13, experts),
        _select_experts(weights.w2, experts),
        None if weights.w13_bias is None else weights.w13_bias[experts.to(x.device)],
        None if weights.w2_bias is None else weights.w2_bias[experts.to(x.device)],
        weights.gate_up_interleaved,
    )
    act = Activation(shape.activation)
    ref = reference_moe(
        x[tokens.to(x.device)], sub, topk.weights.cpu()[tokens], remap[ids[tokens].long()], act
    )
    got = out[tokens.to(out.device)].double().cpu()
    if not torch.isfinite(got).all():
        return float("inf"), float("inf"), len(chosen)
    scale = ref.abs().max().item() or 1.0
    max_rel = (got - ref).abs().max().item() / scale
    rms_rel = ((got - ref).norm() / (ref.norm() + 1e-30)).item()
    return max_rel, rms_rel, len(chosen)


@dataclass
class _Case:
    x: torch.Tensor
    topk: TopK
    ids_long: torch.Tensor
    weights_hf: torch.Tensor
    copy: int


class Sweep:
    """Runs a ``BenchConfig``; ``progress(row)`` is called after each row."""

    def __init__(
        self,
        config: BenchConfig,
        ceilings: DeviceCeilings,
        registry: Registry | None = None,
        progress: Callable[[Row], None] | None = None,
    ) -> None:
        self.config = config
        self.ceilings = ceilings
        self.registry = _measuring(
            registry if registry is not None else default_registry(), config.tokens
        )
        self.progress = progress or (lambda row: None)
        self.device = torch.device(config.device)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.device_gen = torch.Generator(device=self.device).manual_seed(config.seed + 1)
        self.rows: list[Row] = []
        self.skipped_backends: dict[str, str] = {}

    def total_rows(self) -> int:
        """The rows ``run`` reports, for a progress bar: per shape and dtype group, each
        scheme's backends (named ones all, skipped rows included; else those that serve it
        here) and the baselines once, at every routing and T."""
        c = self.config
        per = 0
        for shape in c.shapes:
            for dtype, schemes in self._groups(shape).items():
                per += len(c.baselines)
                for scheme in schemes:
                    if c.backends is not None:
                        per += len(c.backends)
                    else:
                        problem = problem_of(shape, scheme, dtype, self.device.type)
                        verdicts = self.registry.verdicts(problem)
                        per += sum(ok for ok, _ in verdicts.values())
        return len(c.routings) * len(c.tokens) * per

    def run(self, after_shape: Callable[[list[Row]], None] | None = None) -> list[Row]:
        """Measure every row; ``after_shape(rows so far)`` runs after each shape (checkpoints)."""
        for shape in self.config.shapes:
            self._run_shape(shape)
            if after_shape is not None:
                after_shape(self.rows)
        return self.rows

    # -- per shape ------------------------------------------------------------------------

    def _run_shape(self, shape: BenchShape) -> None:
        for dtype, schemes in self._groups(shape).items():
            copies = self._weights(shape, dtype)
            # Each batch starts from the same generator states, so every scheme of the group
            # meets the baselines (timed with the first batch) on the same routing and inputs:
            # its x<baseline> divides times of the same cases.
            start = (self.gen.get_state(), self.device_gen.get_state())
            for i, batch in enumerate(self._batches(schemes)):
                self.gen.set_state(start[0])
                self.device_gen.set_state(start[1])
                self._run_schemes(shape, batch, dtype, copies, with_baselines=i == 0)
            del copies
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _batches(self, schemes: list[str]) -> list[list[str]]:
        """The schemes of one dtype group, in the batches whose rows are timed together.
        On CPU the whole group: its backends and baselines share interleaved rounds (the
        quantized weights of every scheme are held at once; CPU shapes are small). On GPUs,
        where each row is timed alone anyway, one scheme at a time, so only its quantized
        weights are held."""
        return [schemes] if self.device.type == "cpu" else [[s] for s in schemes]

    def _groups(self, shape: BenchShape) -> dict[torch.dtype, list[str]]:
        """The schemes of ``shape`` by hidden dtype, in run order: plain schemes in their own
        dtype, quantized ones in the config's (one set of weights and baselines per group)."""
        c = self.config
        schemes = c.schemes_for(shape)
        groups: dict[torch.dtype, list[str]] = {}
        for s in schemes:
            if s in DTYPES:
                groups.setdefault(act_dtype_for(s, c.dtype), []).append(s)
        quantized = [s for s in schemes if s not in DTYPES]
        if quantized:
            groups.setdefault(DTYPES[c.dtype], []).extend(quantized)
        return groups

    def _weights(self, shape: BenchShape, dtype: torch.dtype) -> list[dict]:
        seed = self.config.seed * 1000 + len(self.rows)
        one = make_weights(shape, dtype, self.device, seed)
        nbytes = sum(t.numel() * t.element_size() for t in one.values() if t is not None)
        n = 1
        if nbytes * 2 <= self.config.rotation_bytes:
            n = min(self.config.rotations, math.ceil(self.config.rotation_bytes / nbytes))
        return [one] + [make_weights(shape, dtype, self.device, seed + j) for j in range(1, n)]

    def _implementations(
        self, shape: BenchShape, scheme: str, dtype: torch.dtype, plain_ew: list[ExpertWeights]
    ) -> tuple[list[ExpertWeights], list[tuple[str, Callable | None, str, Callable | None]]]:
        """``scheme``'s weight copies and its backends: (name, call, note, why its kernels
        run untuned: a callable) each, call None for a skipped or failed one."""
        c = self.config
        act = Activation(shape.activation)
        expert_weights = [
            quantize_layer(plain, shape, scheme, c.seed * 1000 + j)
            for j, plain in enumerate(plain_ew)
        ]
        spec = expert_weights[0].spec(act)
        probe = torch.zeros(1, shape.hidden_size, dtype=dtype, device=self.device)
        problem = MoeProblem.of(probe, expert_weights[0], spec, STANDARD)
        verdicts = self.registry.verdicts(problem)
        impls: list[tuple[str, Callable | None, str, Callable | None]] = []
        names = c.backends if c.backends is not None else tuple(sorted(verdicts))
        for name in names:
            ok, reason = verdicts.get(name, (False, "not registered"))
            if not ok:
                self.skipped_backends[f"{shape.name}/{scheme}/{name}"] = reason
                if c.backends is not None:
                    impls.append((name, None, reason, None))
                continue
            try:
                runner = MoeRunner(name, registry=self.registry)
                prepared = [runner.prepare(ew, problem, spec) for ew in expert_weights]
            except Exception as exc:  # noqa: BLE001  (a broken backend must not end the sweep)
                note = f"prepare failed: {type(exc).__name__}: {exc}"[:200]
                impls.append((name, None, note, None))
                continue

            def fn(case: _Case, runner=runner, prepared=prepared):
                return runner.run(StandardDispatchOutput(case.x, case.topk), prepared[case.copy])

            def untuned(prepared=prepared):
                return next((why for p in prepared if (why := p.untuned())), None)

            impls.append((name, fn, "", untuned))
        return expert_weights, impls

    def _baselines(self, shape: BenchShape, copies: list[dict]) -> list[tuple]:
        """The baselines on the unquantized weight copies, as ``_implementations``' entries."""
        impls: list[tuple[str, Callable | None, str, Callable | None]] = []
        for impl in self.config.baselines:
            try:
                built = [
                    build_baseline(shape, impl, w["w13"], w["w2"], w["w13_bias"], w["w2_bias"])
                    for w in copies
                ]
            except (ImportError, ValueError, RuntimeError) as exc:
                impls.append((f"baseline:{impl}", None, str(exc)[:160], None))
                continue

            def base_fn(case: _Case, built=built):
                return built[case.copy][0](case.x, case.ids_long, case.weights_hf)

            impls.append((f"baseline:{impl}", base_fn, built[0][1], None))
        return impls

    def _run_schemes(
        self,
        shape: BenchShape,
        schemes: list[str],
        dtype: torch.dtype,
        copies: list[dict],
        with_baselines: bool,
    ) -> None:
        """Every row of ``schemes`` (and of the baselines, ``with_baselines``): at each
        (routing, T) one draw of cases that all of them run and are timed on together."""
        c = self.config
        plain_ew = [
            ExpertWeights(w["w13"], w["w2"], w["w13_bias"], w["w2_bias"], shape.gate_up_interleaved)
            for w in copies
        ]
        # per scheme: its weight copies and implementations (the baselines with the first)
        runs = [(s, *self._implementations(shape, s, dtype, plain_ew)) for s in schemes]
        if with_baselines:
            runs[0][2].extend(self._baselines(shape, copies))
        first = len(self.rows)
        owner: dict[int, int] = {}  # id(row) -> its scheme's place in the batch
        for routing in c.routings:
            for tokens in c.tokens:
                cases = self._cases(shape, dtype, routing, tokens, len(copies))
                measured: list[list] = [[] for _ in runs]
                for place, (scheme, expert_weights, impls) in enumerate(runs):
                    for name, fn, note, _ in impls:
                        is_base = name.startswith("baseline:")
                        row = Row(
                            shape.name,
                            # baselines run the unquantized weights, in the hidden dtype
                            _plain_scheme(dtype) if is_base else scheme,
                            str(dtype).replace("torch.", ""),
                            name,
                            routing,
                            tokens,
                        )
                        self.rows.append(row)
                        owner[id(row)] = place
                        if fn is None:
                            row.status, row.note = "skipped", note
                            self.progress(row)
                        else:
                            ref_weights = plain_ew if is_base else expert_weights
                            measured[place].append((row, fn, ref_weights, note))
                self._measure_all([m for ms in measured for m in ms], shape, cases, dtype)
                for ms, (_, _, impls) in zip(measured, runs, strict=True):
                    _mark_untuned(ms, impls)
                del cases, measured
        # rows listed scheme by scheme, as one scheme at a time lists them (stable: each
        # scheme's rows stay in (routing, T) order)
        self.rows[first:] = sorted(self.rows[first:], key=lambda r: owner[id(r)])
        del runs, plain_ew
        gc.collect()

    def _cases(
        self, shape: BenchShape, dtype: torch.dtype, routing: str, tokens: int, n_copies: int
    ) -> list[_Case]:
        cases = []
        for i in range(max(self.config.rotations, 1)):
            topk = draw_routing(tokens, shape, routing, self.gen, self.config.zipf_exponent)
            x = torch.randn(
                tokens, shape.hidden_size, generator=self.device_gen, device=self.device
            ).to(dtype)
            topk = TopK(topk.weights.to(self.device), topk.ids.to(self.device))
            cases.append(
                _Case(
                    x.to(self.device), topk, topk.ids.long(), topk.weights.to(dtype), i % n_copies
                )
            )
        return cases

    def _measure_all(
        self,
        measured: list[tuple[Row, Callable, list[ExpertWeights], str]],
        shape: BenchShape,
        cases: list[_Case],
        dtype: torch.dtype,
    ) -> None:
        """Check every implementation of one (routing, T), then time them: on CPU in
        interleaved rounds (drift of a shared machine hits all alike), on GPU one by one."""
        c = self.config
        if self.device.type == "cpu":
            ready = [m for m in measured if self._check(m[0], shape, m[1], cases, m[2], dtype)]
            runs = {id(row): (lambda i, fn=fn: fn(cases[i])) for row, fn, _, _ in ready}
            try:
                with torch.inference_mode():
                    timings = time_interleaved_cpu(
                        runs, len(cases), min_time_s=c.min_time_s, max_reps=c.max_reps
                    )
            except Exception as exc:  # noqa: BLE001  (a failing row must not end the sweep)
                timings = {}
                for row, _, _, _ in ready:
                    self._fail(row, exc)
            for row, _, _, note in ready:
                if id(row) in timings:
                    self._account(row, shape, cases, dtype, timings[id(row)], note)
            for row, _, _, _ in measured:
                if row.status == "failed":
                    self.progress(row)
            return
        for row, fn, weights, note in measured:
            if self._check(row, shape, fn, cases, weights, dtype):
                self._time_one(row, shape, fn, cases, dtype, note)
            else:
                self.progress(row)

    def _fail(self, row: Row, exc: Exception) -> None:
        row.status, row.note = "failed", f"{type(exc).__name__}: {str(exc)[:200]}"
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _check(
        self,
        row: Row,
        shape: BenchShape,
        fn: Callable,
        cases: list[_Case],
        weights: list[ExpertWeights],
        dtype: torch.dtype,
    ) -> bool:
        """Run case 0 against the reference; False (row failed) if it raises."""
        try:
            with torch.inference_mode():
                out = fn(cases[0])
                if row.tokens:
                    row.max_rel_err, row.rms_rel_err, row.checked_tokens = check_against_reference(
                        out,
                        cases[0].x,
                        cases[0].topk,
                        weights[cases[0].copy],
                        shape,
                        self.config.check_budget_bytes,
                    )
                del out
        except Exception as exc:  # noqa: BLE001  (a failing row is reported, the sweep goes on)
            self._fail(row, exc)
            return False
        if not row.tokens:  # nothing to compare: neither right nor wrong
            row.status, row.note = "n/a", "T=0: no output to check"
        elif row.max_rel_err > (bound := accuracy_bound(row.scheme, dtype)):
            row.status = "wrong"
            row.note = f"max error {row.max_rel_err:.2e} > bound {bound:.2e}"
        return True

    def _time_one(
        self,
        row: Row,
        shape: BenchShape,
        fn: Callable,
        cases: list[_Case],
        dtype: torch.dtype,
        note: str,
    ) -> None:
        c = self.config
        graph = c.cuda_graph and row.tokens <= c.graph_max_tokens and row.impl != "baseline:eager"
        try:
            with torch.inference_mode():
                timing = time_cases(
                    lambda i: fn(cases[i]),
                    len(cases),
                    self.device,
                    cuda_graph=graph,
                    min_time_s=c.min_time_s,
                    max_reps=c.max_reps,
                )
        except Exception as exc:  # noqa: BLE001  (a failing row is reported, the sweep goes on)
            self._fail(row, exc)
            self.progress(row)
            return
        self._account(row, shape, cases, dtype, timing, note)

    def _account(
        self,
        row: Row,
        shape: BenchShape,
        cases: list[_Case],
        dtype: torch.dtype,
        timing: Timing,
        note: str,
    ) -> None:
        """Fill the row from its timing: bytes, flops and the roofline of the cases (the
        note joins what the check wrote, e.g. a T = 0 row's reason)."""
        row.note = "; ".join(n for n in (row.note, note, timing.note) if n)
        row.timing, row.samples = timing.mode, timing.samples
        hit = [len(torch.unique(cs.topk.ids[cs.topk.ids >= 0])) for cs in cases]
        slots = [int((cs.topk.ids >= 0).sum()) for cs in cases]
        costs = [
            row_cost(shape, row.scheme, row.tokens, h, s, dtype)
            for h, s in zip(hit, slots, strict=False)
        ]
        row.experts_hit = sum(hit) / len(hit)
        row.bytes = sum(k.bytes for k in costs) / len(costs)
        row.flops = sum(k.flops for k in costs) / len(costs)
        row.time_us = timing.seconds * 1e6
        row.spread_pct, row.min_us, row.max_us = (
            timing.iqr_pct,
            timing.min_s * 1e6,
            timing.max_s * 1e6,
        )
        row.tflops = row.flops / timing.seconds / 1e12
        row.gbps = row.bytes / timing.seconds / 1e9
        floor = sum(
            floor_seconds(k, self.ceilings, compute_format(row.scheme)) for k in costs
        ) / len(costs)
        row.floor_us = floor * 1e6
        row.pct_roofline = 100.0 * floor / timing.seconds
        self.progress(row)


def _measuring(registry: Registry, tokens: Sequence[int]) -> Registry:
    """``registry`` with each backend as it should be timed at ``tokens``
    (``Backend.measuring``: e.g. flashinfer tuning exactly these counts); a copy where any
    backend changes, so the caller's registry stays as it was."""
    variants = {name: b.measuring(tokens) for name, b in registry.backends.items()}
    changed = {n: v for n, v in variants.items() if v is not registry.backends[n]}
    if not changed:
        return registry
    copy = registry.copy()
    for variant in changed.values():
        copy.register_backend(variant, replace=True)
    return copy


def _mark_untuned(measured: list, impls: list) -> None:
    """Rows whose backend said (``PreparedWeights.untuned``), at this T or before, that its
    kernels ran untuned: status ``untuned``, the reason in the note. Their outputs passed the
    check; their times are not the backend's, so tables leave them out."""
    untuned_of = {name: untuned for name, _, _, untuned in impls if untuned is not None}
    for row, *_ in measured:
        why = untuned_of[row.impl]() if row.impl in untuned_of else None
        if why and row.status == "ok":
            row.status = "untuned"
            row.note = "; ".join(n for n in (row.note, why) if n)


def fill_speedups(rows: list[Row]) -> None:
    """Each measured row's speedup over every baseline of the same preset, hidden dtype,
    routing and T (baseline rows too: over the other baselines, and 1 over themselves)."""
    base = {}
    for r in rows:
        if r.impl.startswith("baseline:") and r.status in ("ok", "wrong"):
            base[(r.preset, r.dtype, r.routing, r.tokens, r.impl[len("baseline:") :])] = r.time_us
    for r in rows:
        if r.status not in ("ok", "wrong"):
            continue
        for (preset, dtype, routing, tokens, impl), t in base.items():
            if (preset, dtype, routing, tokens) == (r.preset, r.dtype, r.routing, r.tokens):
                r.speedup[impl] = t / r.time_us
