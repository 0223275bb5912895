"""flashinfer backend on the CPU: registration and availability, what it declares, and the
weight layouts of its ``prepare_weights`` (pure tensor re-arrangements) checked against an
element-wise reading of the layout FlashInfer's SM90 mixed-input GEMM reads.

The GPU suite (tests/backends/test_flashinfer_gpu.py) compares the same layouts bit-exactly
with FlashInfer's own functions and runs the kernels.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.backends.flashinfer import ALIGN, FlashInferBackend
from moerunner.backends.flashinfer.layout import (
    E2m1Sm90Layout,
    deinterleave_e2m1_sm90,
    fold_scales,
    interleave_e2m1_sm90,
    unfold_scales,
    up_gate_rows,
)
from moerunner.registry import DEFAULT_REGISTRY
from moerunner.runner import prepare_for_backend
from moerunner.weights import ExpertWeights

INSTALLED = importlib.util.find_spec("flashinfer") is not None


def _problem(device="cuda", dtype=torch.bfloat16, scheme="bf16", **kw):
    fields = dict(
        device_type=device,
        dtype=dtype,
        w13_scheme=scheme,
        activation="silu",
        dispatch_format="standard",
        hidden_size=256,
        intermediate_size=256,
        num_experts=8,
    )
    fields.update(kw)
    return MoeProblem(**fields)


# --- registration and availability -------------------------------------------------------


def test_registered_and_unavailable_here_with_a_reason():
    backend = DEFAULT_REGISTRY.backends["flashinfer"]
    ok, reason = backend.available()
    assert not ok
    if INSTALLED:  # installed on a machine without a (Hopper) GPU
        assert "GPU" in reason
    else:
        assert reason.startswith("not installed")


def test_auto_never_picks_it_on_cpu():
    problem = _problem(device="cpu", dtype=torch.float32, scheme="fp32")
    selection = DEFAULT_REGISTRY.select(problem)
    assert selection.backend.name != "flashinfer"
    ok, reason = selection.verdicts["flashinfer"]
    assert not ok and reason


def test_info_lists_it():
    out = subprocess.run(
        [sys.executable, "-m", "moerunner", "info"], capture_output=True, text=True, check=True
    ).stdout
    block = out[out.index("[flashinfer]") :]
    first_line = block.splitlines()[0]
    assert "NOT available" in first_line
    if not INSTALLED:
        assert "not installed" in first_line
    assert "mxfp4" in block and "fp8_block" in block
    assert "options: FlashInferOptions(autotune=True, tune_max_tokens=8192" in block


# --- what it declares ---------------------------------------------------------------------

ACCEPTED = [
    _problem(),
    _problem(dtype=torch.float16, scheme="fp16"),
    _problem(scheme="mxfp4", activation="swiglu_oai", has_bias=True, interleaved=True),
    _problem(scheme="mxfp4", activation="swiglu_oai", extended_swiglu=True),
    _problem(scheme="fp8_block"),
]

DECLINED = [
    (_problem(device="cpu"), "device"),
    (_problem(dtype=torch.float32, scheme="fp32"), "dtype"),
    (_problem(dtype=torch.float16, scheme="bf16"), "input dtype"),
    (_problem(dtype=torch.float16, scheme="mxfp4"), "bf16 inputs"),
    (_problem(scheme="nvfp4"), "nvfp4"),
    (_problem(scheme="int4"), "int4"),
    (_problem(scheme="mxfp4_mxfp8"), "W4A16"),
    (_problem(scheme="fp8_tensor"), "128x128"),
    (_problem(scheme="fp8_block_64x64"), "128x128"),
    (_problem(scheme="fp8_block", interleaved=True), "interleaved"),
    (_problem(scheme="fp8_block", intermediate_size=961), "multiple of 128"),
    (_problem(scheme="fp8_block", has_bias=True), "biases"),
    (_problem(scheme="mxfp4", w2_scheme="bf16"), "differ"),
    (_problem(hooks=True), "hooks"),
]


@pytest.mark.parametrize("problem", ACCEPTED, ids=lambda p: p.w13_scheme.name)
def test_supports_what_the_sm90_kernels_implement(problem):
    assert FlashInferBackend().supports(problem) == (True, "")


@pytest.mark.parametrize("problem,word", DECLINED, ids=[w for _, w in DECLINED])
def test_declines_with_a_reason(problem, word):
    ok, reason = FlashInferBackend().supports(problem)
    assert not ok
    assert word in reason


def test_only_the_standard_format_fused():
    assert DEFAULT_REGISTRY.paths("flashinfer") == {"standard": "fused"}


# --- layouts --------------------------------------------------------------------------------

# Where the SM90 mixed-input GEMM reads each e2m1 value of one 32-bit word, element-wise:
# word nibble n (byte n // 2 of the source word; low nibble first) -> (sign bit, bits of
# magnitude bits 0, 1, 2) in the re-laid word. Source word: bytes (r, c), (r + 8, c), (r, c + 4),
# (r + 8, c + 4) of the packed rows; read off the kernel's register layout, one value at a time.
NIBBLE_BITS = {
    0: (15, (6, 7, 8)),
    1: (31, (22, 23, 24)),
    2: (12, (3, 4, 5)),
    3: (28, (19, 20, 21)),
    4: (9, (0, 1, 2)),
    5: (25, (16, 17, 18)),
    6: (14, (13, 10, 11)),
    7: (30, (29, 26, 27)),
}


def _expected_value(out: torch.Tensor, row: int, k: int) -> int:
    """The e2m1 code of element (row, k) read back from the re-laid bytes ``out [N, K/2]``
    through ``NIBBLE_BITS`` and the word placement of a 16 x 64 tile."""
    tile_r, r_in = divmod(row, 16)
    lower, r8 = divmod(r_in, 8)  # lower: the row is r + 8 of its pair
    p, kk = divmod(k, 64)  # 64 values (32 bytes) per partition
    byte, high = divmod(kk, 2)  # byte = 8 * mma + 4 * upper4 + q: column c, or c + 4
    mma, rest = divmod(byte, 8)
    upper4, q = divmod(rest, 4)
    nibble = 2 * (2 * upper4 + lower) + high
    lane = 4 * mma + q
    dst_row = tile_r * 16 + r8 + 8 * (mma % 2)
    dst_byte = 32 * p + 16 * (lane // 8) + 4 * q
    word = sum(int(out[dst_row, dst_byte + j]) << (8 * j) for j in range(4))
    sign_bit, mag_bits = NIBBLE_BITS[nibble]
    mag = sum(((word >> b) & 1) << i for i, b in enumerate(mag_bits))
    return ((word >> sign_bit) & 1) << 3 | mag


def test_e2m1_interleave_matches_the_element_wise_reading():
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (2, 32, 64), dtype=torch.uint8, generator=gen)
    out = interleave_e2m1_sm90(data)
    assert out.shape == data.shape and out.dtype == torch.uint8
    for e in range(2):
        for row in range(32):
            for k in range(128):
                byte = int(data[e, row, k // 2])
                code = byte >> 4 if k % 2 else byte & 0xF
                assert _expected_value(out[e], row, k) == code, (e, row, k)


def test_e2m1_interleave_round_trips_and_moves_every_byte():
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (3, 48, 96), dtype=torch.uint8, generator=gen)
    out = interleave_e2m1_sm90(data)
    assert not torch.equal(out, data)
    assert torch.equal(deinterleave_e2m1_sm90(out), data)
    # a permutation of bits: the number of set bits per expert is kept
    bits = lambda t: torch.tensor([bin(v).count("1") for v in t.flatten().tolist()]).sum()  # noqa: E731
    assert bits(out) == bits(data)


def test_e2m1_interleave_rejects_unaligned_shapes():
    with pytest.raises(ValueError, match="N % 16"):
        interleave_e2m1_sm90(torch.zeros(1, 24, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 64"):
        interleave_e2m1_sm90(torch.zeros(1, 16, 48, dtype=torch.uint8))


def test_fold_scales_element_wise_and_round_trip():
    gen = torch.Generator().manual_seed(2)
    scale = torch.randint(0, 256, (2, 128, 8), dtype=torch.uint8, generator=gen)
    folded = fold_scales(scale)
    assert folded.shape == (2, 2, 2, 16, 16)
    for e in range(2):
        for r in range(128):
            for g in range(8):
                a, rest = divmod(r, 64)
                s, m = divmod(rest, 16)
                b, j = divmod(g, 4)
                assert folded[e, a, b, m, 4 * s + j] == scale[e, r, g]
    assert torch.equal(unfold_scales(folded), scale)
    with pytest.raises(ValueError, match="N % 64"):
        fold_scales(torch.zeros(1, 32, 4, dtype=torch.uint8))


def test_up_gate_rows_plain_and_interleaved():
    e, i, h = 2, 3, 4
    gate = torch.arange(e * i * h, dtype=torch.float32).reshape(e, i, h)
    up = -gate - 1
    gate_up = torch.cat((gate, up), dim=1)
    inter = torch.stack((gate, up), dim=2).reshape(e, 2 * i, h)
    want = torch.cat((up, gate), dim=1)
    assert torch.equal(up_gate_rows(gate_up, False), want)
    assert torch.equal(up_gate_rows(inter, True), want)
    assert torch.equal(up_gate_rows(inter[..., 0], True), want[..., 0])  # a bias


def test_up_gate_rows_moves_mx_scales_with_their_rows():
    w = torch.randn(2, 2 * 64, 64) * torch.logspace(-2, 2, 128)[None, :, None]
    q = moerunner.quantize(w, "mxfp4")
    for interleaved in (False, True):
        moved = up_gate_rows(q, interleaved)
        assert torch.equal(moved.dequantize(), up_gate_rows(q.dequantize(), interleaved))


def _weights(scheme, activation, inter, hidden, bias, interleaved, experts=3):
    gen = torch.Generator().manual_seed(3)
    act = moerunner.Activation(activation)
    rows = 2 * inter if act.gated else inter
    w13 = torch.randn(experts, rows, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    if scheme == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    else:
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    b13 = torch.randn(experts, rows, generator=gen) if bias else None
    return ExpertWeights(w13, w2, b13, None, interleaved), act


def test_prepare_mxfp4_pads_relays_and_inverts():
    # GPT-OSS form at a small size: interleaved rows, biases, clamped SwiGLU; H and I padded
    # (seed 004: an I that is not 128-aligned) to whole 128 blocks, gate and up halves apart.
    weights, act = _weights("mxfp4", "swiglu_oai", 160, 320, True, True)
    backend = FlashInferBackend()
    prepared = prepare_for_backend(backend, weights, weights.spec(act))
    spec, t = prepared.spec, prepared.tensors
    assert (spec.hidden_size, spec.intermediate_size) == (384, 256)
    assert any("padded I 160 -> 256" in n for n in prepared.notes)
    assert (
        t["mode"] == "w4a16" and t["w13"].shape == (3, 512, 192) and t["w2"].shape == (3, 384, 128)
    )
    assert t["quant_scales"][0].dtype == torch.int32
    # invert the re-laying and compare with the canonical padded weight in up-then-gate order
    data13, scale13 = t["layout"].invert(t["w13"], t["quant_scales"][0])
    from moerunner.backends.prepare import pad_to_alignment

    padded, _, _ = pad_to_alignment(weights, weights.spec(act), ALIGN, ALIGN)
    canonical = up_gate_rows(padded.w13, True)
    assert torch.equal(data13, canonical.data) and torch.equal(scale13, canonical.scale)
    # the bias follows the rows, in bf16; w2 has none, so zeros stand in (the kernel takes both)
    assert torch.equal(t["w13_bias"], up_gate_rows(padded.w13_bias, True).bfloat16())
    assert t["w2_bias"].abs().sum() == 0 and t["w2_bias"].shape == (3, 384)
    for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
        assert t[name].shape == (3,) and t[name].dtype == torch.float32
    assert t["swiglu_alpha"][0].item() == pytest.approx(1.702)


def test_prepare_layout_value_round_trips():
    gen = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (2, 64, 64), dtype=torch.uint8, generator=gen)
    scale = torch.randint(100, 140, (2, 64, 4), dtype=torch.uint8, generator=gen)
    d, s = E2m1Sm90Layout().apply(data, scale)
    assert torch.equal(E2m1Sm90Layout().invert(d, s)[0], data)
    assert torch.equal(E2m1Sm90Layout().invert(d, s)[1], scale)


@pytest.mark.parametrize(
    "scheme,activation,mode",
    [("bf16", "silu", "plain"), ("bf16", "relu2", "plain"), ("fp8_block", "silu", "fp8_block")],
)
def test_prepare_plain_and_block_fp8(scheme, activation, mode):
    weights, act = _weights(scheme, activation, 128, 256, False, False)
    prepared = prepare_for_backend(FlashInferBackend(), weights, weights.spec(act))
    t = prepared.tensors
    assert t["mode"] == mode and t["w13_bias"] is None and t["w2_bias"] is None
    w13 = t["w13"].float()
    if scheme == "fp8_block":
        assert t["w13"].dtype == torch.float8_e4m3fn and t["quant_scales"][0].shape == (3, 2, 2)
        expanded = t["quant_scales"][0].repeat_interleave(128, 1).repeat_interleave(128, 2)
        w13 = w13 * expanded
    want = up_gate_rows(weights.w13, False) if act.gated else weights.w13
    want = want.dequantize() if scheme != "bf16" else want.float()
    assert torch.equal(w13, want)


def test_measuring_tunes_exactly_the_counts_a_benchmark_times():
    """``moerunner bench`` / ``tune --backends`` time flashinfer with FlashInfer's autotuner
    profiling exactly the measured counts (each count runs the tactics tuned for it), the
    largest included; the registry the caller passed keeps its backend."""
    from moerunner.backends.flashinfer import FlashInferOptions
    from moerunner.bench.presets import BenchShape
    from moerunner.bench.roofline import DeviceCeilings
    from moerunner.bench.sweep import BenchConfig, Sweep

    backend = FlashInferBackend()
    measured = backend.measuring((0, 16, 1, 16384, 16))
    assert measured is not backend and measured.name == backend.name
    assert measured.options == FlashInferOptions(tune_max_tokens=16384, tune_tokens=(1, 16, 16384))
    assert backend.measuring((1, 64)).options.tune_max_tokens == 8192  # FlashInfer's default
    assert backend.measuring((0,)) is backend  # T = 0 launches nothing, tunes nothing
    off = FlashInferBackend(FlashInferOptions(autotune=False))
    assert off.measuring((1, 16)) is off

    registry = moerunner.default_registry()
    shape = BenchShape("tiny", 4, 32, 32, 2)
    sweep = Sweep(BenchConfig(shapes=(shape,), tokens=(1, 16)), DeviceCeilings("cpu", 1.0))
    assert sweep.registry is not registry
    assert sweep.registry.backends["flashinfer"].options.tune_tokens == (1, 16)
    assert registry.backends["flashinfer"].options.tune_tokens is None
    assert sweep.registry.backends["torch"] is registry.backends["torch"]


def test_module_built_means_prebuilt_or_compiled_before(tmp_path):
    """``ready`` (what ``auto`` asks) holds where FlashInfer's SM90 module loads without a
    build: a prebuilt artifact, or a compiled one in the JIT folder."""
    from moerunner.backends.flashinfer import SM90_MODULES, _module_built

    none = lambda name: ()  # noqa: E731
    assert not _module_built(SM90_MODULES, none, tmp_path)
    assert _module_built(SM90_MODULES, lambda name: ("artifact",), tmp_path)
    (tmp_path / "fused_moe_90_h20_prebuilt_d").mkdir()
    (tmp_path / "fused_moe_90_h20_prebuilt_d" / "fused_moe_90_h20_prebuilt_d.so").touch()
    assert _module_built(SM90_MODULES, none, tmp_path)
    (tmp_path / "fused_moe_90").mkdir()  # a folder without the library is not a build
    assert not _module_built(("fused_moe_90",), none, tmp_path)


# --- kernel choice: FlashInfer's autotuner at the first call of each weight set -------------


class _FakeFlashInfer:
    """Stands in for ``flashinfer.fused_moe`` and its ``autotune``: records each
    ``cutlass_fused_moe`` call and whether it ran inside a tuning context."""

    class ActivationType:
        Swiglu, Geglu, GegluTanh, Relu2 = "Swiglu", "Geglu", "GegluTanh", "Relu2"

    def __init__(self):
        self.calls, self.contexts, self.tuning = [], [], False
        # The custom ops FlashInfer's autotuner has profiled tactics for (None: unknown).
        self.profiled = set()
        self.profiles = True  # whether a tuning call's profiling succeeds

    def profiled_ops(self):
        return self.profiled

    fail = 0  # calls left to fail (a kernel error inside tuning)

    def cutlass_fused_moe(self, x, ids, weights, *, output, **kwargs):
        self.calls.append({"tuning": self.tuning, "tokens": x.shape[0], **kwargs})
        if self.fail:
            self.fail -= 1
            raise RuntimeError("kernel failed")
        if self.tuning and self.profiles and self.profiled is not None:
            self.profiled |= {"trtllm::fused_moe::gemm1", "trtllm::fused_moe::gemm2"}
        output.zero_()

    def autotune(self, tune_mode, **kwargs):
        import contextlib

        fake = self
        fake.contexts.append((tune_mode, kwargs))

        @contextlib.contextmanager
        def ctx():
            fake.tuning = True
            try:
                yield
            finally:
                fake.tuning = False

        return ctx()


def _fake_call(monkeypatch, options):
    from moerunner.backends.flashinfer import _call
    from moerunner.dispatch.formats import StandardDispatchOutput
    from moerunner.routing import TopK

    fake = _FakeFlashInfer()
    monkeypatch.setattr(
        _call,
        "_flashinfer",
        lambda: _call._FlashInfer(fake, fake.ActivationType, fake.autotune, fake.profiled_ops),
    )
    backend = FlashInferBackend(options)
    weights, act = _weights("bf16", "silu", 128, 128, False, False)
    prepared = prepare_for_backend(backend, weights, weights.spec(act))
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 5)
    topk = TopK(torch.full((5, 2), 0.5), ids)

    def call(rows=5):
        routed = TopK(topk.weights[:rows], ids[:rows])
        return _call.fused_standard(StandardDispatchOutput(x[:rows], routed), prepared)

    call.prepared = prepared
    return fake, call


def test_first_call_tunes_once_then_runs_the_chosen_tactics(monkeypatch):
    from moerunner.backends.flashinfer import FlashInferOptions

    options = FlashInferOptions(tune_max_tokens=4096, tune_tokens=(1, 16, 64))
    fake, call = _fake_call(monkeypatch, options)
    call(), call(), call(3)
    assert fake.contexts == [(True, {"tuning_buckets": (1, 16, 64)})]
    assert [c["tuning"] for c in fake.calls] == [True, False, False]
    assert all(c["tune_max_num_tokens"] == 4096 for c in fake.calls)


def test_a_failed_tuning_call_raises_and_the_next_call_tunes_again(monkeypatch):
    fake, call = _fake_call(monkeypatch, None)
    fake.fail = 1
    with pytest.raises(RuntimeError, match="kernel failed"):
        call()
    call(), call()
    assert fake.contexts == [(True, {}), (True, {})]  # FlashInfer's own buckets
    assert [c["tuning"] for c in fake.calls] == [True, True, False]


def test_a_tuning_pass_that_profiled_nothing_warns(monkeypatch):
    """FlashInfer skips every tactic whose profiling fails and runs its fallback tile without
    an error (on an H100 up to 5x slower: its delay-kernel module was missing): the backend
    warns once, naming the GEMMs and what to check; a pass that profiled, or a FlashInfer
    that does not expose its cache, stays silent."""
    import warnings

    fake, call = _fake_call(monkeypatch, None)
    fake.profiles = False
    assert call.prepared.untuned() is None
    with pytest.warns(RuntimeWarning, match="profiled no tactic.*trtllm_utils") as record:
        call()
    assert "trtllm::fused_moe::gemm1" in str(record[0].message)
    # Noted on the weights too: benchmarks mark such rows and `moerunner tune` leaves them out.
    assert "profiled no tactic" in call.prepared.untuned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call()  # tuned once per weight set: no second pass, no second warning
        for profiled in (set(), None):
            fake, call = _fake_call(monkeypatch, None)
            fake.profiled = profiled
            call(), call()
            assert call.prepared.untuned() is None
    assert fake.contexts == [(True, {})]


def test_no_tuning_when_disabled_and_nothing_launched_at_t0(monkeypatch):
    from moerunner.backends.flashinfer import FlashInferOptions

    fake, call = _fake_call(monkeypatch, FlashInferOptions(autotune=False))
    assert call(0).shape == (0, 128) and fake.calls == []
    call()
    assert fake.contexts == [] and [c["tuning"] for c in fake.calls] == [False]
    fake, call = _fake_call(monkeypatch, None)
    call(0)
    assert fake.contexts == []  # T = 0 neither launches nor tunes


def test_capture_before_tuning_warns_runs_untuned_and_tunes_later(monkeypatch):
    fake, call = _fake_call(monkeypatch, None)
    from moerunner.backends.flashinfer import _call

    monkeypatch.setattr(_call, "_capturing", lambda x: True)
    with pytest.warns(RuntimeWarning, match="outside the capture"):
        call()
    call()  # warned once per weight set
    assert fake.contexts == [] and [c["tuning"] for c in fake.calls] == [False, False]
    monkeypatch.setattr(_call, "_capturing", lambda x: False)
    call()
    assert fake.contexts == [(True, {})] and fake.calls[-1]["tuning"]


@pytest.mark.parametrize(
    "kwargs,error,word",
    [
        ({"autotune": 1}, TypeError, "autotune"),
        ({"tune_max_tokens": 2.0}, TypeError, "tune_max_tokens"),
        ({"tune_max_tokens": 0}, ValueError, "tune_max_tokens"),
        ({"tune_tokens": [1, 2]}, TypeError, "tune_tokens"),
        ({"tune_tokens": ()}, TypeError, "tune_tokens"),
        ({"tune_tokens": (1, 9000)}, ValueError, "tune_tokens"),
        ({"tune_tokens": (True,)}, ValueError, "tune_tokens"),
    ],
)
def test_options_reject_bad_values(kwargs, error, word):
    from moerunner.backends.flashinfer import FlashInferOptions

    with pytest.raises(error, match=word):
        FlashInferOptions(**kwargs)


def test_backend_rejects_options_of_another_type():
    with pytest.raises(TypeError, match="options must be a FlashInferOptions"):
        FlashInferBackend({"autotune": False})


def test_options_travel_with_the_prepared_weights_and_key_their_cache():
    from moerunner.backends.flashinfer import FlashInferOptions

    options = FlashInferOptions(autotune=False)
    weights, act = _weights("bf16", "silu", 128, 128, False, False)
    prepared = prepare_for_backend(FlashInferBackend(options), weights, weights.spec(act))
    assert prepared.options is options
    assert FlashInferBackend().options == FlashInferOptions()
    assert hash(options) != hash(FlashInferOptions())
