# Programmatic dependent launch for the triton backend's kernel sequence (private).
#
# On Hopper and later, a kernel launched with ``launch_pdl`` may start while the kernel before
# it in the stream is still running. Every kernel of the sequence therefore waits for its
# predecessor before its first global-memory access (``griddepcontrol.wait``: the predecessor
# has finished and its writes are visible) and then lets its own successor launch. What
# overlaps is the successor's launch and block setup with the predecessor's last blocks, the
# gap that dominates decode-sized calls. The first kernel of a call also waits, since the
# kernel before it (the router, the previous layer) may have written its inputs.
# ``TritonOptions.pdl`` turns it off.

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def supported(x: torch.Tensor) -> bool:
    """Whether kernels working on ``x`` can launch with PDL (CUDA, compute capability >= 9).
    Asked by ``_launch.launch`` before every launch where ``TritonOptions.pdl`` is on, so the
    capability is looked up once per device."""
    return x.is_cuda and _capable(x.device)


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of every kernel of the sequence (see the module comment)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
