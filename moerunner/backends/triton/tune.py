# ``moerunner tune`` for the triton backend: search GEMM tiles on the current GPU, write JSON.
#
# For each token count, the alignment runs once per candidate BLOCK_M, then GEMM1 (with the
# making of GEMM2's input) and GEMM2 candidates with that BLOCK_M are timed separately
# (CUDA-graph replay, so launch overhead does not hide the kernel time); the best pair over
# all BLOCK_M wins. Results go to one file per (E, N, K, scheme, device) in the schema of
# ``tile_config.py``, by default in the user tile folder that the runtime reads before the
# shipped files (``tile_config.user_tile_dir``). Weights are random with the requested
# scheme's layout: tile choice depends on shapes, not on values. The backend's options
# (``TritonOptions``: the e2m1 layout the weights are prepared in, and every launch switch)
# are a parameter of the search.

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ...bench import presets as _model_shapes
from ...config import ACTIVATIONS
from ...quant import get_scheme
from ...quant.schemes import QuantScheme, plain_scheme
from ._prepare import split_half, weight_layout
from .options import E2M1_LAYOUTS, TritonOptions
from .tile_config import (
    SCHEMA,
    MoeTiles,
    TileConfig,
    config_file_name,
    file_key,
    is_count_text,
    is_tile_file,
    k_blocked,
    load_config_file,
    mma_8bit,
    rows_per_expert,
    write_config_file,
)

# name: (H, I, E, top_k, activation), read from the project's one table of model shapes.
PRESETS = {
    name: (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k, s.activation)
    for name, s in ((n, _model_shapes.PRESETS[n]) for n in _model_shapes.MODEL_PRESETS)
}
DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
# Routings a decode-sized search times in turn (``tune_tokens``).
ROUTINGS = 8
# The fragment-layout decode search also times split K (``SPLIT_K_CANDIDATES`` programs per
# tile) while the call's rows are at most 1 / SPLIT_K_MAX_SHARE of the experts.
SPLIT_K_CANDIDATES = (1, 2, 3, 4, 6)
SPLIT_K_MAX_SHARE = 4
# Experts a compile-only search builds weights for (``compile_experts``).
COMPILE_EXPERTS = 16
# Rows per expert above which the search of the middle band also times 128-row tiles
# (``candidate_tiles``).
MIN_RPE_128_ROWS = 48


