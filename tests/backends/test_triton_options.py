"""The triton backend's options (``TritonOptions``), weight layouts and tile folders.

Options are one frozen value given to ``TritonBackend(options=...)``; prepared weights carry
them to every launch, record their layout as a ``WeightLayout`` that undoes itself, and find
their tuned tiles in the user's folders before the shipped ones. Kernel runs are in the CPU
interpreter with tiny shapes (see test_triton.py).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import moerunner
from moerunner.weights import ExpertWeights

triton_pkg = pytest.importorskip("moerunner.backends.triton")

from moerunner.backends.triton import (  # noqa: E402
    TritonBackend,
    TritonOptions,
    WeightLayout,
    _prepare,
    register,
    tile_config,
    with_options,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = triton_pkg.interpreted() or torch.cuda.is_available()


def test_defaults_are_the_measured_switches():
    o = TritonOptions()
    assert (o.row_blocks_max_tokens, o.split_min_block_m, o.split_max_blocks_per_expert) == (
        1,
        128,
        4,
    )
    assert o.scale_prefetch and o.scale_tiles and o.fragment_async_mma and o.launch_cache
    assert o.pdl and not o.fuse_input_quant_off_gpu
    assert o.e2m1_layout == "fragment" and o.tile_dirs is None
    assert (
        TritonBackend().options == o and moerunner.DEFAULT_REGISTRY.backends["triton"].options == o
    )


def test_tile_dirs_expand_the_home_folder(tmp_path, monkeypatch):
    """``tile_dirs=("~/tiles",)`` names the user's folder (before: a folder literally named
    ``~`` under the working directory, never found, so the tiles in it were silently unused)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    o = TritonOptions(tile_dirs=("~/tiles", "plain"))
    assert o.tile_dirs == (str(tmp_path / "tiles"), "plain")


