"""Data derived from tensors, kept beside them: one cache type and one memo on a tensor.

``DerivedCache`` holds what is derived from an object's tensors (prepared weights, launch
plans, rebuilt views): a copy of its owner (``copy.deepcopy``, pickling, ``torch.save``)
starts with an empty one, since derived data would be duplicated in memory or stored in a
checkpoint (and launch plans cannot be copied at all); the copy derives its own on first use.
``memoised(anchor, key, build)`` keeps one such value on a tensor (an attribute), keyed by
``view_key``s of what it was built from, so it dies with the tensor.

Keys read PyTorch's in-place version counter (``version``). Importing moerunner registers
an optimizer post-step hook (``_count_fused_steps``) so that fused optimizer steps, which
write parameters without counting it, count like every other optimizer's.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_MEMO_ATTR = "_moerunner_op_memo"


class DerivedCache(OrderedDict):
    """A memo of data derived from an object's tensors (module doc): copies start empty."""

    def __deepcopy__(self, memo: dict) -> DerivedCache:
        return type(self)()

    def __reduce__(self):
        return (type(self), ())


class StepCache(DerivedCache):
    """Replayed steps by key (a ``MoE`` layer's eager calls, ``call_steps``' pre-routed
    calls): per key a step, or how many ordinary calls of it tried to make one. At most
    ``MAX`` keys (least recently used dropped first); a key stops trying after ``TRIES``.
    Keys name the calling thread, so another thread's call only drops entries (caught)."""

    MAX = 64
    TRIES = 3

    def replay(self, key, run):
        """``run(step)`` for the step of ``key``; None where there is none or ``run`` gives
        None (the step died: it is dropped, to be made again)."""
        step = self.get(key)
        if step is None or isinstance(step, int):
            return None
        out = run(step)
        if out is None:
            self.pop(key, None)
            return None
        try:
            self.move_to_end(key)
        except KeyError:  # dropped meanwhile by another thread's call
            pass
        return out

    def offer(self, key, make) -> None:
        """After an ordinary call of ``key``: keep ``make()``'s step (None: count a try),
        unless the key has a step or has tried ``TRIES`` times."""
        tries = self.get(key, 0)
        if not isinstance(tries, int) or tries >= self.TRIES:
            return
        step = make()
        self[key] = tries + 1 if step is None else step
        while len(self) > self.MAX:
            try:
                self.popitem(last=False)
            except KeyError:  # emptied meanwhile by another thread
                break


def _count_fused_steps(optimizer, args, kwargs) -> None:
    """Optimizer post-step hook: bump the in-place version of each parameter a fused step
    updated. PyTorch's fused optimizers (``fused=True``) write the parameters without
    counting it, unlike its other optimizers, so every cache keyed on the counter (here and
    in PyTorch's own saved-tensor checks) would keep serving the old values."""
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            if p.grad is not None and not p.is_inference():
                torch.autograd.graph.increment_version(p)


# Registered once per process, when moerunner is imported: a fused step then counts as the
# in-place edit it is, for moerunner's caches and everyone else's.
register_optimizer_step_post_hook(_count_fused_steps)


def version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; for an inference tensor, which keeps none, minus one
    minus the count of ``weights_changed`` calls on inference tensors. Edits PyTorch does not
    count (through ``.data``; in place on inference tensors) are unseen until
    ``weights_changed`` names the tensor."""
    return -1 - _inference_edits[0] if t.is_inference() else t._version


#: ``weights_changed`` calls that named an inference tensor (which has no version counter to
#: bump): every inference tensor's ``version`` moves with it.
_inference_edits = [0]


def weights_changed(*tensors: object) -> None:
    """Say that these tensors were written in a way PyTorch does not count, so that what
    moerunner derived from them (prepared weights, converted scales, replayed steps) is
    derived again on the next call.

    Needed after writes through ``.data`` (``param.data.copy_(new)``, as many weight loaders
    and RL weight syncs write) and in-place writes to tensors made under
    ``torch.inference_mode``; edits PyTorch counts (in place on the tensor, optimizer steps)
    need no call. Name the tensors moerunner was given (the parameter, not a ``.data`` alias
    of it): expert weights, biases, a ``QuantizedWeight`` (all of its tensors), or the data,
    scale and zero-point tensors given to ``moerunner.compat``. A ``MoE`` layer's own
    parameters: ``MoE.weights_changed()``."""
    from .quant.weight import TENSOR_FIELDS
    from .weights import is_quantized

    for given in tensors:
        if isinstance(given, torch.Tensor):
            parts = [given]
        elif is_quantized(given):
            parts = [getattr(given, n, None) for n in TENSOR_FIELDS]
            parts = [t for t in parts if isinstance(t, torch.Tensor)]
        else:
            raise TypeError(
                "weights_changed takes tensors and QuantizedWeight values, got "
                f"{type(given).__name__}"
            )
        for t in parts:
            if t.is_inference():
                _inference_edits[0] += 1
            else:
                torch.autograd.graph.increment_version(t)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A tensor argument's identity and state on the host, no device sync: the object's
    ``id`` and its ``view_key`` (memory by a weak reference to the storage, strides,
    in-place version, dtype, device, shape). Caches of what is derived from a parameter key
    on it: replacing the parameter, assigning ``.data`` or editing it in place changes it,
    also where the new memory gets a freed one's address (an address in the key served a
    copy made of the old memory)."""
    if t is None:
        return None
    return (id(t), view_key(t))


