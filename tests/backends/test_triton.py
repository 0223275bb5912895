"""Triton backend in the CPU interpreter: the kernel sequence piece by piece and whole.

Runs under ``TRITON_INTERPRET=1`` (set by tests/conftest.py before triton is imported) with
tiny shapes in fp32/fp16 (the interpreter computes bf16 wrongly). Every scheme the backend
claims is run against the ``torch`` backend's emulation, which quantizes activations the same
way, so tolerances are tight. The generated conformance matrix (tests/test_conformance.py)
covers the edge cases for plain weights; GPU runs are in test_triton_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from cases import (
    PACKED_SCHEMES,
    TRITON_QUANT_SCHEMES,
    align_buffers,
    align_reference,
    gpt_oss_experts,
    random_experts,
)

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.errors import MoeInputError
from moerunner.routing import TopK
from moerunner.weights import ExpertWeights

triton_pkg = pytest.importorskip("moerunner.backends.triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moerunner.backends.triton import (  # noqa: E402
    TritonBackend,
    TritonOptions,
    _align,
    _overlap,
    _prepare,
    _weight_decode,
    experts,
    tile_config,
)

OPTIONS = TritonOptions()
O = _overlap

if not triton_pkg.interpreted() and not torch.cuda.is_available():
    pytest.skip("triton backend cannot run here", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(backend, x, weights, act, wts, ids, force_permute=False):
    runner = moerunner.MoeRunner(backend, force_permute=force_permute)
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(StandardDispatchOutput(x, TopK(wts, ids)), prepared)


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize(
    "rows,experts,block_m,past",
    [
        (1, 4, 16, 0),
        (10, 4, 16, 0),
        (37, 8, 16, 0),
        (64, 16, 32, 0),
        (100, 3, 64, 0),
        (300, 256, 16, 0),  # DeepSeek-V3's experts: rows of many experts, most alone
        (70, 5, 16, 20),  # ids past E, some past the next power of two
    ],
)
def test_alignment_kernel_equals_reference(rows, experts, block_m, past, multi):
    """Both the one-program (rows sorted in registers) and the multi-program (count, scan,
    scatter) alignment give the reference layout exactly; ``multi`` forces the latter with
    16-row programs. Ids of -1 and ids of ``past`` experts beyond E are skipped alike."""
    single_max = 0 if multi else _align.SINGLE_PROGRAM_MAX_ROWS
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(-1, experts + past, (rows,), generator=gen, dtype=torch.int32)
    ids = ids.to(DEVICE)
    s, b, n = align_buffers(rows, experts, block_m, DEVICE)
    _align.align_rows(
        ids, experts, block_m, s, b, n, rows_per_program=16, options=OPTIONS,
        single_program_max_rows=single_max,
    )  # fmt: skip
    used, want_s, want_b = align_reference(ids, experts, block_m)
    assert int(n) == used and used % block_m == 0
    assert torch.equal(s[:used].cpu(), want_s)
    assert torch.equal(b[: used // block_m].cpu(), want_b)


@pytest.mark.parametrize("multi", [False, True])
def test_alignment_of_int64_ids_checks_them_in_their_width(multi):
    """int64 ids (as transformers' routers give them) align as int32 ones do; an id of
    2**32 + 1 is skipped, not read as expert 1."""
    ids = torch.tensor([1, 2**32 + 1, 0, -1, 1, 2**31, 2], dtype=torch.int64, device=DEVICE)
    experts, block_m = 4, 16
    s, b, n = align_buffers(ids.numel(), experts, block_m, DEVICE)
    _align.align_rows(
        ids, experts, block_m, s, b, n, rows_per_program=16, options=OPTIONS,
        single_program_max_rows=0 if multi else _align.SINGLE_PROGRAM_MAX_ROWS,
    )  # fmt: skip
    used, want_s, want_b = align_reference(ids, experts, block_m)
    assert int(n) == used == 3 * block_m
    assert torch.equal(s[:used].cpu(), want_s)
    assert torch.equal(b[: used // block_m].cpu(), want_b)


@pytest.mark.parametrize("multi", [False, True])
def test_alignment_takes_its_most_experts_and_refuses_more(multi):
    """At ``MAX_EXPERTS`` (2**16) both alignments lay rows out right (the one-program
    path's int32 (expert, row) keys and the multi-program path's one-hot tiles both fit);
    above it ``align_rows`` raises (the one-program keys overflowed past 2**19 experts and
    wrote rows at negative slots; the multi-program tiles exceed Triton's largest tensor),
    and the backend declines such layers with the reason."""
    experts, block_m = _align.MAX_EXPERTS, 16
    ids = torch.tensor([experts - 1, -1, 3, experts - 1, experts], dtype=torch.int32)
    ids = ids.to(DEVICE)
    s, b, n = align_buffers(ids.numel(), experts, block_m, DEVICE)
    single_max = 0 if multi else _align.SINGLE_PROGRAM_MAX_ROWS
    kw = dict(options=OPTIONS, rows_per_program=16, single_program_max_rows=single_max)
    _align.align_rows(ids, experts, block_m, s, b, n, **kw)
    assert int(n) == 32
    assert s[:32].cpu().tolist() == [2] + [5] * 15 + [0, 3] + [5] * 14
    assert b[:2].cpu().tolist() == [3, experts - 1]
    with pytest.raises(ValueError, match="at most 65536 experts"):
        _align.align_rows(ids, experts + 1, block_m, s, b, n, **kw)
    problem = MoeProblem("cpu", torch.float32, "fp32", "silu", "standard", 64, 64, experts + 1)
    ok, reason = triton_pkg.TritonBackend().supports(problem)
    assert not ok and "65536 experts" in reason


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([0, 9, 1, 9, 2, 9, 3, 9], dtype=torch.int32)[::2],  # strided
        torch.zeros(4, 2, dtype=torch.int32),  # 2-D
        torch.tensor([0, 1], dtype=torch.uint8),
        torch.tensor([0, 1], dtype=torch.float32),
    ],
    ids=["strided", "2-D", "uint8", "float32"],
)
def test_alignment_refuses_ids_it_would_misread(ids):
    """The kernels read the ids densely as a 1-D int32 / int64 array: a strided view was
    read as if dense (wrong experts, silently), uint8 ids at 256 experts failed inside the
    interpreter or counted masked lanes as expert 255. Now a clear error."""
    s, b, n = align_buffers(ids.shape[0], 4, 16, DEVICE)
    error = TypeError if ids.dim() == 1 and ids.is_contiguous() else ValueError
    with pytest.raises(error, match="row_expert must be"):
        _align.align_rows(ids.to(DEVICE), 4, 16, s, b, n, options=OPTIONS)


@triton.jit
def _experts_of_blocks_kernel(
    ids_ptr, out_ptr, num_rows, num_experts, BLOCK_M: tl.constexpr, IDS: tl.constexpr,
    EP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    expert = _overlap.block_expert_from_ids(ids_ptr, num_rows, num_experts, pid, BLOCK_M, IDS, EP)
    tl.store(out_ptr + pid, expert)


@pytest.mark.parametrize(
    "rows,experts,block_m",
    [(1, 4, 16), (37, 8, 16), (64, 128, 16), (256, 128, 16), (100, 3, 64), (50, 20, 16)],
)
def test_gemm1_prefetch_computes_the_alignments_block_experts(rows, experts, block_m):
    """GEMM1's early prefetch computes each block's expert from the row ids while the
    alignment runs: it must name the expert the alignment gives the block (-1 past the
    used blocks), with -1 ids and ids past E ignored as the alignment ignores them."""
    gen = torch.Generator().manual_seed(rows * experts)
    ids = torch.randint(-1, experts + 2, (rows,), generator=gen, dtype=torch.int32).to(DEVICE)
    cap = _align.max_padded_rows(rows, experts, block_m)
    s = torch.empty(cap, dtype=torch.int32, device=DEVICE)
    b = torch.empty(cap // block_m, dtype=torch.int32, device=DEVICE)
    n = torch.empty(1, dtype=torch.int32, device=DEVICE)
    _align.align_rows(ids, experts, block_m, s, b, n, options=OPTIONS)
    used = int(n) // block_m
    got = torch.empty(cap // block_m, dtype=torch.int32, device=DEVICE)
    _experts_of_blocks_kernel[(cap // block_m,)](
        ids, got, rows, experts, block_m, triton.next_power_of_2(rows),
        max(16, triton.next_power_of_2(experts)),
    )  # fmt: skip
    assert torch.equal(got[:used].cpu(), b[:used].cpu())
    assert (got[used:] == -1).all()


def test_early_prefetch_launch_values():
    """Steps a power of two within K (0 or a block without experts: off); the ids path off
    once its one-hot of rows x experts would pass the bound."""
    opts = TritonOptions(early_prefetch_steps=6)
    none = (O.EARLY_NONE, 1, 1, 1)
    assert O.early_prefetch(O.EARLY_FROM_BLOCKS, 23, 128, 64, opts) == (
        O.EARLY_FROM_BLOCKS, 4, 1, 1,
    )  # fmt: skip
    assert O.early_prefetch(O.EARLY_FROM_BLOCKS, 3, 128, 64, opts)[1] == 2
    assert O.early_prefetch(O.EARLY_FROM_IDS, 23, 128, 64, opts) == (
        O.EARLY_FROM_IDS, 4, 64, 128,
    )  # fmt: skip
    limit = O.EARLY_IDS_MAX_ELEMENTS
    assert O.early_prefetch(O.EARLY_FROM_IDS, 23, 128, limit // 128 + 1, opts) == none
    assert O.early_prefetch(O.EARLY_NONE, 23, 128, 64, opts) == none
    off = TritonOptions(early_prefetch_steps=0)
    assert O.early_prefetch(O.EARLY_FROM_BLOCKS, 23, 128, 64, off) == none
    with pytest.raises(ValueError, match="early_prefetch_steps"):
        TritonOptions(early_prefetch_steps=-1)
    with pytest.raises(ValueError, match="overlap_max_tokens"):
        TritonOptions(overlap_max_tokens=-1)
    with pytest.raises(TypeError, match="stream_gemms"):
        TritonOptions(stream_gemms=1)


def test_alignment_rejects_small_scratch():
    ids = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    s = torch.empty(64, dtype=torch.int32, device=DEVICE)
    b = torch.empty(4, dtype=torch.int32, device=DEVICE)
    n = torch.empty(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="scratch"):
        _align.align_rows(
            ids, 2, 16, s, b, n, torch.empty(3, dtype=torch.int32), 16, options=OPTIONS,
            single_program_max_rows=0,
        )  # fmt: skip


def test_topk_sum_skips_minus_one_and_out_of_range_slots():
    src = torch.randn(6, 40, device=DEVICE)
    ids = torch.tensor([[0, -1], [2, 1], [-1, 3]], dtype=torch.int32, device=DEVICE)
    out = torch.empty(3, 40, device=DEVICE)
    _align.topk_sum(src, ids, out, num_experts=3, options=OPTIONS)
    want = torch.stack([src[0], src[2] + src[3], torch.zeros(40, device=DEVICE)])
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("scheme", ["fp32", "fp8_block", "mxfp4", "int4_g32_zp"])
def test_row_blocks_equal_the_aligned_layout(scheme):
    """Row blocks (no alignment: one block per row, expert read from the ids, the layout of a
    single token, here forced for four tokens with a repeated expert) equal the aligned
    layout, and ids -1 or >= E contribute nothing."""
    torch.manual_seed(3)
    act = moerunner.Activation("silu")
    T, H, I, E, k = 4, 128, 96, 4, 3
    w13 = torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5
    w2 = torch.randn(E, H, I, device=DEVICE) / I**0.5
    if scheme != "fp32":
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    weights = ExpertWeights(w13, w2)
    prepared = TritonBackend().prepare_weights(weights, weights.spec(act))
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.tensor(
        [[0, 2, -1], [1, 1, 3], [3, E, 0], [2, 0, 1]], dtype=torch.int32, device=DEVICE
    )
    wts = torch.rand(T, k, device=DEVICE)
    as_rows = triton_pkg.with_options(prepared, TritonOptions(row_blocks_max_tokens=T))
    rows = experts.fused_standard(x, wts, ids, as_rows)
    as_aligned = triton_pkg.with_options(prepared, TritonOptions(row_blocks_max_tokens=0))
    aligned = experts.fused_standard(x, wts, torch.where(ids < E, ids, -1), as_aligned)
    assert _rel(rows, aligned) < 1e-6


@pytest.mark.parametrize(
    "scheme,activation,block_n",
    [
        ("fp32", "silu", 32),
        ("fp32", "swiglu_oai", 32),  # interleaved gate/up with biases
        ("fp8_channel", "relu2", 32),  # fp8 operands, per-row A scales after the loop
        ("int8", "silu", 32),  # int8 operands, int32 accumulator
        ("fp8_block", "silu", 32),  # block scales promoted per K step
        ("fp8_block", "silu", 128),  # GEMM1 quantizes GEMM2's input in its epilogue
    ],
)
def test_half_row_tiles_equal_whole_blocks(scheme, activation, block_n, monkeypatch):
    """Blocks whose second half is padding run a tile of half the rows (``SPLIT_M``); the
    result must equal the whole-block tiles. With 32-row blocks, experts of 45, 40, 3 and 16
    rows end in short blocks of 13, 8, 3 and 16 rows (the last: row 16 is the first padding
    row); 45 and 40 also have a full block before."""
    torch.manual_seed(6)
    act = moerunner.Activation(activation)
    H, I, E, k = 64, 128, 4, 2
    counts = [45, 40, 3, 16]
    slots = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    T = slots.numel() // k
    # Token t takes slots t and t + T of the expert-sorted list: always two experts.
    ids = torch.stack([slots[:T], slots[T:]], dim=1).to(DEVICE)
    assert (ids[:, 0] != ids[:, 1]).all()
    assert torch.bincount(ids.flatten().long(), minlength=E).tolist() == counts
    weights = random_experts(scheme, activation, E, H, I, DEVICE)
    fuse = block_n == 128
    options = TritonOptions(fuse_input_quant_off_gpu=fuse, split_min_block_m=32)
    prepared = TritonBackend(options).prepare_weights(weights, weights.spec(act))
    x = torch.randn(T, H, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    tile = tile_config.TileConfig(32, block_n, 64, 1, 4, 2)
    tiles = tile_config.MoeTiles(tile, tile)
    consts = prepared.tensors["w13"].constexprs
    assert experts.splits_blocks(32, consts, T * k / E, options=options)
    # Fresh workspaces: rows a wrong kernel skipped must not find an earlier case's values.
    experts.WORKSPACES.clear()
    split = experts.fused_standard(x, wts, ids, prepared, tiles).clone()
    whole_options = TritonOptions(fuse_input_quant_off_gpu=fuse, split_min_block_m=None)
    whole = experts.fused_standard(
        x, wts, ids, triton_pkg.with_options(prepared, whole_options), tiles
    )
    assert _rel(split, whole) < 1e-6
    assert _rel(split, _run("torch", x, weights, act, wts, ids)) < 1e-5


def test_half_row_tiles_only_where_they_pay():
    """Weight-only schemes decode every weight whatever the row count, and experts of many
    blocks have few short ones: both keep one tile (``split_min_block_m`` 128)."""
    consts = {
        s: _prepare.kernel_weight(moerunner.quantize(torch.randn(2, 64, 128), s)).constexprs
        for s in ("fp8_block", "int8", "mxfp4", "int4")
    }
    consts["bf16"] = _prepare.kernel_weight(torch.randn(2, 64, 128)).constexprs
    options = TritonOptions(split_min_block_m=128)

    def splits(block_m, scheme, rows_per_expert, row_blocks=False):
        return experts.splits_blocks(
            block_m, consts[scheme], rows_per_expert, row_blocks, options=options
        )

    assert splits(128, "bf16", 128)
    assert splits(128, "fp8_block", 512)
    assert not splits(128, "bf16", 4096)  # 32 blocks per expert
    assert not splits(64, "bf16", 128)
    assert not splits(128, "bf16", 128, row_blocks=True)
    assert not splits(128, "mxfp4", 128)
    assert not splits(128, "int4", 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("scheme", TRITON_QUANT_SCHEMES)
def test_quantized_schemes_match_torch_backend(scheme, activation, dtype):
    torch.manual_seed(1)
    act = moerunner.Activation(activation)
    T, H, I, E, k = 5, 128, 128, 4, 2
    n13 = 2 * I if act.gated else I
    w13 = moerunner.quantize(torch.randn(E, n13, H, device=DEVICE) / H**0.5, scheme)
    w2 = moerunner.quantize(torch.randn(E, H, I, device=DEVICE) / I**0.5, scheme)
    interleaved = activation == "swiglu_oai"
    b13 = torch.randn(E, n13, device=DEVICE) * 0.1 if interleaved else None
    b2 = torch.randn(E, H, device=DEVICE) * 0.1 if interleaved else None
    weights = ExpertWeights(w13, w2, b13, b2, interleaved)
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    ids[1, 0] = -1
    wts = torch.rand(T, k, device=DEVICE)
    out = _run("triton", x, weights, act, wts, ids)
    ref = _run("torch", x, weights, act, wts, ids)
    # fp32 end to end: equal up to accumulation order (activation quantization is shared).
    # fp16: both apply the activation to GEMM1's float32 output and round only its result to
    # fp16 before quantizing it for GEMM2, so the codes agree; what is left is where each
    # rounds GEMM2's output and the routing-weighted sum to fp16 (unit roundoff 4.9e-4),
    # measured up to 6e-4. Rounding GEMM1's output to fp16 first, as the torch backend once
    # did, moves codes of GEMM2's quantized input by a step: up to 1.2e-2 here.
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize(
    "activation,inter,block_n,uniform",
    [
        ("silu", 256, 64, True),  # gate rows and up rows each inside one 128-row scale block
        ("silu", 192, 64, False),  # up rows start at I = 192: tiles straddle two blocks
        ("silu", 256, 256, False),  # a 256-column tile spans two blocks
        ("swiglu_oai", 256, 64, True),  # interleaved: 128 weight rows per 64-column tile
        ("swiglu_oai", 256, 128, False),
        ("relu2", 192, 128, True),  # non-gated: output columns are weight rows
    ],
)
def test_block_fp8_scales_per_row_or_per_element(activation, inter, block_n, uniform):
    """Block-scaled fp8 scales each K step's product per A row when a tile's gate and up rows
    each lie in one 128-row weight-scale block, and per element otherwise; both must equal
    the torch backend, including tiles whose last columns are masked."""
    torch.manual_seed(4)
    act = moerunner.Activation(activation)
    T, H, E, k = 9, 256, 3, 2
    n13 = 2 * inter if act.gated else inter
    w13 = moerunner.quantize(torch.randn(E, n13, H, device=DEVICE) / H**0.5, "fp8_block")
    w2 = moerunner.quantize(torch.randn(E, H, inter, device=DEVICE) / inter**0.5, "fp8_block")
    weights = ExpertWeights(w13, w2, gate_up_interleaved=activation == "swiglu_oai")
    spec = weights.spec(act)
    prepared = triton_pkg.TritonBackend().prepare_weights(weights, spec)
    consts = prepared.tensors["w13"].constexprs
    assert (
        experts._uniform_block_scale(consts, block_n, inter, act.gated, spec.gate_up_interleaved)
        is uniform
    )
    tile = tile_config.TileConfig(16, block_n, 128, 1, 4, 2)
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    out = experts.fused_standard(x, wts, ids, prepared, tile_config.MoeTiles(tile, tile))
    ref = _run("torch", x, weights, act, wts, ids)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("block_k", [64, 256])
def test_block_fp8_k_steps_of_part_or_several_scale_groups(block_k):
    """A block-scaled fp8 K step may cover part of a 128-wide scale group or several groups
    (one MMA and promotion each); with K = 384 and I = 192 a 256-wide step ends in a group
    past K (scales load as 0) or a partial one. Both must equal the torch backend."""
    torch.manual_seed(6)
    act = moerunner.Activation("silu")
    T, H, inter, E, k = 9, 384, 192, 3, 2
    w13 = moerunner.quantize(torch.randn(E, 2 * inter, H, device=DEVICE) / H**0.5, "fp8_block")
    w2 = moerunner.quantize(torch.randn(E, H, inter, device=DEVICE) / inter**0.5, "fp8_block")
    weights = ExpertWeights(w13, w2)
    prepared = triton_pkg.TritonBackend().prepare_weights(weights, weights.spec(act))
    tile = tile_config.TileConfig(16, 64, block_k, 1, 4, 2)
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    out = experts.fused_standard(x, wts, ids, prepared, tile_config.MoeTiles(tile, tile))
    assert _rel(out, _run("torch", x, weights, act, wts, ids)) < 1e-5


def test_block_fp8_rejects_a_k_step_that_splits_groups_unevenly():
    """block_k 192 neither divides 128 nor is a multiple of it: a clear error, not a wrong sum
    (since tiles are checked when made, there: no K step that is not a power of two)."""
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        tile_config.TileConfig(16, 64, 192, 1, 4, 2)


@pytest.mark.parametrize("inter", [128, 192])
def test_gemm1_epilogue_quantizes_gemm2_input(inter):
    """fp8_block with a GEMM1 tile of whole 128-column groups: GEMM1 stores GEMM2's e4m3 input
    and scales itself (the last group partial at I = 192), and the result equals the unfused
    path's up to accumulation order (codes and scales bit for bit: test_triton_gpu.py)."""
    torch.manual_seed(5)
    act = moerunner.Activation("silu")
    T, H, E, k = 9, 256, 4, 2
    w13 = moerunner.quantize(torch.randn(E, 2 * inter, H, device=DEVICE) / H**0.5, "fp8_block")
    w2 = moerunner.quantize(torch.randn(E, H, inter, device=DEVICE) / inter**0.5, "fp8_block")
    weights = ExpertWeights(w13, w2)
    fusing = TritonOptions(fuse_input_quant_off_gpu=True)
    prepared = TritonBackend(fusing).prepare_weights(weights, weights.spec(act))
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    tiles = tile_config.MoeTiles(*[tile_config.TileConfig(16, 128, 128, 1, 4, 2)] * 2)
    assert experts.fuses_gemm2_input_quant(prepared.tensors["w2"], x, tiles.gemm1, fusing)
    fused = experts.fused_standard(x, wts, ids, prepared, tiles).clone()
    unfused = triton_pkg.with_options(prepared, TritonOptions(fuse_input_quant_off_gpu=False))
    plain = experts.fused_standard(x, wts, ids, unfused, tiles)
    assert _rel(fused, plain) < 1e-6
    assert _rel(plain, _run("torch", x, weights, act, wts, ids)) < 1e-5


def _activation_quant_case(fmt, rows, k):
    """Run the GPU-input quantization kernel and its PyTorch twin on one random input."""
    from moerunner.backends.triton._quant_kernel import quantize_rows
    from moerunner.quant import get_scheme, quantize_activation

    scheme = {"fp8_group128": "fp8_block", "fp8_token": "fp8_channel", "int8_token": "int8"}[fmt]
    x = torch.randn(rows, k, device=DEVICE) * torch.logspace(-1, 1, k, device=DEVICE)
    x[1] = 0.0  # an all-zero row takes scale 1
    qdtype = torch.int8 if fmt == "int8_token" else torch.float8_e4m3fn
    q = torch.empty(rows, k, dtype=qdtype, device=DEVICE)
    s = torch.empty((rows, -(-k // 128)) if fmt == "fp8_group128" else (rows,), device=DEVICE)
    quantize_rows(x, fmt, q, s, options=OPTIONS)
    ref = quantize_activation(x, get_scheme(scheme))
    return q, s, ref


@pytest.mark.parametrize(
    "fmt,rows,k",
    [
        ("fp8_group128", 9, 1100),
        ("fp8_group128", 3, 200),
        ("fp8_token", 5, 300),
        ("int8_token", 5, 300),
    ],
)
def test_activation_quant_kernel_matches_torch_twin(fmt, rows, k):
    """Scales bit for bit, tiles with partial rows and groups. The interpreter casts to e4m3
    without carrying a round-up into the exponent (124.9 -> 64, not 128) and flushes
    subnormals, so e4m3 codes are compared where neither applies; the GPU test compares all."""
    q, s, ref = _activation_quant_case(fmt, rows, k)
    assert torch.equal(s, ref.scale.float())
    got, want = q.cpu(), ref.data.cpu()
    if fmt == "int8_token" or not triton_pkg.interpreted():
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    mag = want.float().abs()
    power_of_two = torch.frexp(mag).mantissa == 0.5
    checked = ~power_of_two & (mag >= 2.0**-6)
    assert checked[mag > 0].float().mean() > 0.6  # most nonzero codes are compared
    assert torch.equal(got.view(torch.uint8)[checked], want.view(torch.uint8)[checked])


@pytest.mark.parametrize(("chunks", "prefetch"), [(1, True), (1, False), (2, True), (4, True)])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("scheme", PACKED_SCHEMES)
def test_packed_k_steps_of_several_chunks(scheme, activation, chunks, prefetch):
    """A K step may cover several chunks of the split layout; chunks starting at or past K
    are skipped. H = I = 96 is 1.5 chunks of 64 for the 32-groups (int4's group of 128 needs
    whole chunks of 128); fp32 throughout, against the torch backend's emulation. Steps of
    one chunk load their scale codes a step ahead (``prefetch``; the last step's prefetch
    lies past K) or in the step itself."""
    # e2m1 in the split layout too
    options = TritonOptions(scale_prefetch=prefetch, e2m1_layout="split")
    torch.manual_seed(3)
    act = moerunner.Activation(activation)
    size = 128 if scheme == "int4" else 96
    T, H, I, E, k = 7, size, size, 3, 2
    n13 = 2 * I if act.gated else I
    interleaved = activation == "swiglu_oai"
    weights = ExpertWeights(
        moerunner.quantize(torch.randn(E, n13, H, device=DEVICE) / H**0.5, scheme),
        moerunner.quantize(torch.randn(E, H, I, device=DEVICE) / I**0.5, scheme),
        torch.randn(E, n13, device=DEVICE) * 0.1 if interleaved else None,
        torch.randn(E, H, device=DEVICE) * 0.1 if interleaved else None,
        interleaved,
    )
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    ids[2, 1] = -1
    wts = torch.rand(T, k, device=DEVICE)
    prepared = TritonBackend(options).prepare_weights(weights, weights.spec(act))
    chunk = 2 * prepared.tensors["w13"].constexprs["HALF"]
    tile = tile_config.TileConfig(16, 32, chunks * chunk, 1, 4, 2)
    out = experts.fused_standard(x, wts, ids, prepared, tiles=tile_config.MoeTiles(tile, tile))
    assert _rel(out, _run("torch", x, weights, act, wts, ids)) < 1e-5


@pytest.mark.parametrize(
    ("scheme", "layout"),
    [("fp32", None), ("fp8_block", None), ("int4", "split"), ("mxfp4", "fragment")],
)
def test_padding_rows_masked_or_read_give_the_same_output(scheme, layout, monkeypatch):
    """``mask_padding_rows`` zero-fills the A rows of a block's padding instead of reading
    row 0; every A load path (plain, block-fp8 groups, split-layout halves, fragment layout)
    must give the output it gives unmasked, bit for bit, and match the torch backend. Three
    experts for 14 rows: each expert's block of 16 is mostly padding. Row 0 of the input is
    huge, so a padding row that leaked into a real one would show."""
    act = moerunner.Activation("silu")
    torch.manual_seed(11)
    T, H, I, E, k = 7, 128, 128, 3, 2
    scheme_name = None if scheme == "fp32" else scheme
    w13 = torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5
    w2 = torch.randn(E, H, I, device=DEVICE) / I**0.5
    if scheme_name is not None:
        w13, w2 = moerunner.quantize(w13, scheme_name), moerunner.quantize(w2, scheme_name)
    weights = ExpertWeights(w13, w2)
    x = torch.randn(T, H, device=DEVICE)
    x[0] *= 1e4
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1], [0, 1]], device=DEVICE)
    ids = ids.to(torch.int32)
    wts = torch.rand(T, k, device=DEVICE)
    extra = {"e2m1_layout": layout} if layout is not None else {}
    seen = []
    launch = experts._launch.launch

    def spy(kernel, grid, *args, **kw):
        if "MASK_ROWS" in kw:
            seen.append(kw["MASK_ROWS"])
        return launch(kernel, grid, *args, **kw)

    monkeypatch.setattr(experts._launch, "launch", spy)
    outs = []
    for masked in (True, False):
        options = TritonOptions(mask_padding_rows=masked, launch_cache=False, **extra)
        prepared = TritonBackend(options).prepare_weights(weights, weights.spec(act))
        tile = tile_config.TileConfig(16, 32, 128, 1, 4, 2)
        seen.clear()
        outs.append(
            experts.fused_standard(x, wts, ids, prepared, tiles=tile_config.MoeTiles(tile, tile))
        )
        assert seen == [masked, masked]  # both GEMMs launched with the option's value
    assert torch.equal(outs[0], outs[1])
    assert _rel(outs[0], _run("torch", x, weights, act, wts, ids)) < 1e-5


def test_merged_fp4_scale_only_for_small_e8m0_scales():
    """One bf16 multiply can carry both the fp4 decode's 2^126 and an e8m0 scale only when the
    scale is at most 2^1 (code 128); the flag is decided per weight when it is prepared."""
    w = moerunner.quantize(torch.randn(2, 8, 64, device=DEVICE), "mxfp4")
    assert _prepare.kernel_weight(w).constexprs["MERGED_SCALE"]
    w.scale.view(torch.uint8)[1, 3, 0] = 129
    assert not _prepare.kernel_weight(w).constexprs["MERGED_SCALE"]
    nv = moerunner.quantize(torch.randn(2, 8, 64, device=DEVICE), "nvfp4")
    assert not _prepare.kernel_weight(nv).constexprs["MERGED_SCALE"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "swiglu_oai"])
def test_plain_weights_grouped_core_matches_fused(dtype, activation):
    torch.manual_seed(2)
    act = moerunner.Activation(activation)
    T, H, I, E, k = 6, 64, 40, 4, 2
    weights = ExpertWeights(
        (torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5).to(dtype),
        (torch.randn(E, H, I, device=DEVICE) / I**0.5).to(dtype),
        torch.randn(E, 2 * I, device=DEVICE),
        torch.randn(E, H, device=DEVICE),
        gate_up_interleaved=activation == "swiglu_oai",
    )
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    fused = _run("triton", x, weights, act, wts, ids)
    permuted = _run("triton", x, weights, act, wts, ids, force_permute=True)
    ref = moerunner.reference_moe(x, weights, wts, ids, act)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert _rel(fused, ref) < tol and _rel(permuted, ref) < tol


def test_zero_tokens_launch_nothing_and_workspaces_are_reused():
    act = moerunner.Activation("silu")
    E, H, I = 4, 32, 16
    weights = ExpertWeights(
        torch.randn(E, 2 * I, H, device=DEVICE), torch.randn(E, H, I, device=DEVICE)
    )
    prepared = triton_pkg.TritonBackend().prepare_weights(weights, weights.spec(act))
    x0 = torch.empty(0, H, device=DEVICE)
    ids0 = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    before = len(experts.WORKSPACES.entries)
    out = experts.fused_standard(x0, torch.empty(0, 2, device=DEVICE), ids0, prepared)
    assert out.shape == (0, H) and len(experts.WORKSPACES.entries) == before
    x = torch.randn(3, H, device=DEVICE)
    ids = torch.randint(0, E, (3, 2), dtype=torch.int32, device=DEVICE)
    w = torch.rand(3, 2, device=DEVICE)
    experts.fused_standard(x, w, ids, prepared)
    after_first = {
        k: {n: t.data_ptr() for n, t in v.items()} for k, v in experts.WORKSPACES.entries.items()
    }
    experts.fused_standard(x, w, ids, prepared)
    after_second = {
        k: {n: t.data_ptr() for n, t in v.items()} for k, v in experts.WORKSPACES.entries.items()
    }
    assert after_first == after_second


def test_input_validation_names_the_argument():
    act = moerunner.Activation("silu")
    E, H, I = 4, 32, 16
    weights = ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    prepared = triton_pkg.TritonBackend().prepare_weights(weights, weights.spec(act))
    with pytest.raises(MoeInputError, match="hidden_states"):
        experts.fused_standard(
            torch.randn(3, H + 1), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32), prepared
        )
    with pytest.raises(MoeInputError, match="topk"):
        experts.fused_standard(
            torch.randn(3, H), torch.rand(3, 2), torch.zeros(4, 2, dtype=torch.int32), prepared
        )
    with pytest.raises(TypeError, match="hidden_states"):
        experts.fused_standard(
            torch.randn(3, H).half(),
            torch.rand(3, 2),
            torch.zeros(3, 2, dtype=torch.int32),
            prepared,
        )


