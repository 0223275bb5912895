"""Record what a step does that a CUDA graph capture refuses, on any device (CPU included).

``HostReads`` is a context manager: inside it, tensor-to-host reads (``item``, ``tolist``,
``bool(t)``, ``int(t)``, ``.cpu()``, ``.numpy()``), ops whose output shape depends on tensor
values (``nonzero``, ``unique``, ``masked_select``, ``bincount``, ``repeat_interleave``,
boolean-mask indexing) and tensors built from host data (``torch.tensor`` /
``torch.as_tensor``: a host-to-device copy on a GPU) are recorded in ``calls`` with the
caller's file and line. On a GPU each of these synchronises or copies during capture; on a
CPU nothing fails, so this is how CI checks a path meant to be captured.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
_HOST_READS = {
    T.item: "item",
    T.tolist: "tolist",
    T.__bool__: "bool(tensor)",
    T.__int__: "int(tensor)",
    T.__float__: "float(tensor)",
    T.__index__: "index(tensor)",
    T.cpu: "cpu()",
    T.numpy: "numpy()",
    torch.nonzero: "nonzero",
    T.nonzero: "nonzero",
    torch.unique: "unique",
    T.unique: "unique",
    torch.masked_select: "masked_select",
    T.masked_select: "masked_select",
    torch.bincount: "bincount",
    T.bincount: "bincount",
    torch.repeat_interleave: "repeat_interleave",
    T.repeat_interleave: "repeat_interleave",
}


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in (__file__, torch.overrides.__file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class HostReads(TorchFunctionMode):
    """Context manager collecting ``(what, where)`` of every capture-breaking call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._saved = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _HOST_READS.get(func)
        if name is None and func in (T.__getitem__, T.__setitem__) and _bool_index(args[1]):
            name = "boolean-mask indexing"
        if name is not None:
            self.calls.append((name, _caller()))
        return func(*args, **kwargs)

    def _factory(self, name, original):
        def wrapped(data, *args, **kwargs):
            if not isinstance(data, torch.Tensor):
                self.calls.append((f"torch.{name} from host data", _caller()))
            return original(data, *args, **kwargs)

        return wrapped

    def __enter__(self):
        for name in ("tensor", "as_tensor"):
            self._saved[name] = getattr(torch, name)
            setattr(torch, name, self._factory(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch, name, original)
        return super().__exit__(*exc)
