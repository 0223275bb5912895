"""The triton backend's cached kernel launches (``_launch``).

The key must separate every case Triton compiles apart (dtype, 16-byte alignment, integers
equal to 1 or divisible by 16, integer width); the GPU tests check that a cached launch
computes what Triton's own launch does, also for an argument that changes specialisation.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerunner.backends.triton import _launch  # noqa: E402
from moerunner.backends.triton.options import TritonOptions  # noqa: E402

OPTIONS = TritonOptions()


def test_key_separates_what_triton_specialises_on():
    buf = torch.zeros(64, dtype=torch.float32)
    aligned, offset = buf[:16], buf[1:17]  # data pointers 0 and 4 bytes past a 16-byte line

    def key(*args):
        return _launch._args_key(args)

    assert key(aligned, 3) != key(offset, 3)
    assert key(aligned, 3) != key(aligned.to(torch.bfloat16), 3)
    assert key(aligned, 3) == key(torch.zeros(8), 3)  # another aligned fp32 tensor
    # scalars by value: finer than "equal to 1 / divisible by 16 / fits in 32 bits"
    for a, b in ((1, 2), (16, 32), (17, 18), (1 << 31, 1 << 30), (0.5, 2.0)):
        assert key(aligned, a) != key(aligned, b)


def test_host_arithmetic_matches_triton():
    import triton

    for n in range(0, 1100):
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 128):
            assert _launch.cdiv(n, d) == triton.cdiv(n, d)


def test_installed_launch_hooks_are_detected():
    from triton.knobs import HookChain

    chain = HookChain()
    assert not _launch._hooked(None) and not _launch._hooked(chain)
    chain.add(print)
    assert _launch._hooked(chain) and _launch._hooked(print)


def test_without_a_gpu_the_jit_launch_runs(monkeypatch):
    """CPU tensors (the interpreter) never reach the cache."""
    calls = []
    cached = len(_launch._compiled)

    class Kernel:
        params = []
        arg_names = []

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    _launch.launch(Kernel(), (2,), torch.zeros(4), 3, BLOCK=8, options=OPTIONS)
    assert calls == [((2,), (calls[0][1][0], 3), {"BLOCK": 8})]
    assert len(_launch._compiled) == cached


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_launch_equals_jit_launch_and_keys_alignment_apart():
    from moerunner.backends.triton._align import topk_sum

    dev = torch.device("cuda")
    T, k, H, E = 37, 4, 1000, 8
    ids = torch.randint(-1, E, (T, k), dtype=torch.int32, device=dev)
    buf = torch.randn(T * k * H + 1, device=dev, dtype=torch.bfloat16)
    ref_in = buf[: T * k * H].view(T * k, H)
    valid = ((ids >= 0) & (ids < E)).reshape(T * k, 1)
    ref = (ref_in.float() * valid).view(T, k, H).sum(1)
    _launch.clear()
    for src in (ref_in, buf[1:].view(T * k, H), ref_in):  # aligned, 2 bytes off, aligned
        want = (src.float() * valid).view(T, k, H).sum(1)
        outs = []
        for cache in (False, True, True):  # JIT launch, first cached (compiles), cache hit
            out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
            topk_sum(src, ids, out, E, options=TritonOptions(launch_cache=cache))
            outs.append(out.float())
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    # one compiled kernel per alignment of the source, reused on the third pass
    assert len(_launch._compiled) == 2
    torch.testing.assert_close(outs[-1], ref, rtol=1e-2, atol=1e-2)


def test_a_launcher_with_another_signature_falls_back_to_the_jit_launch(monkeypatch):
    """If a future Triton's compiled launcher rejects the arguments, the cache turns itself
    off for that kernel and the launch goes the JIT way (no launch is lost)."""
    jit_calls = []

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            raise TypeError("launcher takes other arguments")

    class Kernel:
        params = []
        arg_names = []

        def __getitem__(self, grid):
            return lambda *a, **k: jit_calls.append(grid)

    kernel = Kernel()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU suite runs under the interpreter
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    monkeypatch.setattr(_launch, "_layouts", {kernel: (1, [])})
    monkeypatch.setattr(_launch, "_compiled", {})
    x = torch.zeros(4)
    _launch._compiled[(id(kernel), 0, (), _launch._args_key((x,)))] = (Compiled(), ())
    _launch.launch(kernel, (3,), x, options=OPTIONS)
    assert jit_calls == [(3,)] and _launch._layouts[kernel] is None and not _launch._compiled
    _launch.launch(kernel, (4,), x, options=OPTIONS)  # from now on the JIT way directly
    assert jit_calls == [(3,), (4,)] and not _launch._compiled


def test_launches_switch_to_the_inputs_gpu(monkeypatch):
    """A layer on another GPU than the current one (transformers' device_map) launches there:
    the entry points enter that device first; on the current device or CPU they do not."""
    import contextlib
    import types

    from moerunner.backends.triton import experts

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext()
    )

    def fake(index):
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))

    with experts._on_device(fake(1)):
        pass
    with experts._on_device(fake(0)):
        pass
    with experts._on_device(torch.zeros(1)):
        pass
    assert entered == [torch.device("cuda", 1)]