def test_tile_files_round_trip_and_nearest_lookup(tmp_path):
    tiles = {
        1: tile_config.MoeTiles(
            tile_config.TileConfig(16, 32, 128, 1, 4, 4),
            tile_config.TileConfig(16, 64, 128, 1, 4, 3),
        ),
        512: tile_config.MoeTiles(
            tile_config.TileConfig(64, 128, 64, 8, 4, 3),
            tile_config.TileConfig(64, 128, 64, 8, 8, 3),
        ),
    }
    name = "NVIDIA H100 80GB HBM3"
    path = tmp_path / tile_config.config_file_name(8, 96, 64, "bf16", name)
    tile_config.write_config_file(path, 8, 96, 64, "bf16", name, tiles)
    assert json.loads(path.read_text())["schema"] == tile_config.SCHEMA
    got = tile_config.lookup_tiles(3, 2, 8, 96, 64, "bf16", name, tile_dirs=[tmp_path])
    assert got == tiles[1]
    got = tile_config.lookup_tiles(400, 2, 8, 96, 64, "bf16", name, tile_dirs=[tmp_path])
    assert got == tiles[512]
    fallback = tile_config.lookup_tiles(400, 2, 8, 96, 64, "bf16", "other", tile_dirs=[tmp_path])
    assert fallback == tile_config.heuristic_tiles(400, 2, 8, 96, 64, "bf16")
    with pytest.raises(ValueError, match="block_m"):
        tile_config.MoeTiles(tile_config.TileConfig(16, 32, 64), tile_config.TileConfig(32, 32, 64))


