"""GEMM1 -> GEMM2 streaming and the early L2 prefetch on a CUDA GPU (marker ``gpu``).

``TritonOptions.stream_gemms`` lets GEMM2 start a block of rows once GEMM1 has counted that
block's tiles done; ``early_prefetch_steps`` makes fragment-layout GEMMs warm L2 before they
wait. Neither may change a bit of the output: every case here compares the switches on
against both off on the same prepared weights and tiles (the defaults themselves are checked
against the float64 reference by the rest of the GPU suite). Streaming is also checked
where a wrong count would show: many calls in a row and graph replays with fresh inputs
(the counts must return to zero after each call), tiles whose GEMMs have different numbers
of column blocks, -1 ids and empty blocks, and a GEMM2 launch that fails after GEMM1 ran.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import gpu_experts

pytest.importorskip("triton")

import moerunner  # noqa: E402
from moerunner.backends.triton import TritonBackend, TritonOptions, with_options  # noqa: E402
from moerunner.backends.triton import _overlap as O  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles, TileConfig  # noqa: E402

pytestmark = pytest.mark.gpu

OFF = TritonOptions(stream_gemms=False, early_prefetch_steps=0)
ON = TritonOptions(stream_gemms=True, early_prefetch_steps=4)


def _prepare(scheme, E, H, I, dev):
    weights, act = gpu_experts(scheme, E, H, I, dev)
    on = TritonBackend(ON).prepare_weights(weights, weights.spec(moerunner.Activation(act)))
    return on, with_options(on, OFF)


def _inputs(T, H, E, k, dev, minus_one=False):
    x = torch.randn(T, H, device=dev).bfloat16()
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.int()
    if minus_one:
        ids = torch.where(torch.rand(ids.shape, device=dev) < 0.3, -1, ids)
    wts = torch.rand(T, k, device=dev)
    return x, wts, ids


def _block_done(prepared, x, ids, tiles=None):
    """The streaming counts of the workspace a call of these shapes uses."""
    num_rows = ids.numel()
    _, ws, _ = X.sequence_workspace(x, num_rows, ids.shape[1], prepared, tiles)
    return ws["block_done"]


@pytest.mark.parametrize(
    ("scheme", "E", "H", "I", "k"),
    [
        ("mxfp4", 32, 2880, 2880, 4),  # GPT-OSS K: 23 fragment chunks
        ("bf16", 64, 512, 384, 8),
        ("fp8_block", 32, 512, 256, 8),  # GEMM1 quantizes GEMM2's input in its epilogue
        ("fp8_channel", 16, 256, 256, 2),  # a quantization launch between: no streaming
    ],
)
@pytest.mark.parametrize("T", [2, 16, 64, 300])
def test_streaming_and_prefetch_are_bit_identical(scheme, E, H, I, k, T):
    dev = torch.device("cuda")
    torch.manual_seed(T + E)
    on, off = _prepare(scheme, E, H, I, dev)
    for minus_one in (False, True):
        for _ in range(3):  # repeated calls: the counts must be back at zero each time
            x, wts, ids = _inputs(T, H, E, k, dev, minus_one)
            got = X.fused_standard(x, wts, ids, on)
            want = X.fused_standard(x, wts, ids, off)
            assert torch.equal(got, want), (scheme, T, minus_one)
    assert not _block_done(on, x, ids).any()


@pytest.mark.parametrize(
    "gemm1,gemm2",
    [
        (TileConfig(16, 32, 128, 1, 4, 3), TileConfig(16, 256, 128, 1, 8, 3)),
        (TileConfig(16, 128, 128, 8, 8, 3), TileConfig(16, 16, 128, 1, 4, 3)),
        (TileConfig(64, 64, 128, 8, 4, 3), TileConfig(64, 128, 128, 8, 4, 3)),
    ],
)
def test_streaming_with_unequal_column_blocks(gemm1, gemm2):
    """GEMM2 waits for GEMM1's column blocks per row block, whatever each GEMM's own count."""
    dev = torch.device("cuda")
    torch.manual_seed(gemm1.block_n + gemm2.block_n)
    E, H, I, T, k = 16, 2880, 2880, 40, 4
    on, off = _prepare("mxfp4", E, H, I, dev)
    tiles = MoeTiles(gemm1, gemm2)
    for _ in range(3):
        x, wts, ids = _inputs(T, H, E, k, dev)
        got = X.fused_standard(x, wts, ids, on, tiles)
        want = X.fused_standard(x, wts, ids, off, tiles)
        assert torch.equal(got, want)
    assert not _block_done(on, x, ids, tiles).any()


def test_streaming_under_graph_replay():
    """One captured call replayed over fresh inputs copied in: each replay equals an eager
    call without streaming, and the counts are zero after the last."""
    dev = torch.device("cuda")
    torch.manual_seed(3)
    E, H, I, T, k = 32, 1024, 768, 24, 4
    on, off = _prepare("mxfp4", E, H, I, dev)
    x, wts, ids = _inputs(T, H, E, k, dev)
    X.fused_standard(x, wts, ids, on)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        X.fused_standard(x, wts, ids, on)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = X.fused_standard(x, wts, ids, on)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        nx, nw, ni = _inputs(T, H, E, k, dev)
        x.copy_(nx)
        wts.copy_(nw)
        ids.copy_(ni)
        graph.replay()
        want = X.fused_standard(x, wts, ids, off)
        assert torch.equal(out, want)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        assert not _block_done(on, x, ids).any()


def test_failed_gemm2_launch_leaves_no_counts(monkeypatch):
    """GEMM1 ran and counted its blocks, GEMM2's launch raised: the counts are reset, so
    the next call's GEMM2 does not start on stale counts."""
    dev = torch.device("cuda")
    torch.manual_seed(4)
    E, H, I, T, k = 16, 512, 256, 32, 4
    on, off = _prepare("bf16", E, H, I, dev)
    x, wts, ids = _inputs(T, H, E, k, dev)
    real = X._launch_gemm
    calls = []

    def gemm2_fails(*args, **kwargs):
        calls.append(kwargs.get("stream"))
        if kwargs.get("stream") == O.STREAM_CONSUME:
            raise RuntimeError("launch failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(X, "_launch_gemm", gemm2_fails)
    with pytest.raises(RuntimeError, match="launch failed"):
        X.fused_standard(x, wts, ids, on)
    assert calls == [O.STREAM_PUBLISH, O.STREAM_CONSUME]
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert not _block_done(on, x, ids).any()
    x, wts, ids = _inputs(T, H, E, k, dev)
    assert torch.equal(X.fused_standard(x, wts, ids, on), X.fused_standard(x, wts, ids, off))


@pytest.mark.parametrize(
    ("scheme", "streams"),
    [("mxfp4", True), ("bf16", True), ("fp8_block", True), ("fp8_channel", False)],
)
def test_which_calls_stream(scheme, streams, monkeypatch):
    """Aligned rows stream unless a quantization launch separates the GEMMs; row blocks
    (one token), calls past ``overlap_max_tokens`` and the switch turned off never do."""
    dev = torch.device("cuda")
    E, H, I, k = 16, 256, 256, 4
    on, off = _prepare(scheme, E, H, I, dev)
    real = X._launch_gemm
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("stream", O.STREAM_NONE))
        return real(*args, **kwargs)

    monkeypatch.setattr(X, "_launch_gemm", spy)
    short = with_options(on, dataclasses.replace(ON, overlap_max_tokens=4))
    cases = ((8, on, streams), (1, on, False), (8, off, False), (8, short, False))
    for T, prepared, want in cases:
        seen.clear()
        x, wts, ids = _inputs(T, H, E, k, dev)
        X.run_kernel_sequence(
            x, ids.view(-1), k, wts.view(-1), prepared, torch.empty(T * k, H, device=dev).bfloat16()
        )
        expect = [O.STREAM_PUBLISH, O.STREAM_CONSUME] if want else [O.STREAM_NONE] * 2
        assert seen == expect, (T, prepared.options)
