"""Checks of values that live on the device, without waiting for the device.

A forward pass must not read device memory from the host: the read waits until the GPU has
run everything queued before it, and the host stops running ahead. Expert ids are values, so
their range check works like this:

- CPU tensors: checked at once (reading host memory costs nothing); a bad id raises
  ``MoeInputError`` from the call that passed it.
- CUDA tensors: the call queues the check on the device (the ids' min and max, copied without
  blocking into pinned host memory, then an event), then reads the queued checks whose event
  has completed (``event.query()``, which never waits) and returns. A bad id raises
  ``MoeInputError`` naming the call, ``topk_ids``, the valid range and the values seen, from
  the first check call after the device ran it (usually a later call). The output of the
  call given the bad ids is wrong: the kernels skip ids outside ``[0, E)``. Buffers and
  events of read checks are reused. ``check_errors()`` waits for every queued check (it
  synchronises with the GPU) and raises the first error: call it where a synchronisation is
  acceptable, e.g. at the end of a step or of a test.
- A backend whose kernels read the ids anyway checks them there instead (the triton
  backend's top-k reduction, ``IdFlags``): no launch or copy of its own per call; the flags
  are read the same way, without waiting, and raise the same ``MoeInputError``.
- While a CUDA graph is being captured or ``torch.compile`` traces, no check is queued or
  read: the captured or compiled code stays free of host work (a kernel that checks ids
  still records bad ones in a captured graph; a later eager call or ``check_errors()``
  reads them).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import MoeInputError
from .memory import kept


@dataclass
class PendingCheck:
    """One queued id check: ``stats`` (host, ``[min, max]``) is valid once ``event`` has
    completed (``event.query()`` true; ``event.synchronize()`` waits for it)."""

    stats: torch.Tensor
    event: Any
    num_experts: int
    where: str
    # Device-side [min, max] and its two 0-d views: reused with ``stats`` and ``event`` by a
    # later check once this one has been read.
    device_stats: tuple | None = None
    # What the values are and what bounds them, as the message names them.
    names: tuple[str, str] = ("topk_ids", "E")


# Buffers kept for reuse per (device, dtype): enough for the checks in flight of a few steps.
_MAX_FREE = 32


class CheckQueue:
    """Queued device checks, read in submission order without waiting (``poll``) or waiting
    (``drain``). A check's buffers and event are reused once it has been read."""

    def __init__(self) -> None:
        self._pending: deque[PendingCheck] = deque()
        self._lock = threading.Lock()
        self._free: dict[tuple, list] = {}

    def take_buffers(self, device: torch.device, dtype: torch.dtype) -> tuple | None:
        """``(device_stats, host stats, event)`` of a check already read, or None."""
        with self._lock:
            free = self._free.get((device, dtype))
            return free.pop() if free else None

    def _recycle(self, check: PendingCheck) -> None:
        if check.device_stats is None:
            return
        key = (check.device_stats[0].device, check.device_stats[0].dtype)
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < _MAX_FREE:
                free.append((check.device_stats, check.stats, check.event))

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, check: PendingCheck) -> None:
        """Queue ``check``; its result is read by a later ``poll`` or ``drain``."""
        with self._lock:
            self._pending.append(check)

    def poll(self) -> None:
        """Read every check at the front of the queue whose event has completed; raise the first
        bad one (``MoeInputError``). Never waits for the device."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0].event.query():
                    return
                check = self._pending.popleft()
            self._read(check)

    def drain(self) -> None:
        """Wait for every queued check and raise the first bad one. Synchronises."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                check = self._pending.popleft()
            check.event.synchronize()
            self._read(check)

    def _read(self, check: PendingCheck) -> None:
        bounds = check.stats.tolist()  # host memory, written by the completed copy
        self._recycle(check)
        _raise_if_bad(bounds, check, lazily=True)

    def clear(self) -> None:
        """Forget every queued check unread."""
        with self._lock:
            self._pending.clear()
            self._free.clear()