def test_shipped_tile_files_follow_the_schema():
    for path in tile_config.SHIPPED_DIR.glob("*.json"):
        doc = json.loads(path.read_text())
        assert doc["schema"] == tile_config.SCHEMA
        key = doc["key"]
        assert path.name == tile_config.config_file_name(
            key["E"], key["N"], key["K"], key["scheme"], key["device"], key.get("layout")
        )
        for entry in doc["by_tokens"].values():
            tile_config.MoeTiles.from_dict(entry)


@pytest.mark.parametrize(
    ("scheme", "k", "groups"),
    [("mxfp4", 96, 16), ("mxfp4", 512, 16), ("mxfp4", 576, 32), ("nvfp4", 96, 16),
     ("int4_g32", 96, 8), ("int4", 384, None)],
)  # fmt: skip
def test_packed_group_scales_are_padded_for_step_tiles(scheme, k, groups):
    """Group scales of packed weights in the split layout with one group per half are
    zero-padded to whole 16-byte rows of a multiple of 8 groups (what the kernel's per-step
    scale tiles read); int4's 128-groups span two halves and keep their shape."""
    w = moerunner.quantize(torch.randn(2, 8, k, device=DEVICE), scheme)
    kw = _prepare.kernel_weight(w, options=TritonOptions(e2m1_layout="split"))
    raw = _prepare._as_bytes(w.scale)
    if groups is None:
        assert kw.scale.shape == raw.shape and not _prepare.scale_tiles_ok(kw)
        return
    assert kw.scale.shape[-1] == groups and _prepare.scale_tiles_ok(kw)
    assert torch.equal(kw.scale[..., : raw.shape[-1]], raw)
    assert not kw.scale[..., raw.shape[-1] :].any()


