"""Roofline: this device's measured ceilings and each row's minimum bytes and flops.

This is the project's one roofline: ``moerunner bench`` and the scripts under
``benchmarks/`` count bytes and flops with ``row_cost`` and place a time against
``floor_seconds`` (or its two parts, ``floor_parts``) with ceilings from
``measure_ceilings``; none keeps its own byte count or bandwidth.

Ceilings (``DeviceCeilings``) are measured once per device and cached in a JSON file: copy
bandwidth (a device-to-device copy of a buffer far larger than any cache, read + write
bytes), and dense matmul peaks (square GEMMs; bf16, fp32 and, on GPUs that have it, fp8 e4m3
through ``torch._scaled_mm``). A row's floor is ``max(min_bytes / bandwidth, flops / peak)``
where the peak is the one of the GEMM inputs' format (``compute_format``): fp8 for schemes
that quantize activations to 8 bits, fp4 for nvfp4 activations (not measured: the best
measured peak stands in), bf16 otherwise (fp32 for fp32). Minimum bytes are the weights of the
experts actually hit (at the scheme's storage, scales, zero points and biases included), the
activations in and out, and the routing (fp32 weights + int32 ids).

Which bandwidth, and why the copy. A MoE layer mostly reads (the weights of the experts
hit), so the ceiling that matters is how fast the memory streams. Before this module was
the only one, kernel experiments measured it as the read rate of ``torch.sum`` over 1 GiB
and the CPU benchmark as an fp32 matrix-vector product over 1 GiB; ``moerunner bench`` has
always used ``Tensor.copy_`` with read + write bytes counted. The copy is kept as the one
definition: it is a single library call on every device (no custom kernel to trust), every
``moerunner bench`` record uses it, and where both were measured in one run it was within
1-3 % of the read stream (H200: copy 4.22-4.25 TB/s, ``torch.sum`` 4.13-4.19 TB/s; H100: copy
3.00 TB/s, ``torch.sum`` 2.96-2.97 TB/s; the ``*-triton-*`` records in
``benchmarks/results/``). A kernel that only reads can stream slightly faster than a copy,
so rows a little above 100 % mean "at the bandwidth limit", not a measurement error.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from .presets import BenchShape

_WEIGHT_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "e4m3": 8, "int8": 8, "e2m1": 4, "int4": 4}
_SCALE_BYTES = {"none": 0, "fp32": 4, "e8m0": 1, "e4m3": 1}
_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _positive(value: object) -> bool:
    """A finite int or float above 0 (bools are not numbers here)."""
    return (
        type(value) in (int, float) and math.isfinite(value) and value > 0  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class DeviceCeilings:
    """Measured limits of one device. Bandwidth in GB/s, peaks in TFLOP/s by input format."""

    device: str
    copy_gbps: float
    peak_tflops: dict[str, float] = field(default_factory=dict)
    measured_at: str = ""
    method: str = ""

    def __post_init__(self) -> None:
        for name in ("device", "measured_at", "method"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: must be a str, got {getattr(self, name)!r}")
        if not _positive(self.copy_gbps):
            raise ValueError(f"copy_gbps: must be a finite number > 0, got {self.copy_gbps!r}")
        peaks = self.peak_tflops
        if not isinstance(peaks, dict):
            raise ValueError(
                f"peak_tflops: must map formats (bf16, fp32, ...) to TFLOP/s, got {peaks!r}"
            )
        for fmt, value in peaks.items():
            if not isinstance(fmt, str) or not _positive(value):
                raise ValueError(
                    f"peak_tflops[{fmt!r}]: must be a finite number > 0, got {value!r}"
                )

    @classmethod
    def from_dict(cls, entry: object, where: str) -> DeviceCeilings:
        """One cached entry (``asdict`` of a ``DeviceCeilings``); ``ValueError`` naming
        ``where`` and the field where it is malformed."""
        names = [f.name for f in fields(cls)]
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be an object of {', '.join(names)}")
        unknown = sorted(set(entry) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; fields: {', '.join(names)}")
        missing = [n for n in ("device", "copy_gbps", "peak_tflops") if n not in entry]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        if not isinstance(entry["peak_tflops"], dict) or not entry["peak_tflops"]:
            raise ValueError(
                f"{where}: field peak_tflops: must map formats (bf16, fp32, ...) to TFLOP/s, "
                f"got {entry['peak_tflops']!r}"
            )
        try:
            return cls(**entry)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: field {exc}") from None

    def peak_for(self, compute: str) -> float:
        """Peak for a compute format; falls back to the best measured one (CPU fp8: emulated)."""
        if compute in self.peak_tflops:
            return self.peak_tflops[compute]
        if not self.peak_tflops:
            raise ValueError(f"ceilings of {self.device!r}: no matmul peak was measured")
        return max(self.peak_tflops.values())


def scheme_of(name: str):
    """The QuantScheme of ``name`` (plain dtypes included)."""
    from ..quant import get_scheme

    return get_scheme(name)


def compute_format(scheme_name: str) -> str:
    """Which matmul peak bounds a scheme: the format its GEMMs multiply in.

    Read from the scheme's fields, not its name, so every scheme (custom ones and
    ``fp8_block_<rows>x<cols>`` included) is placed alike: one that quantizes its activations
    (``QuantScheme.quantizes_activations``) multiplies in that 8-bit format (``fp8``: e4m3 or
    int8, every activation format but nvfp4) or in 4 bits (``fp4``: nvfp4; no fp4 peak is
    measured, so ``peak_for`` takes the best measured one); a weight-only one multiplies
    dequantized weights in ``fp32`` or ``bf16``.
    """
    s = scheme_of(scheme_name)
    if s.quantizes_activations:
        return "fp4" if s.activation_format == "nvfp4" else "fp8"
    return "fp32" if s.weight_format == "fp32" else "bf16"


def weight_bytes_per_expert(rows: int, cols: int, scheme_name: str) -> int:
    """Bytes of one expert's ``[rows, cols]`` weight stored in ``scheme_name``, scales included."""
    s = scheme_of(scheme_name)
    data = math.ceil(rows * cols * _WEIGHT_BITS[s.weight_format] / 8)
    scale = _SCALE_BYTES[s.scale_format]
    if s.granularity == "tensor":
        extra = scale
    elif s.granularity == "channel":
        extra = rows * scale
    elif s.granularity == "block":
        br, bc = s.block_shape
        extra = math.ceil(rows / br) * math.ceil(cols / bc) * scale
    elif s.granularity == "group":
        groups = rows * math.ceil(cols / s.block_shape[1])
        extra = groups * scale + (groups if s.zero_point else 0)
    else:
        extra = 0
    if s.has_global_scale:
        extra += 4
    return data + extra


