"""First-call tile tuning (``TritonOptions(autotune="first_call")``, ``autotune.py``).

A call whose token bucket has no tuned entry times a few tuner candidates once, keeps the
winner in the prepared weights and in the first tile folder (the schema ``moerunner tune``
writes), and never times under ``torch.compile`` tracing or CUDA-graph capture. On the CPU
kernels run in the interpreter with tiny fp16 shapes and the times come from a timer passed
in (the interpreter's times mean nothing); the GPU test checks capture.
"""

from __future__ import annotations

import json

import pytest
import torch

import moerunner
from moerunner.testing import assert_close, error_bound
from moerunner.weights import ExpertWeights

triton_pkg = pytest.importorskip("moerunner.backends.triton")

from moerunner.backends.triton import (  # noqa: E402
    TritonBackend,
    TritonOptions,
    autotune,
    tile_config,
    tune,
)
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton._prepare import weight_layout  # noqa: E402

RUNS = triton_pkg.interpreted() or torch.cuda.is_available()
E, H, I, K = 4, 64, 64, 2
ACT = moerunner.Activation("silu")


def _weights(device="cpu"):
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).to(device=device, dtype=torch.float16)
    w2 = (torch.randn(E, H, I) / I**0.5).to(device=device, dtype=torch.float16)
    return ExpertWeights(w13, w2)


def _prepared(tile_dirs, device="cpu"):
    options = TritonOptions(autotune="first_call", tile_dirs=tile_dirs)
    weights = _weights(device)
    return weights, TritonBackend(options).prepare_weights(weights, weights.spec(ACT))


class FakeTimer:
    """Milliseconds by call order: 1.0, except the calls in ``fast`` (0.5). Records calls."""

    def __init__(self, fast=()):
        self.fast, self.calls = set(fast), 0

    def __call__(self, fn, graph):
        self.calls += 1
        return 0.5 if self.calls - 1 in self.fast else 1.0


def _never(fn, graph):
    raise AssertionError("timed where it must not")


def test_options_accept_the_autotune_modes():
    assert TritonOptions().autotune == "off"
    opts = TritonOptions(autotune="first_call")
    assert eval(repr(opts), {"TritonOptions": TritonOptions}) == opts
    with pytest.raises(ValueError, match="autotune must be one of off, first_call"):
        TritonOptions(autotune="always")
    with pytest.raises(TypeError, match="autotune must be a str"):
        TritonOptions(autotune=True)


def test_token_buckets_are_the_tuners_token_counts():
    assert [autotune.token_bucket(t) for t in (0, 1, 8, 9, 40, 41, 3000, 10**6)] == [
        1, 1, 1, 16, 16, 64, 4096, 16384,
    ]  # fmt: skip
    assert set(map(autotune.token_bucket, range(20000))) <= set(tune.DEFAULT_TOKENS)


@pytest.mark.skipif(not RUNS, reason="triton backend cannot run here")
def test_first_call_tunes_caches_and_reloads(tmp_path):
    weights, prepared = _prepared((str(tmp_path),))
    dev = torch.device("cpu")
    w13 = prepared.tensors["w13"]
    scheme = prepared.tensors["tiles"].scheme
    default = tile_config.heuristic_tiles(1, K, E, I, H, scheme, 2)
    cands = tune.limited_candidates(
        tune.candidate_tiles(1, K, E, scheme, weight_layout(w13)),
        autotune.QUICK_CANDIDATES,
        (default.gemm1, default.gemm2),
    )
    assert len(cands) > 2 and cands[0] == default.gemm1
    last = len(cands) - 1  # the last candidate's GEMM1 and GEMM2 are the fast ones
    timer = FakeTimer(fast=(2 * last, 2 * last + 1))
    got = autotune.tiles_for_call(prepared, 3, K, dev, timer=timer)
    assert got == tile_config.MoeTiles(cands[last], cands[last])
    assert timer.calls == 2 * len(cands)  # every candidate timed once per GEMM
    # Cached: same bucket (T = 1..8), no timing; the file holds it in the tuner's schema.
    assert autotune.tiles_for_call(prepared, 8, K, dev, timer=_never) == got
    (path,) = tmp_path.iterdir()
    assert path.name == tile_config.config_file_name(E, I, H, scheme, "cpu")
    assert tile_config.is_tile_file(path)
    assert json.loads(path.read_text())["by_tokens"].keys() == {"1"}
    assert prepared.tensors["tiles"].path == path
    # Reloaded where prepare looks files up (keyed by device name; off the GPU prepare
    # itself takes the heuristic, so the lookup is asked for the name the file carries).
    found = tile_config.find_tiles(E, I, H, scheme, "cpu", 2, None, tile_dirs=[tmp_path])
    assert found.path == path and found.lookup(3, K) == got
    # A new bucket is tuned on its first call and merged into the same file.
    timer16 = FakeTimer(fast=(0, 1))
    got16 = autotune.tiles_for_call(prepared, 16, K, dev, timer=timer16)
    assert timer16.calls > 0 and got16.gemm1 == got16.gemm2
    assert json.loads(path.read_text())["by_tokens"].keys() == {"1", "16"}
    # The call runs with the cached tiles and is right (fp16 against the float64 reference).
    x = torch.randn(3, H, dtype=torch.float16)
    wts = torch.rand(3, K)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    out = X.fused_standard(x, wts, ids, prepared)
    ref = moerunner.reference_moe(x, weights, wts, ids, ACT)
    assert_close(out, ref, error_bound(torch.float16, False), what="first-call tiles")


