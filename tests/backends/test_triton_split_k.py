"""Split K in the triton backend's grouped GEMM (``TileConfig.split_k``), in the CPU interpreter.

A split tile runs as several programs, each over a share of the K steps; the last one to
finish sums the partial sums in a fixed order and runs the epilogue. Checked here: the
result against the float64 reference (each scheme's bound) and against the unsplit tile (the
same products summed in another order), uneven shares, row blocks and aligned rows, every
weight path of the K loop (plain, block-scaled fp8, the int8 MMA, packed 4-bit in the split
layout, e2m1 in the fragment layout), the counts back at zero after each call, and how many
programs a tile gets. GPU runs: test_triton_gpu_split_k.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import random_experts, split_k_counts

import moerunner
from moerunner.quant import get_scheme
from moerunner.testing import assert_close, error_bound

triton_pkg = pytest.importorskip("moerunner.backends.triton")

from moerunner.backends.triton import (  # noqa: E402
    TritonBackend,
    TritonOptions,
    _split_k,
    experts,
    tile_config,
)

if not triton_pkg.interpreted() and not torch.cuda.is_available():
    pytest.skip("triton backend cannot run here", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(scheme, activation, E, H, I, seed):
    torch.manual_seed(seed)
    return random_experts(scheme, activation, E, H, I, DEVICE), moerunner.Activation(activation)


# (scheme, activation, H, I, block_k): K = H for GEMM1 and I for GEMM2; every case has
# K steps that do not divide evenly among 3 programs.
CASES = [
    ("fp32", "silu", 320, 192, 64),  # plain weights: 5 and 3 K steps
    ("fp8_block", "silu", 640, 384, 128),  # block scales promoted per K step
    ("int8", "relu2", 320, 192, 64),  # the int8 MMA: int32 partial sums
    ("int4_g32_zp", "swiglu_oai", 320, 192, 64),  # split layout, codes fetched a step ahead
    ("mxfp4", "swiglu_oai", 640, 384, 128),  # fragment layout, biases
]


@pytest.mark.parametrize("tokens", [1, 7], ids=["row_blocks", "aligned"])
@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_split_k_matches_reference_and_unsplit_tile(case, split_k, tokens):
    scheme, activation, H, I, block_k = case
    E, k = 4, 2
    weights, act = _weights(scheme, activation, E, H, I, seed=split_k + tokens)
    prepared = TritonBackend(TritonOptions()).prepare_weights(weights, weights.spec(act))
    x = torch.randn(tokens, H, device=DEVICE)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(tokens)]).to(torch.int32)
    ids = ids.to(DEVICE)
    if tokens > 1:
        ids[2, 1] = -1  # a skipped slot
    wts = torch.rand(tokens, k, device=DEVICE)
    g1 = tile_config.TileConfig(16, 32, block_k, 1, 4, 2)
    g2 = tile_config.TileConfig(16, 64, block_k, 1, 4, 2)
    split = tile_config.MoeTiles(
        tile_config.TileConfig(**{**g1.to_dict(), "split_k": split_k}),
        tile_config.TileConfig(**{**g2.to_dict(), "split_k": split_k}),
    )
    out = experts.fused_standard(x, wts, ids, prepared, tiles=split)
    quantizes = scheme != "fp32" and get_scheme(scheme).activation_format != "none"
    ref = moerunner.reference_moe(x, weights, wts, ids, act)
    assert_close(out, ref, error_bound(torch.float32, quantizes), what=f"split_k {split_k}")
    # The unsplit tile adds the same products in another order.
    whole = experts.fused_standard(x, wts, ids, prepared, tiles=tile_config.MoeTiles(g1, g2))
    assert_close(out, whole, 1e-5, what="split against whole")
    # Counts are back at zero, so a second call computes the same, bit for bit.
    counts = split_k_counts(experts.WORKSPACES)
    assert counts and all(int(c.abs().sum()) == 0 for c in counts)
    again = experts.fused_standard(x, wts, ids, prepared, tiles=split)
    assert torch.equal(out, again)


@pytest.mark.parametrize(
    "split_k,k_steps,programs",
    [(1, 9, 1), (2, 9, 2), (4, 23, 4), (4, 5, 3), (3, 2, 2), (8, 8, 8), (6, 7, 4), (5, 1, 1)],
)
def test_split_k_never_leaves_a_program_without_k_steps(split_k, k_steps, programs):
    """Shares are ceil(k_steps / programs) steps, the last the rest: the count is lowered
    until the last share is not empty (the kernel relies on it)."""
    got = _split_k.split_k_steps(split_k, k_steps)
    assert got == programs
    share = -(-k_steps // got)
    assert (got - 1) * share < k_steps


def test_split_k_tile_field_round_trips_and_is_checked():
    tile = tile_config.TileConfig(16, 64, 128, 1, 4, 4, split_k=2)
    assert tile_config.TileConfig.from_dict(tile.to_dict()) == tile
    # Files written before the field leave it to the launcher, and such tiles write as before.
    plain = tile_config.TileConfig(16, 64, 128, 1, 4, 4)
    assert plain.split_k is None and "split_k" not in plain.to_dict()
    assert tile_config.TileConfig.from_dict(plain.to_dict()) == plain
    assert tile_config.TileConfig.from_dict({**plain.to_dict(), "split_k": None}) == plain
    with pytest.raises(ValueError, match="split_k must be None or at least 1"):
        tile_config.TileConfig(16, 64, 128, split_k=0)


def test_split_k_keeps_counts_apart_per_gemm():
    """GEMM2 may run beside GEMM1 under PDL, so the two take different split workspaces."""
    weights, act = _weights("fp32", "silu", 2, 320, 192, seed=3)
    prepared = TritonBackend(TritonOptions()).prepare_weights(weights, weights.spec(act))
    tile = tile_config.TileConfig(16, 64, 64, 1, 4, 2, split_k=2)
    x = torch.randn(1, 320, device=DEVICE)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    experts.WORKSPACES.clear()
    experts.fused_standard(
        x, torch.rand(1, 2, device=DEVICE), ids, prepared, tiles=tile_config.MoeTiles(tile, tile)
    )
    slots = {k[3] for k in experts.WORKSPACES.entries if k[2:3] == ("split_k",)}
    assert slots == {0, 1}


def test_split_k_rejects_a_bad_tile_file():
    """A user tile file asking for split_k 0 is a clear error naming the field."""
    with pytest.raises(ValueError, match="split_k"):
        tile_config.MoeTiles.from_dict(
            {"gemm1": {"block_m": 16, "block_n": 64, "block_k": 64, "split_k": 0},
             "gemm2": {"block_m": 16, "block_n": 64, "block_k": 64}}
        )  # fmt: skip


@pytest.mark.parametrize(
    "tiles,k_steps,expected",
    [
        # GPT-OSS-120B mxfp4 GEMM2 on 132 SMs (8 programs per SM wanted, 23 K steps, >= 4 each)
        (92, 23, 5),  # T = 1 (4 experts x 23 column tiles)
        (184, 23, 5),  # T = 2
        (300, 23, 3),
        (368, 23, 1),  # T = 4: two programs per tile are not worth it
        (736, 23, 1),  # T = 8
        (20, 9, 1),  # too few K steps to share three ways
        (20, 12, 3),
        (20, 13, 3),  # shares of 5, 5, 3
    ],
)
def test_split_k_rule_fills_the_gpu_at_decode(tiles, k_steps, expected):
    frag = {"FRAG": True}
    tile = tile_config.TileConfig(16, 128, 128, 1, 4, 4)
    options = TritonOptions()
    assert _split_k.split_k_for(tile, frag, tiles, k_steps, 132, options) == expected
    # A GEMM with an activation epilogue (GEMM1) is split only by its tile's own split_k.
    assert _split_k.split_k_for(tile, frag, tiles, k_steps, 132, options, True) == 1


def test_split_k_rule_applies_only_where_it_was_measured():
    """Only e2m1 weights in the fragment layout, 16-row tiles, on a GPU, with the option on;
    a tile's own split_k always wins (capped at the K steps)."""
    tile = tile_config.TileConfig(16, 128, 128, 1, 4, 4)
    on = TritonOptions()
    assert _split_k.split_k_for(tile, {"FRAG": False}, 92, 23, 132, on) == 1  # bf16, fp8, ...
    assert _split_k.split_k_for(tile, {"FRAG": True}, 92, 23, None, on) == 1  # not a GPU
    wide = tile_config.TileConfig(32, 128, 128, 1, 4, 4)
    assert _split_k.split_k_for(wide, {"FRAG": True}, 92, 23, 132, on) == 1
    off = TritonOptions(decode_split_programs=0)
    assert _split_k.split_k_for(tile, {"FRAG": True}, 92, 23, 132, off) == 1
    own = tile_config.TileConfig(16, 128, 128, 1, 4, 4, split_k=3)
    assert _split_k.split_k_for(own, {"FRAG": False}, 500, 23, None, off) == 3
    capped = tile_config.TileConfig(16, 128, 128, 1, 4, 4, split_k=8)
    assert _split_k.split_k_for(capped, {"FRAG": True}, 92, 23, 132, on) == 8
    assert _split_k.split_k_for(capped, {"FRAG": True}, 92, 5, 132, on) == 5