def candidate_tiles(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    scheme: str | QuantScheme,
    layout: str | None = None,
) -> list[TileConfig]:
    """Candidates for the rows-per-expert regime of this call (both GEMMs draw from these);
    ``layout`` is the weights' ``_prepare.weight_layout``."""
    rpe = rows_per_expert(num_tokens, top_k, num_experts)
    packed = get_scheme(scheme).packed
    quant8 = mma_8bit(scheme)  # 8-bit operands fed to the MMA
    bks = (128,) if k_blocked(scheme) or packed else (64, 128)
    out = []
    if packed and rpe <= 16 and layout == "fragment":
        # e2m1 in the fragment layout at decode: K steps are one 128-wide chunk, so search the
        # tile's weight rows (2 * BLOCK_N for the gated GEMM1; tiles the layout cannot take
        # are skipped when they raise), the warps decoding them and the pipeline depth.
        for bn in (32, 64, 128, 256):
            for warps, stages in ((4, 3), (4, 4), (4, 5), (8, 3), (8, 4)):
                out.append(TileConfig(16, bn, 128, 1, warps, stages))
        if num_tokens * top_k * SPLIT_K_MAX_SHARE <= num_experts:
            # Few experts hit: too few tiles to keep every SM's decode busy, so also try each
            # tile's K loop split over several programs (``TileConfig.split_k``; the
            # candidates above leave it to the launcher's rule, which splits GEMM2 only).
            for bn in (64, 128):
                for warps, stages in ((4, 4), (4, 5), (8, 4)):
                    for split in SPLIT_K_CANDIDATES:
                        out.append(TileConfig(16, bn, 128, 1, warps, stages, split))
        return out
    if packed and rpe <= 16:
        # Packed 4-bit in the split layout at decode: the weight decode dominates, so search
        # how many chunks one K step covers (per-step overhead) and the warps decoding them.
        # Beyond decode a K step is 128 elements (whole chunks, see the launcher).
        # BLOCK_N 16 is a 32-column MMA for a gated GEMM1, one n8 slice per warp of four.
        chunk = 2 * split_half(get_scheme(scheme))
        for bn in (16, 32, 64, 128):
            for bk in sorted({chunk, 2 * chunk, min(4 * chunk, 256)}):
                for warps, stages in ((2, 3), (4, 3), (4, 4)):
                    out.append(TileConfig(16, bn, bk, 1, warps, stages))
        return out
    if rpe <= 16:
        # Decode streams weights: long K steps and deep pipelines keep more bytes in flight.
        # Block-scaled fp8 also takes 256-wide steps (two scale groups each), and 1-byte
        # operands' stages are half the size, so their pipelines go deeper: on an H100 the
        # DeepSeek-V3 fp8_block call at T = 16-64 ran 1.03-1.035x faster with 16 x 32 x 256
        # GEMM1 tiles 4-6 stages deep than with the 128-wide steps searched before.
        bms = (16, 32, 64) if rpe >= 8 else (16,)
        for bm in bms:
            for bn in (32, 64, 128) if bm == 16 else (64, 128):
                for bk in (128, 256):
                    for stages in (3, 4, 5, 6) if quant8 and bm == 16 else (3, 4):
                        out.append(TileConfig(bm, bn, bk, 1, 4, stages))
    elif rpe <= 128:
        # Also search the wide GEMM2 tile and BLOCK_M 128 once many experts overflow one
        # 64-row block (an expert's rows spread by about sqrt(rows per expert) under uniform
        # routing, so from ~48 on): masked padding rows cost MMA time but are never loaded, so
        # a half-empty 128-row block moves fewer bytes than two 64-row blocks, and its tile
        # runs two warpgroups. At 64 rows per expert, Mixtral-8x7B (T = 256) ran 1.065x faster
        # on an H200 with 128-row tiles than with the 64-row ones a search above 64 only found.
        for bm in (16, 32, 64):
            for bn in (64, 128, 256) if bm == 64 and rpe > 32 else (64, 128):
                for bk in bks:
                    pipelines = ((4, 3), (4, 4), (8, 3)) if bm == 64 else ((4, 3),)
                    for warps, stages in pipelines:
                        out.append(TileConfig(bm, bn, bk, 8, warps, stages))
        if rpe > MIN_RPE_128_ROWS:
            for bn in (64, 128) if quant8 else (64, 128, 256):
                for warps, stages in ((8, 3), (8, 4)):
                    out.append(TileConfig(128, bn, bks[0] if quant8 else 64, 8, warps, stages))
    else:
        # A gated GEMM1's MMA is 2 * BLOCK_N wide (gate and up columns side by side): 64 and
        # 128 suit it, 256 suits GEMM2. Block-scaled fp8 keeps a second accumulator-sized
        # product per K step, so its 4-warp tiles also try a deeper pipeline, and its
        # 256-wide GEMM2 tile only with 64 rows (two 128 x 256 fp32 tiles do not fit).
        for bm in (64, 128):
            for bn in (64, 128) if quant8 and bm == 128 else (64, 128, 256):
                for bk in (128,) if quant8 else bks[:1]:
                    for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                        out.append(TileConfig(bm, bn, bk, 8, warps, stages))
    if k_blocked(scheme) and rpe > 64:
        # Two scale groups per K step: the promotion of the first overlaps the second's MMA.
        for bm in (64, 128):
            for bn in (64, 128):
                for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
                    out.append(TileConfig(bm, bn, 256, 8, warps, stages))
    if layout == "fragment":  # K steps are one 128-wide chunk whatever block_k says
        out = list(dict.fromkeys(dataclasses.replace(t, block_k=128) for t in out))
    return out


def limited_candidates(
    cands: Iterable[TileConfig], limit: int, keep: Iterable[TileConfig] = ()
) -> list[TileConfig]:
    """``keep`` (e.g. the default tiles) and at most ``limit`` of ``cands``, taken in turn
    from each BLOCK_M so every row band of the search stays in (each band's list is walked
    every other entry first, to spread the picks over its block sizes and pipelines)."""
    by_m: dict[int, list[TileConfig]] = {}
    for c in cands:
        by_m.setdefault(c.block_m, []).append(c)
    for group in by_m.values():
        group[:] = group[::2] + group[1::2]
    out: list[TileConfig] = []
    while len(out) < limit and any(by_m.values()):
        for group in by_m.values():
            if group and len(out) < limit:
                out.append(group.pop(0))
    return list(dict.fromkeys([*keep, *out]))


