"""Conformance cases as rows, and the matrix generated from the registry.

Every registered backend that is available here is crossed with every path it registers
(fused op, permute path) and every case row; a combination the backend does not claim is
skipped by the same ``supports()`` the selector uses, so tests never silently cover less
than a backend claims.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import STANDARD
from moerunner.testing import DTYPE_BOUND
from moerunner.weights import ExpertWeights


def interpreted_triton() -> bool:
    """Whether the triton backend runs CPU tensors here: under Triton's interpreter (CPU
    runs, CI). On a CUDA machine the interpreter is off and triton takes CUDA tensors only."""
    try:
        from moerunner.backends.triton import interpreted
    except ImportError:
        return False
    return interpreted()


def cpu_backends() -> list:
    """The backend rows of tests whose tensors live on the CPU: torch, and triton where it
    runs them (``interpreted_triton``); elsewhere the triton row says why it is skipped
    instead of failing in backend selection (the gpu-marked tests run triton there)."""
    import pytest

    reason = "CPU tensors: triton runs them under its interpreter only (CPU runs)"
    return [
        "torch",
        pytest.param("triton", marks=pytest.mark.skipif(not interpreted_triton(), reason=reason)),
    ]


# One quantized scheme of each family the triton kernels implement (the kernel test subset),
# and the packed 4-bit ones among them (split layout, in-kernel decode).
PACKED_SCHEMES = ["int4", "int4_g32_zp", "mxfp4", "mxfp4_mxfp8", "nvfp4"]
TRITON_QUANT_SCHEMES = [
    "fp8_tensor",
    "fp8_channel",
    "fp8_block",
    "int8",
    "int8_w8a16",
    *PACKED_SCHEMES,
    "mxfp8",
    "fp8_block_64x64",
    "fp8_block_128x64",
    "int8_g64",
    "int8_g128_zp",
]


@dataclass(frozen=True)
class Case:
    """One MoE call. ``routing``: random | one_expert | half_experts | with_skips | all."""

    name: str
    tokens: int = 7
    experts: int = 4
    hidden: int = 32
    inter: int = 24
    top_k: int = 2
    activation: str = "silu"
    bias: bool = False
    interleaved: bool = False
    routing: str = "random"
    seed: int = 0

    def build(self, dtype: torch.dtype, device: str = "cpu"):
        """Random inputs for the case: (x, ExpertWeights, topk weights, topk ids)."""
        gen = torch.Generator().manual_seed(self.seed)
        gated = moerunner.Activation(self.activation).gated
        rows = 2 * self.inter if gated else self.inter

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

        x = rand(self.tokens, self.hidden)
        w13 = rand(self.experts, rows, self.hidden, scale=self.hidden**-0.5)
        w2 = rand(self.experts, self.hidden, self.inter, scale=self.inter**-0.5)
        b13 = rand(self.experts, rows, scale=0.1) if self.bias else None
        b2 = rand(self.experts, self.hidden, scale=0.1) if self.bias else None
        weights = ExpertWeights(w13, w2, b13, b2, self.interleaved)
        logits = torch.randn(self.tokens, self.experts, generator=gen)
        if self.routing == "one_expert":
            logits[:, 1] += 100.0
        if self.routing == "half_experts":
            logits[:, self.experts // 2 :] -= 100.0
        topk = moerunner.select_experts(logits, self.top_k, renormalize=True)
        ids = topk.ids
        if self.routing == "with_skips":
            ids = ids.clone()
            ids[::2, 0] = -1
        return x, weights, topk.weights.to(device), ids.to(device)


CASES = [
    Case("T0", tokens=0),
    Case("T1", tokens=1),
    Case("empty_experts", tokens=5, experts=8, routing="half_experts"),
    Case("all_on_one_expert", routing="one_expert"),
    Case("topk_equals_E", top_k=4),
    Case("I61", inter=61),
    Case("I17", inter=17),
    Case("I1", inter=1),
    Case("bias", bias=True),
    Case("minus_one_ids", routing="with_skips"),
    Case("gelu", activation="gelu"),
    Case("gelu_tanh", activation="gelu_tanh"),
    Case("relu2", activation="relu2", inter=17),
    Case("relu2_bias", activation="relu2", bias=True),
    Case("silu_no_mul", activation="silu_no_mul", inter=17),
    Case("gelu_no_mul_bias", activation="gelu_no_mul", bias=True),
    Case("gelu_tanh_no_mul", activation="gelu_tanh_no_mul"),
    Case("swiglu_oai", activation="swiglu_oai", bias=True, interleaved=True),
    Case("swiglu_step", activation="swiglu_step", bias=True),
    Case("situ", activation="situ", bias=True),
    Case("silu_interleaved", interleaved=True),
]

# Relative-error bounds per dtype, justified where they are defined (moerunner.testing).
TOLERANCE = DTYPE_BOUND


def gpt_oss_experts(scheme: str, E: int, H: int, I: int, device) -> ExpertWeights:
    """Random GPT-OSS-style experts quantized as ``scheme``: interleaved gate/up rows, biases."""
    return ExpertWeights(
        moerunner.quantize(torch.randn(E, 2 * I, H, device=device) / H**0.5, scheme),
        moerunner.quantize(torch.randn(E, H, I, device=device) / I**0.5, scheme),
        torch.randn(E, 2 * I, device=device) * 0.1,
        torch.randn(E, H, device=device) * 0.1,
        True,
    )


def random_experts(scheme: str, activation: str, E: int, H: int, I: int, device) -> ExpertWeights:
    """Random experts for ``activation`` in ``scheme`` ("fp32": unquantized): gate then up rows,
    or for swiglu_oai interleaved rows with biases (GPT-OSS style)."""
    gated = moerunner.Activation(activation).gated
    n13 = 2 * I if gated else I
    w13 = torch.randn(E, n13, H, device=device) / H**0.5
    w2 = torch.randn(E, H, I, device=device) / I**0.5
    if scheme != "fp32":
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    interleaved = activation == "swiglu_oai"
    b13 = torch.randn(E, n13, device=device) * 0.1 if interleaved else None
    b2 = torch.randn(E, H, device=device) * 0.1 if interleaved else None
    return ExpertWeights(w13, w2, b13, b2, interleaved)


def gpu_experts(scheme: str, E: int, H: int, I: int, device) -> tuple[ExpertWeights, str]:
    """(experts, activation) for GPU tests: GPT-OSS-style for mxfp4, else DeepSeek-style (gate
    then up rows, silu) in bf16 or quantized as ``scheme``."""
    if scheme == "mxfp4":
        return gpt_oss_experts("mxfp4", E, H, I, device), "swiglu_oai"
    w13 = torch.randn(E, 2 * I, H, device=device) / H**0.5
    w2 = torch.randn(E, H, I, device=device) / I**0.5
    if scheme == "bf16":
        return ExpertWeights(w13.bfloat16(), w2.bfloat16()), "silu"
    return ExpertWeights(moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)), "silu"


def split_k_counts(workspaces) -> list[torch.Tensor]:
    """Every split-K count buffer a triton workspace cache (``experts.WORKSPACES``) holds
    (keys: caller, then ``workspaces.split_k_workspace``'s key)."""
    return [v["count"] for k, v in workspaces.entries.items() if k[2:3] == ("split_k",)]


def backend_paths(dispatch_format: str = STANDARD):
    """(backend, force_permute) for every available backend and every path it registers."""
    registry = moerunner.default_registry()
    result = []
    for name, backend in registry.backends.items():
        ok, _ = backend.available()
        if not ok:
            continue
        if dispatch_format in backend.fused_ops:
            result.append((name, False))
        if backend.core is not None:
            result.append((name, True))
    return result


def supports(backend: str, x: torch.Tensor, weights: ExpertWeights, activation: str):
    """The selector's own verdict for this call."""
    registry = moerunner.default_registry()
    act = moerunner.Activation(activation)
    problem = MoeProblem.of(x, weights, weights.spec(act), STANDARD)
    return registry.backends[backend].supports(problem)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """``moerunner ARGV`` in process: (exit status, stdout, stderr)."""
    from moerunner.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def cli_usage_error(code, err: str, command: str) -> str:
    """Assert a usage error of ``moerunner COMMAND`` (status 2, one line, no traceback);
    return that line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"moerunner {command}: error: " if command else "moerunner: error:")
    return lines[0]


class OpCalls(TorchDispatchMode):
    """Notes ``note(name, args, out)`` of every run of the named aten ops (overload packet
    names such as ``"_grouped_mm"``), in order, in ``self.calls``: which kernels a call ran,
    in which dtype, on which shapes, without patching the library."""

    def __init__(self, names, note: Callable = lambda name, args, out: name) -> None:
        super().__init__()
        self.names, self.note, self.calls = frozenset(names), note, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.names:
            self.calls.append(self.note(name, args, out))
        return out


class _UndefinedRowsMm(torch.autograd.Function):
    """PyTorch's grouped GEMM with the rows it leaves undefined made NaN: rows past the last
    group of its output and of its input's gradient (the CUDA kernel leaves them as memory
    was); its weight gradient reads the groups' rows alone, as the kernel does."""

    @staticmethod
    def forward(ctx, a, b, ends):
        ctx.save_for_backward(a, b, ends)
        return _nan_past(torch._grouped_mm(a, b, offs=ends), ends)

    @staticmethod
    def backward(ctx, grad):
        a, b, ends = ctx.saved_tensors
        end = int(ends[-1])
        grad_a = _nan_past(torch._grouped_mm(grad, b.transpose(-2, -1), offs=ends), ends)
        return grad_a, torch._grouped_mm(a[:end].T, grad[:end], offs=ends), None