def test_split_k_is_not_taken_where_the_partial_sums_would_be_large():
    """A tile file pinning split_k at a large T (its nearest entry) runs unsplit rather than
    allocate gigabytes of partial sums; at decode sizes the pinned split stands."""
    tile = tile_config.TileConfig(128, 128, 64, 8, 8, 3, split_k=2)
    options = TritonOptions()
    # Mixtral-8x7B GEMM1 at T = 16384: ~264 row blocks x 112 column tiles.
    assert _split_k.split_k_for(tile, {"FRAG": False}, 264 * 112, 64, 132, options) == 1
    small = tile_config.TileConfig(16, 64, 128, 1, 4, 4, split_k=2)
    assert _split_k.split_k_for(small, {"FRAG": True}, 32 * 45, 23, 132, options) == 2


class _Timer:
    """Milliseconds by call order: 1.0, except the calls in ``fast`` (0.5)."""

    def __init__(self, fast):
        self.fast, self.calls = set(fast), 0

    def __call__(self, fn, graph):
        self.calls += 1
        return 0.5 if self.calls - 1 in self.fast else 1.0


@pytest.mark.parametrize("split_call_faster", [True, False])
def test_tuner_keeps_a_split_only_if_the_whole_call_is_faster(split_call_faster):
    """The search times GEMM by GEMM; a winner that pins split K is then timed as a whole
    call against the same tiles with split_k left to the launcher, and loses to them unless
    faster (timer calls: 0-3 the two candidates' GEMMs, 4 the split call, 5 the other)."""
    from moerunner.backends.triton import tune

    weights, act = _weights("fp32", "silu", 4, 128, 64, seed=1)
    prepared = TritonBackend(TritonOptions()).prepare_weights(weights, weights.spec(act))
    split = tile_config.TileConfig(16, 32, 64, 1, 4, 2, split_k=2)
    plain = tile_config.TileConfig(16, 64, 64, 1, 4, 2)
    timer = _Timer({0, 1, 4 if split_call_faster else 5})
    lines = []
    tiles, ms = tune.tune_tokens(prepared, 1, 2, [split, plain], progress=lines.append, timer=timer)
    assert timer.calls == 6 and any("whole call" in line for line in lines)
    if split_call_faster:
        assert tiles == tile_config.MoeTiles(split, split)
    else:
        unset = tile_config.TileConfig(16, 32, 64, 1, 4, 2)
        assert tiles == tile_config.MoeTiles(unset, unset)


