"""Launch plans of the triton backend (``_plan``): a call's launches recorded once per shape
and caller, replayed with the call's own tensors.

CPU tests check the plan's bookkeeping with stand-in launchers; GPU tests check that a
replayed call computes what the unplanned call computes (bit for bit: the same kernels with
the same arguments), for every kind of call the plan serves, and that it re-records where it
must (a workspace evicted, another stream, another alignment).
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict

import pytest
import torch

pytest.importorskip("triton")

import moerunner  # noqa: E402
from moerunner.backends.triton import _launch, _plan  # noqa: E402
from moerunner.backends.triton.options import TritonOptions  # noqa: E402


def _fake_launches(roles, stable):
    """Two recorded launches: (launcher, head, args, tail) as ``_launch`` records them."""
    calls = []

    def run(*args):
        calls.append(args)

    head = (1, 1, 1, 0, "function", "metadata", None, None, None)
    launches = [
        (run, head, (roles[0], stable, 7, roles[1]), (True,)),
        (run, head, (stable, roles[2], 3.5), ()),
    ]
    return launches, calls


def test_plan_puts_the_calls_tensors_in_their_slots():
    roles = tuple(torch.zeros(4) for _ in range(3))
    stable = torch.zeros(8)
    launches, calls = _fake_launches(roles, stable)
    plan = _plan.LaunchPlan.build(launches, roles)
    assert plan is not None and plan.alive()
    others = tuple(torch.zeros(4) for _ in range(3))
    plan.replay(others)
    head = (1, 1, 1, 0, "function", "metadata", None, None, None)
    p = [t.data_ptr() for t in others]
    assert calls == [
        (*head, p[0], stable.data_ptr(), 7, p[1], True),
        (*head, stable.data_ptr(), p[2], 3.5),
    ]


def test_plan_dies_with_a_tensor_it_holds_by_pointer():
    roles = tuple(torch.zeros(4) for _ in range(3))
    stable = torch.zeros(8)
    launches, _ = _fake_launches(roles, stable)
    plan = _plan.LaunchPlan.build(launches, roles)
    del launches, stable
    gc.collect()
    assert not plan.alive()


def test_roles_sharing_a_pointer_give_no_plan():
    t = torch.zeros(4)
    launches, _ = _fake_launches((t, t, torch.zeros(2)), torch.zeros(8))
    assert _plan.LaunchPlan.build(launches, (t, t.view(2, 2), torch.zeros(2))) is None


def test_recording_keeps_a_plan_only_from_a_clean_call():
    """A call that ran an operation other than views, or launched through the JIT, leaves
    no plan; after ``MAX_ATTEMPTS`` such calls the key is no longer recorded."""
    plans = OrderedDict()
    roles = (torch.zeros(4), torch.zeros(4))
    key = ("k",)
    for attempt in range(1, _plan.MAX_ATTEMPTS + 1):
        with _plan.recorded(plans, key, roles) as rec:
            assert rec.active
            torch.add(roles[0], 1)  # an op between launches
        assert plans[key] == attempt
    with _plan.recorded(plans, key, roles) as rec:
        assert not rec.active
    assert not _plan.replay(plans, key, roles)


def test_recording_collects_compiled_launches():
    plans = OrderedDict()
    roles = (torch.zeros(4), torch.zeros(4), torch.zeros(4))
    stable = torch.zeros(8)
    launches, calls = _fake_launches(roles, stable)
    with _plan.recorded(plans, ("k",), roles):
        rec = _launch._local.rec
        rec.launches.extend(launches)
        roles[0].view(2, 2)  # views are allowed
    assert isinstance(plans[("k",)], _plan.LaunchPlan)
    assert _plan.replay(plans, ("k",), roles) and len(calls) == 2
    with _plan.recorded(plans, ("j",), roles):
        _launch._note_jit_launch()  # a launch that compiled
    assert plans[("j",)] == 1


def _per_call_buffers(made):
    """A per-call buffers function that counts its calls and zero-fills one buffer (an op
    that would end a recording if it were the call's own)."""

    def make():
        made.append(threading.get_ident())
        return {"a": torch.empty(6), "b": torch.zeros(3)}

    return make


def test_a_plan_makes_its_per_call_buffers_again_at_each_replay():
    roles = (torch.zeros(4),)
    made = []
    make = _per_call_buffers(made)
    plans = OrderedDict()
    calls = []

    def run(*args):
        calls.append(args)

    with _plan.recorded(plans, ("k",), roles):
        bufs = _launch.per_call(make)  # recorded with the call
        rec = _launch._local.rec
        rec.launches.append((run, (), (bufs["b"], roles[0], bufs["a"]), ()))
    plan = plans[("k",)]
    assert isinstance(plan, _plan.LaunchPlan) and plan.made == 2 and plan.refs == ()
    del bufs, rec
    gc.collect()
    assert plan.alive()  # holds no per-call buffer by pointer
    other = (torch.zeros(4),)
    assert _plan.replay(plans, ("k",), other) and len(made) == 2
    (args,) = calls
    assert args[1] == other[0].data_ptr()
    assert args[0] != args[2] and args[0] != 0 and args[2] != 0  # two fresh buffers


def test_joined_plans_keep_each_parts_per_call_buffers_apart():
    made_a, made_b = [], []
    calls = []

    def run(*args):
        calls.append(args)

    def part(make, roles):
        plans = OrderedDict()
        with _plan.recorded(plans, ("k",), roles):
            bufs = _launch.per_call(make)
            _launch._local.rec.launches.append((run, (), (roles[0], bufs["a"], bufs["b"]), ()))
        return plans[("k",)]

    a = part(_per_call_buffers(made_a), (torch.zeros(2),))
    b = part(_per_call_buffers(made_b), (torch.zeros(2),))
    joined = _plan.LaunchPlan.join([(a, (1,)), (b, (0,))])
    assert joined.made == 4 and len(joined.makes) == 2
    roles = (torch.zeros(2), torch.zeros(2))
    calls.clear()
    joined.replay(roles)
    assert len(made_a) == len(made_b) == 2
    (a_args, b_args) = calls
    assert a_args[0] == roles[1].data_ptr() and b_args[0] == roles[0].data_ptr()
    assert len({*a_args[1:], *b_args[1:]}) == 4  # four distinct per-call buffers


def test_per_call_buffers_outside_a_recording_are_just_made():
    made = []
    bufs = _launch.per_call(_per_call_buffers(made))
    assert set(bufs) == {"a", "b"} and len(made) == 1


def test_large_workspaces_are_made_per_call_in_the_callers_thread():
    """Buffers above ``per_call_bytes`` are not kept (they would pin memory, and two such
    keys would evict each other on every call): from their second call on they are made in
    the calling thread and noted in an open recording; smaller ones stay cached beside them."""
    from moerunner.backends.triton import workspaces

    ws = workspaces.Workspaces(max_bytes=1000, per_call_bytes=300)
    cpu = torch.device("cpu")
    threads = []

    def big():
        threads.append(threading.get_ident())
        return {"y": torch.empty(400, dtype=torch.uint8)}

    small = ws.get((cpu, "small"), lambda: {"y": torch.empty(200, dtype=torch.uint8)})
    first = ws.get((cpu, "big"), big)
    for _ in range(3):
        again = ws.get((cpu, "big"), big)
        assert again is not first and again["y"].numel() == 400
        assert ws.get((cpu, "small"), lambda: {"y": torch.empty(1)}) is small
    assert threads[1:] == [threading.get_ident()] * 3
    assert ws.nbytes == 200 and list(ws.sizes.values()) == [200]
    with _launch.recording() as rec:
        bufs = ws.get((cpu, "big"), big)
    assert rec.buffers == [(big, (bufs["y"],))]
    ws.clear()
    assert not ws.per_call and not ws.entries
    limit = workspaces.WORKSPACE_LIMIT_BYTES
    assert workspaces.WORKSPACES.per_call_bytes == workspaces.PER_CALL_BYTES <= limit


def test_a_prefill_intermediate_buffer_is_noted_per_call_without_the_calls_tensors():
    """The experts' own large buffer (a prefill's intermediate activations, here 80 MB) goes
    through ``per_call`` into an open recording, made by a function that holds no tensor of
    the call (a plan keeps that function for its replays)."""
    from moerunner.backends.triton import experts, workspaces

    e, h, i, rows = 2, 64, 2048, 20_000
    assert rows * i * 2 > workspaces.PER_CALL_BYTES
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    weights = moerunner.ExpertWeights(w13, w2)
    act = moerunner.Activation("silu")
    prepared = moerunner.backends.triton.TritonBackend(TritonOptions(autotune="off"))
    prepared = prepared.prepare_weights(weights, weights.spec(act))
    hidden = torch.randn(4, h)
    for _ in range(2):  # made on the keeper's path, then in the calling thread
        with _launch.recording() as rec:
            _, ws, _ = experts.sequence_workspace(hidden, rows, 1, prepared)
        ((make, tensors),) = rec.buffers
        assert tensors == (ws["inter"],) and ws["inter"].shape == (rows, i)
        held = [c.cell_contents for c in make.__closure__ or ()]
        assert not any(isinstance(v, torch.Tensor) for v in held), held
    workspaces.WORKSPACES.clear()


def test_plans_are_off_on_cpu_and_under_the_interpreter():
    assert not _plan.enabled(TritonOptions(), torch.device("cpu"))


# -- GPU ------------------------------------------------------------------------------------

E, K, H, I = 16, 4, 256, 128


def _weights(scheme, device):
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    if scheme == "bf16":
        return w13.bfloat16(), w2.bfloat16()
    return moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)