@dataclass(frozen=True)
class RowCost:
    """Minimum traffic and work of one row."""

    bytes: int
    flops: int
    experts_hit: int


def row_cost(
    shape: BenchShape,
    scheme_name: str,
    num_tokens: int,
    experts_hit: int,
    routed_slots: int,
    act_dtype: torch.dtype,
) -> RowCost:
    """Bytes and flops a perfect kernel needs for one forward of ``num_tokens`` tokens.

    ``experts_hit``: distinct experts with at least one token; ``routed_slots``: (token, slot)
    pairs with an expert (T*k when no id is -1). Bias rows count at the activation dtype.
    """
    h, i, rows = shape.hidden_size, shape.intermediate_size, shape.w13_rows
    per_expert = weight_bytes_per_expert(rows, h, scheme_name) + weight_bytes_per_expert(
        h, i, scheme_name
    )
    act_bytes = _DTYPE_BYTES[act_dtype]
    if shape.bias:
        per_expert += (rows + h) * act_bytes
    activations = 2 * num_tokens * h * act_bytes  # hidden in, combined output out
    routing = num_tokens * shape.top_k * (4 + 4)  # fp32 weights + int32 ids
    flops = 2 * routed_slots * (rows * h + h * i)
    return RowCost(experts_hit * per_expert + activations + routing, flops, experts_hit)


