"""LoRA over the experts, many adapters in one batch, through the runner's hooks.

Each token carries an adapter id (``-1``: none). Per adapter ``a`` and expert ``e`` an
adapter holds low-rank factors for both GEMMs (the punica / S-LoRA formulation that vLLM
and SGLang serve): expert ``e`` of a token with adapter ``a`` computes with
``w13[e] + s_a B13[a, e] A13[a, e]`` and ``w2[e] + s_a B2[a, e] A2[a, e]``. The product is
never formed: the hooks (``moerunner.hooks``) add ``s_a B (A x)`` to GEMM1's output before
the activation ("shrink" ``A x`` to rank r, "expand" by ``B``) and the same with GEMM2's
input to GEMM2's output, so every backend that runs hooks runs LoRA, on both paths of the
standard format.

Shapes (L adapters, E experts, r rank, N13 = w13's rows):

- ``w13_a [L, E, r, H]``, ``w13_b [L, E, N13, r]`` (N13 in w13's row order: gate then up, or
  alternating). A model whose gate and up projections carry separate adapters (PEFT's
  ``gate_proj`` / ``up_proj``) stacks the two A's (rank 2r) and places the two B's block
  diagonally;
- ``w2_a [L, E, r, I]``, ``w2_b [L, E, H, r]``;
- ``scaling``: a number or float ``[L]`` (PEFT: ``lora_alpha / r``).

Rows whose expert is past ``E`` (the shared experts of ``moerunner.shared``) get no delta.

Each hook is a ``LoraDelta``: a callable (the PyTorch form below, which every backend that
runs hooks can call) and at once a declarative record of one GEMM's LoRA that a backend
with its own kernels applies instead (the triton backend's hooked sequence:
``moerunner.backends.triton.lora``, punica-style shrink and expand kernels). The PyTorch
form runs the shrink and expand in float32 on the factors of each row:

- on CPU grouped by (adapter, expert), two GEMMs per group (one host read of the group
  bounds, as the torch backend's experts do);
- elsewhere by gathering each row's factors in chunks of rows (batched GEMMs, no host read,
  CUDA-graph capturable). This reads r x (K + N) factor values per row: cheap at decode,
  the dominant cost of a long prefill.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .device_checks import check_ids_async
from .errors import MoeInputError
from .hooks import HookRows, MoeHooks

__all__ = ["LoraDelta", "MoeLoraWeights", "lora_hooks"]

# Gathered factor elements per chunk of rows (off the CPU): ~16 MiB of float32.
_GATHER_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class MoeLoraWeights:
    """The LoRA factors of L adapters over one layer's experts (module doc for shapes)."""

    w13_a: torch.Tensor
    w13_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    scaling: float | torch.Tensor = 1.0

    @property
    def num_adapters(self) -> int:
        """L."""
        return self.w13_a.shape[0]

    @property
    def num_experts(self) -> int:
        """E covered by the adapters."""
        return self.w13_a.shape[1]

    def __repr__(self) -> str:  # the factors' shapes, not their values
        shapes = ", ".join(
            f"{n}={list(getattr(self, n).shape)}" for n in ("w13_a", "w13_b", "w2_a", "w2_b")
        )
        scaling = self.scaling
        if isinstance(scaling, torch.Tensor):
            scaling = f"tensor{list(scaling.shape)}"
        t = self.w13_a
        return f"MoeLoraWeights({shapes}, scaling={scaling}, {t.dtype}, {t.device})"

    @functools.cached_property
    def scale_per_adapter(self) -> torch.Tensor | None:
        """``scaling`` as float32 ``[L]`` on the factors' device, made on first use and kept
        (the tensor itself where it already is one), so no call converts or copies it; None
        where one number scales every adapter."""
        if not isinstance(self.scaling, torch.Tensor):
            return None
        return self.scaling.to(device=self.w13_a.device, dtype=torch.float32).contiguous()

    def validate(self) -> None:
        """Shapes, dtypes and devices; raises naming the field."""
        names = ("w13_a", "w13_b", "w2_a", "w2_b")
        for name in names:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"lora {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or not t.is_floating_point():
                raise MoeInputError(
                    f"lora {name} must be a floating 4-D [L, E, ., .] tensor, got "
                    f"{t.dtype} {list(t.shape)}"
                )
            if t.device != self.w13_a.device:
                raise MoeInputError(
                    f"lora {name} is on {t.device} but w13_a on {self.w13_a.device}"
                )
        a13, b13, a2, b2 = (getattr(self, n) for n in names)
        lead = tuple(a13.shape[:2])
        if any(tuple(t.shape[:2]) != lead for t in (b13, a2, b2)):
            raise MoeInputError(
                "lora factors must share [L, E]: got "
                + ", ".join(f"{n} {list(getattr(self, n).shape)}" for n in names)
            )
        rank = a13.shape[2]
        if b13.shape[3] != rank or a2.shape[2] != b2.shape[3]:
            raise MoeInputError(
                f"lora ranks differ: w13_a {list(a13.shape)} with w13_b {list(b13.shape)}, "
                f"w2_a {list(a2.shape)} with w2_b {list(b2.shape)} ([L, E, r, K] and [L, E, N, r])"
            )
        if isinstance(self.scaling, torch.Tensor):
            if tuple(self.scaling.shape) != (lead[0],) or not self.scaling.is_floating_point():
                raise MoeInputError(
                    f"lora scaling must be a number or a float [L={lead[0]}] tensor, got "
                    f"{self.scaling.dtype} {list(self.scaling.shape)}"
                )
        elif isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)):
            raise TypeError(f"lora scaling must be a number or a tensor, got {self.scaling!r}")
        elif not math.isfinite(self.scaling):
            raise MoeInputError(f"lora scaling must be finite, got {self.scaling}")
        if lead[0] == 0:
            raise MoeInputError(
                "lora holds no adapters (L = 0): pass hooks=None (or adapter ids of -1) to run "
                "the base experts"
            )

    def check_against(self, w13_rows: int, hidden: int, inter: int) -> None:
        """The factors fit experts of these sizes."""
        want = {"w13_a": hidden, "w13_b": w13_rows, "w2_a": inter, "w2_b": hidden}
        got = {
            "w13_a": self.w13_a.shape[3],
            "w13_b": self.w13_b.shape[2],
            "w2_a": self.w2_a.shape[3],
            "w2_b": self.w2_b.shape[2],
        }
        wrong = [
            f"{n} has {got[n]} where the experts need {want[n]}" for n in want if got[n] != want[n]
        ]
        if wrong and got["w13_b"] == 2 * w13_rows and w13_rows == inter:
            wrong.append(
                "w13_b has the rows of gated experts and these are not (for a checkpoint: "
                "MoeModelShape(..., gated=False))"
            )
        if wrong:
            raise MoeInputError("lora factors do not fit the experts: " + "; ".join(wrong))


