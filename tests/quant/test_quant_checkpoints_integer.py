# Integer checkpoint formats (compressed-tensors pack-quantized, GPTQ, AWQ): tensors packed
# here by each format's published rules (numpy, one slot at a time), imported, and compared
# bit-exactly with a float64 dequantization written from the same rules. The products
# (q - zero) * scale need at most 8 + 11 bits (fp16 scales), so float32 holds them exactly.

import numpy as np
import pytest
import torch

import moerunner
from moerunner.quant.checkpoints import (
    AWQ_ORDER,
    import_awq,
    import_compressed_tensors,
    import_gptq,
)
from moerunner.testing import assert_close, error_bound


def pack(values: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """Pack unsigned ``values`` (< 2^bits) into int32 words along ``axis``: slot i of word c
    holds element c*per + order[i] (order: identity unless given), slot 0 in the low bits."""
    per = 32 // bits
    order = list(range(per)) if order is None else list(order)
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    pad = -v.shape[-1] % per
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint64)], axis=-1)
    words = np.zeros(v.shape[:-1] + (v.shape[-1] // per,), np.uint64)
    for c in range(words.shape[-1]):
        for i in range(per):
            words[..., c] |= v[..., c * per + order[i]] << np.uint64(bits * i)
    out = np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)
    return torch.from_numpy(np.ascontiguousarray(out))


def scales_fp16(rng, shape) -> torch.Tensor:
    return torch.from_numpy(rng.uniform(0.002, 0.05, shape).astype(np.float16))


# ---------------------------------------------------------------- compressed-tensors


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_compressed_tensors_pack_quantized(bits, symmetric, group):
    rng = np.random.default_rng(bits * 100 + group + symmetric)
    e, n, k = 2, 16, 128
    offset = 1 << (bits - 1)
    q = rng.integers(-offset, offset, (e, n, k))  # signed values, stored + offset
    zp = (
        np.zeros((e, n, k // group), np.int64)
        if symmetric
        else rng.integers(-offset, offset, (e, n, k // group))
    )
    scale = scales_fp16(rng, (e, n, k // group))
    packed = [pack(q[x] + offset, bits, 1) for x in range(e)]
    zeros = None if symmetric else [pack(zp[x] + offset, bits, 0) for x in range(e)]
    shape = [torch.tensor([n, k], dtype=torch.int64)] * e
    qw = import_compressed_tensors(packed, list(scale), zeros, shape, num_bits=bits)
    expected = (q - np.repeat(zp, group, axis=-1)) * np.repeat(scale.double().numpy(), group, -1)
    assert qw.scheme.name == f"int{bits}_g{group}" + ("" if symmetric else "_zp")
    assert torch.equal(moerunner.dequantize(qw).double(), torch.from_numpy(expected))


def test_compressed_tensors_channel_wise_and_padding():
    # K = 40 is not a multiple of 8: the last word is zero-padded; one scale per row (channel).
    rng = np.random.default_rng(1)
    n, k = 8, 40
    q = rng.integers(-8, 8, (n, k))
    scale = scales_fp16(rng, (n, 1))
    qw = import_compressed_tensors(
        pack(q + 8, 4, 1)[None], scale[None], weight_shape=torch.tensor([n, k]), num_bits=4
    )
    assert qw.shape == (1, n, k) and qw.scheme.group_size == k
    expected = q * scale.double().numpy()
    assert torch.equal(moerunner.dequantize(qw)[0].double(), torch.from_numpy(expected))


def test_compressed_tensors_rejects_act_order_and_bad_shapes():
    rng = np.random.default_rng(2)
    q = rng.integers(-8, 8, (8, 64))
    packed, scale = pack(q + 8, 4, 1)[None], scales_fp16(rng, (1, 8, 2))
    g_idx = torch.arange(64) // 32
    import_compressed_tensors(packed, scale, g_idx=g_idx)  # the trivial order is accepted
    with pytest.raises(ValueError, match="act-order"):
        import_compressed_tensors(packed, scale, g_idx=g_idx.flip(0))
    with pytest.raises(ValueError, match="weight_shape"):
        import_compressed_tensors(packed, scale, weight_shape=torch.tensor([8, 100]))
    with pytest.raises(ValueError, match="num_bits must be one of"):
        import_compressed_tensors(packed, scale, num_bits=3)
    with pytest.raises(ValueError, match="weight_scale must be a floating"):
        import_compressed_tensors(packed, scale.to(torch.int32))


# ---------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq(bits, checkpoint_format, symmetric):
    rng = np.random.default_rng(bits + symmetric * 7 + len(checkpoint_format))
    e, n, k, group = 2, 16, 128, 32
    top = (1 << bits) - 1
    q = rng.integers(0, top + 1, (e, k, n))  # GPTQ's [in, out] orientation
    # Zero points: the midpoint when symmetric; never 0 in the v1 format (stored as zero - 1).
    low = 1 if checkpoint_format == "gptq" else 0
    z = (
        np.full((e, k // group, n), 1 << (bits - 1))
        if symmetric
        else rng.integers(low, top + 1, (e, k // group, n))
    )
    stored = z - 1 if checkpoint_format == "gptq" else z
    scale = scales_fp16(rng, (e, k // group, n))
    g_idx = torch.arange(k, dtype=torch.int32) // group
    qw = import_gptq(
        [pack(q[x], bits, 0) for x in range(e)],
        [pack(stored[x], bits, 1) for x in range(e)],
        list(scale),
        [g_idx] * e,
        bits=bits,
        checkpoint_format=checkpoint_format,
    )
    w_kn = (q - np.repeat(z, group, axis=1)) * np.repeat(scale.double().numpy(), group, axis=1)
    assert qw.scheme.name == f"int{bits}_g{group}" + ("" if symmetric else "_zp")
    assert torch.equal(moerunner.dequantize(qw).double(), torch.from_numpy(w_kn).transpose(1, 2))


def test_gptq_rejects_desc_act_and_wrapped_zero():
    rng = np.random.default_rng(3)
    k, n, group = 64, 8, 32
    q = rng.integers(0, 16, (k, n))
    qweight, scale = pack(q, 4, 0)[None], scales_fp16(rng, (1, k // group, n))
    zeros = pack(np.full((k // group, n), 7), 4, 1)[None]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="act-order"):
        import_gptq(qweight, zeros, scale, (perm // group)[None])
    # v1 stores zero - 1: a zero of 0 was stored as -1, i.e. 15, which reads back as 16.
    wrapped = pack(np.full((k // group, n), 15), 4, 1)[None]
    with pytest.raises(ValueError, match="zero points must lie in"):
        import_gptq(qweight, wrapped, scale)
    assert import_gptq(qweight, wrapped, scale, checkpoint_format="gptq_v2").scheme.zero_point
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        import_gptq(qweight, zeros, scale, checkpoint_format="exllama")


# ---------------------------------------------------------------- AWQ


@pytest.mark.parametrize("group", [32, 128])
def test_awq_interleaved_order(group):
    rng = np.random.default_rng(group)
    e, n, k = 2, 32, 128
    q = rng.integers(0, 16, (e, k, n))  # AWQ's [in, out] orientation
    z = rng.integers(0, 16, (e, k // group, n))
    scale = scales_fp16(rng, (e, k // group, n))
    qw = import_awq(
        torch.stack([pack(q[x], 4, 1, AWQ_ORDER) for x in range(e)]),
        torch.stack([pack(z[x], 4, 1, AWQ_ORDER) for x in range(e)]),
        scale,
    )
    w_kn = (q - np.repeat(z, group, axis=1)) * np.repeat(scale.double().numpy(), group, axis=1)
    assert qw.scheme.name == f"int4_g{group}_zp"
    assert torch.equal(moerunner.dequantize(qw).double(), torch.from_numpy(w_kn).transpose(1, 2))


def test_awq_hand_word():
    # One word, columns 0..7 holding 0..7: AWQ stores them in slots [0, 2, 4, 6, 1, 3, 5, 7].
    word = sum(col << (4 * slot) for slot, col in enumerate(AWQ_ORDER))
    qweight = torch.tensor([[[word]] * 2], dtype=torch.int32).reshape(1, 2, 1)  # K = 2 rows
    qzeros = torch.zeros(1, 1, 1, dtype=torch.int32)
    qw = import_awq(qweight, qzeros, torch.ones(1, 1, 8, dtype=torch.float16))
    assert moerunner.dequantize(qw)[0, :, 0].tolist() == list(range(8))
    with pytest.raises(ValueError, match="bits must be one of"):
        import_awq(qweight, qzeros, torch.ones(1, 1, 8), bits=8)


# ---------------------------------------------------------------- run on imported weights


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_fused_moe_on_imported_weights_matches_reference(fmt):
    rng = np.random.default_rng(5)
    e, h, i, group = 4, 64, 32, 32

    def projection(n, k):
        q = rng.integers(0, 16, (e, k, n))
        z = rng.integers(1, 16, (e, k // group, n))
        s = scales_fp16(rng, (e, k // group, n))
        if fmt == "awq":
            return import_awq(
                torch.stack([pack(q[x], 4, 1, AWQ_ORDER) for x in range(e)]),
                torch.stack([pack(z[x], 4, 1, AWQ_ORDER) for x in range(e)]),
                s,
            )
        if fmt == "gptq":
            return import_gptq(
                torch.stack([pack(q[x], 4, 0) for x in range(e)]),
                torch.stack([pack(z[x] - 1, 4, 1) for x in range(e)]),
                s,
            )
        qt, zt = np.swapaxes(q, 1, 2), np.swapaxes(z, 1, 2)  # [E, N, K], [E, N, K/g]
        return import_compressed_tensors(
            torch.stack([pack(qt[x], 4, 1) for x in range(e)]),
            s.transpose(1, 2),
            torch.stack([pack(zt[x], 4, 0) for x in range(e)]),
        )

    from moerunner.quant.checkpoints import cat_rows

    w13 = cat_rows([projection(i, h), projection(i, h)])
    w2 = projection(h, i)
    x = torch.randn(6, h)
    topk = moerunner.select_experts(torch.randn(6, e), 2, renormalize=True)
    out = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch")
    ref = moerunner.reference_moe(x, moerunner.ExpertWeights(w13, w2), topk.weights, topk.ids)
    # fp32 hidden states, weight-only int4 (dequantized exactly): fp32 accumulation bound.
    assert_close(out, ref, error_bound(torch.float32, False))


# ---------------------------------------------------------- group sizes that K does not settle


def _gptq_parts(rng, k, n, group):
    """A v1 GPTQ projection with ceil(K / group) groups, as AutoGPTQ lays it out."""
    groups = -(-k // group)
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(1, 16, (groups, n))
    scale = scales_fp16(rng, (1, groups, n))
    g_idx = (torch.arange(k, dtype=torch.int32) // group)[None]
    return pack(q, 4, 0)[None], pack(z - 1, 4, 1)[None], scale, g_idx, q, z


def test_gptq_group_size_comes_from_the_config_or_g_idx_not_a_guess():
    # Was: the group size was K // groups, so K = 192 with group_size 128 (AutoGPTQ makes
    # ceil(192 / 128) = 2 groups, the second one ragged) imported as int4_g96: 507 of 3072
    # values wrong. Now a group count that two group sizes explain is refused unless the
    # checkpoint's group_size or g_idx says which; a ragged last group is refused by name.
    rng = np.random.default_rng(11)
    qweight, qzeros, scale, g_idx, _, _ = _gptq_parts(rng, 192, 16, 128)
    with pytest.raises(ValueError, match="pass group_size"):
        import_gptq(qweight, qzeros, scale)
    with pytest.raises(ValueError, match="ragged"):
        import_gptq(qweight, qzeros, scale, group_size=128)
    with pytest.raises(ValueError, match="ragged"):
        import_gptq(qweight, qzeros, scale, g_idx)  # not blamed on act-order any more
    # A group size of 96 really is 2 groups of 96: stated, it imports exactly.
    qweight, qzeros, scale, g_idx, q, z = _gptq_parts(rng, 192, 16, 96)
    for how in ({"group_size": 96}, {"g_idx": g_idx}):
        qw = import_gptq(qweight, qzeros, scale, **how)
        w_kn = (q - np.repeat(z, 96, axis=0)) * np.repeat(scale[0].double().numpy(), 96, axis=0)
        assert qw.scheme.name == "int4_g96_zp"
        assert torch.equal(moerunner.dequantize(qw)[0].double(), torch.from_numpy(w_kn).T)
    with pytest.raises(ValueError, match="makes 3 groups"):
        import_gptq(qweight, qzeros, scale, group_size=64)
    with pytest.raises(ValueError, match="group_size must be"):
        import_gptq(qweight, qzeros, scale, group_size=0)


def test_compressed_tensors_group_size_and_a_stacked_weight_shape():
    rng = np.random.default_rng(12)
    e, n, k, group = 2, 8, 100, 50
    q = rng.integers(-8, 8, (e, n, k))
    scale = scales_fp16(rng, (e, n, k // group))
    packed = torch.stack([pack(q[x] + 8, 4, 1) for x in range(e)])
    with pytest.raises(ValueError, match="pass group_size"):  # 50, or 64 with a ragged group
        import_compressed_tensors(packed, scale, weight_shape=torch.tensor([n, k]))
    expected = torch.from_numpy(q * np.repeat(scale.double().numpy(), group, axis=-1))
    # compressed-tensors' compress() of a stacked [E, N, K] weight stores (E, N, K).
    for shape in (torch.tensor([n, k]), torch.tensor([e, n, k])):
        qw = import_compressed_tensors(packed, scale, weight_shape=shape, group_size=group)
        assert torch.equal(moerunner.dequantize(qw).double(), expected)
    with pytest.raises(ValueError, match="names 3 experts"):
        import_compressed_tensors(
            packed, scale, weight_shape=torch.tensor([3, n, k]), group_size=group
        )


def test_awq_qzeros_must_match_qweight_words():
    # Was: one word fewer gave an IndexError, one more was silently dropped.
    qweight = torch.zeros(1, 128, 2, dtype=torch.int32)
    scale = torch.ones(1, 4, 16, dtype=torch.float16)
    for words in (1, 3):
        with pytest.raises(ValueError, match="qzeros"):
            import_awq(qweight, torch.zeros(1, 4, words, dtype=torch.int32), scale)


def test_awq_group_size_comes_from_the_config_like_gptq():
    # Was: import_awq took no group_size and used K // groups, so K = 192 with AutoAWQ's
    # group size 128 (ceil(192 / 128) = 2 groups, the second one ragged) imported as
    # int4_g96, every row past 96 in the wrong group. Now as GPTQ: the config's group size,
    # else the scales' shape where unambiguous; a ragged last group is refused by name.
    rng = np.random.default_rng(13)
    k, n = 192, 16

    def parts(group):
        groups = -(-k // group)
        q, z = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (groups, n))
        scale = scales_fp16(rng, (1, groups, n))
        return pack(q, 4, 1, AWQ_ORDER)[None], pack(z, 4, 1, AWQ_ORDER)[None], scale, q, z

    qweight, qzeros, scale, _, _ = parts(128)
    with pytest.raises(ValueError, match="scales: 2 groups for K=192.*pass group_size"):
        import_awq(qweight, qzeros, scale)
    with pytest.raises(ValueError, match=r"group size 128 does not divide K=192.*ragged"):
        import_awq(qweight, qzeros, scale, group_size=128)
    qweight, qzeros, scale, q, z = parts(96)
    qw = import_awq(qweight, qzeros, scale, group_size=96)
    w_kn = (q - np.repeat(z, 96, axis=0)) * np.repeat(scale[0].double().numpy(), 96, axis=0)
    assert qw.scheme.name == "int4_g96_zp"
    assert torch.equal(moerunner.dequantize(qw)[0].double(), torch.from_numpy(w_kn).T)
    with pytest.raises(ValueError, match="makes 3 groups"):
        import_awq(qweight, qzeros, scale, group_size=64)
    with pytest.raises(ValueError, match="group_size must be"):
        import_awq(qweight, qzeros, scale, group_size=0)
