"""``dispatch.permute.group_pairs``: the (token, slot) pairs grouped by expert, against a
Python loop over the pairs, for ids of every integer dtype (-1, and ids past E, sort last)."""

from __future__ import annotations

import pytest
import torch

from moerunner.dispatch.permute import group_pairs
from moerunner.topk import TopK


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("num_experts", [5, 127, 128])
def test_group_pairs_matches_a_loop_over_the_pairs(dtype, num_experts):
    g = torch.Generator().manual_seed(num_experts)
    tokens, k = 13, 3
    high = min(num_experts + 2, torch.iinfo(dtype).max + 1)
    low = 0 if dtype == torch.uint8 else -1
    ids = torch.randint(low, high, (tokens, k), generator=g)
    ids[0, 0] = num_experts - 1  # (the last expert; with int8 ids and E = 128, id 127)
    weights = torch.rand(tokens, k, generator=g)
    order, token, offsets, weight_TK = group_pairs(TopK(weights, ids.to(dtype)), num_experts)
    pairs = [(t, j, int(ids[t, j])) for t in range(tokens) for j in range(k)]
    valid = [p for p in pairs if 0 <= p[2] < num_experts]
    grouped = sorted(valid, key=lambda p: p[2])  # (stable: pair order within an expert)
    rows = len(grouped)
    assert offsets.dtype == torch.int64 and offsets.shape == (num_experts + 1,)
    counts = [sum(p[2] == e for p in valid) for e in range(num_experts)]
    assert offsets.tolist() == [sum(counts[:e]) for e in range(num_experts + 1)]
    assert order[:rows].tolist() == [t * k + j for t, j, _ in grouped]
    assert token[:rows].tolist() == [t for t, _, _ in grouped]
    assert sorted(order.tolist()) == list(range(tokens * k))  # the skipped pairs after them
    want = torch.where((ids >= 0) & (ids < num_experts), weights, 0.0)
    assert torch.equal(weight_TK, want)
