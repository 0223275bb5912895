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

- ``w13_a [L, E, r, H]``, ``w13_b [L, E, N13, r]``. ``w13_b``'s rows are in the canonical
  order that GEMM1's output has where the hook sees it: gate rows then up rows, for
  ``w13_order="gate_up"`` and ``"up_gate"`` alike (an up-then-gate w13 is swapped to gate
  then up where its weights are prepared; the factors are never swapped), alternating
  (row 2j gate j, row 2j+1 up j) for ``"interleaved"``; a non-gated w13's ``I`` up rows.
  A model whose gate and up projections carry separate adapters (PEFT's ``gate_proj`` /
  ``up_proj``) stacks the two A's (rank 2r) and places the two B's block diagonally;
- ``w2_a [L, E, r, I]``, ``w2_b [L, E, H, r]``;
- ``scaling``: a finite number or float ``[L]`` (PEFT: ``lora_alpha / r``). A tensor is read
  on every call (in-place edits take effect); its values are checked where it lies on the
  CPU, and never read on a GPU (no host read there: a non-finite scale gives non-finite rows).

Gradients: the hooks' PyTorch form is differentiable in the factors (and a ``scaling``
tensor) and in its input rows. In grad mode a call whose factors, hidden states, expert
weights or routing weights require grad runs on the torch backend's differentiable path
(``fused_moe``'s Gradients), so gradients reach every one of them: adapted MoE layers train
stacked (a later layer's hidden states depend on an earlier layer's factors), beside a
trained router or experts, and over frozen quantized experts (QLoRA: the weights stay
quantized, ``moerunner.backends.torch_autograd``). Backends that apply the
hooks in their own kernels (triton) have no backward and refuse such a call by name.

Rows whose expert is past ``E`` (the shared experts of ``moerunner.shared``) get no delta.

torch.compile: a traced ``fused_moe`` call with ``lora_hooks``' hooks is one custom op that
takes the factors, adapter ids and scaling as arguments (``op_arguments``; fullgraph works,
and the op's backward gives the factors their gradients); other hooks run eagerly.

Each hook is a ``LoraDelta``: a callable (the PyTorch form below, which every backend that
runs hooks can call) and at once a declarative record of one GEMM's LoRA that a backend
with its own kernels applies instead (the triton backend's hooked sequence:
``moerunner.backends.triton.lora``, punica-style shrink and expand kernels). The PyTorch
form runs the shrink and expand on the rows grouped by (adapter, expert):

- on CPU in float32, two grouped GEMMs over every group (or two GEMMs per group where
  PyTorch's grouped GEMM cannot take the factors), after one host read of the group bounds,
  as the torch backend's experts do;
- on CUDA in bf16 as two grouped GEMMs too, with the groups' ends found on the device (no
  host read, CUDA-graph capturable; the rank-r intermediate rounds to bf16);
- elsewhere (other dtypes, widths that are not 16-byte multiples) in float32 by gathering
  each row's factors in chunks of rows (batched GEMMs, no host read). This reads
  r x (K + N) factor values per row, and its backward scatters as many: cheap at decode, the
  dominant cost of a long prefill or a training step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import InitVar, dataclass

import torch

from .device_checks import check_ids_async, checks_may_run
from .dispatch.permute import group_rows, valid_rows
from .errors import INDEX_DTYPES_TEXT, MoeInputError, is_index_tensor
from .hooks import HookRows, MoeHooks, in_graph_of

__all__ = ["LoraDelta", "MoeLoraWeights", "lora_hooks"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def finite_in_float32(value: float) -> bool:
    """A scale the hooks can use: they compute in float32, where a larger number is inf."""
    return math.isfinite(value) and abs(value) <= _FLOAT32_MAX


# Gathered factor elements per chunk of rows (off the CPU): ~16 MiB of float32.
_GATHER_ELEMENTS = 1 << 22
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


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

    @property
    def scale_per_adapter(self) -> torch.Tensor | None:
        """``scaling`` as float32 ``[L]`` on the factors' device (the tensor itself where it
        already is one); None where one number scales every adapter. Another tensor is
        converted once and again only after it changed in place, so an edit (``scaling[a] =
        0``) takes effect whatever its dtype, layout or device, and an unchanged tensor is not
        copied per call. Its version counter tells (a host-side number: no device read)."""
        scaling = self.scaling
        if not isinstance(scaling, torch.Tensor):
            return None
        if scaling.is_inference() or (scaling.requires_grad and torch.is_grad_enabled()):
            # An inference tensor has no version counter; a trained one needs this call's
            # graph (a kept copy's would be freed by the first backward).
            return self._float32_scaling()
        kept = self.__dict__.get("_scaling_copy")
        if kept is None or kept[0] is not scaling or kept[1] != scaling._version:
            kept = (scaling, scaling._version, self._float32_scaling())
            self.__dict__["_scaling_copy"] = kept  # frozen: beside the fields, as a cache
        return kept[2]

    def _float32_scaling(self) -> torch.Tensor:
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
            scaling = self.scaling
            if scaling.device not in (a13.device, torch.device("cpu")):
                raise MoeInputError(
                    f"lora scaling is on {scaling.device}: it must lie on the CPU or on the "
                    f"factors' device ({a13.device})"
                )
            # Values are read on the CPU only (on a GPU this would be a host read per call),
            # and not while torch.compile traces (as the adapter ids: ``checks_may_run``);
            # finite in float32, the precision the hooks compute in.
            if (
                scaling.device.type == "cpu"
                and checks_may_run(scaling.device)
                and not bool(scaling.detach().float().isfinite().all())
            ):
                raise MoeInputError(
                    "lora scaling must be finite, and in float32 (the precision LoRA computes "
                    f"in), got {scaling.detach().tolist()}"
                )
        elif isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)):
            raise TypeError(f"lora scaling must be a number or a tensor, got {self.scaling!r}")
        elif not finite_in_float32(self.scaling):
            raise MoeInputError(
                "lora scaling must be finite, and in float32 (the precision LoRA computes in), "
                f"got {self.scaling}"
            )
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
    shared: dict | None = None,
) -> torch.Tensor:
    """float32 ``[R, N]``: row r's ``scale_R[r] * b[ad, ex] @ (a[ad, ex] @ x_RK[r])`` with
    ``ad, ex = adapter_R[r], expert_R[r]``; 0 where either is -1 (or ``ex`` past E).
    ``shared``: where to keep (and find) what depends only on the rows, their adapters and
    the factors' shape, for the other GEMM of the same call (``LoraDelta``)."""
    num_experts, rank = a.shape[1], a.shape[2]
    rows, n = x_RK.shape[0], b.shape[2]
    out = torch.zeros(rows, n, dtype=torch.float32, device=x_RK.device)
    if rows and rank:
        shared = {} if shared is None else shared
        if "key" not in shared:
            valid = (adapter_R >= 0) & (expert_R >= 0) & (expert_R < num_experts)
            pair = adapter_R.long() * num_experts + expert_R.long()
            shared["key"] = torch.where(valid, pair, -1)
        key = shared["key"]
        if x_RK.device.type == "cpu":
            out = _grouped_cpu(x_RK, a, b, key, scale_R, out, shared)
        elif _grouped_device_fits(x_RK, a, b):
            out = _grouped_device(x_RK, a, b, key, scale_R, out, shared)
        else:
            chunk = max(1, _GATHER_ELEMENTS // (rank * (a.shape[3] + n)))
            out = _gathered(x_RK, a, b, key, scale_R, out, chunk)
    return in_graph_of(out, (a, b, scale_R))


def _grouping(
    key: torch.Tensor, a: torch.Tensor, scale_R: torch.Tensor, shared: dict | None
) -> tuple:
    """The rows grouped by (adapter, expert) key (``dispatch.permute.group_rows``; rows
    without a pair sort last): (order, offsets ``[G + 1]``, the groups' ends in int32, the
    rows inside a group ``[R, 1]``, the scales in group order ``[R, 1]``), made once per
    call (``shared``, where given) for both GEMMs."""
    shared = {} if shared is None else shared
    if "grouping" not in shared:
        groups = a.shape[0] * a.shape[1]
        order, offsets = group_rows(torch.where(key >= 0, key, groups), groups)
        valid = valid_rows(offsets, order.shape[0])[:, None]
        ends = offsets[1:].to(torch.int32)
        shared["grouping"] = order, offsets, ends, valid, scale_R[order, None]
    return shared["grouping"]


def _gathered(x_RK, a, b, key, scale_R, out, chunk: int):
    """Each row's factors gathered, ``chunk`` rows at a time: batched GEMMs, no host read.
    A row without a pair computes with pair 0's factors and is then replaced by 0 (selected
    out, not multiplied by 0: pair 0's non-finite values would give NaN there)."""
    groups, rank, n = a.shape[0] * a.shape[1], a.shape[2], b.shape[2]
    a_flat = a.reshape(groups, rank, -1)
    b_flat = b.reshape(groups, n, rank)
    for start in range(0, x_RK.shape[0], chunk):
        k = key[start : start + chunk]
        g = k.clamp(min=0)
        shrunk = torch.bmm(a_flat[g].float(), x_RK[start : start + chunk, :, None].float())
        d = torch.bmm(b_flat[g].float(), shrunk)[:, :, 0]
        d = d * scale_R[start : start + chunk, None]
        out[start : start + chunk] = torch.where(k[:, None] >= 0, d, 0.0)
    return out


def _grouped_cpu(x_RK, a, b, key, scale_R, out, shared: dict | None = None):
    """The rows in (adapter, expert) order (``_grouping``), gathered once: two grouped GEMMs
    over every group where PyTorch's can take the factors (``_grouped_fits``), else two
    GEMMs per group (host-side bounds; the rows and factors split once, ``split`` and
    ``unbind``); one scatter of the result. Under autograd, indexing a factor per group made
    a full-size gradient per group (3.5 s for one Qwen3-30B-A3B-size layer's backward, 0.12 s
    gathered), and so did slicing the rows per group (each slice's backward fills a zero
    gradient of all the rows: 64 % of a Qwen3-30B-A3B / 16 LoRA training step, T = 256)."""
    order, offsets, ends, _, scale_sorted = _grouping(key, a, scale_R, shared)
    counts = offsets.diff().tolist()  # (CPU tensors only: a host read that waits for nothing)
    rows = sum(counts)
    if rows == 0:
        return out
    groups = a.shape[0] * a.shape[1]
    x_sorted = x_RK[order[:rows]].float()
    a_f = a.reshape(groups, a.shape[2], -1).float().transpose(1, 2)
    b_f = b.reshape(groups, b.shape[2], -1).float().transpose(1, 2)
    if _grouped_fits(a_f, b_f):
        d = _GROUPED_MM(_GROUPED_MM(x_sorted, a_f, offs=ends), b_f, offs=ends)
    else:
        hit = [g for g, count in enumerate(counts) if count]
        x_groups = x_sorted.split([counts[g] for g in hit])
        a_groups, b_groups = a_f.unbind(0), b_f.unbind(0)
        d = torch.cat([
            x_g @ a_groups[g] @ b_groups[g]
            for g, x_g in zip(hit, x_groups, strict=True)
        ])  # fmt: skip
    d = d * scale_sorted[:rows]
    return out.index_put((order[:rows],), d)


def _grouped_device(x_RK, a, b, key, scale_R, out, shared: dict | None = None, mm=None):
    """The rows in (adapter, expert) order (``_grouping``: no host read) through two grouped
    GEMMs in the rows' dtype (the rank-r intermediate rounds to it, as a LoRA layer's own
    bf16 product does), one scatter; no per-row copy of the factors (the gathered form's
    backward scattered a factor-sized gradient per row). Rows without a pair sort past the
    last group, where the grouped GEMM leaves its output and its input gradient undefined:
    they are selected out at the first GEMM's input (whose gradient reaches the rows') and
    at the result. ``mm``: the grouped GEMM (PyTorch's by default)."""
    mm = mm or _GROUPED_MM
    order, _, ends, valid, scale_sorted = _grouping(key, a, scale_R, shared)
    groups = a.shape[0] * a.shape[1]
    x_sorted = torch.where(valid, x_RK[order], 0)
    a_t = a.reshape(groups, a.shape[2], -1).transpose(1, 2)  # [G, K, r]
    b_t = b.reshape(groups, b.shape[2], -1).transpose(1, 2)  # [G, r, N]
    d = mm(mm(x_sorted, a_t, offs=ends), b_t, offs=ends)
    d = torch.where(valid, d, 0) * scale_sorted  # (selected before the product)
    return out.index_put((order,), d)


def _grouped_device_fits(x_RK: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``_grouped_device`` serves these rows and factors: a CUDA bf16 call on a GPU where
    PyTorch's grouped GEMM has its own kernel (compute capability 9 or 10; elsewhere, and
    for other dtypes, it runs a group at a time after a host read of the ends), every width
    a 16-byte multiple and every tensor 16-byte aligned."""
    if _GROUPED_MM is None or x_RK.device.type != "cuda":
        return False
    if _capability_major(x_RK.device.index) not in (9, 10):
        return False
    if not x_RK.dtype == a.dtype == b.dtype == torch.bfloat16:
        return False
    widths = (x_RK.shape[1], a.shape[2], b.shape[2])
    return _rows16((x_RK, a, b), widths) and all(t.stride(-1) == 1 for t in (x_RK, a, b))


@functools.cache
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _grouped_fits(a_GKR: torch.Tensor, b_GRN: torch.Tensor) -> bool:
    """PyTorch's grouped GEMM can take these float32 factors (and the rows, ``[M, K]`` and
    ``[M, R]`` made row-major here): every width a 16-byte multiple, 16-byte aligned."""
    if _GROUPED_MM is None:
        return False
    return _rows16((a_GKR, b_GRN), (a_GKR.shape[1], a_GKR.shape[2], b_GRN.shape[2]))


def _rows16(tensors: tuple, widths: tuple) -> bool:
    """The grouped GEMM's layout rule for operands of one dtype: every row width (elements)
    a multiple of 16 bytes and every tensor 16-byte aligned."""
    size = tensors[0].element_size()
    return all(w * size % 16 == 0 for w in widths) and all(_address(t) % 16 == 0 for t in tensors)


def _address(t: torch.Tensor) -> int:
    """``t``'s data address, also of a tensor that torch.func transforms wrap (the custom ops'
    backward differentiates the hooks under ``torch.func.vjp``), whose own has no storage;
    an odd number where the wrappers cannot be undone (the caller's check then fails)."""
    functorch = getattr(torch._C, "_functorch", None)
    unwrap = getattr(functorch, "get_unwrapped", None)
    while unwrap is not None and functorch.is_functorch_wrapped_tensor(t):
        t = unwrap(t)
    try:
        return t.data_ptr()
    except RuntimeError:
        return 1


def lora_hooks(lora: MoeLoraWeights, adapter_ids: torch.Tensor, check_ids: bool = True):
    """``MoeHooks`` that apply ``lora`` to the tokens of one call: token ``t`` uses adapter
    ``adapter_ids[t]`` (int ``[T]``; -1: none). ``check_ids``: ids must lie in ``[-1, L)``
    (checked at once on CPU, without a host read on a GPU, as ``fused_moe``'s ids); ids
    outside are skipped."""
    if not isinstance(lora, MoeLoraWeights):
        raise TypeError(f"lora must be a MoeLoraWeights, got {type(lora).__name__}")
    lora.validate()
    _check_adapter_ids(adapter_ids, lora, "adapter_ids", "lora", check_ids)
    ids = _in_range(adapter_ids.long(), lora.num_adapters)
    return MoeHooks(  # the ids are checked and in range: not again per hook
        gate_up=LoraDelta(lora, ids, "w13", check_ids=False),
        down=LoraDelta(lora, ids, "w2", check_ids=False),
        num_tokens=ids.shape[0],
        num_experts=lora.num_experts,
    )


#: The LoRA arguments the custom ops (``moerunner.ops``) take last, in this order.
OP_ARGUMENTS = (
    "lora_w13_a",
    "lora_w13_b",
    "lora_w2_a",
    "lora_w2_b",
    "lora_adapter_ids",
    "lora_scaling",
    "lora_scale",
)


def op_arguments(hooks: MoeHooks | None) -> tuple | None:
    """The hooks of ``lora_hooks`` as the custom ops' LoRA arguments (``OP_ARGUMENTS``: the
    four factors, the per-token adapter ids, the scaling tensor or None, the scaling number),
    so a traced call with LoRA stays one graph node; ``()`` for no hooks; None for any other
    hooks (those run eagerly)."""
    if hooks is None:
        return ()
    up, down = hooks.gate_up, hooks.down
    if not (
        isinstance(up, LoraDelta)
        and isinstance(down, LoraDelta)
        and (up.gemm, down.gemm) == _GEMMS
        and up.lora is down.lora
        and up.adapter_T is down.adapter_T
    ):
        return None
    lora = up.lora
    scaling = lora.scaling if isinstance(lora.scaling, torch.Tensor) else None
    number = 1.0 if scaling is not None else float(lora.scaling)
    return (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b, up.adapter_T, scaling, number)


def hooks_of_op_arguments(
    w13_a, w13_b, w2_a, w2_b, adapter_ids, scaling, number, check_ids: bool
) -> MoeHooks | None:
    """The hooks that ``op_arguments`` gave these arguments of (None without factors)."""
    if w13_a is None:
        return None
    lora = MoeLoraWeights(w13_a, w13_b, w2_a, w2_b, number if scaling is None else scaling)
    return lora_hooks(lora, adapter_ids, check_ids)


def _check_adapter_ids(
    ids: object, lora: MoeLoraWeights, name: str, where: str, check_ids: bool
) -> None:
    """A 1-D integer tensor beside the factors; with ``check_ids``, values in ``[-1, L)``
    (at once on CPU; queued without a host read on a GPU, ``check_ids_async``)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1 or not is_index_tensor(ids):
        raise MoeInputError(
            f"{where}: {name} must be a 1-D [T] tensor of {INDEX_DTYPES_TEXT}, got {ids.dtype} "
            f"{list(ids.shape)}"
        )
    if ids.device != lora.w13_a.device:
        raise MoeInputError(
            f"{where}: {name} is on {ids.device} but the lora factors on {lora.w13_a.device}"
        )
    if check_ids and ids.numel():
        check_ids_async(ids[:, None], lora.num_adapters, where=where, names=(name, "L"))


def _in_range(ids: torch.Tensor, num_adapters: int) -> torch.Tensor:
    """``ids`` with those outside ``[-1, L)`` set to -1 (no adapter), on the device."""
    return torch.where((ids >= 0) & (ids < num_adapters), ids, -1)


_GEMMS = ("w13", "w2")  # LoraDelta.gemm: the gate/up GEMM, the down GEMM


@dataclass(frozen=True, eq=False)
class LoraDelta:
    """One GEMM's LoRA in one call: ``gemm`` "w13" (the gate/up hook) or "w2" (the down
    hook) of ``lora``, token ``t`` with adapter ``adapter_T[t]`` (int ``[T]``; -1: none).
    Called as a hook it adds the delta in PyTorch (``lora_delta``); a backend that
    recognises the record may apply it with its own kernels instead.

    ``check_ids``: ids must lie in ``[-1, L)``, checked as ``lora_hooks`` checks them (at once
    on CPU; on a GPU queued without a host read, ``check_ids_async``, and ids outside are set
    to -1 so that no kernel reads past the factors). False: the caller vouches for them
    (``lora_hooks`` passes ids it checked and brought into range)."""

    lora: MoeLoraWeights
    adapter_T: torch.Tensor
    gemm: str
    check_ids: InitVar[bool] = True

    def __post_init__(self, check_ids: bool) -> None:
        if not isinstance(self.lora, MoeLoraWeights):
            raise TypeError(f"LoraDelta: lora must be a MoeLoraWeights, got {type(self.lora)}")
        if self.gemm not in _GEMMS:
            raise MoeInputError(
                f"LoraDelta: gemm must be 'w13' (the gate/up GEMM, hook gate_up) or 'w2' (the "
                f"down GEMM, hook down), got {self.gemm!r}"
            )
        ids = self.adapter_T
        _check_adapter_ids(ids, self.lora, "adapter_T", "LoraDelta", check_ids)
        if check_ids and ids.numel() and ids.device.type != "cpu":
            # checked later there (no host read): ids out of range are none meanwhile
            object.__setattr__(self, "adapter_T", _in_range(ids.long(), self.lora.num_adapters))

    @property
    def num_tokens(self) -> int:
        """The tokens of the call this delta is for (one adapter id each): ``MoeHooks`` checks
        it against the call."""
        return self.adapter_T.shape[0]

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
        shared = self._shared(rows)
        if "adapter" not in shared:  # (the call's first LoRA GEMM)
            shared["adapter"] = adapter = self.row_adapters(rows)
            shared["scale"] = _scales(self.lora, adapter)
        adapter, scale = shared["adapter"], shared["scale"]
        delta = lora_delta(x_RK, self.a, self.b, adapter, rows.expert, scale, shared)
        return out_RN.add_(delta)

    def _shared(self, rows: HookRows) -> dict:
        """What this call's two GEMMs of these adapters share (``HookRows.shared``): each
        row's adapter and scale, the (adapter, expert) keys, the device grouping. Found by
        identity of the adapter ids and the factors, which both hooks of ``lora_hooks``
        hold."""
        entries = rows.shared.setdefault("lora", [])
        for adapter_T, lora, shared in entries:
            if adapter_T is self.adapter_T and lora is self.lora:
                return shared
        entries.append((self.adapter_T, self.lora, {}))
        return entries[-1][2]