def view_key(t: torch.Tensor | None) -> tuple | None:
    """Which memory a tensor views, and its in-place version. The storage is named by a weak
    reference: equal while that storage lives (its Python object lives as long as any tensor
    on it), and never equal to a later storage once it is freed, which may get the freed
    one's ``id`` (a key of ids matched a replaced weight of the same shape: a memoised value
    derived from the old weight was served for the new one). The key keeps nothing alive."""
    if t is None:
        return None
    return (
        _storage_ref(t),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
        version(t),
    )


def _storage_ref(t: torch.Tensor):
    return object_ref(t.untyped_storage())


class _Ref(weakref.ref):
    """A weak reference in a key: pickled or copied (a key kept on a module that is saved or
    deep-copied), it becomes a ``_Gone`` that equals nothing, as a reference to a freed
    object (plain weak references cannot be pickled)."""

    __slots__ = ()

    def __reduce__(self):
        return (_Gone, ())


class _Gone:
    """What a pickled or copied ``_Ref`` becomes: equal to itself only."""

    __slots__ = ("__weakref__",)


def object_ref(obj: object):
    """A key naming ``obj`` while it lives and never a later object that gets its ``id``
    (``view_key``): a weak reference, or the ``id`` of an object that takes none or cannot
    be hashed (a weak reference hashes as its object)."""
    if type(obj).__hash__ is None:
        return ("id", id(obj))
    try:
        ref = _Ref(obj)
    except TypeError:  # (module note above)
        return ("id", id(obj))
    hash(ref)  # kept by the reference from now: hashed only after obj died, it would raise
    return ref


def memoised(anchor, key: tuple, build):
    """``build()`` memoised on ``anchor`` under ``key`` (one entry: a new key replaces it).
    A built value that holds ``anchor`` itself makes a cycle that only the garbage collector
    frees: build it from an alias (``anchor.detach()``) instead."""
    memo = getattr(anchor, _MEMO_ATTR, None)
    if memo is None:
        memo = DerivedCache()
        try:
            setattr(anchor, _MEMO_ATTR, memo)
        except (AttributeError, TypeError, RuntimeError):  # no attributes: build every call
            return build()
    value = memo.get(key)
    if isinstance(value, weakref.ref):  # seeded (``seed_memo``)
        value = value()
    if value is None:
        memo.clear()
        value = memo[key] = build()
    return value


def seed_memo(anchor, key: tuple, value) -> bool:
    """Make ``value`` what ``memoised(anchor, key, ...)`` returns (replacing any entry) while
    it lives: the memo refers to it weakly, since the caller's own object holds ``anchor``
    and would otherwise be kept alive by it. False where ``anchor`` takes no attributes."""
    memo = DerivedCache()
    memo[key] = weakref.ref(value)
    try:
        setattr(anchor, _MEMO_ATTR, memo)
    except (AttributeError, TypeError, RuntimeError):
        return False
    return True


def forget_memo(t: torch.Tensor) -> None:
    """Drop what ``memoised`` keeps on ``t`` (e.g. canonical views of its old memory), so that
    memory is freed when ``t``'s data is replaced instead of at the next call."""
    t.__dict__.pop(_MEMO_ATTR, None)
