"""The masked dispatcher's flag mode is capturable: no host reads or host-data tensors.

A CUDA graph capture refuses host synchronisation and host-to-device copies; on CPU the
``HostReads`` recorder stands in for it and lists every such call with its source line. The
whole layer step (dispatch -> torch backend experts through the masked format -> combine) is
checked on 2 gloo ranks; the ``on_overflow="raise"`` mode, which reads the overflow flag on
the host by design, shows the recorder sees such reads. Output tolerance: fp32 experts, the
masked path only reorders fp32 additions, so 1e-5 of the output scale (as the other tests).
"""

from __future__ import annotations

import pytest
import torch

from moerunner import ExpertWeights
from moerunner.routing import TopK

from .host_reads import HostReads
from .test_expert_parallel import E, H, single_process
from .worlds import run_world

I, K, TOKENS = 32, 2, 6  # I = 32: fp32 rows 16-byte aligned, the torch core's no-sync path


def _case(rank: int):
    g = torch.Generator().manual_seed(11)
    weights = ExpertWeights(
        torch.randn(E, 2 * I, H, generator=g) * H**-0.5, torch.randn(E, H, I, generator=g) * I**-0.5
    )
    g.manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g)
    ids = torch.rand(TOKENS, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    return weights, x, TopK(torch.rand(TOKENS, K, generator=g), ids)


def _steps(rank: int, world: int) -> dict:
    from moerunner.backends.torch_native import TorchBackend, TorchOptions
    from moerunner.distributed_moe import ExpertParallelMoE
    from moerunner.registry import DEFAULT_REGISTRY

    # The torch core as it runs on CUDA (grouped GEMM, no host reads), here for fp32: on CPU
    # it would loop over chunks of experts, reading the offsets on the host.
    grouped = TorchOptions(grouped_mm={("cpu", torch.float32)})
    DEFAULT_REGISTRY.register_backend(TorchBackend(grouped, name="torch-grouped"), replace=True)
    weights, x, topk = _case(rank)
    out = {}
    for mode in ("flag", "raise"):
        moe = ExpertParallelMoE.from_global(
            weights, dispatcher="masked", capacity=8, on_overflow=mode, backend="torch-grouped"
        )
        moe(x, topk)  # warm-up (as before a capture)
        with HostReads() as reads:
            y = moe(x, topk)
        out[mode] = {"y": y, "calls": reads.calls, "overflow": moe.last_overflow}
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_steps, 2)


def test_flag_mode_step_has_no_host_reads(results):
    for rank, r in enumerate(results):
        assert r["flag"]["calls"] == [], f"rank {rank}: {r['flag']['calls']}"
        assert not bool(r["flag"]["overflow"])
        weights, x, topk = _case(rank)
        want = single_process(weights, x, topk)
        err = (r["flag"]["y"] - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), err


def test_recorder_sees_the_raise_modes_host_read(results):
    for r in results:
        assert any(what in ("cpu()", "bool(tensor)") for what, _ in r["raise"]["calls"]), r[
            "raise"
        ]["calls"]
