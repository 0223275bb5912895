"""The Triton routing kernel against select_experts' torch path: the same bits.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by tests/conftest.py before triton is
imported) with fp32/fp16 logits and tiny shapes; the ``gpu`` tests run real model shapes in
bf16/fp32, under CUDA graph capture and with device-to-host synchronisation forbidden.
"""

from __future__ import annotations

import pytest
import torch
from cases import run_without_interpreter

from moerunner import MoeInputError, select_experts
from moerunner.routing import TopK

triton_pkg = pytest.importorskip("moerunner.backends.triton")

from moerunner.backends.triton import _launch, _routing  # noqa: E402

if not triton_pkg.interpreted() and not torch.cuda.is_available():
    pytest.skip("triton backend cannot run here", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same_bits(a: TopK, b: TopK) -> None:
    assert a.ids.dtype == b.ids.dtype == torch.int32
    assert a.weights.dtype == b.weights.dtype == torch.float32
    assert a.ids.shape == b.ids.shape and a.weights.shape == b.weights.shape
    assert torch.equal(a.ids.cpu(), b.ids.cpu()), (a.ids, b.ids)
    # Bit patterns (-0.0 differs from +0.0); every NaN counts as one value (sign and payload
    # of a NaN carry no meaning and differ between libraries).
    wa, wb = (
        torch.nan_to_num(w.cpu(), nan=0.125).view(torch.int32) for w in (a.weights, b.weights)
    )
    assert torch.equal(a.weights.cpu().isnan(), b.weights.cpu().isnan()), (a.weights, b.weights)
    assert torch.equal(wa, wb), (a.weights, b.weights)


def _both(logits: torch.Tensor, top_k: int, **kwargs) -> tuple[TopK, TopK]:
    ref = select_experts(logits, top_k, backend="torch", **kwargs)
    got = select_experts(logits, top_k, backend="triton", **kwargs)
    return ref, got


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


DEEPSEEK = dict(
    scoring_func="sigmoid",
    renormalize=True,
    num_expert_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)

VARIANTS = {
    "softmax": (8, 2, dict()),
    "softmax-renorm": (8, 2, dict(renormalize=True)),
    "softmax-scaled": (16, 4, dict(routed_scaling_factor=2.827)),
    "softmax-E12-k12": (12, 12, dict(renormalize=True)),
    "sigmoid": (8, 3, dict(scoring_func="sigmoid")),
    "sigmoid-renorm": (8, 3, dict(scoring_func="sigmoid", renormalize=True)),
    "sigmoid-bias": (16, 4, dict(scoring_func="sigmoid", renormalize=True, bias=True)),
    "softmax-bias": (16, 4, dict(renormalize=True, bias=True)),
    "deepseek-like": (16, 4, dict(DEEPSEEK, bias=True)),
    "grouped-no-bias": (16, 3, dict(num_expert_group=4, topk_group=3, renormalize=True)),
    "grouped-size-1": (8, 3, dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4)),
    "grouped-size-5": (20, 6, dict(DEEPSEEK, num_expert_group=4, topk_group=2, bias=True)),
    "grouped-all-kept": (12, 12, dict(scoring_func="sigmoid", num_expert_group=3, topk_group=3)),
    "E1": (1, 1, dict(renormalize=True)),
    "topk-sigmoid": (8, 1, dict(scoring_func="topk_sigmoid")),
    # (the kernel chose on the scores plus the bias, not on the logits plus the bias)
    "topk-sigmoid-bias": (16, 2, dict(scoring_func="topk_sigmoid", bias=True)),
}


def _case(name: str, num_tokens: int, seed: int, ties: bool, dtype=torch.float32):
    num_experts, top_k, kwargs = VARIANTS[name]
    kwargs = dict(kwargs)
    gen = _gen(seed)
    if ties:  # few distinct values: ties inside rows, between groups and at the k-th slot
        logits = torch.randint(-2, 3, (num_tokens, num_experts), generator=gen).float() * 0.5
    else:
        logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    if kwargs.pop("bias", False):
        bias = torch.randint(-1, 2, (num_experts,), generator=gen).float() * 0.25
        if not ties:
            bias = bias + torch.randn(num_experts, generator=gen) * 0.1
        kwargs["correction_bias"] = bias.to(DEVICE)
    return logits.to(dtype).to(DEVICE), top_k, kwargs


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_bit_identical_to_torch_path(name, ties):
    logits, top_k, kwargs = _case(name, 9, seed=len(name), ties=ties)
    _same_bits(*_both(logits, top_k, **kwargs))


