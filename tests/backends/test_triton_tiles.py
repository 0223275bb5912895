"""The triton backend's default tiles (``tile_config.heuristic_tiles``), where no tuned file is.

The defaults must be tiles every launch accepts (``experts.launch_tile``: K blocks of
block-scaled fp8, scale groups, the fragment layout's tile rows), tiles the tuner itself
searches (``tune.candidate_tiles``), and agree with the tuned files shipped in ``configs/``
where those files agree with one another. Checked on the CPU: nothing here launches a kernel.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("moerunner.backends.triton")

from moerunner import Activation  # noqa: E402
from moerunner.backends.triton import TritonBackend, TritonOptions, tile_config, tune  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton._prepare import SUPPORTED_SCHEMES, weight_layout  # noqa: E402
from moerunner.bench.presets import PRESETS  # noqa: E402
from moerunner.quant.schemes import SCHEME_NAMES, get_scheme  # noqa: E402

E, TOP_K = 8, 2
# Token counts whose rows per expert (T * 2 / 8) fall in every band of every family:
# 1, 2.5, 4, 10, 14, 20, 40, 100, 150, 200, 300, 1000, 4096.
TOKENS = (1, 10, 16, 40, 56, 80, 160, 400, 600, 800, 1200, 4000, 16384)
SCHEMES = [n for n in SCHEME_NAMES if n in SUPPORTED_SCHEMES]


def _prepared(scheme: str, e2m1_layout: str | None, hidden: int = 256, inter: int = 256):
    """Random CPU weights prepared as the backend does (``e2m1_layout`` None: default)."""
    weights = tune.random_weights(hidden, inter, E, "silu", scheme, torch.device("cpu"))
    options = TritonOptions(e2m1_layout=e2m1_layout or "fragment", tile_dirs=())
    return TritonBackend(options).prepare_weights(weights, weights.spec(Activation("silu")))


def _no_group(tile: tile_config.TileConfig) -> tile_config.TileConfig:
    # GROUP_M only orders the launch of row blocks; the tuner's decode and mid-band
    # candidates differ in it alone.
    return dataclasses.replace(tile, group_m=1)


@pytest.mark.parametrize(
    ("scheme", "layout"),
    [
        (s, lay)
        for s in SCHEMES
        for lay in (("fragment", "split") if get_scheme(s).weight_format == "e2m1" else (None,))
    ],
)
def test_default_tiles_launch_on_every_scheme(scheme, layout):
    """Every band's default tiles pass the launch's tile constraints for both GEMMs, with H
    shorter than the decode K step (128), I not a power of two (384), and both longer (1024)."""
    for hidden, inter in ((128, 384), (1024, 1024)):
        prepared = _prepared(scheme, layout, hidden, inter)
        w13, w2 = prepared.tensors["w13"], prepared.tensors["w2"]
        source = prepared.tensors["tiles"]
        assert source.path is None  # off the GPU: the heuristic answers
        for t in TOKENS:
            tiles = source.lookup(t, TOP_K)
            assert tiles.gemm1.block_m == tiles.gemm2.block_m
            X.launch_tile(tiles.gemm1, dict(w13.constexprs), gated=True)
            X.launch_tile(tiles.gemm2, dict(w2.constexprs), gated=False)
            if w2.activation_format == "fp8_group128":  # GEMM1 quantizes GEMM2's input
                fused = dataclasses.replace(prepared.options, fuse_input_quant_off_gpu=True)
                x = torch.empty(1, hidden)
                assert X.fuses_gemm2_input_quant(w2, x, tiles.gemm1, fused)


@pytest.mark.parametrize(
    ("scheme", "layout"),
    [
        ("bf16", None),
        ("fp32", None),
        ("int8_w8a16", None),
        ("fp8_block", None),
        ("fp8_channel", None),
        ("int8", None),
        ("mxfp4", "fragment"),
        ("mxfp4", None),
        ("nvfp4", "fragment"),
        ("int4_g32", None),
    ],
)
def test_default_tiles_are_tuner_candidates(scheme, layout):
    """At every band the default is one of the tiles ``moerunner tune`` times for that call
    (GROUP_M aside), so a tuned file can only match or beat it (fp32, whose K steps are
    halved, only where its K step is one the tuner searches)."""
    dtype_bytes = {"bf16": 2, "fp32": 4, "int8_w8a16": 1}.get(scheme, 1)
    for t in TOKENS:
        cands = {_no_group(c) for c in tune.candidate_tiles(t, TOP_K, E, scheme, layout)}
        tiles = tile_config.heuristic_tiles(t, TOP_K, E, 2048, 4096, scheme, dtype_bytes)
        for tile in (tiles.gemm1, tiles.gemm2):
            if scheme == "fp32" and tile.block_k not in {c.block_k for c in cands}:
                continue
            assert _no_group(tile) in cands, (t, tile)


def _shipped():
    shapes = {(s.num_experts, s.intermediate_size, s.hidden_size): s for s in PRESETS.values()}
    for path in sorted(tile_config.SHIPPED_DIR.glob("*.json")):
        key = json.loads(path.read_text())["key"]
        shape = shapes[(key["E"], key["N"], key["K"])]
        dtype_bytes = 2 if key["scheme"] in ("bf16", "fp16") else 1
        for t, tiles in tile_config.load_config_file(str(path)).items():
            rpe = tile_config.rows_per_expert(t, shape.top_k, shape.num_experts)
            default = tile_config.heuristic_tiles(
                t, shape.top_k, key["E"], key["N"], key["K"], key["scheme"], dtype_bytes
            )
            yield key, rpe, tiles, default


def test_default_block_m_is_the_shipped_files():
    """BLOCK_M (the row band) is the tuner's at every entry of every shipped file except
    two kinds of entries: from 64 to 160 rows per expert the default takes 128-row blocks
    (the tuner's choice on unseen shapes and in the H200 files) where some H100 files kept
    64, and block-scaled fp8 files took 128-row blocks from 128 rows on where the default
    keeps 64-row ones whose GEMM1 quantizes GEMM2's input."""
    entries = list(_shipped())
    assert len(entries) >= 100  # every shipped file is read
    for key, rpe, tiles, default in entries:
        if tiles.gemm1.block_m == default.gemm1.block_m:
            continue
        what = (key["scheme"], key["device"], rpe, tiles.gemm1, default.gemm1)
        if 64 < rpe <= 160 and key["scheme"] in ("bf16", "fp16"):
            assert "H100" in key["device"], what
            assert (tiles.gemm1.block_m, default.gemm1.block_m) == (64, 128), what
        else:
            assert key["scheme"] == "fp8_block" and rpe >= 128, what
            assert (tiles.gemm1.block_m, default.gemm1.block_m) == (128, 64), what


def test_default_tiles_are_the_h100_files_where_compute_bound():
    """On the H100 from 160 rows per expert on (bf16) and from 32 to 128 rows (mxfp4 in the
    split layout), the tuned tiles are the default's but for the pipeline depth, which the
    tuner's files vary by one stage from T to T."""
    checked = 0
    for key, rpe, tiles, default in _shipped():
        if "H100" not in key["device"] or key.get("layout"):
            continue
        if (key["scheme"] == "bf16" and rpe > 160) or (
            key["scheme"] == "mxfp4" and 32 <= rpe <= 128
        ):
            for got, want in ((default.gemm1, tiles.gemm1), (default.gemm2, tiles.gemm2)):
                assert dataclasses.replace(_no_group(got), num_stages=1) == dataclasses.replace(
                    _no_group(want), num_stages=1
                ), (key, rpe)
            checked += 1
    assert checked >= 9  # bf16 and split-layout mxfp4 entries of the H100 files


def test_rows_per_expert_bands():
    """Bands key on rows per expert, T * k over the experts those rows can reach."""
    assert tile_config.rows_per_expert(1, 8, 128) == 1.0  # 8 experts, one row each
    assert tile_config.rows_per_expert(1024, 8, 64) == 128.0
    assert tile_config.rows_per_expert(0, 8, 64) == 1.0  # an empty batch takes decode tiles
    heur = tile_config.heuristic_tiles
    assert heur(1, 8, 64, 1024, 2048, "bf16").gemm1.block_m == 16
    assert heur(384, 8, 64, 1024, 2048, "bf16").gemm1.block_m == 64  # 48 rows per expert
    assert heur(504, 8, 64, 1024, 2048, "bf16").gemm1.block_m == 64  # 63
    assert heur(512, 8, 64, 1024, 2048, "bf16").gemm1.block_m == 128  # 64: half overflow 64
    assert heur(1024, 8, 64, 1024, 2048, "bf16").gemm1.block_m == 128  # 128
    assert heur(4096, 8, 64, 1024, 2048, "bf16").gemm1.block_m == 128
    # K steps no longer than K needs: GEMM1's K is H (96 -> 128), GEMM2's is I.
    small = heur(1, 2, 8, 64, 96, "bf16")
    assert (small.gemm1.block_k, small.gemm2.block_k) == (128, 64)
    # fp32 weights hold twice the bytes per element: half the K step of bf16.
    assert heur(1, 2, 8, 4096, 4096, "fp32", 4).gemm1.block_k == 128
    assert heur(1, 2, 8, 4096, 4096, "bf16", 2).gemm1.block_k == 256


def test_search_times_128_row_tiles_where_experts_overflow_64_rows():
    """The middle band's search also times 128-row tiles once many experts overflow one
    64-row block (from ``tune.MIN_RPE_128_ROWS`` rows per expert on): at exactly 64 rows per
    expert about half of them do (Mixtral-8x7B at T = 256, where such tiles won on an H200);
    at 32 rows per expert none is searched."""

    def block_ms(t, k, e):
        return {c.block_m for c in tune.candidate_tiles(t, k, e, "bf16")}

    assert tile_config.rows_per_expert(256, 2, 8) == 64.0
    assert 128 in block_ms(256, 2, 8)  # Mixtral-8x7B, T = 256
    assert 128 in block_ms(1024, 8, 128)  # Qwen3-30B-A3B, T = 1024
    assert tile_config.rows_per_expert(1024, 8, 256) == 32.0
    assert 128 not in block_ms(1024, 8, 256)  # DeepSeek-V3, T = 1024
    assert 128 not in block_ms(128 * tune.MIN_RPE_128_ROWS // 8, 8, 128)  # the bound itself


def test_prepared_layout_of_the_test_weights():
    """The launch test above covers both e2m1 layouts (the option re-lays e2m1 weights)."""
    assert weight_layout(_prepared("mxfp4", "fragment").tensors["w13"]) == "fragment"
    assert weight_layout(_prepared("mxfp4", "split").tensors["w13"]) is None


@pytest.mark.parametrize(
    ("experts", "top_k", "built"),
    [(256, 8, 16), (128, 8, 16), (60, 4, 17), (8, 2, 8), (16, 2, 16), (64, 32, 64)],
)
def test_compile_only_search_builds_few_experts_with_the_shapes_candidates(
    monkeypatch, tmp_path, experts, top_k, built
):
    """``moerunner tune --jobs``'s compile processes (``tune_preset(compile_only=True)``)
    build weights for at most 16 experts (17 where E is no multiple of 16, the property
    Triton specialises on; all where top_k needs more) instead of the whole layer, which ran
    an 80 GB H100 out of memory with DeepSeek-V3's; they still compile the candidates of the
    real expert count. The timed search builds every expert."""
    assert tune.compile_experts(experts, top_k) == built
    seen = []

    def fake_tune_tokens(prepared, t, k, candidates=None, progress=print, compile_only=False):
        seen.append((prepared.spec.num_experts, compile_only, candidates))
        return None, float("nan")

    monkeypatch.setattr(tune, "tune_tokens", fake_tune_tokens)
    tune.tune_preset(
        256, 128, experts, top_k, "silu", "bf16", [1, 64], tmp_path, compile_only=True,
        device="cpu",
    )  # fmt: skip
    w13 = _prepared("bf16", None, 256, 128).tensors["w13"]
    want = [tune.candidate_tiles(t, top_k, experts, "bf16", weight_layout(w13)) for t in (1, 64)]
    assert seen == [(built, True, want[0]), (built, True, want[1])]
    assert list(tmp_path.iterdir()) == []  # compiling writes no file


GPU_NAME = "NVIDIA H100 80GB HBM3"
GOOD_TILE = {"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4,
             "num_stages": 3}  # fmt: skip


def _tile_file(folder, body: object, key: dict | None = None) -> str:
    """A file named as the tuned file of E=8, N=128, K=256, bf16 on GPU_NAME in ``folder``,
    holding ``body`` (a str as is, else as JSON with the schema and ``key`` added)."""
    path = folder / tile_config.config_file_name(8, 128, 256, "bf16", GPU_NAME)
    if not isinstance(body, str):
        doc = {"schema": tile_config.SCHEMA, "key": key or {"E": 8, "N": 128, "K": 256,
               "scheme": "bf16", "device": GPU_NAME}, **body}  # fmt: skip
        body = json.dumps(doc)
    path.write_text(body)
    return str(path)


def _gemm2_with(**fields) -> dict:
    """A file body of one entry whose GEMM2 tile is GOOD_TILE with ``fields`` changed."""
    return {"by_tokens": {"16": {"gemm1": GOOD_TILE, "gemm2": {**GOOD_TILE, **fields}}}}


def _find(folder):
    return tile_config.find_tiles(8, 128, 256, "bf16", GPU_NAME, tile_dirs=[folder])


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("", "unreadable as JSON"),
        ("{not json", "unreadable as JSON"),
        ("[1, 2]", "top level is not a JSON object"),
        ({}, "'by_tokens' is missing"),
        ({"by_tokens": [1]}, "'by_tokens' is missing or not an object"),
        ({"by_tokens": {"abc": {}}}, "token count 'abc'"),
        ({"by_tokens": {"-4": {}}}, "token count '-4'"),
        ({"by_tokens": {"16": None}}, "entry '16'"),
        ({"by_tokens": {"16": {"gemm1": GOOD_TILE}}}, "'gemm1' and 'gemm2'"),
        (_gemm2_with(bogus=1), "unknown fields"),
        (_gemm2_with(block_n=-64), "block_n must be a power of two"),
        (_gemm2_with(block_n=48), "block_n must be a power of two"),
        (_gemm2_with(block_m=0), "block_m must be a power of two"),
        (_gemm2_with(num_warps=3), "num_warps must be a power of two"),
        (_gemm2_with(block_n=64.7), "block_n must be a power of two"),
        (_gemm2_with(num_stages=True), "num_stages must be a positive int"),
    ],
)
def test_a_broken_tile_file_is_refused_naming_it(tmp_path, body, why):
    """A user's tile file that moerunner cannot use raises one ValueError naming the file and
    what is wrong. Before: raw JSONDecodeError / KeyError / AttributeError / TypeError without
    the path, and tiles with a negative or non-power-of-two BLOCK_N loaded and launched (a
    negative one gave wrong results under the interpreter, silently); 64.7 read as 64."""
    path = _tile_file(tmp_path, body)
    with pytest.raises(ValueError, match="not a usable moerunner tile file") as info:
        _find(tmp_path)
    assert path in str(info.value) and why in str(info.value)


