"""Backends accept schemes by their fields, not their names; both weights' schemes count.

Custom ``QuantScheme`` values with the fields of a supported scheme run; mixed w13/w2 schemes
run where a backend computes each GEMM in its own scheme (torch) and are refused with a reason
elsewhere (triton); the tile heuristic keys on the MMA operand type.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moerunner
from moerunner.backends.base import Capabilities, MoeProblem, SchemeSupport
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.errors import MoeInputError
from moerunner.quant import SCHEME_NAMES, QuantScheme, get_scheme
from moerunner.routing import TopK
from moerunner.testing import assert_close, error_bound
from moerunner.weights import ExpertWeights

triton_pkg = pytest.importorskip("moerunner.backends.triton")
from moerunner.backends.triton import _prepare, tile_config  # noqa: E402

RUNS_TRITON = triton_pkg.interpreted() or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT = moerunner.Activation("silu")


def _weights(w13_scheme, w2_scheme, hidden=128, inter=128, experts=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return ExpertWeights(
        moerunner.quantize(w13, w13_scheme).to(DEVICE),
        moerunner.quantize(w2, w2_scheme).to(DEVICE),
    )


def _call(backend, weights, tokens=6, top_k=2):
    gen = torch.Generator().manual_seed(1)
    e, _, h = weights.w13.shape
    x = torch.randn(tokens, h, generator=gen).to(DEVICE)
    ids = torch.randint(0, e, (tokens, top_k), generator=gen, dtype=torch.int32).to(DEVICE)
    wts = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    runner = moerunner.MoeRunner(backend)
    spec = weights.spec(ACT)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    out = runner.run(StandardDispatchOutput(x, TopK(wts, ids)), prepared)
    return out, moerunner.reference_moe(x, weights, wts, ids, ACT)


def _backend(name):
    return moerunner.default_registry().backends[name]


def test_problem_carries_both_schemes_as_values():
    weights = _weights("fp8_block", "int8_g64")
    problem = MoeProblem.of(torch.randn(2, 128), weights, weights.spec(ACT), "standard")
    assert problem.w13_scheme is get_scheme("fp8_block")
    assert problem.w2_scheme is get_scheme("int8_g64")
    assert weights.w13_scheme.name == "fp8_block" and weights.w2_scheme.name == "int8_g64"
    assert weights.scheme == "w13 fp8_block, w2 int8_g64"
    plain = ExpertWeights(torch.randn(2, 8, 4), torch.randn(2, 4, 4))
    assert plain.w13_scheme is get_scheme("fp32") and plain.scheme == "fp32"
    # A name is resolved; w2 defaults to w13's scheme.
    p = MoeProblem("cpu", torch.float32, "bf16", "silu", "standard", 32, 16, 4)
    assert p.w13_scheme is p.w2_scheme is get_scheme("bf16")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_custom_scheme_with_supported_fields_runs(backend):
    """A QuantScheme under its own name, with fp8_block's fields, is accepted by field and
    computes what fp8_block computes (bit for bit)."""
    if backend == "triton" and not RUNS_TRITON:
        pytest.skip("triton cannot run here")
    custom = dataclasses.replace(get_scheme("fp8_block"), name="my_deepseek_fp8")
    assert custom.family == "fp8" and custom in _backend(backend).capabilities.schemes
    named, _ = _call(backend, _weights("fp8_block", "fp8_block"))
    own, ref = _call(backend, _weights(custom, custom))
    assert torch.equal(own, named)
    assert_close(own, ref, error_bound(torch.float32, True))
    # The tile files of fp8_block serve it too.
    assert tile_config.scheme_key(custom) == "fp8_block"


def test_mixed_schemes_torch_computes_each_gemm_in_its_own():
    weights = _weights("fp8_block_64x64", "int8_g64_zp")
    ok, reason = _backend("torch").supports(
        MoeProblem.of(torch.randn(1, 128).to(DEVICE), weights, weights.spec(ACT), "standard")
    )
    assert ok, reason
    out, ref = _call("torch", weights)
    assert_close(out, ref, error_bound(torch.float32, True))


@pytest.mark.parametrize(
    ("w13_scheme", "w2_scheme"), [("fp8_block", "int4"), ("fp8_block_64x64", "int8_g64_zp")]
)
def test_mixed_schemes_triton_computes_each_gemm_in_its_own(w13_scheme, w2_scheme):
    if not _backend("triton").available()[0]:
        pytest.skip("triton cannot run here")
    weights = _weights(w13_scheme, w2_scheme)
    problem = MoeProblem.of(torch.randn(1, 128).to(DEVICE), weights, weights.spec(ACT), "standard")
    ok, reason = _backend("triton").supports(problem)
    assert ok, reason
    out, ref = _call("triton", weights)
    assert_close(out, ref, error_bound(torch.float32, True))
    # Same fields under two names are one scheme.
    custom = dataclasses.replace(get_scheme("int4"), name="int4_custom")
    assert _backend("triton").capabilities.schemes.check(custom) == ""


@pytest.mark.parametrize(
    ("scheme", "words"),
    [
        (QuantScheme("b", "e4m3", "fp32", "block", (128, 32), activation_format="fp8_group"),
         "K blocks of 64 or 128"),
        (QuantScheme("c", "e4m3", "fp32", "block", (128, 128), activation_format="fp8_token"),
         "grouped by the weight's K block"),
        (get_scheme("int8_g16"), "groups of (32, 64, 128)"),
        (get_scheme("fp8_tensor_static"), "static activation scales"),
        (get_scheme("nvfp4_a4"), "weight-only"),
    ],
)  # fmt: skip
def test_triton_refuses_fields_it_does_not_compute(scheme, words):
    why = _backend("triton").capabilities.schemes.check(scheme)
    assert words in why and repr(scheme.name) in why
    with pytest.raises(MoeInputError, match="cannot compute"):
        static = {"input_scale": 0.1} if scheme.activation_scales == "static" else {}
        _prepare.kernel_weight(moerunner.quantize(torch.randn(1, 128, 128), scheme, **static))
    # torch computes every family.
    assert scheme in _backend("torch").capabilities.schemes


def test_capabilities_from_names_and_describe():
    caps = Capabilities(
        frozenset({"cpu"}), frozenset({torch.float32}), frozenset({"fp32", "int4"}), frozenset()
    )
    assert isinstance(caps.schemes, SchemeSupport)
    assert caps.schemes.names() == ("fp32", "int4", "int4_g128")  # int4_g128 has int4's fields
    assert caps.schemes & set(SCHEME_NAMES) == {"fp32", "int4", "int4_g128"}
    assert "int4_g64" not in caps.schemes and "no_such_scheme" not in caps.schemes
    described = _backend("triton").capabilities.describe()
    assert "fp8_block_64x64" in described["schemes"] and "int8_g64_zp" in described["schemes"]
    assert "nvfp4_a4" not in described["schemes"]
    with pytest.raises(TypeError, match="schemes must be a SchemeSupport"):
        Capabilities(frozenset(), frozenset(), 3, frozenset())


def test_tiles_key_on_the_mma_operand_not_the_name():
    """int8_w8a16's MMA runs in the hidden dtype: it takes bf16's tiles, not int8's."""
    args = (4096, 8, 8, 12288, 4096)
    w8a16 = tile_config.heuristic_tiles(*args, "int8_w8a16", dtype_bytes=1)
    assert w8a16 == tile_config.heuristic_tiles(*args, "bf16", dtype_bytes=2)
    w8a8 = tile_config.heuristic_tiles(*args, "int8", dtype_bytes=1)
    assert w8a8 != w8a16 and w8a8 == tile_config.heuristic_tiles(*args, "fp8_channel", 1)
    assert tile_config.tile_family("int8", 1) == "qdot8"
    assert tile_config.tile_family("int8_w8a16", 1) == "plain"
    assert not tile_config.mma_8bit("int8_w8a16") and not tile_config.mma_8bit("int8_g64")
    assert tile_config.mma_8bit("fp8_channel") and tile_config.mma_8bit("int8")
    assert tile_config.k_blocked("fp8_block_128x64") and not tile_config.k_blocked("fp8_tensor")
    # New block shapes take block-scaled fp8's tiles.
    assert tile_config.heuristic_tiles(*args, "fp8_block_64x64", 1) == (
        tile_config.heuristic_tiles(*args, "fp8_block", 1)
    )


@pytest.mark.skipif(not RUNS_TRITON, reason="triton cannot run here")
@pytest.mark.parametrize(
    ("scheme", "inter"),
    [
        ("fp8_block_64x64", 96),
        ("fp8_block_128x64", 96),
        ("fp8_block_1x128", 96),
        ("int8_g32_zp", 96),
        ("int8_g64", 64),
    ],
)
def test_triton_new_schemes_with_partial_blocks(scheme, inter):
    """I = 96: the 64-row scale blocks of w13 straddle gate and up, w2's last K block is
    partial (fp8); int8 groups of 32 come from a parametrised name."""
    out, ref = _call("triton", _weights(scheme, scheme, hidden=128, inter=inter))
    assert_close(out, ref, error_bound(torch.float32, get_scheme(scheme).quantizes_activations))
    torch_out, _ = _call("torch", _weights(scheme, scheme, hidden=128, inter=inter))
    assert ((out - torch_out).norm() / torch_out.norm()).item() < 1e-5