#: The queue of the library's own checks.
QUEUE = CheckQueue()


def check_errors() -> None:
    """Raise the first error that a queued device check found (``MoeInputError``), after
    waiting for all of them: this synchronises with the GPU. Without CUDA, or with nothing
    queued, it returns at once."""
    QUEUE.drain()
    ID_FLAGS.drain()


def capturing() -> bool:
    """``torch.compile`` traces, or this process captures a CUDA graph on the current stream:
    no host read may happen. A process that never initialised CUDA (a CPU run, a forked
    child) captures nothing and is not asked, which a forked child could not answer."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def checks_may_run(device: torch.device | None = None) -> bool:
    """False while a CUDA graph is being captured or ``torch.compile`` traces: device checks
    are then skipped (neither queued nor read). ``device``: the checked tensors' (a CPU
    device skips the CUDA query, which costs microseconds per call)."""
    if torch.compiler.is_compiling():
        return False
    if device is not None:
        return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    return not capturing()


def check_ids_async(
    topk_ids: torch.Tensor,
    num_experts: int,
    where: str = "fused_moe",
    *,
    names: tuple[str, str] = ("topk_ids", "E"),
    queue: CheckQueue | None = None,
    make_event: Callable[[torch.Tensor], Any] | None = None,
) -> None:
    """Check ``-1 <= topk_ids < num_experts`` without a device-to-host synchronisation.

    CPU tensors are checked at once. On CUDA the check is queued (module docstring):
    it raises at a later call of this function once the device has run it, or from
    ``check_errors()``. ``where`` names the call in the message, ``names`` the values and
    their bound (default ``("topk_ids", "E")``). ``queue`` and
    ``make_event`` (ids -> an object with ``query()`` and ``synchronize()``, recorded on the
    ids' stream) default to the library's queue and a CUDA event; tests pass stand-ins.
    """
    if topk_ids.numel() == 0 or not checks_may_run(topk_ids.device):
        return
    queue = QUEUE if queue is None else queue
    if make_event is None and not topk_ids.is_cuda:  # CPU (or a device without events here)
        check = PendingCheck(
            torch.stack(torch.aminmax(topk_ids)), None, num_experts, where, names=names
        )
        _raise_if_bad(check.stats.tolist(), check, lazily=False)
        return
    # Checks completed since the last call are read first, so this call reuses their buffers
    # (after a synchronisation every earlier check has completed: no new buffer is made). An
    # error found there is raised once this call's own check is queued.
    earlier_error = _read_completed(queue)
    device, dtype = topk_ids.device, topk_ids.dtype
    reused = queue.take_buffers(device, dtype)
    if reused is None:
        # Reused by later checks, which may run outside ``inference_mode``: no inference
        # tensors (they refuse in-place writes there). Kept between calls, so made outside
        # a CUDA graph's pool (``memory.kept``): made while inductor's cudagraph trees warmed
        # a graph up, the pool held them and the trees refused it.
        with torch.inference_mode(False):
            stats = kept(lambda: torch.empty(2, dtype=dtype, device=device), device)
            host = torch.empty(2, dtype=dtype, pin_memory=topk_ids.is_cuda)
        device_stats = (stats, stats[0], stats[1])
        event = None
    else:
        device_stats, host, event = reused
    torch.aminmax(topk_ids, out=device_stats[1:])
    host.copy_(device_stats[0], non_blocking=True)
    if make_event is not None:
        event = make_event(topk_ids)
    else:
        event = event if event is not None else torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    queue.submit(PendingCheck(host, event, num_experts, where, device_stats, names))
    if earlier_error is not None:
        raise earlier_error
    queue.poll()  # this call's own check, where the device has already run it


def _read_completed(queue: CheckQueue) -> MoeInputError | None:
    """``queue.poll()``, returning the error it raises instead of raising it."""
    try:
        queue.poll()
    except MoeInputError as error:
        return error
    return None


class IdFlags:
    """Ids checked inside a kernel that reads them anyway (no launch of its own).

    Per device an int32 ``[3]`` buffer that such kernels update when they meet an id outside
    ``[-1, E)``: ``[lowest id below -1 (else -1), highest id >= E (else -1), largest such
    E]``. The host reads it without waiting: every ``every``-th ``poll`` starts a
    non-blocking copy to pinned memory when none is in flight, and reads the previous one
    once its event has completed; a bad value raises ``MoeInputError`` there (from a later
    call, as the queued checks do) and the buffer is reset. The buffer keeps what it saw
    until it is read, so reading it every few calls misses nothing; it only raises later
    (a read costs about as much host time as a kernel launch). ``check_errors()`` waits for
    the buffer too.
    """

    CLEAN = (-1, -1, 0)

    def __init__(self, every: int = 1) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.every = every
        self._lock = threading.Lock()
        # device -> [buffer, host, event, in flight, polls since the last read]
        self._state: dict[torch.device, list] = {}

    def _clean(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` set to ``CLEAN`` by kernels on its device, no host copy; returns it."""
        buf[:2].fill_(self.CLEAN[0])
        buf[2:].fill_(self.CLEAN[2])
        return buf

    def buffer(self, device: torch.device) -> torch.Tensor:
        """The device's flag buffer (made on first use, then the same tensor)."""
        state = self._state.get(device)
        if state is None:
            with self._lock:
                state = self._state.get(device)
                if state is None:
                    # Filled on the device: a copy from pageable host memory would sync.
                    make = lambda: self._clean(torch.empty(3, dtype=torch.int32, device=device))  # noqa: E731
                    buf = kept(make, device)
                    with torch.inference_mode(False):  # read into outside it too
                        host = torch.empty(3, dtype=torch.int32, pin_memory=device.type == "cuda")
                    state = self._state[device] = [buf, host, None, False, 0]
        return state[0]

    def poll(self, device: torch.device, where: str = "fused_moe") -> None:
        """Every ``every``-th call: raise what a completed read found and start the next
        read (never waits)."""
        state = self._state.get(device)
        if state is None:
            return
        state[4] += 1
        if state[4] < self.every or not checks_may_run(device):
            return
        state[4] = 0
        buf, host, event, in_flight, _ = state
        if in_flight:
            if not event.query():
                return
            state[3] = False
            self._raise_if_set(state, host.tolist(), where)
        host.copy_(buf, non_blocking=True)
        if event is None:
            event = state[2] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        state[3] = True

    def drain(self) -> None:
        """Wait for every device's buffer and raise what it holds (synchronises)."""
        for device, state in list(self._state.items()):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            state[3] = False
            self._raise_if_set(state, state[0].tolist(), "fused_moe")

    def _raise_if_set(self, state: list, values: list, where: str) -> None:
        low, high, num_experts = values
        if low >= -1 and high < 0:
            return
        self._clean(state[0])
        seen = []
        if low < -1:
            seen.append(f"ids below -1 (lowest {low})")
        if high >= 0:
            seen.append(f"ids >= E (highest {high})")
        raise MoeInputError(
            f"{where}: topk_ids must be in [-1, E={num_experts}), got {' and '.join(seen)} "
            "(checked on the device and read once it completed, possibly calls later: the "
            "call given these ids skipped those outside [0, E), its output is wrong)"
        )


#: The flag buffers of the kernels that check ids themselves, read every 8th call.
ID_FLAGS = IdFlags(every=8)


def _raise_if_bad(bounds: list, check: PendingCheck, lazily: bool) -> None:
    low, high = (int(v) for v in bounds)
    if low >= -1 and high < check.num_experts:
        return
    message = (
        f"{check.where}: {check.names[0]} must be in [-1, {check.names[1]}={check.num_experts}), "
        f"got values in [{low}, {high}]"
    )
    if lazily:
        message += (
            " (checked on the device and read once it completed, possibly calls later: the "
            "call given these ids skipped those outside [0, E), its output is wrong)"
        )
    raise MoeInputError(message)
