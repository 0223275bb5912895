# Cached launches of the triton backend's kernels (private).
#
# ``kernel[grid](*args, **kwargs)`` re-derives on every call what Triton specialises a compiled
# kernel on (each tensor's dtype and 16-byte alignment, integers equal to 1 or divisible by
# 16, integer width), hashes that with the constexprs into a cache key and binds every
# argument: ~45 us of CPU for one launch of the grouped GEMM (~70 arguments) on an H200 host,
# 58 us in all against 13 us through the compiled kernel's own launcher. Eager callers pay it
# three to seven times per MoE call.
#
# ``launch`` keeps each compiled kernel under a key that fixes all of those facts (tensor
# dtypes and alignments, every other argument by value) and launches it through the compiled
# launcher. A key not seen yet goes through the JIT launch, which compiles if needed and
# returns the kernel to remember. The JIT path is also taken under Triton's interpreter, in
# its debug mode, with launch hooks installed (profilers), when a kernel's constexprs do not
# all follow its runtime parameters, or with the cache off (``TritonOptions.launch_cache``).
# Every launch takes the backend's options (``options=``): the cache and PDL switches.

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
from triton import knobs

from . import _pdl
from .options import TritonOptions

_MAX_ENTRIES = 4096
# kernel -> (number of runtime parameters, [(constexpr name, default)]), or None: JIT only
# (also once its compiled launcher rejected the arguments, see ``launch``).
_layouts: dict = {}
# (id of the kernel, device, constexprs and options, runtime-argument key)
#   -> (compiled kernel, constexpr values in parameter order)
_compiled: dict = {}
# kernel -> whether it takes the PDL constexpr
_pdl_kernels: dict = {}
# Per thread: the list that ``recording`` collects this thread's launches into, or None.
_local = threading.local()