def _nan_past(out, ends):
    out[int(ends[-1]) :] = float("nan")
    return out


def undefined_rows_mm(a: torch.Tensor, b: torch.Tensor, ends=None, *, offs=None) -> torch.Tensor:
    """A grouped GEMM (``torch._grouped_mm``'s arguments: the ends positionally or as
    ``offs``) whose undefined rows are NaN (``_UndefinedRowsMm``): to show on the CPU that a
    form running without a host read keeps those rows out of every defined value."""
    return _UndefinedRowsMm.apply(a, b, ends if offs is None else offs)


def align_buffers(num_rows, num_experts, block_m, device):
    """The alignment's outputs for ``num_rows`` ids (sorted rows, block experts, used
    length), the first two filled with -7 so a slot left unwritten shows."""
    from moerunner.backends.triton import _align

    cap = _align.max_padded_rows(num_rows, num_experts, block_m)
    s = torch.full((cap,), -7, dtype=torch.int32, device=device)
    b = torch.full((cap // block_m,), -7, dtype=torch.int32, device=device)
    return s, b, torch.empty(1, dtype=torch.int32, device=device)


def align_reference(row_expert, num_experts, block_m):
    """Sort-based alignment in PyTorch: stable order within each expert, sentinel padding."""
    rows = row_expert.shape[0]
    ids = row_expert.cpu().long()
    sorted_rows, block_expert = [], []
    for e in range(num_experts):
        seg = torch.nonzero(ids == e).flatten().tolist()
        if not seg:
            continue
        pad = -len(seg) % block_m
        sorted_rows += seg + [rows] * pad
        block_expert += [e] * ((len(seg) + pad) // block_m)
    return (
        len(sorted_rows),
        torch.tensor(sorted_rows, dtype=torch.int32),
        torch.tensor(block_expert, dtype=torch.int32),
    )


def run_without_interpreter(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python ARGV`` in a process without Triton's interpreter (compiling for a GPU needs
    none), with the repository on its path; skips the test where this Triton build ships no
    ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode and "ptxas" in done.stderr:
        if "not found" in done.stderr or "No such file" in done.stderr:
            pytest.skip("no ptxas in this triton")
    return done
