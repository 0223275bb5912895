"""moerunner.memory: the per-op storage tracker and the reachable-storage count that the
memory tests rely on, checked on hand-made cases."""

from __future__ import annotations

import dataclasses

import torch

from moerunner.memory import AllocationTracker, storage_bytes


def test_tracker_counts_new_storages_and_their_release():
    x = torch.zeros(256)  # made before: not counted
    with AllocationTracker() as tracker:
        y = x * 2  # 1 KiB, new
        x.view(16, 16).t()  # a view: no new memory
        torch.mul(x, 2, out=y)  # out=: writes existing memory
        y.add_(1)  # in place
        z = torch.empty(1024)  # 4 KiB, new
        assert tracker.live_bytes == 1024 + 4096
        del z
        assert tracker.live_bytes == 1024
        w = torch.ones(512)
    assert tracker.peak_bytes == 1024 + 4096
    assert tracker.largest_bytes == 4096
    assert tracker.live_bytes == 1024 + 2048
    del y, w


@dataclasses.dataclass
class _Holder:
    a: torch.Tensor
    more: dict


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(100)  # 400 bytes
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    holder = _Holder(base[10:], {"x": [base.view(10, 10), (other,)], "n": 3})
    assert storage_bytes(holder) == 480
    assert storage_bytes(holder, base, other) == 480
    assert storage_bytes(torch.zeros(0)) == 0
    assert storage_bytes(torch) == 0  # modules are not walked


def test_kept_runs_in_place_off_cuda_and_passes_errors_on():
    """Off CUDA no graph pool can claim memory: ``kept`` is the call itself (same thread),
    and an error of ``make`` reaches the caller as it is. The CUDA side (a worker thread,
    outside a graph's pool) is tested in tests/test_cuda_graphs.py."""
    import threading

    import pytest

    from moerunner.memory import kept

    seen = []
    out = kept(lambda: seen.append(threading.get_ident()) or torch.ones(2), torch.device("cpu"))
    assert seen == [threading.get_ident()] and torch.equal(out, torch.ones(2))

    def bad():
        raise ValueError("made badly")

    with pytest.raises(ValueError, match="made badly"):
        kept(bad, torch.device("cpu"))