def test_options_are_frozen_hashable_and_rebuild_from_their_repr():
    o = TritonOptions(pdl=False, e2m1_layout="split", tile_dirs="tiles")
    assert o.tile_dirs == ("tiles",)
    assert eval(repr(o)) == o and repr(TritonOptions()) == "TritonOptions()"
    assert hash(o) == hash(TritonOptions(pdl=False, e2m1_layout="split", tile_dirs=["tiles"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.pdl = True
    assert dataclasses.replace(o, pdl=True).pdl


@pytest.mark.parametrize(
    "changes,error,field",
    [
        (dict(pdl=1), TypeError, "pdl"),
        (dict(scale_tiles="yes"), TypeError, "scale_tiles"),
        (dict(row_blocks_max_tokens=-1), ValueError, "row_blocks_max_tokens"),
        (dict(row_blocks_max_tokens=1.5), TypeError, "row_blocks_max_tokens"),
        (dict(split_min_block_m=True), TypeError, "split_min_block_m"),
        (dict(split_min_block_m=0), ValueError, "split_min_block_m"),
        (dict(split_max_blocks_per_expert=-2), ValueError, "split_max_blocks_per_expert"),
        (dict(e2m1_layout="marlin"), ValueError, "e2m1_layout"),
        (dict(e2m1_layout=None), TypeError, "e2m1_layout"),
        (dict(tile_dirs=3), TypeError, "tile_dirs"),
        (dict(tile_dirs=["a", 3]), TypeError, "tile_dirs"),
    ],
)
def test_bad_options_name_the_field(changes, error, field):
    with pytest.raises(error, match=f"TritonOptions.{field}"):
        TritonOptions(**changes)


def test_backend_and_with_options_check_their_arguments():
    with pytest.raises(TypeError, match="options must be a TritonOptions"):
        TritonBackend(options={"pdl": False})
    with pytest.raises(TypeError, match="name"):
        TritonBackend(name="")
    with pytest.raises(TypeError, match="TritonBackend"):
        register(moerunner.DEFAULT_REGISTRY.backends["torch"])
    act = moerunner.Activation("silu")
    weights = ExpertWeights(torch.randn(2, 64, 32), torch.randn(2, 32, 32))
    prepared = TritonBackend().prepare_weights(weights, weights.spec(act))
    assert prepared.options == TritonOptions()
    faster = with_options(prepared, TritonOptions(pdl=False))
    assert faster.options.pdl is False and faster.tensors is prepared.tensors
    with pytest.raises(ValueError, match="prepare time"):
        with_options(prepared, TritonOptions(e2m1_layout="split"))
    with pytest.raises(TypeError, match="TritonOptions"):
        with_options(prepared, None)


# --------------------------------------------------------------------------------------------
# Weight layouts: values with their inverse.


@pytest.mark.parametrize("k,half", [(128, 16), (96, 32), (256, 64), (64, 64)])
def test_split_layout_round_trips(k, half):
    gen = torch.Generator().manual_seed(k + half)
    packed = torch.randint(0, 256, (3, 5, k // 2), dtype=torch.uint8, generator=gen)
    layout = WeightLayout("split", 5, k, half=half)
    data, _ = layout.apply(packed, None)
    assert torch.equal(layout.invert(data, None)[0], packed)


@pytest.mark.parametrize("n,k,pairs", [(32, 128, False), (48, 160, True), (300, 96, False)])
def test_fragment_layout_round_trips(n, k, pairs):
    gen = torch.Generator().manual_seed(n * k)
    packed = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 255, (2, n, -(-k // 32)), dtype=torch.uint8, generator=gen)
    layout = WeightLayout("fragment", n, k, group_k=32, gate_up_pairs=pairs)
    data, laid_scale = layout.apply(packed, scale)
    assert data.shape == (2, -(-n // 256) * 128, -(-k // 128) * 128)
    back, back_scale = layout.invert(data, laid_scale)
    assert torch.equal(back, packed) and torch.equal(back_scale, scale)


@pytest.mark.parametrize("layout", ["fragment", "split"])
@pytest.mark.parametrize(
    "scheme", ["mxfp4", "nvfp4", "int4", "int4_g32", "int4_g64_zp", "fp8_block", "bf16"]
)
@pytest.mark.parametrize("pairs", [False, True])
def test_prepared_weights_record_their_layout_and_undo_it(scheme, layout, pairs):
    """Each prepared weight says how it was re-laid; undoing it gives back the canonical
    packed bytes and scale codes (8-bit scales as bytes) exactly."""
    w = torch.randn(3, 64, 384 if scheme.startswith("int4") else 96)
    if scheme != "bf16":
        w = moerunner.quantize(w, scheme)
    kw = _prepare.kernel_weight(w, pairs, TritonOptions(e2m1_layout=layout))
    packed = scheme.startswith(("mxfp4", "nvfp4", "int4"))
    e2m1 = scheme.startswith(("mxfp4", "nvfp4"))
    want = (layout if e2m1 else "split") if packed else "stored"
    assert kw.layout.kind == want
    assert kw.constexprs["FRAG"] == (want == "fragment")
    assert kw.layout.tile_key == ("fragment" if want == "fragment" else None)
    data, scale = kw.layout.invert(kw.data, kw.scale)
    if scheme == "bf16":
        assert torch.equal(data, w) and scale is None
        return
    assert torch.equal(data.view(torch.uint8), w.data.view(torch.uint8))
    assert torch.equal(scale, _prepare._as_bytes(w.scale))


def test_layout_kind_is_checked():
    with pytest.raises(ValueError, match="kind"):
        WeightLayout("swizzled")


# --------------------------------------------------------------------------------------------
# Tile folders: the user's first, then the shipped files.

SHIPPED = ("E=128,N=768,K=2048,scheme=bf16,device=NVIDIA_H100_80GB_HBM3.json", 128, 768, 2048)


def test_user_tile_folder_follows_the_cache_convention(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tile_config.user_tile_dir() == tmp_path / "moerunner" / "tiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tile_config.user_tile_dir() == tmp_path / "home" / ".cache" / "moerunner" / "tiles"


def test_tuned_tiles_in_the_user_folder_come_before_the_shipped(monkeypatch, tmp_path):
    name, e, n, k = SHIPPED
    device = "NVIDIA H100 80GB HBM3"
    assert (tile_config.SHIPPED_DIR / name).is_file()
    mine = tile_config.MoeTiles(*[tile_config.TileConfig(16, 32, 64, 1, 4, 2)] * 2)
    user = tmp_path / "moerunner" / "tiles"
    user.mkdir(parents=True)
    tile_config.write_config_file(user / name, e, n, k, "bf16", device, {1: mine})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    found = tile_config.find_tiles(e, n, k, "bf16", device)  # tile_dirs None: the user folder
    assert found.path == user / name and found.lookup(1, 8) == mine
    assert found.describe() == str(user / name)
    shipped = tile_config.find_tiles(e, n, k, "bf16", device, tile_dirs=())
    assert shipped.path == tile_config.SHIPPED_DIR / name and shipped.lookup(1, 8) != mine
    other = tile_config.find_tiles(e, n, k, "bf16", device, tile_dirs=[tmp_path / "none"])
    assert other.path == shipped.path
    off_gpu = tile_config.find_tiles(e, n, k, "bf16", None)
    assert off_gpu.path is None and "heuristic" in off_gpu.describe()
    assert off_gpu.lookup(1, 8) == tile_config.heuristic_tiles(1, 8, e, n, k, "bf16")


@pytest.fixture
def variant():
    """A triton backend with its own options registered under its own name (removed after)."""
    registry = moerunner.DEFAULT_REGISTRY
    name = "triton-test-variant"
    yield name
    registry.backends.pop(name, None)
    registry._selections.clear()


@pytest.mark.skipif(not RUNS, reason="triton backend cannot run here")
def test_a_registered_variant_runs_with_its_options(variant, caplog):
    """``register(TritonBackend(options, name=...))`` makes the options selectable by name in
    every entry point; its prepared weights carry them, the weights' cache keeps variants
    apart, and the choice and the tiles are logged at debug level."""
    torch.manual_seed(0)
    T, H, I, E, k = 5, 96, 96, 3, 2
    act = moerunner.Activation("silu")
    w13 = moerunner.quantize(torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5, "mxfp4")
    w2 = moerunner.quantize(torch.randn(E, H, I, device=DEVICE) / I**0.5, "mxfp4")
    x = torch.randn(T, H, device=DEVICE)
    wts = torch.rand(T, k, device=DEVICE)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    split = TritonOptions(e2m1_layout="split", tile_dirs=())
    register(TritonBackend(split, name=variant))
    with caplog.at_level(logging.DEBUG, logger="moerunner"):
        out = moerunner.fused_moe(x, w13, w2, wts, ids, activation=act, backend=variant)
    from moerunner.runner import _CACHE_ATTR

    (prepared,) = getattr(w13, _CACHE_ATTR).values()
    assert prepared.backend == variant and prepared.options == split
    assert prepared.tensors["w13"].layout.kind == "split"
    assert any("tiles: heuristic" in note for note in prepared.notes)
    logged = caplog.text
    assert variant in logged and "selected" in logged and "tiles:" in logged
    ref = moerunner.reference_moe(x, ExpertWeights(w13, w2), wts, ids, act)
    assert ((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-5
    # The same name with other options prepares again (the cache is keyed on the options).
    with pytest.raises(ValueError, match="already registered"):
        register(TritonBackend(TritonOptions(tile_dirs=()), name=variant))
    register(TritonBackend(TritonOptions(tile_dirs=()), name=variant), replace=True)
    again = moerunner.fused_moe(x, w13, w2, wts, ids, activation=act, backend=variant)
    forms = list(getattr(w13, _CACHE_ATTR).values())  # both kept, newest last
    assert len(forms) == 2
    prepared = forms[-1]
    assert prepared.tensors["w13"].layout.kind == "fragment"
    assert ((again.double() - ref.double()).norm() / ref.double().norm()) < 1e-5


@pytest.mark.skipif(not RUNS, reason="needs CUDA or the Triton interpreter")
@pytest.mark.parametrize("tokens", [1, 40])
def test_min_group_m_orders_programs_without_changing_bits(tokens, monkeypatch):
    """``min_group_m`` only reorders the GEMM's programs (each output tile is one program's):
    the outputs are bit-identical to GROUP_M 1, and within the float32 bound of the float64
    reference. Aligned rows launch with at least ``min_group_m``; row blocks (one token) keep
    the tile's own GROUP_M."""
    from moerunner.backends.triton import _launch, experts
    from moerunner.reference import reference_moe
    from moerunner.testing import DTYPE_BOUND, assert_close

    E, H, I, k = 6, 64, 32, 2
    gen = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(DEVICE)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(DEVICE)
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    ids = ids.to(torch.int32).to(DEVICE)
    wts = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(DEVICE)
    weights = ExpertWeights(w13, w2)
    spec = weights.spec(moerunner.Activation("silu"))
    group_ms = []
    launch = _launch.launch

    def spy(kernel, grid, *args, **kw):
        if "GROUP_M" in kw:
            group_ms.append(kw["GROUP_M"])
        return launch(kernel, grid, *args, **kw)

    monkeypatch.setattr(experts._launch, "launch", spy)
    outs = {}
    for least in (1, 8):
        options = TritonOptions(min_group_m=least, launch_cache=False)
        prepared = TritonBackend(options).prepare_weights(weights, spec)
        tiles = tile_config.MoeTiles(
            tile_config.TileConfig(16, 32, 64, 1, 4, 2), tile_config.TileConfig(16, 32, 64, 1, 4, 2)
        )
        group_ms.clear()
        outs[least] = experts.fused_standard(x, wts, ids, prepared, tiles).clone()
        row_blocks = tokens <= options.row_blocks_max_tokens
        assert group_ms == [1 if row_blocks else least] * 2, group_ms
    assert torch.equal(outs[1], outs[8])
    ref = reference_moe(x, weights, wts, ids)
    assert_close(outs[8], ref, DTYPE_BOUND[torch.float32])


def test_min_group_m_is_checked():
    with pytest.raises(ValueError, match="min_group_m"):
        TritonOptions(min_group_m=0)
    with pytest.raises(TypeError, match="min_group_m"):
        TritonOptions(min_group_m=8.0)


def test_every_option_is_in_the_architecture_table():
    """docs/architecture.md's table of ``TritonOptions`` names every field with its default
    (one list of the knobs a reader can trust)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    for f in dataclasses.fields(TritonOptions):
        assert f.name in rows, f"TritonOptions.{f.name} is missing from the table"
        default = f.default
        want = f'`"{default}"`' if isinstance(default, str) else str(default)
        assert rows[f.name] == want, (f.name, rows[f.name], want)