def floor_parts(cost: RowCost, ceilings: DeviceCeilings, compute: str) -> tuple[float, float]:
    """Seconds to move the bytes at the copy bandwidth and to do the flops at the peak."""
    t_mem = cost.bytes / (ceilings.copy_gbps * 1e9)
    t_flop = cost.flops / (ceilings.peak_for(compute) * 1e12)
    return t_mem, t_flop


def floor_seconds(cost: RowCost, ceilings: DeviceCeilings, compute: str) -> float:
    """The roofline floor: the slower of moving the bytes and doing the flops."""
    return max(floor_parts(cost, ceilings, compute))


# ---------------------------------------------------------------------------------------------
# Measurement


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up (CUDA events on a
    GPU, ``perf_counter`` on CPU)."""
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _copy_gbps(
    device: torch.device,
    nbytes: int,
    repeats: int,
    blocks: int = 1,
    warm_s: float = 0.0,
    timer=median_seconds,
) -> float:
    """Read + write GB/s of ``copy_`` over ``nbytes``: copies for ``warm_s`` seconds first
    (clocks and power settle), then the highest of ``blocks`` medians of ``repeats`` timings
    (``timer(fn, device, repeats)``: seconds per call).
    The best sustained rate, not one short sample: on an H100 two single 20-copy medians five
    minutes apart read 2905 and 2731 GB/s, which alone moved a kernel's share of the roofline
    from 87 to 92 %."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = min(timer(lambda: dst.copy_(src), device, repeats) for _ in range(blocks))
    return 2 * src.numel() * 4 / seconds / 1e9


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """TFLOP/s of an ``n`` x ``n`` x ``n`` matmul in ``dtype`` on random data (median)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds / 1e12


def _cpu_gemm_size(dtype: torch.dtype, largest: int = 2048, budget_s: float = 0.05) -> int:
    """The square GEMM size a CPU peak is measured at: doubled from 256 while one matmul
    stays under ``budget_s``, up to ``largest``. A CPU without bf16 matrix instructions runs
    bf16 GEMMs a thousand times slower than fp32 (measured: a 1 x 64 x 128 bf16 matmul in
    0.9 ms), where 2048^3 took minutes per measurement."""
    n = 256
    while n < largest:
        a = torch.randn(n, n).to(dtype)
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > budget_s:
            break
        n *= 2
    return n


def _fp8_tflops(device: torch.device, n: int, repeats: int) -> float | None:
    scaled_mm = getattr(torch, "_scaled_mm", None)
    if scaled_mm is None or device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=device)
    try:
        seconds = median_seconds(
            lambda: scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, repeats
        )
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / seconds / 1e12


def device_key(device: torch.device) -> str:
    """A name identifying the hardware (and thread count on CPUs) and the torch build for the
    ceilings cache: the peaks are those of the build's GEMM libraries, so a new build measures
    afresh instead of reusing another build's numbers (``--remeasure`` forces it anyway)."""
    build = f"torch{torch.__version__}"
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}:{build}"
    from ..device_files import hardware_name

    return f"cpu:{hardware_name(device)}:{torch.get_num_threads()}threads:{build}"