def test_lookup_keeps_a_pinned_split_only_up_to_its_bucket():
    """A tuned entry's split_k is kept for calls of at most its token count; a larger call
    nearest to it has more tiles, and takes the entry's tiles with split_k left to the
    launcher (its rule, ``split_k_for``). The shipped GPT-OSS-120B mxfp4 H100 file pins
    splits at T = 4: T = 3 and 4 keep them, T = 5 and 6 do not."""
    g1 = tile_config.TileConfig(16, 64, 128, 1, 4, 4, split_k=3)
    g2 = tile_config.TileConfig(16, 128, 128, 1, 4, 4, split_k=4)
    plain = tile_config.TileConfig(16, 64, 128, 1, 4, 4)
    table = {
        2: tile_config.MoeTiles(plain, plain),
        4: tile_config.MoeTiles(g1, g2),
        16: tile_config.MoeTiles(plain, plain),
    }
    source = tile_config.TileSource(8, 256, 256, "mxfp4", table=table)
    assert source.lookup(4, 2) == table[4]
    assert source.lookup(3, 2) == table[2]  # a tie goes to the smaller entry
    for tokens in (5, 6, 7):
        got = source.lookup(tokens, 2)
        assert (got.gemm1.split_k, got.gemm2.split_k) == (None, None)
        assert got == tile_config.MoeTiles(plain, dataclasses.replace(g2, split_k=None))
    assert table[2].unpinned() is table[2]
    path = tile_config.SHIPPED_DIR / (
        "E=128,N=2880,K=2880,scheme=mxfp4,layout=fragment,device=NVIDIA_H100_80GB_HBM3.json"
    )
    shipped = tile_config.TileSource(
        128, 2880, 2880, "mxfp4", path=path, table=tile_config.load_config_file(str(path))
    )
    assert shipped.lookup(4, 4).gemm2.split_k == 4
    assert shipped.lookup(6, 4).gemm2.split_k is None