def _plans_against_unplanned(weights, tokens, top_k, what):
    """Four calls (compile, record, replay, replay; new inputs each) through the triton backend
    and through one with launch plans off, bit for bit equal; the plans recorded."""
    from moerunner.api import run_experts

    dev, num_experts, hidden = weights.device, weights.num_experts, weights.hidden_size
    planned = moerunner.MoeRunner("triton")
    registry = moerunner.default_registry().copy()
    registry.register_backend(
        moerunner.backends.triton.TritonBackend(
            TritonOptions(launch_cache=False), name="triton-unplanned"
        )
    )
    unplanned = moerunner.MoeRunner("triton-unplanned", registry=registry)
    act = moerunner.Activation("silu")
    for step in range(4):
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        tk = moerunner.select_experts(torch.randn(tokens, num_experts, device=dev), top_k)
        got = run_experts(planned, weights, x, tk.weights, tk.ids, act)
        want = run_experts(unplanned, weights, x, tk.weights, tk.ids, act)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (what, step)
    spec = weights.spec(act)
    problem = moerunner.backends.base.MoeProblem.of(x, weights, spec, "standard")
    prepared = moerunner.runner.prepared_for(planned, weights, problem, spec)
    return [p for p in prepared.tensors["plans"].values() if isinstance(p, _plan.LaunchPlan)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "mxfp4", "int4_g128"])