def measure_ceilings(device: torch.device) -> DeviceCeilings:
    """Measure copy bandwidth and matmul peaks of ``device`` now (a few seconds)."""
    if device.type == "cuda":
        copy = _copy_gbps(device, 1 << 30, 10, blocks=5, warm_s=0.3)
        peaks = {
            "bf16": matmul_tflops(device, 8192, torch.bfloat16, 20),
            "fp32": matmul_tflops(device, 8192, torch.float32, 5),
        }
        fp8 = _fp8_tflops(device, 8192, 20)
        if fp8 is not None:
            peaks["fp8"] = fp8
        method = (
            "copy_ 1 GiB fp32 (read+write) after 0.3 s of copies, best of 5 medians of 10 "
            "CUDA-event timings; "
            "square 8192 GEMMs (bf16 matmul, fp8 torch._scaled_mm)"
        )
    else:
        copy = _copy_gbps(device, 256 << 20, 5)
        sizes = {dtype: _cpu_gemm_size(dtype) for dtype in (torch.float32, torch.bfloat16)}
        fp32 = matmul_tflops(device, sizes[torch.float32], torch.float32, 5)
        # A bf16 GEMM may multiply in float32 (the torch backend does where PyTorch has no
        # oneDNN bf16 matmul: TorchOptions.cpu_float32_gemms), so bf16 work's peak is the
        # better of the two.
        peaks = {
            "fp32": fp32,
            "bf16": max(fp32, matmul_tflops(device, sizes[torch.bfloat16], torch.bfloat16, 5)),
        }
        method = (
            f"copy_ 256 MiB fp32 (read+write), square GEMMs (fp32 {sizes[torch.float32]}, "
            f"bf16 {sizes[torch.bfloat16]}; bf16 the better of the two), perf_counter "
            f"medians, {torch.get_num_threads()} threads"
        )
    return DeviceCeilings(
        device_key(device), copy, peaks, time.strftime("%Y-%m-%dT%H:%M:%S%z"), method
    )


def is_ceilings_cache(doc: object) -> bool:
    """Whether a parsed JSON document is a ceilings cache (an object of device key ->
    ceilings entry): a file that is not is someone else's, never written over."""
    return isinstance(doc, dict) and all(
        isinstance(v, dict) and "copy_gbps" in v for v in doc.values()
    )


def read_cache(cache_path: Path) -> dict:
    """The ceilings cache at ``cache_path`` ({} when absent).

    Raises ValueError naming the file when it exists but is not a ceilings cache (JSON object
    of device key -> ceilings): such a file is someone else's, and must not be written over.
    """
    if not cache_path.exists():
        return {}
    if not cache_path.is_file():
        raise ValueError(f"ceilings cache {cache_path}: exists and is not a file")
    try:
        cache = json.loads(cache_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        cache = None
    except OSError as exc:
        raise ValueError(f"ceilings cache {cache_path}: cannot be read ({exc})") from None
    if not is_ceilings_cache(cache):
        raise ValueError(
            f"ceilings cache {cache_path}: not a moerunner ceilings cache (JSON of device -> "
            "ceilings); refusing to overwrite it (remove it or choose another path)"
        )
    return cache


def load_or_measure(
    device: torch.device, cache_path: Path | None, remeasure: bool = False
) -> DeviceCeilings:
    """Ceilings of ``device`` from ``cache_path`` (JSON keyed by device), measured if absent.

    Raises ValueError (before measuring) if ``cache_path`` exists and is not a ceilings cache,
    or if its entry of this device is malformed (naming the file, the entry and the field;
    ``remeasure`` replaces that entry instead of reading it).
    """
    key = device_key(device)
    cache = read_cache(cache_path) if cache_path is not None else {}
    if not remeasure and key in cache:
        where = f"ceilings cache {cache_path}: entry {key!r}"
        try:
            return DeviceCeilings.from_dict(cache[key], where)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (fix or remove the entry, or re-measure it: --remeasure)"
            ) from None
    ceilings = measure_ceilings(device)
    if cache_path is not None:
        cache[key] = asdict(ceilings)
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(cache, indent=2))
        except OSError as exc:  # only costs a re-measurement next time: say so, go on
            warnings.warn(
                f"ceilings cache {cache_path}: not written ({exc.strerror or exc}); the "
                "ceilings will be measured again next time",
                stacklevel=2,
            )
    return ceilings