def test_topk_sigmoid_with_bias_chooses_on_logits_plus_bias():
    """Independent of the torch path: logit 3 beats -2 + 0.9 (choosing on sigmoid(-2) + 0.9
    picked expert 3); the weight is sigmoid of the chosen logit."""
    logits = torch.tensor([[3.0, 0.0, -1.0, -2.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9], device=DEVICE)
    for backend in ("torch", "triton"):
        got = select_experts(
            logits, 1, scoring_func="topk_sigmoid", correction_bias=bias, backend=backend
        )
        assert got.ids.tolist() == [[0]], (backend, got)
        assert abs(got.weights.item() - 1 / (1 + 2.718281828459045**-3)) < 1e-7, backend


@pytest.mark.parametrize("name", ["softmax-renorm", "deepseek-like", "topk-sigmoid-bias"])
def test_kernel_float64_logits(name):
    """float64 logits are rounded to float32 on both paths (the torch path used to score the
    float64 values: other ids and weights than the kernel's)."""
    logits, top_k, kwargs = _case(name, 7, seed=5, ties=False, dtype=torch.float64)
    logits = logits * 3 + 1e-6  # (values whose float32 rounding matters)
    ref, got = _both(logits, top_k, **kwargs)
    _same_bits(ref, got)
    _same_bits(ref, select_experts(logits.float(), top_k, backend="torch", **kwargs))


@pytest.mark.parametrize("name", ["softmax-renorm", "deepseek-like"])
def test_kernel_fp16_logits(name):
    logits, top_k, kwargs = _case(name, 5, seed=3, ties=False, dtype=torch.float16)
    _same_bits(*_both(logits, top_k, **kwargs))


def test_ties_go_to_the_lowest_index_first():
    """Hand-checked: slots by descending score, equal scores by ascending expert id."""
    logits = torch.tensor([[1.0, 3.0, 1.0, 3.0, 0.0, 1.0]], device=DEVICE)
    for backend in ("torch", "triton"):
        topk = select_experts(logits, 4, backend=backend)
        assert topk.ids.tolist() == [[1, 3, 0, 2]], backend


def test_group_ties_keep_the_lowest_groups():
    # Four groups of two with equal group scores: groups 0 and 1 stay eligible.
    logits = torch.zeros(1, 8, device=DEVICE)
    for backend in ("torch", "triton"):
        topk = select_experts(
            logits, 4, scoring_func="sigmoid", num_expert_group=4, topk_group=2, backend=backend
        )
        assert topk.ids.tolist() == [[0, 1, 2, 3]], backend


def test_signed_zero_and_special_values():
    """-0.0 ties +0.0; NaN rows, -inf and +inf logits give the same bits as the torch path."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [-0.0, 0.0, -0.0, 0.0],
            [nan, 1.0, 2.0, 0.0],
            [-inf, 1.0, -inf, 0.5],
            [inf, 1.0, 0.0, 0.5],
            [-inf, -inf, -inf, -inf],
        ],
        device=DEVICE,
    )
    for kwargs in (dict(), dict(renormalize=True), dict(scoring_func="sigmoid")):
        _same_bits(*_both(logits, 2, **kwargs))
    bias = torch.tensor([-0.0, 0.0, 0.0, -0.0], device=DEVICE)
    _same_bits(*_both(logits, 2, scoring_func="sigmoid", correction_bias=bias))


def test_larger_rows_and_blocks():
    """E = 256 (DeepSeek-V3 routing: 8 groups, top 4, k 8) over more rows than one block, and
    a non-contiguous view of the logits."""
    gen = _gen(5)
    logits = torch.randn(11, 256, generator=gen).to(DEVICE)
    bias = (torch.randn(256, generator=gen) * 0.05).to(DEVICE)
    kw = dict(DEEPSEEK, num_expert_group=8, topk_group=4, correction_bias=bias)
    _same_bits(*_both(logits, 8, **kw))
    wide = torch.randn(6, 40, generator=gen).to(DEVICE)
    view = wide[:, 4:36]  # stride 40, 32 experts
    _same_bits(*_both(view, 4, renormalize=True))


def test_empty_batch_launches_nothing(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched a kernel for T = 0")

    monkeypatch.setattr(_launch, "launch", no_launch)
    bias = torch.zeros(8, device=DEVICE)
    topk = select_experts(
        torch.zeros(0, 8, device=DEVICE),
        2,
        scoring_func="sigmoid",
        correction_bias=bias,
        num_expert_group=4,
        topk_group=2,
        backend="triton",
    )
    assert topk.ids.shape == (0, 2) and topk.weights.shape == (0, 2)
    assert topk.ids.dtype == torch.int32 and topk.weights.dtype == torch.float32


def test_auto_uses_the_kernel_only_for_cuda_logits(monkeypatch):
    calls = []
    real = _routing.route

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    from moerunner import routing

    monkeypatch.setattr(routing, "_kernel_route", lambda: spy)  # (the import is cached)
    select_experts(torch.randn(3, 8, device=DEVICE), 2)
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
    select_experts(torch.randn(3, 8, device=DEVICE), 2, backend="torch")
    assert len(calls) == (1 if DEVICE == "cuda" else 0)


def test_triton_backend_without_triton_is_named(monkeypatch):
    from moerunner import BackendUnavailableError, routing

    monkeypatch.setattr(routing, "_kernel_route", lambda: None)
    with pytest.raises(BackendUnavailableError, match="triton"):
        select_experts(torch.randn(3, 8), 2, backend="triton")
    select_experts(torch.randn(3, 8, device=DEVICE), 2)  # auto: the torch path


def test_bad_backend_is_named():
    with pytest.raises(MoeInputError, match="backend"):
        select_experts(torch.randn(3, 8), 2, backend="cuda")


def test_bias_on_another_device_is_named():
    if DEVICE != "cuda":
        pytest.skip("needs two devices")
    with pytest.raises(MoeInputError, match="correction_bias"):
        select_experts(
            torch.randn(3, 8, device="cuda"),
            2,
            scoring_func="sigmoid",
            correction_bias=torch.zeros(8),
            backend="triton",
        )


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moerunner.backends.triton import _routing as R

fn = R._routing_kernel
for logits, e, k, t, groups, sigmoid, group_max, on_logits in [
    ("*bf16", 256, 8, 64, 8, True, False, False),  # DeepSeek-V3
    ("*fp32", 128, 8, 1, 0, False, False, False),  # Qwen3
    ("*bf16", 8, 2, 64, 0, False, False, False),  # Mixtral
    ("*bf16", 64, 6, 16, 8, False, True, False),  # DeepSeek-V2 (groups ranked by their max)
    ("*bf16", 16, 1, 16, 0, False, False, True),  # Llama-4 (top-1 on logits, then sigmoid)
]:
    e2 = 1 << (e - 1).bit_length()
    block_t = max(1, min(t, R._TILE // e2))
    k2 = 1 << (k - 1).bit_length()
    consts = dict(NUM_EXPERTS=e, TOP_K=k, E_POW2=e2, K_POW2=k2, BLOCK_T=block_t,
                  SIGMOID=sigmoid, HAS_BIAS=sigmoid, NUM_GROUPS=groups,
                  GROUP_SIZE=e // groups if groups else 1, TOPK_GROUP=groups // 2,
                  G_POW2=max(groups, 1), RENORMALIZE=True, SCALED=sigmoid, PDL=True,
                  GROUP_MAX=group_max, ON_LOGITS=on_logits)
    sig = dict(logits_ptr=logits, bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32",
               num_tokens="i32", stride_lt="i32", scale="fp32", **{c: "constexpr" for c in consts})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    if not on_logits:  # (a sigmoid of the chosen logits only: float32)
        assert "__nv_exp" in compiled.asm["ptx"], "fp64 exp must be libdevice's"
print("compiled")
"""


@pytest.mark.slow
def test_kernel_compiles_for_hopper():
    """The interpreter runs Python, not the compiler: compile the DeepSeek-V3, Qwen3 and
    Mixtral variants for sm_90 (Triton's own ptxas; nothing runs) to catch what only the
    compiler rejects, e.g. a non-constexpr global in the kernel."""
    pytest.importorskip("triton.backends.nvidia")
    res = run_without_interpreter(["-c", _COMPILE_FOR_HOPPER], timeout=500)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


# --- other output dtypes; the kernel under torch.compile -------------------------------------

# bf16 stores truncate under Triton's interpreter (ENVIRONMENT.md); on a GPU they round to
# nearest even, as torch's cast does (checked there).
OUT_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _same_bits_as(ref: TopK, got: TopK, weights_dtype, ids_dtype) -> None:
    assert got.weights.dtype == ref.weights.dtype == weights_dtype
    assert got.ids.dtype == ref.ids.dtype == ids_dtype
    assert torch.equal(ref.ids.cpu(), got.ids.cpu()), (ref.ids, got.ids)
    bits = torch.int16 if weights_dtype != torch.float32 else torch.int32
    assert torch.equal(ref.weights.cpu().view(bits), got.weights.cpu().view(bits)), (ref, got)


@pytest.mark.parametrize("weights_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["softmax-renorm", "deepseek-like", "topk-sigmoid-bias"])
def test_other_output_dtypes_are_the_float32_weights_rounded_once(name, weights_dtype):
    """The kernel stores bf16 / fp16 weights and int64 ids directly; the torch path casts.
    Both equal the default outputs converted by torch (independent of either path's code)."""
    logits, top_k, kwargs = _case(name, 9, seed=11, ties=False)
    default = select_experts(logits, top_k, backend="torch", **kwargs)
    want = TopK(weights=default.weights.to(weights_dtype), ids=default.ids.long())
    for backend in ("torch", "triton"):
        got = select_experts(
            logits,
            top_k,
            backend=backend,
            weights_dtype=weights_dtype,
            ids_dtype=torch.int64,
            **kwargs,
        )
        _same_bits_as(want, got, weights_dtype, torch.int64)


def test_other_output_dtypes_of_a_custom_routing_function():
    got = select_experts(
        torch.randn(3, 4),
        2,
        custom_routing_function=lambda h, lg, k, r: (
            torch.full((3, k), 0.5, dtype=torch.bfloat16),
            torch.tensor([[1, 2]] * 3),
        ),
        weights_dtype=torch.bfloat16,
        ids_dtype=torch.int64,
    )
    assert got.weights.dtype == torch.bfloat16 and got.ids.dtype == torch.int64
    assert got.ids.tolist() == [[1, 2]] * 3 and got.weights.float().eq(0.5).all()


@pytest.mark.parametrize(
    "arg, value",
    [("weights_dtype", torch.float64), ("weights_dtype", "bf16"), ("ids_dtype", torch.int16)],
)
def test_bad_output_dtypes_are_named(arg, value):
    with pytest.raises(MoeInputError, match=f"{arg}: got .*; accepted: torch"):
        select_experts(torch.randn(3, 8), 2, **{arg: value})


def test_compiled_routing_is_one_graph_node():
    """Under ``torch.compile(fullgraph=True)`` the kernel is the custom op ``moerunner::route``
    (before: ``auto`` took the torch path's sorts there, and ``triton`` failed to trace), with
    the same bits as the torch path, in the dtypes asked for."""
    seen = []

    def recording(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return lookup_backend("aot_eager")(gm, example_inputs)

    logits, top_k, kwargs = _case("deepseek-like", 6, seed=2, ties=False)
    backend = "auto" if DEVICE == "cuda" else "triton"  # (auto: the kernel for CUDA logits)
    for ids_dtype in (torch.int32, torch.int64):
        torch._dynamo.reset()
        seen.clear()
        fn = torch.compile(
            lambda lg, ids_dtype=ids_dtype: select_experts(
                lg, top_k, backend=backend, ids_dtype=ids_dtype, **kwargs
            ),
            fullgraph=True,
            backend=recording,
        )
        got = fn(logits)
        assert any("moerunner.route" in targets for targets in seen), seen
        assert not any("sort" in t for targets in seen for t in targets), seen
        ref = select_experts(logits, top_k, backend="torch", ids_dtype=ids_dtype, **kwargs)
        _same_bits_as(ref, got, torch.float32, ids_dtype)
    torch._dynamo.reset()


def test_traced_routing_code_calls_no_locals():
    """``torch.compile`` traces ``select_experts`` down to the graph node; torch 2.11's dynamo
    cannot trace ``locals()`` under Python 3.12 (inlined comprehensions), where the GPU
    suite's compiled tests failed with it (Python 3.11 traces it: no run here would)."""
    import ast
    import inspect

    from moerunner import routing

    for fn in (routing.select_experts, routing._kernel, routing._kernel_route, routing._route_node):
        tree = ast.parse(inspect.getsource(fn))
        calls = [
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        ]
        assert "locals" not in calls, fn.__name__


def test_route_op_contract():
    """The op's schema, fake (shapes and dtypes without running) and dispatch checks."""
    logits, top_k, kwargs = _case("deepseek-like", 5, seed=4, ties=False)
    args = (
        logits,
        kwargs["correction_bias"],
        top_k,
        "sigmoid",
        True,
        4,
        2,
        2.5,
        "top2_sum",
        torch.float16,
        torch.int64,
    )
    torch.library.opcheck(torch.ops.moerunner.route.default, args)
    empty = torch.ops.moerunner.route(logits[:0], *args[1:])
    assert empty[0].shape == (0, top_k) and empty[1].dtype == torch.int64


# --- GPU: real shapes, bf16 and fp32, graph capture, no host synchronisation -----------------

REAL_SHAPES = {
    "deepseek-v3": (256, 8, dict(DEEPSEEK, num_expert_group=8, topk_group=4, bias=True)),
    "qwen3-moe": (128, 8, dict(renormalize=True)),
    "mixtral": (8, 2, dict(renormalize=True)),
}


def _real_case(name: str, num_tokens: int, dtype: torch.dtype, seed: int = 0):
    num_experts, top_k, kwargs = REAL_SHAPES[name]
    kwargs = dict(kwargs)
    gen = _gen(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype).cuda()
    if kwargs.pop("bias", False):
        kwargs["correction_bias"] = (torch.randn(num_experts, generator=gen) * 0.05).cuda()
    return logits, top_k, kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 1024, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_gpu_real_shapes_bit_identical(name, dtype, num_tokens):
    logits, top_k, kwargs = _real_case(name, num_tokens, dtype)
    _same_bits(*_both(logits, top_k, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_gpu_graph_capture_and_no_host_sync(name):
    logits, top_k, kwargs = _real_case(name, 16, torch.bfloat16, seed=1)
    ref = select_experts(logits, top_k, backend="torch", **kwargs)
    select_experts(logits, top_k, **kwargs)  # compile and cache outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = select_experts(logits, top_k, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _same_bits(ref, got)

    static = logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        select_experts(static, top_k, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select_experts(static, top_k, **kwargs)
    other, _, _ = _real_case(name, 16, torch.bfloat16, seed=2)
    static.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    _same_bits(select_experts(other, top_k, backend="torch", **kwargs), captured)


def test_logits_that_need_gradients_are_routed_differentiably():
    """The kernel has no backward: ``auto`` takes the torch path for logits that require grad
    (on CUDA too, where it would take the kernel), so their gradient is the torch path's;
    ``backend="triton"`` refuses them instead of returning weights without a graph."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 16, generator=g).to(DEVICE).requires_grad_(True)
    probe = torch.randn(9, 4, generator=g).to(DEVICE)
    auto = select_experts(logits, 4, renormalize=True)
    assert auto.weights.requires_grad
    (grad,) = torch.autograd.grad((auto.weights * probe).sum(), logits)
    # float64 autograd of the same softmax -> top-k -> renormalize on the chosen ids.
    l64 = logits.detach().cpu().double().requires_grad_(True)
    w64 = torch.softmax(l64, -1).gather(1, auto.ids.cpu().long())
    w64 = w64 / w64.sum(-1, keepdim=True)
    (want,) = torch.autograd.grad((w64 * probe.cpu().double()).sum(), l64)
    torch.testing.assert_close(grad.cpu().double(), want, rtol=1e-5, atol=1e-7)
    with pytest.raises(MoeInputError, match="no backward"):
        select_experts(logits, 4, backend="triton")
    with torch.no_grad():  # no gradients needed: the kernel serves
        _same_bits(select_experts(logits, 4, backend="triton"), select_experts(logits, 4))
