"""Memory accounting on any device, without allocator statistics (tests and experiments).

- ``AllocationTracker``: a ``TorchDispatchMode`` that counts the storages torch ops create
  while it is active (not the views, in-place results or ``out=`` writes into existing
  memory), their live bytes as they are created and freed, the peak and the largest one.
  CPU allocations are invisible to ``tracemalloc`` and to the CUDA statistics; this sees
  every op that runs under it, on any device.
- ``storage_bytes(*roots)``: bytes of the distinct storages reachable from some objects
  (tensors, containers, dataclasses, objects with ``__dict__`` / ``__slots__``), each storage
  counted once however many tensors view it: what holding those objects keeps alive.
- ``kept(make, device)``: runs ``make`` so that the CUDA memory of what it makes (state kept
  across calls: workspaces, prepared weights) is not taken from a CUDA graph's private pool.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationTracker", "storage_bytes", "storages"]


class AllocationTracker(TorchDispatchMode):
    """Bytes of the storages created by torch ops under this mode (``with tracker: ...``).

    ``live_bytes``: created and not yet freed; ``peak_bytes``: the most live at once;
    ``largest_bytes``: the largest single storage. A result that shares a storage with one of
    the op's tensor arguments (a view, an in-place op, ``out=``) is not new memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in inputs or ptr in self._live:
            return
        self._live[ptr] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.largest_bytes = max(self.largest_bytes, nbytes)
        weakref.finalize(storage, self._free, ptr)

    def _free(self, ptr: int) -> None:
        self.live_bytes -= self._live.pop(ptr, 0)


# Not walked: code and namespaces (a module's globals would reach the whole library).
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    weakref.ref,
)


def storages(*roots: Any) -> dict[tuple[str, int], int]:
    """``{(device, data_ptr): nbytes}`` of the distinct non-empty storages reachable from
    ``roots`` through tensors, mappings, sequences, sets, dataclasses and objects'
    ``__dict__`` / ``__slots__`` (each object visited once; classes, modules, functions and
    weak references are not followed)."""
    found: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.nbytes():
                found[(str(obj.device), s.data_ptr())] = s.nbytes()
            stack.extend(vars(obj).values())  # attributes set on the tensor (memos)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, _OPAQUE):
            continue
        if dataclasses.is_dataclass(obj):
            stack.extend(getattr(obj, f.name, None) for f in dataclasses.fields(obj))
        for name in getattr(type(obj), "__slots__", ()):
            if name != "__weakref__":
                stack.append(getattr(obj, name, None))
        stack.extend(getattr(obj, "__dict__", {}).values())
    return found


def storage_bytes(*roots: Any) -> int:
    """Total bytes of ``storages(*roots)``: the memory holding ``roots`` keeps alive."""
    return sum(storages(*roots).values())


class Worker:
    """One thread, started at first use, that runs a caller's function on the caller's CUDA
    device and current stream (so its kernels stay in the caller's order) while the caller
    waits: for work whose thread-local state must not be the caller's (``kept``: the CUDA
    graph pool the allocator hands out). Not for autograd work: a CUDA backward runs on the
    autograd engine's device thread, which would wait for this thread while this thread's
    differentiation waits for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any], device: torch.device) -> Any:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def call() -> Any:
            if stream is None:
                return fn()
            with torch.cuda.device(device), torch.cuda.stream(stream):
                return fn()

        return self._pool.submit(call).result()


_KEEPER = Worker("moerunner-kept")  # the one worker thread of ``kept``
_ON_KEEPER = threading.local()  # set on that thread while it runs a ``make``


def kept(make: Callable[[], Any], device: torch.device) -> Any:
    """``make()``, for state that outlives the call (workspaces, prepared weights, flag
    buffers), with its CUDA memory taken from the device's ordinary memory.

    While a CUDA graph warms up or records (inductor's cudagraph trees, ``torch.cuda.graph``),
    the allocator hands the calling thread's allocations to the graph's private pool. The
    pool then holds memory that outlives the graph and that the graph's owner does not know
    of: inductor refuses it ("tensor(s) in the cudagraph pool not tracked as outputs") and
    may hand the same memory to a later graph. So on CUDA, except while the caller's stream
    is capturing (where new memory cannot be had anyway, and state must exist before), the
    function runs on a worker thread, whose allocations no pool claims, on the caller's
    current stream: its kernels stay in the caller's order and its tensors belong to that
    stream. The caller waits for the thread on the host (``make`` only queues work); this
    happens once per kept object, never per call. Elsewhere ``make()`` runs here. Either way
    it runs with grad mode off (grad mode is per thread, and kept state is never part of an
    autograd graph, even where it is made from parameters that require grad).
    """
    if (
        device.type != "cuda"
        or getattr(_ON_KEEPER, "active", False)  # kept state made while making kept state
        or not torch.cuda.is_available()
        or torch.cuda.is_current_stream_capturing()
    ):
        with torch.no_grad():
            return make()

    def run() -> Any:
        _ON_KEEPER.active = True
        try:
            with torch.no_grad():
                return make()
        finally:
            _ON_KEEPER.active = False

    return _KEEPER.run(run, device)