@pytest.mark.parametrize("k,half", [(128, 16), (96, 32), (256, 64)])
def test_split_layout_keeps_every_nibble(k, half):
    """Byte j of chunk c holds k = c*2*half + j (low) and c*2*half + half + j (high)."""
    codes = torch.randint(0, 16, (2, 3, k), dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    split = _prepare.split_packed(packed, k, half)
    lo, hi = split & 0xF, split >> 4
    chunk = 2 * half
    for c in range(-(-k // chunk)):
        for j in range(half):
            for val, kk in ((lo, c * chunk + j), (hi, c * chunk + half + j)):
                want = codes[..., kk] if kk < k else torch.zeros_like(codes[..., 0])
                assert torch.equal(val[..., c * half + j], want)


@pytest.mark.parametrize("scheme", ["mxfp4", "int4_g32_zp"])
def test_packed_weights_with_a_partial_last_chunk(scheme):
    """K = 96 is one and a half chunks of the split layout (64 K elements per chunk): the
    last chunk's bytes hold real low nibbles beyond byte K / 2 and padding high nibbles."""
    torch.manual_seed(5)
    act = moerunner.Activation("silu")
    T, H, I, E, k = 5, 96, 96, 3, 2
    weights = ExpertWeights(
        moerunner.quantize(torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5, scheme),
        moerunner.quantize(torch.randn(E, H, I, device=DEVICE) / I**0.5, scheme),
    )
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    out = _run("triton", x, weights, act, wts, ids)
    # fp32 math on exactly dequantized weights: summation order only.
    assert _rel(out, moerunner.reference_moe(x, weights, wts, ids, act)) < 1e-5


def test_backend_declares_interpreter_bf16_limit():
    backend = triton_pkg.TritonBackend()
    problem = MoeProblem("cpu", torch.bfloat16, "bf16", "silu", "standard", 32, 16, 4)
    ok, reason = backend.supports(problem)
    if triton_pkg.interpreted():
        assert not ok and "interpreter" in reason


def _unplaced_bytes(storage: torch.Tensor) -> torch.Tensor:
    """Plain bytes of placed fragment words, from the documented rule: nibble ``nb`` of byte
    ``i`` is the value the decode puts in half ``i % 2`` of register ``2 nb + i // 2``, whose
    recipe (DS, DM) has its sign at bit 15 (31 for the high half) of the word rotated right by
    DS and its three other bits, low first, at bits 6-8 (22-24) of the word rotated by DM."""
    b = storage.to(torch.int64).reshape(-1, 4)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)

    def rotated(d):
        return ((word >> d) | (word << (32 - d))) & 0xFFFFFFFF

    plain = torch.zeros_like(b)
    for i in range(4):
        for nb in range(2):
            ds, dm = _weight_decode.E2M1_WORD_RECIPES[2 * nb + i // 2]
            half = 16 * (i % 2)
            code = (((rotated(ds) >> (15 + half)) & 1) << 3) | ((rotated(dm) >> (6 + half)) & 7)
            plain[:, i] |= code << (4 * nb)
    return plain.to(torch.uint8).reshape(storage.shape)


def _fragment_codes(storage: torch.Tensor, n: int, k: int, placed: bool) -> torch.Tensor:
    """Inverse of ``_prepare.fragment_packed`` written from its documented layout, element by
    element: storage row 8b + g, byte t*32 + a*4 + r*2 + j of chunk q holds weight row
    16b + 8r + g at k = 128q + 16a + 2t + j (low nibble) and k + 8 (high nibble), once each
    4-byte word's bits are read back from their placement (``_unplaced_bytes``) if
    ``placed``."""
    if placed:
        storage = _unplaced_bytes(storage)
    e, rows2, kp = storage.shape
    out = torch.full((e, 2 * rows2, kp), 255, dtype=torch.uint8)
    for b in range(rows2 // 8):
        for g in range(8):
            for q in range(kp // 128):
                for t in range(4):
                    for a in range(8):
                        for r in range(2):
                            for j in range(2):
                                byte = storage[:, 8 * b + g, 128 * q + 32 * t + 4 * a + 2 * r + j]
                                row, kk = 16 * b + 8 * r + g, 128 * q + 16 * a + 2 * t + j
                                out[:, row, kk] = byte & 0xF
                                out[:, row, kk + 8] = byte >> 4
    assert (out != 255).all()  # every (row, k) written once is checked by the comparison
    return out


@pytest.mark.parametrize("placed", [True, False])
@pytest.mark.parametrize("n,k,pairs", [(32, 128, False), (48, 160, True), (300, 96, False)])
def test_fragment_layout_keeps_every_nibble(n, k, pairs, placed):
    """The fragment layout holds every code of the packed weight at its documented place
    (words with their bits placed for the word decode, or plain bytes), rows in gate/up pair
    order when asked, and zeros in the row and K padding; ``unfragment_packed`` undoes it."""
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (2, n, k), dtype=torch.uint8, generator=gen)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    order = _prepare.gate_up_pair_order(n) if pairs else None
    storage = _prepare.fragment_packed(packed, k, order, placed)
    n_pad, k_pad = -(-n // 256) * 256, -(-k // 128) * 128
    assert storage.shape == (2, n_pad // 2, k_pad)
    back = _prepare.unfragment_packed(storage, n, k, order, placed)
    assert torch.equal(back, packed)
    got = _fragment_codes(storage, n, k, placed)
    want = codes if order is None else codes[:, order]
    if pairs:  # (gate c, up c): rows c and c + n / 2 of the stored weight
        assert torch.equal(want[:, 1], codes[:, n // 2]) and torch.equal(want[:, 2], codes[:, 1])
    assert torch.equal(got[:, :n, :k], want)
    assert not got[:, n:].any() and not got[:, :, k:].any()


def _run_ptx(asm: str, word: int) -> list:
    """The four outputs of a decode assembly (``_weight_decode``) on the 32-bit ``word``: its
    integer instructions computed, each bf16x2 FMA kept as a term ("fma", a, b, c) over the
    operands' names and values, so two decodes agree exactly when their outputs are equal."""
    mask = 0xFFFFFFFF
    regs = {"$4": word}

    def val(token):
        return regs.get(token, token) if token.startswith("$") else regs.get(token, None)

    for stmt in asm.replace("{", ";").replace("}", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *srcs = (a.strip() for a in rest.split(","))
        x = [int(a, 0) if a[0].isdigit() else val(a) for a in srcs]
        if op == "mov.b32":
            out = x[0]
        elif op == "and.b32":
            out = x[0] & x[1]
        elif op == "or.b32":
            out = x[0] | x[1]
        elif op == "shl.b32":
            out = (x[0] << x[1]) & mask
        elif op == "shr.b32":
            out = x[0] >> x[1]
        elif op == "shf.r.wrap.b32":  # low word of (b:a) >> n
            n = x[2] % 32
            out = ((x[0] >> n) | (x[1] << (32 - n))) & mask if n else x[0]
        elif op == "prmt.b32":  # bytes of {b, a}; selector nibble k picks output byte k
            pool = x[0] | (x[1] << 32)
            out = 0
            for k in range(4):
                sel = (x[2] >> (4 * k)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * k)
        elif op == "fma.rn.bf16x2":
            out = ("fma", *x)
        else:
            raise AssertionError(f"instruction {op} is not emulated")
        regs[dst] = out
    return [regs[f"${m}"] for m in range(4)]


@pytest.mark.parametrize("merged", [True, False])
def test_placed_word_decode_equals_the_byte_decode(merged):
    """The fragment layout's decode of a placed word (``_e2m1_word_asm``) gives every
    output the byte-local decode (``_e2m1_bf16_asm``) gives for the plain word, term for
    term, for 2000 random words and the all-zero and all-one words."""
    gen = torch.Generator().manual_seed(5)
    plain = torch.randint(0, 256, (2002, 4), dtype=torch.uint8, generator=gen)
    plain[0], plain[1] = 0, 255
    placed = _prepare._permute_word_bits(plain, _weight_decode.e2m1_word_bits())
    words = [int.from_bytes(bytes(row.tolist()), "little") for row in (plain, placed)[0]]
    placed_words = [int.from_bytes(bytes(row.tolist()), "little") for row in placed]
    byte_asm = _weight_decode._e2m1_bf16_asm(merged)
    word_asm = _weight_decode._e2m1_word_asm(merged)
    for w, p in zip(words, placed_words, strict=True):
        assert _run_ptx(word_asm, p) == _run_ptx(byte_asm, w), hex(w)

    def integer_ops(asm):
        lines = [line.strip() for line in asm.splitlines()]
        ops = ("shf.", "and.", "or.", "shl.", "shr.", "prmt.")
        return sum(line.startswith(ops) for line in lines)

    # 13 against 20 in PTX; ptxas fuses each (and, and, or) into two LOP3: 11 against ~15.
    assert integer_ops(word_asm) == 13 and integer_ops(byte_asm) == 20


def test_fragment_scales_follow_the_rows():
    """Scale codes in the fragment layout: the weight's row order, zero-padded rows and
    groups (whole 128-wide K chunks, then 16-byte rows, so each K step's scale tile is an
    aligned load the kernel's pipeline can copy)."""
    s = torch.randint(1, 255, (2, 6, 3), dtype=torch.uint8)
    order = _prepare.gate_up_pair_order(6)
    out = _prepare.fragment_scales(s, 96, 32, order)
    assert out.shape == (2, 256, 16) and out.stride(1) % 16 == 0
    assert _prepare.fragment_scales(s, 96 + 17 * 128, 32).shape[-1] == 80  # 18 chunks: 72 -> 80
    assert torch.equal(out[:, :6, :3], s[:, order]) and not out[:, 6:].any()
    assert not out[:, :, 3:].any()


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "relu2"])
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
def test_fragment_layout_matches_torch_backend(scheme, activation, block_n):
    """e2m1 weights in the fragment layout (``e2m1_layout``): tiles of 16 to 256 weight
    rows, gate rows then up rows (silu, stored as pairs), interleaved gate/up with biases
    (swiglu) and non-gated (relu2); H = 96 and I = 160 leave partial K chunks and row tiles,
    one id is -1. fp32 throughout, against the torch backend's emulation."""
    torch.manual_seed(block_n)
    act = moerunner.Activation(activation)
    T, H, I, E, k = 6, 96, 160, 3, 2
    n13 = 2 * I if act.gated else I
    inter = activation == "swiglu_oai"
    weights = ExpertWeights(
        moerunner.quantize(torch.randn(E, n13, H, device=DEVICE) / H**0.5, scheme),
        moerunner.quantize(torch.randn(E, H, I, device=DEVICE) / I**0.5, scheme),
        torch.randn(E, n13, device=DEVICE) * 0.1 if inter else None,
        torch.randn(E, H, device=DEVICE) * 0.1 if inter else None,
        inter,
    )
    backend = TritonBackend(TritonOptions(e2m1_layout="fragment"))
    prepared = backend.prepare_weights(weights, weights.spec(act))
    assert prepared.tensors["w13"].constexprs["FRAG"]
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    ids[3, 1] = -1
    wts = torch.rand(T, k, device=DEVICE)
    g1 = tile_config.TileConfig(16, block_n, 128, 1, 4, 2)
    g2 = tile_config.TileConfig(16, 2 * block_n, 64, 1, 4, 2)  # block_k: 128 is forced
    out = experts.fused_standard(x, wts, ids, prepared, tiles=tile_config.MoeTiles(g1, g2))
    assert _rel(out, _run("torch", x, weights, act, wts, ids)) < 1e-5


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
def test_placed_and_plain_words_give_the_same_output(scheme):
    """The fragment layout's words stored placed (``e2m1_placed_words=True``: off the GPU
    the kernel puts them back to plain bytes before decoding) and stored plain give bit-equal
    outputs on GPT-OSS-style tiles (interleaved gate/up, biases) of 32 and 128 weight rows."""
    act = moerunner.Activation("swiglu_oai")
    T, H, I, E, k = 5, 96, 64, 3, 2
    torch.manual_seed(3)
    weights = gpt_oss_experts(scheme, E, H, I, DEVICE)
    outs = []
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    g1 = tile_config.TileConfig(16, 64, 128, 1, 4, 2)
    g2 = tile_config.TileConfig(16, 32, 128, 1, 4, 2)
    for placed in (True, False):
        backend = TritonBackend(TritonOptions(e2m1_placed_words=placed))
        prepared = backend.prepare_weights(weights, weights.spec(act))
        assert prepared.tensors["w13"].layout.placed_words is placed
        tiles = tile_config.MoeTiles(g1, g2)
        outs.append(experts.fused_standard(x, wts, ids, prepared, tiles=tiles))
    assert torch.equal(outs[0], outs[1])
    assert _rel(outs[0], _run("torch", x, weights, act, wts, ids)) < 1e-5


def test_word_decode_is_chosen_per_tile_and_triton_version():
    """Placed words are stored with the Triton versions the GPU suite checked (or when the
    option forces it) and decoded as words only on tiles whose register layout was checked;
    elsewhere the kernel unplaces them first, and plain words take the byte decode."""
    import triton

    D = _weight_decode
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    assert D.placed_words_checked() is ((major, minor) in D.PLACED_WORDS_TRITON)
    assert _prepare.placed_words(TritonOptions()) is D.placed_words_checked()
    assert _prepare.placed_words(TritonOptions(e2m1_placed_words=False)) is False
    assert _prepare.placed_words(TritonOptions(e2m1_placed_words=True)) is True
    w = moerunner.quantize(torch.randn(2, 64, 128, device=DEVICE), "mxfp4")
    assert _prepare.kernel_weight(w).layout.placed_words is D.placed_words_checked()
    with pytest.raises(TypeError, match="e2m1_placed_words must be a bool"):
        TritonOptions(e2m1_placed_words="yes")
    assert D.e2m1_words(False, True, 64, 4) == D.WORDS_PLAIN
    assert D.e2m1_words(True, True, 64, 4) == D.WORDS_DECODE
    assert D.e2m1_words(True, True, 32, 8) == D.WORDS_DECODE
    assert D.e2m1_words(True, True, 32, 4) == D.WORDS_UNPLACE  # the layout that mixes words
    assert D.e2m1_words(True, False, 64, 4) == D.WORDS_UNPLACE  # off the GPU, fp16/fp32


def test_fragment_layout_rejects_a_tile_it_cannot_take():
    """A gated tile of 2 * 256 weight rows exceeds the layout's row padding: a clear error
    naming the limit, not an out-of-bounds read."""
    act = moerunner.Activation("silu")
    weights = ExpertWeights(
        moerunner.quantize(torch.randn(2, 64, 32, device=DEVICE), "mxfp4"),
        moerunner.quantize(torch.randn(2, 32, 32, device=DEVICE), "mxfp4"),
    )
    backend = TritonBackend(TritonOptions(e2m1_layout="fragment"))
    prepared = backend.prepare_weights(weights, weights.spec(act))
    tile = tile_config.TileConfig(16, 256, 128, 1, 4, 2)
    x = torch.randn(3, 32, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(MoeInputError, match="fragment layout.*512 rows"):
        experts.fused_standard(
            x, torch.ones(3, 1, device=DEVICE), ids, prepared,
            tiles=tile_config.MoeTiles(tile, tile),
        )  # fmt: skip


def test_fragment_layout_is_the_default_and_tunes_apart():
    """e2m1 weights are prepared in the fragment layout unless ``e2m1_layout`` is "split";
    fragment tiles are looked up under layout=fragment, and the tuner's candidates are the
    128-deep K steps that layout runs."""
    w = moerunner.quantize(torch.randn(2, 64, 128, device=DEVICE), "mxfp4")
    frag = _prepare.kernel_weight(w)
    assert frag.constexprs["FRAG"] and _prepare.weight_layout(frag) == "fragment"
    assert frag.layout.kind == "fragment"
    split = _prepare.kernel_weight(w, options=TritonOptions(e2m1_layout="split"))
    assert not split.constexprs["FRAG"] and _prepare.weight_layout(split) is None
    assert split.layout.kind == "split"
    assert not _prepare.kernel_weight(moerunner.quantize(w.dequantize(), "int4")).constexprs["FRAG"]
    name = tile_config.config_file_name(128, 2880, 2880, "mxfp4", "NVIDIA H200", "fragment")
    assert name == "E=128,N=2880,K=2880,scheme=mxfp4,layout=fragment,device=NVIDIA_H200.json"
    from moerunner.backends.triton import tune

    for t in (16, 4096):
        cands = tune.candidate_tiles(t, 4, 128, "mxfp4", "fragment")
        assert cands and all(c.block_k == 128 for c in cands)
        assert len(set(cands)) == len(cands)


def test_tune_command_passes_options_and_writes_to_the_user_folder(monkeypatch, tmp_path):
    """``moerunner tune --e2m1-layout`` hands the search a ``TritonOptions`` (no module
    switch), and by default writes into the user tile folder, never the package's."""
    from moerunner.backends.triton import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--preset", "gpt-oss-20b", "--scheme", "mxfp4"]) == 2  # needs a GPU
    with pytest.raises(SystemExit):
        tune.main(["--preset", "gpt-oss-20b", "--e2m1-layout", "marlin"])
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")  # file names
    monkeypatch.setattr(tune, "tune_preset", lambda *a, **kw: calls.append((a, kw)) or (None, {}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tune.main(["--preset", "gpt-oss-20b", "--scheme", "mxfp4", "--e2m1-layout", "split"])
    tune.main(["--preset", "gpt-oss-20b", "--scheme", "mxfp4", "--out", str(tmp_path / "x")])
    (args, kw), (args2, kw2) = calls
    assert kw["options"] == TritonOptions(e2m1_layout="split")
    assert args[7] == tmp_path / "moerunner" / "tiles" == tile_config.user_tile_dir()
    assert kw2["options"] == TritonOptions() and args2[7] == tmp_path / "x"


@pytest.mark.parametrize("row_blocks", [True, False])
@pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
def test_routing_in_the_callers_dtypes_is_read_as_given(weights_dtype, row_blocks):
    """transformers' routers give int64 ids and routing weights in the model's dtype; the
    triton kernels read both as given (``routing_dtypes``: no clamp, cast or widening launch
    per call). Same bits as the same routing converted first, ids beyond int32 skipped (a
    cast would wrap 2**32 + 1 into the good id 1), and within fp32's bound of the float64
    reference."""
    torch.manual_seed(5)
    T, H, I, E, k = 4, 64, 32, 4, 3
    w13 = torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5
    w2 = torch.randn(E, H, I, device=DEVICE) / I**0.5
    x = torch.randn(T, H, device=DEVICE)
    ids = torch.tensor(
        [[0, 2, -1], [1, 2**32 + 1, 3], [3, -(2**32) + 2, 0], [2, 0, 1]], device=DEVICE
    )
    wts = torch.rand(T, k, device=DEVICE).to(weights_dtype)
    assert ids.dtype == torch.int64
    options = TritonOptions(row_blocks_max_tokens=T if row_blocks else 0)
    triton_pkg.register(TritonBackend(options, name="triton-routing"), replace=True)
    call = dict(backend="triton-routing", check_ids=False)
    out = moerunner.fused_moe(x, w13, w2, wts, ids, **call)
    good = torch.where((ids >= 0) & (ids < E), ids, -1)
    converted = moerunner.fused_moe(x, w13, w2, wts.float(), good.int(), **call)
    assert torch.equal(out, converted)
    ref = moerunner.reference_moe(x, ExpertWeights(w13, w2), wts, good, "silu")
    moerunner.testing.assert_close(out, ref, moerunner.testing.DTYPE_BOUND[torch.float32])


def test_fused_moe_passes_routing_in_the_dtypes_a_fused_op_reads(monkeypatch):
    """``fused_moe`` hands a fused op with ``routing_dtypes`` the caller's tensors themselves;
    others (and dtypes outside the declared sets) get int32 ids and fp32 weights."""
    seen = []

    def spy(dispatch_output, prepared):
        seen.append(dispatch_output.topk)
        return torch.zeros_like(dispatch_output.hidden_states)

    spy.routing_dtypes = (frozenset({torch.int64}), frozenset({torch.bfloat16}))
    registry = moerunner.DEFAULT_REGISTRY
    variant = registry.backends["torch"].variant(name="spy-routing", fused_ops={"standard": spy})
    monkeypatch.setitem(registry.backends, "spy-routing", variant)
    x = torch.randn(2, 8)
    w13, w2 = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    ids = torch.tensor([[0, 2], [1, 0]])
    wts = torch.rand(2, 2).to(torch.bfloat16)
    moerunner.fused_moe(x, w13, w2, wts, ids, backend="spy-routing", check_ids=False)
    assert seen[-1].ids is ids and seen[-1].weights is wts
    moerunner.fused_moe(x, w13, w2, wts.half(), ids.int(), backend="spy-routing")
    assert seen[-1].ids.dtype == torch.int32 and seen[-1].weights.dtype == torch.float32