@pytest.mark.skipif(not RUNS, reason="triton backend cannot run here")
def test_first_call_keeps_in_memory_only_without_a_folder():
    """``tile_dirs=()`` (shipped files only): the tuned tiles stay with the weights."""
    _, prepared = _prepared(())
    got = autotune.tiles_for_call(prepared, 1, K, torch.device("cpu"), timer=FakeTimer())
    source = prepared.tensors["tiles"]
    assert source.path is None and source.table == {1: got}


def test_first_call_never_times_while_tracing(tmp_path, monkeypatch):
    """Under torch.compile tracing the default tiles answer and nothing is written; so on
    the CPU without a timer (the runtime path there)."""
    _, prepared = _prepared((str(tmp_path),))
    dev = torch.device("cpu")
    default = tile_config.heuristic_tiles(5, K, E, I, H, prepared.tensors["tiles"].scheme, 2)
    assert autotune.tiles_for_call(prepared, 5, K, dev) == default  # no timer off the GPU
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not autotune.may_time(dev)
    assert autotune.tiles_for_call(prepared, 5, K, dev, timer=_never) == default
    assert list(tmp_path.iterdir()) == [] and prepared.tensors["tiles"].table is None


def test_off_takes_the_lookup():
    weights = _weights()
    prepared = TritonBackend(TritonOptions(tile_dirs=())).prepare_weights(
        weights, weights.spec(ACT)
    )
    got = autotune.tiles_for_call(prepared, 300, K, torch.device("cpu"), timer=_never)
    assert got == prepared.tensors["tiles"].lookup(300, K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_first_call_skips_timing_under_cuda_graph_capture(tmp_path):
    """Captured calls take the default tiles and write nothing; the next eager call of the
    bucket tunes it (real timing) and the file appears."""
    weights, prepared = _prepared((str(tmp_path),), "cuda")
    x = torch.randn(3, H, dtype=torch.float16, device="cuda")
    wts = torch.rand(3, K, device="cuda")
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device="cuda")
    X.fused_standard(x, wts, ids, prepared)
    assert len(list(tmp_path.iterdir())) == 1  # the eager first call tuned bucket 1
    x16 = torch.randn(16, H, dtype=torch.float16, device="cuda")
    wts16 = torch.rand(16, K, device="cuda")
    ids16 = torch.randint(0, E, (16, K), dtype=torch.int32, device="cuda")
    before = dict(prepared.tensors["tiles"].table)
    scheme = prepared.tensors["tiles"].scheme
    default = tile_config.heuristic_tiles(16, K, E, I, H, scheme, 2)
    X.fused_standard(x16, wts16, ids16, prepared, default)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            out = X.fused_standard(x16, wts16, ids16, prepared)
    graph.replay()
    torch.cuda.synchronize()
    assert prepared.tensors["tiles"].table == before  # bucket 16 not tuned under capture
    ref = moerunner.reference_moe(x16, weights, wts16, ids16, ACT)
    assert_close(out, ref, error_bound(torch.float16, False), what="captured")
    X.fused_standard(x16, wts16, ids16, prepared)
    assert 16 in prepared.tensors["tiles"].table