def test_a_tile_file_of_another_shape_is_refused(tmp_path):
    """A file under this shape's name whose key names another shape (copied or renamed by
    hand) is refused, not used for this shape; ``moerunner tune`` will not merge into it."""
    key = {"E": 64, "N": 128, "K": 256, "scheme": "mxfp4", "device": GPU_NAME}
    entry = {"gemm1": GOOD_TILE, "gemm2": GOOD_TILE}
    path = _tile_file(tmp_path, {"by_tokens": {"16": entry}}, key)
    with pytest.raises(ValueError, match="names another shape"):
        _find(tmp_path)
    with pytest.raises(ValueError, match="names another shape"):
        tune.check_mergeable(Path(path), tile_config.file_key(8, 128, 256, "bf16", GPU_NAME))


def test_an_edited_tile_file_is_read_again(tmp_path):
    """Tile files were cached by path for the process: weights prepared after a file was
    rewritten (a second ``moerunner tune`` in a notebook) kept the old tiles."""
    entry = {"gemm1": GOOD_TILE, "gemm2": GOOD_TILE}
    _tile_file(tmp_path, {"by_tokens": {"16": entry}})
    assert _find(tmp_path).table[16].gemm1.block_n == 64
    wider = {"gemm1": {**GOOD_TILE, "block_n": 128}, "gemm2": GOOD_TILE}
    _tile_file(tmp_path, {"by_tokens": {"16": wider, "64": wider}})
    assert _find(tmp_path).table[16].gemm1.block_n == 128


@pytest.mark.parametrize(
    "body",
    [
        {"by_tokens": {"16": None}},
        {"by_tokens": {}, "measured": []},
        {"by_tokens": {}, "measured": {"gemm_ms": {"x": 1.0}}},
    ],  # fmt: skip
)
def test_tune_refuses_a_broken_file_before_its_search(tmp_path, body):
    """``moerunner tune`` checks the file it will merge into before searching: a file with
    the schema marker but a broken body made ``merge_tuned`` fail after the whole search,
    losing its results."""
    path = Path(_tile_file(tmp_path, body))
    with pytest.raises(ValueError) as info:
        tune.check_mergeable(path, tile_config.file_key(8, 128, 256, "bf16", GPU_NAME))
    assert str(path) in str(info.value)