def _bench(fn: Callable[[], None], graph: bool) -> float:
    """Median milliseconds of ``fn`` (CUDA-graph replay when ``graph``)."""
    import triton.testing as tt

    if graph:
        return tt.do_bench_cudagraph(fn, rep=30, return_mode="median")
    return tt.do_bench(fn, warmup=5, rep=30, return_mode="median")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tune_tokens(
    prepared,
    num_tokens: int,
    top_k: int,
    candidates: Iterable[TileConfig] | None = None,
    progress: Callable[[str], None] = print,
    compile_only: bool = False,
    timer: Callable[[Callable[[], None], bool], float] = _bench,
) -> tuple[MoeTiles | None, float]:
    """Best tiles for ``num_tokens`` tokens (random routing); returns (tiles, GEMM ms).
    A winner that pins split K is kept only if the whole fused call runs faster with it than
    with ``split_k`` left to the launcher (both timed by ``timer``; the GEMM ms are then
    scaled by the calls' ratio).

    ``compile_only`` launches every candidate once (filling Triton's kernel cache) and times
    nothing; it returns (None, nan). ``timer(fn, graph)``: milliseconds of one ``fn()`` call
    (default ``_bench``; ``graph``: whether CUDA-graph replay suits the size), called once
    per candidate and GEMM after a first launch.
    """
    from . import experts as X
    from . import workspaces as W

    spec = prepared.spec
    options = prepared.options
    w13, w2 = prepared.tensors["w13"], prepared.tensors["w2"]
    dev = w13.data.device
    num_experts, inter, hidden = spec.num_experts, spec.intermediate_size, spec.hidden_size
    scheme = w13.scheme if w13.scheme is not None else plain_scheme(torch.bfloat16)
    # Inputs in the weights' float dtype where it is one of 16 bits or more (fp16 weights
    # run with fp16 inputs), else bf16.
    stored = w13.data.dtype
    dtype = stored if stored.is_floating_point and stored.itemsize >= 2 else torch.bfloat16
    cands = (
        list(candidates)
        if candidates is not None
        else candidate_tiles(num_tokens, top_k, num_experts, scheme, weight_layout(w13))
    )
    x = torch.randn(num_tokens, hidden, device=dev, dtype=dtype)
    rows = num_tokens * top_k
    graph = rows <= 4096
    # Decode-sized calls are timed over ROUTINGS different routings in turn, as moerunner bench
    # and the GPU benchmark time them: with one routing a few tokens' experts stay in L2 from
    # one replay to the next (GPT-OSS-120B at T = 1: 4 experts of 12.4 MB against a 50 MB L2),
    # which could favour tiles that win only on cached weights (on an H100 the GPT-OSS mxfp4
    # and nvfp4 searches chose the same tiles either way). Compiling needs one launch.
    rotations = ROUTINGS if graph and not compile_only else 1
    routings = []
    for _ in range(rotations):
        ids = torch.rand(num_tokens, num_experts, device=dev).topk(top_k, dim=1).indices
        routings.append(ids.to(torch.int32).reshape(-1).contiguous())
    route_w = torch.rand(num_tokens * top_k, device=dev)
    inter_buf = W.intermediate_buffers(rows, inter, dtype, False, dev)["inter"]
    inter_q = inter_s = None  # GEMM2's input as GEMM1's epilogue makes it (fp8_group128)
    if w2.activation_format == "fp8_group128":
        fused = W.intermediate_buffers(rows, inter, dtype, True, dev)
        inter_q, inter_s = fused["inter"], fused["inter_scale"]
    out_buf = torch.empty(rows, hidden, device=dev, dtype=dtype)
    a1, s1 = X._quantize_input(x, w13, options)
    a2, s2 = X._quantize_input(inter_buf.normal_(), w2, options)
    best: dict[int, dict[str, tuple[float, TileConfig]]] = {}
    for i, tile in enumerate(cands):
        bm = tile.block_m
        layouts = [  # as run_kernel_sequence makes them, one per routing
            X.layout_rows(
                ids,
                top_k,
                num_experts,
                bm,
                W.alignment_workspace(rows, num_experts, bm, dev),
                options,
            )
            for ids in routings
        ]
        times: dict[str, str] = {}
        fuse = X.fuses_gemm2_input_quant(w2, x, tile, options)

        def gemm1(tile=tile, layouts=layouts, fuse=fuse):
            # GEMM1 and whatever makes GEMM2's input, as run_kernel_sequence does: the
            # epilogue's quantization or the standalone one (a no-op for unquantized inputs).
            for layout in layouts:
                X._launch_gemm(
                    a1,
                    s1,
                    w13,
                    prepared.tensors["w13_bias"],
                    inter_q if fuse else inter_buf,
                    layout,
                    rows,
                    top_k,
                    None,
                    tile,
                    inter,
                    spec,
                    inter_s if fuse else None,
                    dtype,
                    options=options,
                )
                if not fuse:
                    X._quantize_input(inter_buf, w2, options)

        def gemm2(tile=tile, layouts=layouts):
            for layout in layouts:
                X._launch_gemm(
                    a2,
                    s2,
                    w2,
                    prepared.tensors["w2_bias"],
                    out_buf,
                    layout,
                    rows,
                    1,
                    route_w,
                    tile,
                    hidden,
                    None,
                    options=options,
                )

        for which, fn in (("gemm1", gemm1), ("gemm2", gemm2)):
            try:
                fn()
                _synchronize(dev)
                if compile_only:
                    continue
                ms = timer(fn, graph) / rotations
            except Exception as exc:  # out of shared memory, invalid combination...
                times[which] = f"skipped ({type(exc).__name__})"
                _synchronize(dev)
                continue
            cur = best.setdefault(bm, {}).get(which)
            if cur is None or ms < cur[0]:
                best[bm][which] = (ms, tile)
            times[which] = f"{ms * 1e3:.1f} us"
        progress(
            f"  [{i + 1}/{len(cands)}] {tile}: " + ", ".join(f"{k} {v}" for k, v in times.items())
        )
    if compile_only:
        return None, float("nan")
    pairs = [
        (v["gemm1"][0] + v["gemm2"][0], MoeTiles(v["gemm1"][1], v["gemm2"][1]))
        for v in best.values()
        if "gemm1" in v and "gemm2" in v
    ]
    if not pairs:
        raise RuntimeError(f"no candidate tile ran for T={num_tokens}")
    ms, tiles = min(pairs, key=lambda p: p[0])
    if _pins_split(tiles):
        # Splits win GEMM by GEMM but can lose in the call, where GEMM2 streams behind GEMM1
        # and the top-k sum follows (GPT-OSS-120B mxfp4 at T = 8 on an H100: the searched
        # splits took 167.4 us per call against 161.4 unsplit). Keep them only if the whole
        # call is faster with them than with split_k left to the launcher.
        unpinned = tiles.unpinned()
        weights_tk = route_w.view(num_tokens, top_k)

        def call(t: MoeTiles):
            def run():
                for ids in routings:
                    X.fused_standard(x, weights_tk, ids.view(num_tokens, top_k), prepared, t)

            return run

        calls = {}
        for name, t in (("split", tiles), ("unsplit", unpinned)):
            call(t)()
            _synchronize(dev)
            calls[name] = timer(call(t), graph) / rotations
        progress(
            f"  whole call: split {calls['split'] * 1e3:.1f} us, "
            f"split_k left to the launcher {calls['unsplit'] * 1e3:.1f} us"
        )
        if calls["unsplit"] <= calls["split"]:
            ms, tiles = ms * calls["unsplit"] / calls["split"], unpinned
    return tiles, ms


