"""Expert-id checks that do not wait for the device (moerunner.device_checks).

CPU tensors are checked at once. The deferred mechanism (queue, event, read at a later call
or at ``check_errors``) runs here with CPU tensors and a stand-in event; the ``gpu`` tests
run it for real with device-to-host synchronisation forbidden.
"""

from __future__ import annotations

import re

import pytest
import torch

import moerunner
from moerunner import MoeInputError
from moerunner.device_checks import ID_FLAGS, QUEUE, CheckQueue, IdFlags, check_ids_async

E = 8


class FakeEvent:
    """Stands in for a CUDA event: completes when the test says so (or on synchronize)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def _ids(*values) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.int32)


@pytest.fixture(autouse=True)
def _empty_queue():
    QUEUE.clear()
    yield
    QUEUE.clear()


@pytest.mark.parametrize("bad, low, high", [((0, E), 0, E), ((-2, 3), -2, 3)])
def test_cpu_ids_are_checked_at_once(bad, low, high):
    with pytest.raises(MoeInputError, match=rf"topk_ids must be in \[-1, E={E}\)") as info:
        check_ids_async(_ids(*bad), E, where="fused_moe")
    assert f"[{low}, {high}]" in str(info.value) and "fused_moe" in str(info.value)
    assert "completed" not in str(info.value)
    check_ids_async(_ids(-1, E - 1), E)  # the valid extremes
    check_ids_async(torch.zeros(0, 2, dtype=torch.int32), E)  # nothing to check
    assert len(QUEUE) == 0


def test_fused_moe_raises_at_once_on_cpu():
    w13, w2 = torch.randn(E, 8, 16), torch.randn(E, 16, 4)
    with pytest.raises(MoeInputError, match="topk_ids"):
        moerunner.fused_moe(torch.randn(2, 16), w13, w2, torch.ones(2, 1), _ids(E, 0).T)


def test_deferred_check_raises_at_the_next_call_once_its_event_completed():
    queue, events = CheckQueue(), []

    def make_event(ids):
        events.append(FakeEvent())
        return events[-1]

    def check(*values):
        check_ids_async(_ids(*values), E, "fused_moe", queue=queue, make_event=make_event)

    check(0, E + 3)  # bad, but the device has not run the check yet: nothing raises
    check(1, 2)
    assert len(queue) == 2
    events[1].done = True  # a later check completing first does not jump the queue
    check(2, 3)
    assert len(queue) == 3
    events[0].done = True
    with pytest.raises(MoeInputError, match=r"read once it completed") as info:
        check(3, 4)
    assert f"topk_ids must be in [-1, E={E}), got values in [0, {E + 3}]" in str(info.value)
    # The bad check is consumed; the good completed one is read without error, the rest wait.
    queue.poll()
    assert len(queue) == 2  # checks 3 and 4: their events have not completed
    assert not any(e.waited for e in events)


def test_drain_waits_and_raises_the_first_error():
    queue, events = CheckQueue(), []

    def make_event(ids):
        events.append(FakeEvent())
        return events[-1]

    for values in ((0, 1), (-5, 2), (0, 99)):
        check_ids_async(_ids(*values), E, "fused_moe", queue=queue, make_event=make_event)
    with pytest.raises(MoeInputError, match=r"\[-5, 2\]"):
        queue.drain()
    assert events[0].waited and events[1].waited and not events[2].waited
    with pytest.raises(MoeInputError, match=r"\[0, 99\]"):
        queue.drain()
    queue.drain()
    assert len(queue) == 0


def test_buffers_are_reused_once_read():
    queue, submitted = CheckQueue(), []
    submit = queue.submit
    queue.submit = lambda check: (submitted.append(check), submit(check))

    def done_event(ids):
        event = FakeEvent()
        event.done = True  # the device has run it by the time the queue is read
        return event

    def check(*values):
        check_ids_async(_ids(*values), E, "fused_moe", queue=queue, make_event=done_event)

    check(0, 1)  # queued, then read at once by the same call (its event has completed)
    assert len(queue) == 0
    with pytest.raises(MoeInputError, match=rf"\[0, {E}\]"):
        check(0, E)  # bad: reuses the first check's buffers; read (and raised) by the same call
    assert submitted[1].stats is submitted[0].stats
    assert submitted[1].device_stats is submitted[0].device_stats


def test_a_call_reuses_the_buffers_of_checks_completed_before_it():
    """The checks the device has run since the last call are read before this call takes
    buffers: after a synchronisation a call makes none (the GPU weight-lifetime test saw
    a new 512-byte buffer on the second call when they were read after it)."""
    queue, submitted, events = CheckQueue(), [], []
    submit = queue.submit
    queue.submit = lambda check: (submitted.append(check), submit(check))

    def make_event(ids):
        events.append(FakeEvent())  # not completed when recorded, as on a busy GPU
        return events[-1]

    def check(*values):
        check_ids_async(_ids(*values), E, "fused_moe", queue=queue, make_event=make_event)

    check(0, 1)
    events[0].done = True  # the device ran it (a synchronisation, or time)
    check(2, 3)
    assert submitted[1].device_stats is submitted[0].device_stats
    assert submitted[1].stats is submitted[0].stats
    check(0, E)  # bad: read only once its event completes
    events[1].done = events[2].done = True
    with pytest.raises(MoeInputError, match=rf"\[0, {E}\]"):
        check(4, 5)  # raised after its own check is queued: that one is read later
    assert len(queue) == 1
    assert any(submitted[3].device_stats is done.device_stats for done in submitted[1:3])
    events[3].done = True
    check(1, 2)
    assert len(queue) == 1  # check(4, 5) was read (no error); this call's own waits


def test_buffers_made_under_inference_mode_serve_checks_outside_it():
    """A model's first calls may run under ``torch.inference_mode`` and later ones under
    ``torch.no_grad``: the reused buffers must not be inference tensors (which refuse the
    in-place writes of a check outside inference mode)."""
    queue = CheckQueue()

    def done_event(ids):
        event = FakeEvent()
        event.done = True
        return event

    with torch.inference_mode():
        check_ids_async(_ids(0, 1), E, "fused_moe", queue=queue, make_event=done_event)
    with torch.no_grad():
        check_ids_async(_ids(2, 3), E, "fused_moe", queue=queue, make_event=done_event)
        with pytest.raises(MoeInputError, match=rf"\[0, {E}\]"):
            check_ids_async(_ids(0, E), E, "fused_moe", queue=queue, make_event=done_event)


def test_check_errors_with_nothing_queued_returns():
    moerunner.check_errors()


def test_no_check_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    check_ids_async(_ids(0, E), E)  # skipped: no host work while tracing
    assert len(QUEUE) == 0


# --- GPU: the real deferred path with synchronisation forbidden -------------------------------


def _gpu_problem(num_tokens=4, top_k=2, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype).cuda()
    w13 = (torch.randn(E, 64, 64, generator=gen) * 0.1).to(dtype).cuda()
    w2 = (torch.randn(E, 64, 32, generator=gen) * 0.1).to(dtype).cuda()
    weights = torch.rand(num_tokens, top_k, generator=gen).cuda()
    ids = torch.randint(0, E, (num_tokens, top_k), generator=gen, dtype=torch.int32).cuda()
    return x, w13, w2, weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])  # checked in a kernel / by aminmax
def test_gpu_bad_id_raises_later_without_sync(backend):
    x, w13, w2, weights, ids = _gpu_problem()
    moerunner.fused_moe(x, w13, w2, weights, ids, backend=backend)  # compile, cache
    torch.cuda.synchronize()
    bad = ids.clone()
    bad[1, 0] = E + 5
    match = rf"topk_ids must be in \[-1, E={E}\).*{E + 5}"
    torch.cuda.set_sync_debug_mode("error")  # whatever happens below, no host sync
    raised = False
    try:
        # The check is queued; it raises in the first call that finds it completed, which
        # may be this very call when the GPU is quicker than the host. The triton kernels'
        # flags are read every ID_FLAGS.every-th call: a raise comes within twice that.
        calls = [bad] + [ids] * (2 * ID_FLAGS.every + 1)
        for i, call_ids in enumerate(calls):
            try:
                out = moerunner.fused_moe(x, w13, w2, weights, call_ids, backend=backend)
                assert out.shape == x.shape
            except MoeInputError as exc:
                assert re.search(match, str(exc)), (i, exc)
                raised = True
                break
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if not raised:
        torch.cuda.synchronize()  # the bad call's check has now completed
        with pytest.raises(MoeInputError, match=match):
            moerunner.fused_moe(x, w13, w2, weights, ids, backend=backend)
    moerunner.check_errors()  # the remaining (good) checks


@pytest.mark.gpu
def test_gpu_int64_id_beyond_int32_raises():
    """int64 ids go to the triton kernels unconverted; one that a cast to int32 would turn
    into a good id (2**32 + 1 -> 1) is still reported."""
    x, w13, w2, weights, ids = _gpu_problem()
    bad = ids.long()
    bad[1, 0] = 2**32 + 1
    with pytest.raises(MoeInputError, match=r"highest 2147483647"):
        moerunner.fused_moe(x, w13, w2, weights, bad, backend="triton")
        moerunner.check_errors()


@pytest.mark.gpu
def test_gpu_first_flag_buffer_does_not_sync():
    """The id flag buffer is made on a process's first checked call: made by kernels on the
    device, so even that call does not synchronise (a tensor copied from a Python tuple
    would; this failed when the test below was the first checked call of its worker)."""
    flags = IdFlags()
    torch.cuda.set_sync_debug_mode("error")
    try:
        buf = flags.buffer(torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert buf.tolist() == list(IdFlags.CLEAN)


@pytest.mark.gpu
def test_gpu_check_errors_waits_and_raises():
    x, w13, w2, weights, ids = _gpu_problem()
    bad = ids.clone()
    bad[0, 1] = -3
    torch.cuda.set_sync_debug_mode("error")
    try:  # raises here only if the check already completed (no sync either way)
        moerunner.fused_moe(x, w13, w2, weights, bad, backend="triton")
        raised_early = False
    except MoeInputError as exc:
        assert "lowest -3" in str(exc)
        raised_early = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if not raised_early:
        with pytest.raises(MoeInputError, match="lowest -3"):
            moerunner.check_errors()
    moerunner.check_errors()


@pytest.mark.gpu
def test_gpu_select_then_fused_moe_without_sync():
    x, w13, w2, _, _ = _gpu_problem(num_tokens=16)
    logits = torch.randn(16, E, device="cuda", dtype=torch.bfloat16)
    topk = moerunner.select_experts(logits, 2, renormalize=True)
    moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        topk = moerunner.select_experts(logits, 2, renormalize=True)
        out = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    moerunner.check_errors()
    assert torch.isfinite(out.float()).all()


# -- ids checked inside the top-k reduction (``IdFlags``) ------------------------------------


def _flag_sum(ids, flags):
    pytest.importorskip("triton")
    from moerunner.backends.triton import TritonOptions
    from moerunner.backends.triton._align import topk_sum

    tokens, k = ids.shape
    dev = flags.device
    src = torch.randn(tokens * k, 16, device=dev)
    out = torch.empty(tokens, 16, device=dev)
    topk_sum(src, ids.to(dev), out, E, options=TritonOptions(), id_flags=flags)
    valid = ((ids.to(dev) >= 0) & (ids.to(dev) < E)).reshape(-1, 1).float()
    torch.testing.assert_close(out, (src * valid).reshape(tokens, k, 16).sum(1))


def test_topk_sum_records_bad_ids_in_the_flags():
    """Under Triton's interpreter on CPU: the reduction's check writes the lowest id below -1,
    the highest id >= E and E; good ids (-1 included) leave the flags clean."""
    from moerunner.device_checks import IdFlags

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    flags = torch.tensor(IdFlags.CLEAN, dtype=torch.int32, device=dev)
    _flag_sum(torch.tensor([[0, -1], [E - 1, 3]], dtype=torch.int32), flags)
    assert flags.tolist() == list(IdFlags.CLEAN)
    _flag_sum(torch.tensor([[0, -5], [E + 2, -3], [E, 1]], dtype=torch.int32), flags)
    assert flags.tolist() == [-5, E + 2, E]


def test_topk_sum_records_int64_ids_saturated_to_the_flags():
    """int64 ids reach the reduction unconverted (``routing_dtypes``): ids beyond int32
    are recorded saturated, so they stay out of range in the int32 flags (a plain cast would
    make 2**32 + 1 the good id 1 and -2**32 - 3 the id -3)."""
    from moerunner.device_checks import IdFlags

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    flags = torch.tensor(IdFlags.CLEAN, dtype=torch.int32, device=dev)
    _flag_sum(torch.tensor([[0, 2**32 + 1], [-(2**32) - 3, 3]], dtype=torch.int64), flags)
    assert flags.tolist() == [-(2**31), 2**31 - 1, E]
    flags = torch.tensor(IdFlags.CLEAN, dtype=torch.int32, device=dev)
    _flag_sum(torch.tensor([[0, -1], [E + 3, -7]], dtype=torch.int64), flags)
    assert flags.tolist() == [-7, E + 3, E]


def test_id_flags_read_every_nth_poll():
    """A poll reads the buffer on every ``every``-th call only; what the buffer holds is
    kept until then, so a bad id is reported late, never lost."""
    from moerunner.device_checks import IdFlags

    with pytest.raises(ValueError, match="every"):
        IdFlags(every=0)
    flags = IdFlags(every=3)
    buf = flags.buffer(torch.device("cpu"))
    buf.copy_(torch.tensor([-1, E + 1, E], dtype=torch.int32))
    flags.poll(torch.device("cpu"))
    flags.poll(torch.device("cpu"))  # polls 1 and 2: nothing read, nothing raised
    assert buf.tolist() == [-1, E + 1, E]
    with pytest.raises(MoeInputError, match=rf"highest {E + 1}"):
        flags.drain()


def test_id_flags_raise_once_and_reset():
    from moerunner.device_checks import IdFlags

    flags = IdFlags()
    buf = flags.buffer(torch.device("cpu"))
    assert flags.buffer(torch.device("cpu")) is buf
    flags.drain()  # clean: nothing raised
    buf.copy_(torch.tensor([-4, 11, E], dtype=torch.int32))
    with pytest.raises(MoeInputError, match=rf"E={E}\), got ids below -1 \(lowest -4\) and "):
        flags.drain()
    assert buf.tolist() == list(IdFlags.CLEAN)
    flags.drain()
