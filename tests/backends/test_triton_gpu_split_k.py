"""Split K on a CUDA GPU (marker ``gpu``): ``TileConfig.split_k`` compiled for the GPU.

Split tiles must give the float64 reference's result within the format's bound, agree with
the unsplit tiles up to summation order, be deterministic (the same bits on every call and
graph replay, whichever program of a tile finishes last), and leave every count at zero.
Streaming GEMM1 -> GEMM2 counts split programs on both sides, and the fragment layout's early
prefetch starts at each program's own share of K: both are exercised with split tiles.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import gpu_experts, split_k_counts

pytest.importorskip("triton")

import moerunner  # noqa: E402
from moerunner.backends.triton import TritonBackend, TritonOptions  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles, TileConfig  # noqa: E402
from moerunner.testing import assert_close, error_bound  # noqa: E402

pytestmark = pytest.mark.gpu


def _split(tiles: MoeTiles, s1: int, s2: int) -> MoeTiles:
    return MoeTiles(
        dataclasses.replace(tiles.gemm1, split_k=s1), dataclasses.replace(tiles.gemm2, split_k=s2)
    )


def _counts_zero() -> bool:
    counts = split_k_counts(X.WORKSPACES)
    return bool(counts) and all(int(c.abs().sum()) == 0 for c in counts)


T128 = TileConfig(16, 128, 128, 1, 4, 3)


@pytest.mark.parametrize(
    ("scheme", "E", "H", "I", "k", "tile1", "tile2"),
    [
        # GPT-OSS K: 23 fragment chunks (shares of 12 + 11, 8 + 8 + 7, 6 x 3 + 5)
        ("mxfp4", 16, 2880, 2880, 4, TileConfig(16, 128, 128, 1, 8, 4), T128),
        ("bf16", 32, 1024, 768, 8, TileConfig(16, 64, 256, 1, 4, 4), T128),
        ("fp8_block", 16, 1024, 512, 8, T128, T128),
    ],
)
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("splits", [(2, 2), (3, 4), (1, 3)])
def test_split_k_matches_reference_and_is_deterministic(
    scheme, E, H, I, k, tile1, tile2, T, splits
):
    """T = 1 runs row blocks, T = 3 and 16 aligned rows that stream GEMM2 behind GEMM1."""
    dev = torch.device("cuda")
    torch.manual_seed(T + 10 * splits[0] + splits[1])
    weights, act = gpu_experts(scheme, E, H, I, dev)
    prepared = TritonBackend(TritonOptions()).prepare_weights(
        weights, weights.spec(moerunner.Activation(act))
    )
    x = torch.randn(T, H, device=dev).bfloat16()
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.int()
    if T > 1:
        ids[1, 0] = -1
    wts = torch.rand(T, k, device=dev)
    whole = MoeTiles(tile1, tile2)
    tiles = _split(whole, *splits)
    out = X.fused_standard(x, wts, ids, prepared, tiles)
    ref = moerunner.reference_moe(x, weights, wts, ids, act)
    quantizes = scheme == "fp8_block"
    assert_close(out, ref, error_bound(torch.bfloat16, quantizes), what=f"split {splits}")
    unsplit = X.fused_standard(x, wts, ids, prepared, whole)
    # Both round the same float32 sums (in another order) to bf16 and back through GEMM2.
    assert_close(out, unsplit, 2e-2, what="split against whole")
    assert _counts_zero()
    for _ in range(5):
        assert torch.equal(X.fused_standard(x, wts, ids, prepared, tiles), out)
    assert _counts_zero()


def test_split_k_graph_replays_with_fresh_inputs():
    """A captured split call replayed with new inputs equals eager calls on them, bit for
    bit, and leaves the counts at zero (they are not reset by anything the graph holds)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    E, H, I, k, T = 16, 2880, 2880, 4, 1
    weights, act = gpu_experts("mxfp4", E, H, I, dev)
    prepared = TritonBackend(TritonOptions()).prepare_weights(
        weights, weights.spec(moerunner.Activation(act))
    )
    tiles = MoeTiles(
        TileConfig(16, 128, 128, 1, 8, 4, split_k=2), TileConfig(16, 128, 128, 1, 4, 5, split_k=4)
    )
    x = torch.randn(T, H, device=dev).bfloat16()
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.int()
    wts = torch.rand(T, k, device=dev)
    X.fused_standard(x, wts, ids, prepared, tiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = X.fused_standard(x, wts, ids, prepared, tiles)
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.rand(T, E, device=dev).topk(k, dim=1).indices.int())
        wts.copy_(torch.rand_like(wts))
        graph.replay()
        eager = X.fused_standard(x, wts, ids, prepared, tiles)
        assert torch.equal(out, eager)
        assert _counts_zero()