class Recording:
    """What ``launch`` saw while a ``recording`` was open: every launch that went through a
    compiled kernel's launcher as ``(launcher, head, args, tail)`` (the launcher's grid,
    stream and metadata arguments, the runtime arguments, the trailing constexprs), whether
    all of them did (``complete``: none took Triton's JIT launch), and the buffers made for
    the call alone (``buffers``: ``(make, its tensors)`` in order, see ``per_call``)."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.complete = True
        self.buffers: list[tuple[Callable[[], dict], tuple[torch.Tensor, ...]]] = []
        self.making = False  # inside a ``per_call`` make


class recording:  # noqa: N801  (used as a context manager, like contextlib's)
    """``with recording() as rec:`` collects the launches of this thread (``Recording``)."""

    def __enter__(self) -> Recording:
        self.previous = getattr(_local, "rec", None)
        _local.rec = Recording()
        return _local.rec

    def __exit__(self, *exc) -> None:
        _local.rec = self.previous


def per_call(make: Callable[[], dict], made: dict | None = None) -> dict:
    """``make()``: buffers (a dict of tensors) that one call uses and drops, made in the
    calling thread (the caching allocator hands the same blocks back call after call);
    ``made``: such buffers made already (elsewhere) for this call. An open recording notes
    ``make`` with them: a plan of the call makes its buffers again at each replay instead of
    holding these by pointer, and the operations ``make`` runs are not counted as the call's
    own (``making``)."""
    rec = getattr(_local, "rec", None)
    if made is None:
        if rec is None:
            return make()
        rec.making = True
        try:
            made = make()
        finally:
            rec.making = False
    if rec is not None:
        rec.buffers.append((make, tuple(made.values())))
    return made


def making() -> bool:
    """Whether this thread is inside a ``per_call`` make of an open recording."""
    rec = getattr(_local, "rec", None)
    return rec is not None and rec.making


def _note_jit_launch() -> None:
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.complete = False


def compiled_launches(options: TritonOptions) -> bool:
    """Whether launches may go through compiled kernels' launchers: the cache is on
    (``options.launch_cache``), Triton runs compiled code (not its interpreter or debug
    mode) and calls no launch hook (a profiler's: launches must then go through it)."""
    rt = knobs.runtime
    return (
        options.launch_cache
        and not rt.interpret
        and not rt.debug
        and not _hooked(rt.launch_enter_hook)
        and not _hooked(rt.launch_exit_hook)
    )


def _layout(kernel):
    """Runtime parameter count and trailing constexprs of ``kernel``, or None."""
    if kernel not in _layouts:
        params = kernel.params
        n_runtime = sum(not p.is_constexpr for p in params)
        trailing = all(p.is_constexpr for p in params[n_runtime:])
        no_opt_outs = not any(
            p.do_not_specialize or p.do_not_specialize_on_alignment for p in params
        )
        _layouts[kernel] = (
            (n_runtime, [(p.name, p.default) for p in params[n_runtime:]])
            if trailing and no_opt_outs
            else None
        )
    return _layouts[kernel]


def _args_key(args: tuple) -> tuple:
    """The runtime arguments as a cache key: each tensor's dtype and its data pointer modulo
    16 (Triton specialises on 16-byte alignment), every other argument by value. Values are
    finer than Triton's own specialisation (integers equal to 1 or divisible by 16, integer
    width), so two calls that share a key always share a compiled kernel."""
    return tuple([(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a for a in args])


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: a function, or a non-empty chain of them (Triton
    3.6 keeps an empty ``HookChain`` by default)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _takes_pdl(kernel) -> bool:
    """Whether ``kernel`` has the ``PDL`` constexpr of ``_pdl.enter``."""
    if kernel not in _pdl_kernels:
        _pdl_kernels[kernel] = "PDL" in kernel.arg_names
    return _pdl_kernels[kernel]


def launch(kernel, grid: tuple, *args, options: TritonOptions, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` with the compiled kernel cached (module comment).

    ``args`` are the runtime arguments in parameter order, the first a tensor on the
    launch's device; ``kwargs`` the constexprs and Triton's launch options (num_warps,
    num_stages); ``options`` the backend's (``launch_cache``, ``pdl``). A kernel with a
    ``PDL`` constexpr gets it here, with the matching launch option: programmatic dependent
    launch where ``options.pdl`` asks for it and ``args[0]``'s GPU has it (``_pdl``)."""
    if _takes_pdl(kernel):
        pdl = options.pdl and _pdl.supported(args[0])
        kwargs["PDL"] = pdl
        if pdl:
            kwargs["launch_pdl"] = True
    layout = _layout(kernel) if compiled_launches(options) else None
    if (
        layout is None
        or len(args) != layout[0]
        or not isinstance(args[0], torch.Tensor)
        or args[0].device.type != "cuda"
    ):
        _note_jit_launch()
        kernel[grid](*args, **kwargs)
        return
    index = torch.cuda.current_device()
    # id: kernels are module objects that live as long as the process (hashing a JITFunction
    # hashes its source key, microseconds per launch).
    key = (id(kernel), index, tuple(kwargs.items()), _args_key(args))
    compiled = _compiled.get(key)
    if compiled is None:  # first call with this key: Triton's launch, then remember
        _note_jit_launch()
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        if hasattr(compiled, "run") and hasattr(compiled, "function"):
            if len(_compiled) >= _MAX_ENTRIES:  # keys carry sizes: bound what many shapes add
                _compiled.clear()
            tail = tuple(kwargs.get(name, default) for name, default in layout[1])
            _compiled[key] = (compiled, tail)
        return
    compiled, tail = compiled
    head = (
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        torch._C._cuda_getCurrentRawStream(index),
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
    )
    try:
        compiled.run(*head, *args, *tail)
    except TypeError:
        # A Triton whose compiled launcher takes other arguments (this calls the 3.6 one):
        # the arguments are checked before anything launches, so launch this kernel the JIT
        # way from now (each other kernel finds out the same way, once).
        _layouts[kernel] = None
        clear()
        _note_jit_launch()
        kernel[grid](*args, **kwargs)
        return
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.launches.append((compiled.run, head, args, tail))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA ``device`` (looked up once)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids and sizes on the host (``triton.cdiv`` is a constexpr
    function in Triton 3.6: a host call unwraps its arguments, a few microseconds)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (0 for 0), as Triton's, on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def clear() -> None:
    """Forget every cached kernel (they stay in Triton's own cache)."""
    _compiled.clear()