def _scales(lora: MoeLoraWeights, adapter_R: torch.Tensor) -> torch.Tensor:
    per_adapter = lora.scale_per_adapter
    if per_adapter is not None:
        return per_adapter.to(adapter_R.device)[adapter_R.clamp(min=0)]
    return torch.full(adapter_R.shape, float(lora.scaling), device=adapter_R.device)


def lora_delta(
    x_RK: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    adapter_R: torch.Tensor,
    expert_R: torch.Tensor,
    scale_R: torch.Tensor,
) -> torch.Tensor:
    """float32 ``[R, N]``: row r's ``scale_R[r] * b[ad, ex] @ (a[ad, ex] @ x_RK[r])`` with
    ``ad, ex = adapter_R[r], expert_R[r]``; 0 where either is -1 (or ``ex`` past E)."""
    num_experts, rank = a.shape[1], a.shape[2]
    rows, n = x_RK.shape[0], b.shape[2]
    valid = (adapter_R >= 0) & (expert_R >= 0) & (expert_R < num_experts)
    out = torch.zeros(rows, n, dtype=torch.float32, device=x_RK.device)
    if rows == 0 or rank == 0:
        return out
    key = torch.where(valid, adapter_R.long() * num_experts + expert_R.long(), -1)
    if x_RK.device.type == "cpu":
        return _grouped_cpu(x_RK, a, b, key, scale_R, out)
    chunk = max(1, _GATHER_ELEMENTS // (rank * (a.shape[3] + n)))
    return _gathered(x_RK, a, b, key, scale_R, out, chunk)


def _gathered(x_RK, a, b, key, scale_R, out, chunk: int):
    """Each row's factors gathered, ``chunk`` rows at a time: batched GEMMs, no host read."""
    groups, rank, n = a.shape[0] * a.shape[1], a.shape[2], b.shape[2]
    a_flat = a.reshape(groups, rank, -1)
    b_flat = b.reshape(groups, n, rank)
    for start in range(0, x_RK.shape[0], chunk):
        k = key[start : start + chunk]
        g = k.clamp(min=0)
        shrunk = torch.bmm(a_flat[g].float(), x_RK[start : start + chunk, :, None].float())
        d = torch.bmm(b_flat[g].float(), shrunk)[:, :, 0]
        scale = torch.where(k >= 0, scale_R[start : start + chunk], 0.0)
        out[start : start + chunk] = d * scale[:, None]
    return out


def _grouped_cpu(x_RK, a, b, key, scale_R, out):
    """Rows grouped by (adapter, expert): two GEMMs per group (host-side bounds)."""
    groups = a.shape[0] * a.shape[1]
    order = torch.argsort(torch.where(key >= 0, key, groups), stable=True)
    counts = torch.bincount(key[key >= 0], minlength=groups).tolist()
    a_flat = a.reshape(groups, a.shape[2], -1)
    b_flat = b.reshape(groups, b.shape[2], -1)
    start = 0
    for g, count in enumerate(counts):
        if count:
            idx = order[start : start + count]
            shrunk = x_RK[idx].float() @ a_flat[g].float().T
            out[idx] = (shrunk @ b_flat[g].float().T) * scale_R[idx, None]
            start += count
    return out


def lora_hooks(lora: MoeLoraWeights, adapter_ids: torch.Tensor, check_ids: bool = True):
    """``MoeHooks`` that apply ``lora`` to the tokens of one call: token ``t`` uses adapter
    ``adapter_ids[t]`` (int ``[T]``; -1: none). ``check_ids``: ids must lie in ``[-1, L)``
    (checked at once on CPU, without a host read on a GPU, as ``fused_moe``'s ids); ids
    outside are skipped."""
    if not isinstance(lora, MoeLoraWeights):
        raise TypeError(f"lora must be a MoeLoraWeights, got {type(lora).__name__}")
    lora.validate()
    if not isinstance(adapter_ids, torch.Tensor):
        raise TypeError(f"adapter_ids must be a torch.Tensor, got {type(adapter_ids).__name__}")
    if adapter_ids.dim() != 1 or adapter_ids.is_floating_point() or adapter_ids.dtype == torch.bool:
        raise MoeInputError(
            f"adapter_ids must be a 1-D integer [T] tensor, got {adapter_ids.dtype} "
            f"{list(adapter_ids.shape)}"
        )
    if adapter_ids.device != lora.w13_a.device:
        raise MoeInputError(
            f"adapter_ids are on {adapter_ids.device} but the lora factors on {lora.w13_a.device}"
        )
    if check_ids and adapter_ids.numel():
        check_ids_async(
            adapter_ids[:, None], lora.num_adapters, where="lora", names=("adapter_ids", "L")
        )
    ids = adapter_ids.long()
    ids = torch.where((ids >= 0) & (ids < lora.num_adapters), ids, -1)
    return MoeHooks(
        gate_up=LoraDelta(lora, ids, "w13"),
        down=LoraDelta(lora, ids, "w2"),
        num_tokens=ids.shape[0],
        num_experts=lora.num_experts,
    )


@dataclass(frozen=True, eq=False)
class LoraDelta:
    """One GEMM's LoRA in one call: ``gemm`` "w13" (the gate/up hook) or "w2" (the down
    hook) of ``lora``, token ``t`` with adapter ``adapter_T[t]`` (int64 ``[T]`` in
    ``[-1, L)``; -1: none). Called as a hook it adds the delta in PyTorch (``lora_delta``);
    a backend that recognises the record may apply it with its own kernels instead."""

    lora: MoeLoraWeights
    adapter_T: torch.Tensor
    gemm: str

    def tensors(self) -> tuple:
        """The tensors this delta reads (its factors and scaling): ``MoeHooks.needs_grad``."""
        return (self.a, self.b, self.lora.scaling)

    @property
    def a(self) -> torch.Tensor:
        """Shrink factors ``[L, E, r, K]``."""
        return self.lora.w13_a if self.gemm == "w13" else self.lora.w2_a

    @property
    def b(self) -> torch.Tensor:
        """Expand factors ``[L, E, N, r]``."""
        return self.lora.w13_b if self.gemm == "w13" else self.lora.w2_b

    def check(self, out_RN: torch.Tensor, x_RK: torch.Tensor) -> None:
        """The factors fit this GEMM's output ``[R, N]`` and input ``[R, K]`` (or ``[T, K]``)."""
        lora = self.lora
        if self.gemm == "w13":
            lora.check_against(out_RN.shape[1], x_RK.shape[1], lora.w2_a.shape[3])
        else:
            lora.check_against(lora.w13_b.shape[2], out_RN.shape[1], x_RK.shape[1])

    def row_adapters(self, rows: HookRows) -> torch.Tensor:
        """Adapter of each row (-1: none)."""
        return torch.where(rows.token >= 0, self.adapter_T[rows.token.clamp(min=0)], -1)

    def __call__(self, out_RN: torch.Tensor, x_RK: torch.Tensor, rows: HookRows) -> torch.Tensor:
        self.check(out_RN, x_RK)
        adapter = self.row_adapters(rows)
        scale = _scales(self.lora, adapter)
        return out_RN.add_(lora_delta(x_RK, self.a, self.b, adapter, rows.expert, scale))