def test_replayed_call_equals_the_unplanned_call(scheme, tokens):
    weights = moerunner.ExpertWeights(*_weights(scheme, torch.device("cuda")))
    assert _plans_against_unplanned(weights, tokens, K, (scheme, tokens)), "no plan recorded"


@pytest.mark.gpu
def test_a_call_with_per_call_workspaces_replays_its_plan():
    """A prefill-sized call whose intermediate buffer is above ``PER_CALL_BYTES`` (not kept)
    still replays a plan, which makes that buffer again per call, and computes what the
    unplanned call computes."""
    from moerunner.backends.triton import workspaces

    dev = torch.device("cuda")
    e, h, i, k, t = 8, 256, 2048, 8, 4608  # inter: 36864 x 2048 bf16 = 144 MiB
    assert t * k * i * 2 > workspaces.PER_CALL_BYTES
    torch.manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=dev) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev) * i**-0.5).bfloat16()
    plans = _plans_against_unplanned(moerunner.ExpertWeights(w13, w2), t, k, "per call")
    assert plans and all(p.made > 0 for p in plans)
    # A plan keeps its make functions: none may hold a call's tensors (they would live on).
    for plan in plans:
        for make, _ in plan.makes:
            held = [c.cell_contents for c in make.__closure__ or ()]
            assert not any(isinstance(v, torch.Tensor) for v in held), held


@pytest.mark.gpu
def test_replay_follows_alignment_stream_and_evicted_workspaces():
    from moerunner.backends.triton import experts

    dev = torch.device("cuda")
    w13, w2 = _weights("bf16", dev)
    ref = moerunner.MoeRunner("torch")
    tri = moerunner.MoeRunner("triton")
    weights = moerunner.ExpertWeights(w13, w2)
    act = moerunner.Activation("silu")
    from moerunner.api import run_experts

    def check(x, tk):
        got = run_experts(tri, weights, x, tk.weights, tk.ids, act)
        want = run_experts(ref, weights, x, tk.weights, tk.ids, act).float()
        torch.cuda.synchronize()
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()

    base = torch.randn(65, H + 8, device=dev, dtype=torch.bfloat16)
    tk = moerunner.select_experts(torch.randn(8, E, device=dev), K)
    for _ in range(3):
        check(base[:8, :H], tk)
    check(base[:8, 2 : H + 2].contiguous()[:, :], tk)  # other data, same alignment class
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another caller: its own workspaces and plan
        for _ in range(3):
            check(base[:8, :H], tk)
    torch.cuda.synchronize()
    experts.WORKSPACES.clear()  # the plan's buffers are gone: recorded again
    gc.collect()
    for _ in range(3):
        check(base[:8, :H], tk)


@pytest.mark.gpu
def test_replayed_launches_capture_into_a_cuda_graph():
    dev = torch.device("cuda")
    w13, w2 = _weights("bf16", dev)
    x = torch.randn(4, H, device=dev, dtype=torch.bfloat16)
    tk = moerunner.select_experts(torch.randn(4, E, device=dev), K)
    for _ in range(3):  # compile, record a plan, replay it
        eager = moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, backend="triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, backend="triton")
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(out, want) and not torch.equal(out, eager)


def test_direct_launcher_only_for_a_scratch_free_triton_36_launcher(monkeypatch):
    class CudaLauncher:  # the name Triton's NVIDIA driver gives its launcher class
        launch_cooperative_grid, launch_pdl = False, True
        global_scratch_size = profile_scratch_size = 0

        def launch(self, *args):
            pass

        def __call__(self, *args):
            pass

    launcher = CudaLauncher()
    monkeypatch.setattr(_plan, "_TRITON_VERSION", "3.6.0")
    run, extra = _plan._direct_launcher(launcher.__call__)
    assert run == launcher.launch and extra == (False, True, None, None)
    # what ``CompiledKernel.run`` gives: the launcher object itself
    assert _plan._direct_launcher(launcher) == (launcher.launch, (False, True, None, None))
    launcher.global_scratch_size = 128
    assert _plan._direct_launcher(launcher.__call__) is None
    launcher.global_scratch_size = 0
    monkeypatch.setattr(_plan, "_TRITON_VERSION", "3.7.1")  # another argument order there
    assert _plan._direct_launcher(launcher.__call__) is None
    assert _plan._direct_launcher(print) is None