def _pins_split(tiles: MoeTiles) -> bool:
    return any(t.split_k is not None and t.split_k > 1 for t in (tiles.gemm1, tiles.gemm2))


def random_weights(
    hidden: int, inter: int, num_experts: int, activation: str, scheme: str, device: torch.device
):
    """Random ExpertWeights in ``scheme``'s stored layout, built directly (no fp32 copies)."""
    from ...quant import QuantizedWeight, get_scheme
    from ...weights import ExpertWeights

    gated = ACTIVATIONS[activation]
    n13 = 2 * inter if gated else inter

    def one(n: int, k: int):
        s = get_scheme(scheme)
        if not s.is_quantized:
            dt = torch.float16 if s.weight_format == "fp16" else torch.bfloat16
            return torch.randn(num_experts, n, k, device=device, dtype=dt) * 0.02
        e = num_experts
        if s.weight_format == "e4m3":
            data = (torch.randn(e, n, k, device=device, dtype=torch.bfloat16)).to(
                torch.float8_e4m3fn
            )
        elif s.weight_format == "e2m1" or s.weight_format == "int4":
            data = torch.randint(0, 256, (e, n, k // 2), device=device, dtype=torch.uint8)
        else:
            data = torch.randint(-127, 128, (e, n, k), device=device, dtype=torch.int8)
        kw = {}
        if s.granularity == "tensor":
            scale = torch.rand(e, device=device) * 1e-3 + 1e-3
        elif s.granularity == "channel":
            scale = torch.rand(e, n, device=device) * 1e-3 + 1e-3
        else:
            br, bc = s.block_shape
            shape = (e, -(-n // br), -(-k // bc))
            if s.scale_format == "e8m0":
                scale = torch.randint(118, 122, shape, device=device, dtype=torch.uint8)
            elif s.scale_format == "e4m3":
                scale = (torch.rand(shape, device=device) + 0.5).to(torch.float8_e4m3fn)
                kw["global_scale"] = torch.full((e,), 1e-2, device=device)
            else:
                scale = torch.rand(shape, device=device) * 1e-3 + 1e-3
        if s.zero_point:
            zp_dtype = torch.int8 if s.weight_format == "int8" else torch.uint8
            kw["zero_point"] = torch.randint(6, 10, scale.shape, device=device, dtype=zp_dtype)
        return QuantizedWeight(scheme, (e, n, k), data, scale, **kw)

    w13, w2 = one(n13, hidden), one(hidden, inter)
    biases = {}
    if activation == "swiglu_oai":
        biases = {
            "w13_bias": torch.randn(num_experts, n13, device=device) * 0.1,
            "w2_bias": torch.randn(num_experts, hidden, device=device) * 0.1,
        }
    return ExpertWeights(w13, w2, gate_up_interleaved=activation == "swiglu_oai", **biases)


def compile_experts(num_experts: int, top_k: int) -> int:
    """Experts a compile-only search (``tune_preset``, the processes of ``precompile``)
    builds weights for: the kernels it compiles do not depend on the expert count beyond
    whether it is a multiple of 16 (Triton specialises integer arguments on that), so at
    most ``COMPILE_EXPERTS`` (+ 1, to keep that property) and at least ``top_k``. Each
    parallel process then holds a few experts, not the layer: DeepSeek-V3's whole fp8 layer
    took 21.6 GB a process, and two of five ran out of memory on an 80 GB H100."""
    if num_experts <= COMPILE_EXPERTS or top_k > COMPILE_EXPERTS:
        return num_experts
    return COMPILE_EXPERTS if num_experts % 16 == 0 else COMPILE_EXPERTS + 1


def tune_preset(
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    activation: str,
    scheme: str,
    tokens: Iterable[int],
    out_dir: Path,
    progress: Callable[[str], None] = print,
    compile_only: bool = False,
    options: TritonOptions | None = None,
    device: str | torch.device = "cuda",
) -> tuple[Path | None, dict]:
    """Tune every token count of one shape on ``device`` and write its file into
    ``out_dir``; returns (path, ms by T). ``options``: the backend's (default
    ``TritonOptions()``), with which the weights are prepared (``e2m1_layout``: the layout
    tuned, named in the file) and every candidate launched.

    ``compile_only`` only compiles every candidate of the shape (see ``tune_tokens``) and
    writes nothing; it builds weights for ``compile_experts`` experts only.
    """
    from ...config import Activation
    from . import TritonBackend

    dev = torch.device(device)
    act = Activation(activation)
    built = compile_experts(num_experts, top_k) if compile_only else num_experts
    weights = random_weights(hidden, inter, built, activation, scheme, dev)
    spec = weights.spec(act)
    prepared = TritonBackend(options).prepare_weights(weights, spec)
    layout = weight_layout(prepared.tensors["w13"])
    if not compile_only:
        name = torch.cuda.get_device_name(dev)
        path = out_dir / config_file_name(num_experts, inter, hidden, scheme, name, layout)
        check_mergeable(path, file_key(num_experts, inter, hidden, scheme, name, layout))
    found, timings = {}, {}
    for t in tokens:
        start = time.time()
        progress(f"E={num_experts} N={inter} K={hidden} {scheme} T={t}: searching")
        # The shape's own candidates also where fewer experts' weights stand in for it.
        cands = candidate_tiles(t, top_k, num_experts, scheme, layout) if compile_only else None
        tiles, ms = tune_tokens(prepared, t, top_k, cands, progress, compile_only)
        if compile_only:
            continue
        found[t], timings[t] = tiles, ms
        progress(
            f"E={num_experts} N={inter} K={hidden} {scheme} T={t}: {ms * 1e3:.1f} us "
            f"with {tiles} ({time.time() - start:.0f} s)"
        )
    if compile_only:
        return None, {}
    out_dir.mkdir(parents=True, exist_ok=True)
    timings = merge_tuned(path, (num_experts, inter, hidden, scheme, name, layout), found, timings)
    return path, timings


def check_mergeable(path: Path, key: tuple | None = None) -> None:
    """ValueError unless ``path`` is absent or a valid tuned file moerunner wrote
    (``is_tile_file``, then read whole by ``load_config_file``, of the shape ``key`` where
    given): a tuned file is merged into, any other file is left alone. Checked before a
    search, so a broken file does not lose the search's results at the end."""
    if path.exists() and not (path.is_file() and is_tile_file(path)):
        raise ValueError(
            f"{path}: exists and is not a moerunner tile file (no top-level schema "
            f"{SCHEMA!r}); refusing to merge into it: move it away or tune into another folder"
        )
    load_config_file(str(path), key)
    _measured_ms(path)


def _measured_ms(path: Path) -> dict[int, float]:
    """The GEMM ms by token count a tuned file records (empty for no file); ValueError if
    they are not an object of token counts."""
    if not path.is_file():
        return {}
    measured = json.loads(path.read_text()).get("measured", {})
    gemm_ms = measured.get("gemm_ms", {}) if isinstance(measured, dict) else None
    if not isinstance(gemm_ms, dict) or not all(is_count_text(t) for t in gemm_ms):
        raise ValueError(
            f"{path}: its 'measured' timings are not an object of token counts; fix or delete "
            "the file"
        )
    return {int(t): v for t, v in gemm_ms.items()}


def merge_tuned(
    path: Path,
    key: tuple[int, int, int, str, str, str | None],
    found: dict[int, MoeTiles],
    timings: dict[int, float],
) -> dict[int, float]:
    """Write ``found`` (tiles by token count) to the tuned file ``path``, keeping the token
    counts an earlier moerunner file there holds and not searched this time; returns every
    timing (ms by T) in the written file. ``key``: (E, N, K, scheme, device name, layout),
    as ``write_config_file`` takes them. Refuses a file moerunner did not write
    (``check_mergeable``)."""
    check_mergeable(path, file_key(*key))
    if path.is_file():
        load_config_file.cache_clear()
        found = {**(load_config_file(str(path)) or {}), **found}
        timings = {**_measured_ms(path), **timings}
    num_experts, n, k, scheme, device_name, layout = key
    write_config_file(
        path,
        num_experts,
        n,
        k,
        scheme,
        device_name,
        found,
        {"gemm_ms": {str(t): v for t, v in sorted(timings.items())}},
        layout,
    )
    load_config_file.cache_clear()
    return timings


def precompile(
    plan: Iterable[tuple[str, str, Iterable[int]]],
    jobs: int,
    progress: Callable[[str], None] = print,
    e2m1_layout: str = "fragment",
) -> None:
    """Compile the candidates of several (preset, scheme, tokens) in parallel processes.

    Compilation is CPU work and dominates a search; timing must run one shape at a time.
    Running this first fills Triton's on-disk cache so the serial search only times.
    ``e2m1_layout``: the layout the search will prepare e2m1 weights in
    (``TritonOptions.e2m1_layout``), so the processes compile the kernels it launches.
    """
    import subprocess
    import tempfile

    if e2m1_layout not in E2M1_LAYOUTS:
        raise ValueError(f"e2m1_layout must be one of {', '.join(E2M1_LAYOUTS)}")
    layout = ["--e2m1-layout", e2m1_layout]
    pending = [
        [
            sys.executable,
            "-m",
            __name__,
            "--preset",
            preset,
            "--schemes",
            scheme,
            "--compile-only",
            *layout,
            "--tokens",
            str(t),
        ]
        for preset, scheme, tokens in plan
        for t in tokens
    ]
    running: list[tuple[list[str], subprocess.Popen, Any]] = []
    start = time.time()
    while pending or running:
        while pending and len(running) < max(1, jobs):
            cmd = pending.pop(0)
            log = tempfile.TemporaryFile(mode="w+")
            running.append((cmd, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in list(running):
            cmd, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            what = f"{cmd[4]} {cmd[6]} T={cmd[-1]}"
            if proc.returncode:
                log.seek(0)
                tail = log.read().strip().splitlines()[-1:]
                progress(f"precompile {what}: failed ({' '.join(tail)})")
            else:
                progress(f"precompile {what}: done ({time.time() - start:.0f} s)")
            log.close()


def main(argv: list[str] | None = None) -> int:
    """``moerunner tune``; its flags are parsed in ``moerunner.cli.tune``."""
    from ...cli.tune import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
