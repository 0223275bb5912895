# quantize's memory bound: experts quantized a chunk at a time into tensors allocated once,
# bit for bit the result of quantizing all experts at once, with transient memory that does
# not grow with E (counted by moerunner.memory.AllocationTracker, which sees CPU storages).

import pytest
import torch

import moerunner
from moerunner.memory import AllocationTracker
from moerunner.quant import SCHEME_NAMES, get_scheme, quantize
from moerunner.quant.weight import TRANSIENT_FACTOR, experts_per_chunk

QUANTIZED = [n for n in SCHEME_NAMES if get_scheme(n).is_quantized]
# N = 80 leaves fp8 blocks partial along N; K = 256 is a whole number of every group size.
E, N, K = 7, 80, 256
EXPERT_FP32 = N * K * 4


def _weight(dtype=torch.float32, experts=E) -> torch.Tensor:
    torch.manual_seed(0)
    # Experts of different magnitudes, so per-expert scales (fp8_tensor, nvfp4's global
    # scale) differ from chunk to chunk.
    magnitude = torch.logspace(-3, 2, experts)[:, None, None]
    return (torch.randn(experts, N, K) * magnitude).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("scheme", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_quantize_is_bit_identical(scheme, dtype):
    w = _weight(dtype)
    kw = {"input_scale": torch.tensor(0.05)} if "static" in scheme else {}
    whole = quantize(w, scheme, chunk_bytes=E * EXPERT_FP32, **kw).tensors()
    for experts in (1, 3, E):
        got = quantize(w, scheme, chunk_bytes=experts * EXPERT_FP32, **kw).tensors()
        assert got.keys() == whole.keys()
        for field, value in got.items():
            assert value.dtype == whole[field].dtype and value.shape == whole[field].shape
            assert torch.equal(_bits(value), _bits(whole[field])), (scheme, experts, field)


def test_chunked_quantize_of_a_strided_view_matches():
    w = _weight().transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, K] K-major
    a = quantize(w, "fp8_block", chunk_bytes=EXPERT_FP32).tensors()
    b = quantize(w.contiguous(), "fp8_block").tensors()
    assert all(torch.equal(_bits(a[f]), _bits(b[f])) for f in a)


def test_experts_per_chunk():
    assert experts_per_chunk((10, N, K), 3 * EXPERT_FP32 + 1) == 3
    assert experts_per_chunk((10, N, K), 1) == 1  # never below one expert
    assert experts_per_chunk((10, N, K), 1 << 40) == 10
    assert experts_per_chunk((0, N, K), 1 << 20) == 1


def _transient(w: torch.Tensor, scheme: str, chunk_bytes: int) -> int:
    with AllocationTracker() as tracker:
        q = quantize(w, scheme, chunk_bytes=chunk_bytes)
    result = sum(t.untyped_storage().nbytes() for t in q.tensors().values())
    return tracker.peak_bytes - result


@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_tensor", "mxfp4", "nvfp4", "int4_zp"])
def test_transient_memory_is_bounded_and_independent_of_experts(scheme):
    # bf16 input: the float32 copy of the chunk is transient too (the worst case).
    small, large = _weight(torch.bfloat16, 4), _weight(torch.bfloat16, 16)
    chunk = 2 * EXPERT_FP32
    bounded = [_transient(w, scheme, chunk) for w in (small, large)]
    assert max(bounded) <= TRANSIENT_FACTOR * chunk, (scheme, bounded)
    assert bounded[1] == bounded[0]  # four times the experts, the same transient peak
    # The unchunked path (one chunk of all 16 experts) takes ~8x that: what the bound fixes.
    unchunked = _transient(large, scheme, 16 * EXPERT_FP32)
    assert unchunked >= 6 * bounded[1], (scheme, unchunked, bounded)


def test_default_chunk_and_public_entry_point():
    w = _weight()
    a = moerunner.quantize(w, "mxfp4").tensors()
    b = moerunner.quantize(w, "mxfp4", chunk_bytes=EXPERT_FP32).tensors()
    assert all(torch.equal(a[f], b[f]) for f in a)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "256MiB"])
def test_bad_chunk_bytes_is_named(bad):
    with pytest.raises(ValueError, match="chunk_bytes"):
        quantize(_weight(), "fp8_block", chunk_bytes=bad)


def test_empty_experts_still_quantize():
    q = quantize(torch.zeros(0, N, K), "fp8_block", chunk_bytes=1)
    assert q.data.shape == (0, N, K)
