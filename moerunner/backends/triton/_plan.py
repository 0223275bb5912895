# Launch plans of the triton backend's eager calls (private).
#
# An eager call re-derives on the host what only its shapes decide: the tiles, the alignment
# path, the workspaces, the constexprs and the argument list of every kernel, each kernel's
# cache key. On a GPU that host work (about 250 us for the four launches of a decode call on
# an H100 host) is larger than the device work of a decode step, so a call's launches are
# recorded once and replayed:
#
# - ``recorded(...)`` runs a call's kernel sequence while ``_launch`` records each launch that
#   went through a compiled kernel's launcher, and while a dispatch mode watches for any other
#   operation. A call that launched through Triton's JIT (it compiled, or a hook or the
#   interpreter is on) or ran another operation between its launches (a torch op that makes
#   a temporary, e.g. the emulated activation formats) leaves no plan.
# - A plan keeps each launch's arguments with the call's own tensors (the *roles*: hidden
#   states, ids, routing weights, output) as slots, and every other tensor (workspaces,
#   prepared weights) by its data pointer, with a weak reference that tells when it died
#   (a workspace evicted from its cache): the plan is then dropped and recorded again.
#   Buffers made for the call alone (``_launch.per_call``: workspaces too large to keep, e.g.
#   a prefill's intermediate activations) are slots too, at negative roles: a replay makes
#   them again with the same function, and the operations of that function do not count as
#   the call's own.
# - Plans of expert calls live in the prepared weights' ``tensors["plans"]`` and die with
#   them (routing keeps its own), keyed by the options, the caller (thread and CUDA stream,
#   as the workspaces are), the shapes and dtypes of the roles and each role's 16-byte
#   alignment (what Triton specialises a kernel on).
#
# Replay is off while a profiler records (the stage ranges would go missing), while Triton
# calls launch hooks, under its interpreter or debug mode, and with ``launch_cache`` off.

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from ...weights import PreparedWeights
from ..base import caller
from . import _launch

_TRITON_VERSION = triton.__version__
#: Plans kept per prepared weights (least recently used dropped first).
MAX_PLANS = 64
#: Calls of one key recorded without a plan coming of it before the key gives up.
MAX_ATTEMPTS = 3

# Operations that only make views (no kernel, no new data): allowed inside a recording.
_VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "as_strided",
        "alias",
        "detach",
        "t",
        "transpose",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
    }
)


class _OpWatch(TorchDispatchMode):
    """Notes whether any operation other than a view ran."""

    def __init__(self) -> None:
        super().__init__()
        self.other = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEW_OPS and not _launch.making():
            self.other = True
        return func(*args, **(kwargs or {}))


class LaunchPlan:
    """A call's launches with its own tensors as slots (module comment)."""

    __slots__ = ("launches", "refs", "makes", "made")

    def __init__(self, launches: tuple, refs: tuple, makes: tuple = ()) -> None:
        self.launches = launches  # (launcher, argument template, ((position, role), ...))
        self.refs = refs  # weak references to every tensor the template holds by pointer
        # The per-call buffers' functions, made at each replay in order; their tensors fill
        # roles -1, -2, ... (``replay`` appends their pointers reversed).
        self.makes = makes
        self.made = sum(n for _, n in makes)  # how many tensors they make

    @classmethod
    def build(
        cls, launches: list[tuple], roles: tuple[torch.Tensor, ...], buffers: list[tuple] = ()
    ) -> LaunchPlan | None:
        """The plan of ``launches`` (a ``_launch.Recording``'s) for a call whose own tensors
        are ``roles`` and whose per-call buffers are ``buffers`` (the recording's: ``(make,
        its tensors)``); None where two of those share a data pointer (their slots would be
        ambiguous) or a tensor argument cannot be weakly referenced."""
        role_of = {t.data_ptr(): i for i, t in enumerate(roles)}
        made = [t for _, tensors in buffers for t in tensors]
        role_of.update((t.data_ptr(), -1 - j) for j, t in enumerate(made))
        if len(role_of) != len(roles) + len(made):
            return None
        refs: dict[int, weakref.ref] = {}
        planned = []
        for run, head, args, tail in launches:
            direct = _direct_launcher(run)
            if direct is not None:  # the launcher's C function, its own arguments put in
                run, extra = direct
                head = (*head[:5], *extra, *head[5:])
            template = [*head]
            slots = []
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    ptr = arg.data_ptr()
                    role = role_of.get(ptr)
                    if role is not None:
                        slots.append((len(template), role))
                    else:
                        try:
                            refs.setdefault(id(arg), weakref.ref(arg))
                        except TypeError:
                            return None
                    template.append(ptr)
                else:
                    template.append(arg)
            template.extend(tail)
            planned.append((run, template, tuple(slots)))
        makes = tuple((make, len(tensors)) for make, tensors in buffers)
        return cls(tuple(planned), tuple(refs.values()), makes)

    @classmethod
    def join(cls, parts: list[tuple[LaunchPlan, tuple[int, ...]]]) -> LaunchPlan:
        """One plan running ``parts`` in order: each a plan and, per role of that plan, the
        index of the joined plan's role that fills it (two calls whose tensors meet, e.g.
        routing writing the ids that the experts read, become one replay)."""
        launches, refs, makes = [], [], []
        made = 0  # per-call tensors of the parts before: theirs come first
        for plan, role_map in parts:
            for run, template, slots in plan.launches:
                mapped = tuple((pos, role_map[r] if r >= 0 else r - made) for pos, r in slots)
                launches.append((run, template, mapped))
            refs.extend(plan.refs)
            makes.extend(plan.makes)
            made += plan.made
        return cls(tuple(launches), tuple(refs), tuple(makes))

    def alive(self) -> bool:
        """Whether every tensor the plan holds by pointer still exists."""
        for ref in self.refs:
            if ref() is None:
                return False
        return True

    def replay(self, roles: tuple[torch.Tensor, ...]) -> None:
        """Launch the recorded kernels with ``roles`` in their slots, and the call's per-call
        buffers, made again, in theirs."""
        ptrs = [t.data_ptr() for t in roles]
        if self.makes:
            # Held until every launch is queued; freed after, on the stream that used them.
            buffers = [t for make, _ in self.makes for t in make().values()]
            if len(buffers) != self.made:
                raise RuntimeError(
                    f"launch plan: its per-call buffers came to {len(buffers)} tensors, "
                    f"recorded as {self.made}"
                )
            ptrs.extend(t.data_ptr() for t in reversed(buffers))
        for run, template, slots in self.launches:
            args = template.copy()
            for position, role in slots:
                args[position] = ptrs[role]
            run(*args)


def _direct_launcher(run) -> tuple | None:
    """``(C launch function, its arguments after the function handle)`` behind a compiled
    kernel's ``run`` where calling it directly is known to be equivalent: Triton 3.6's
    ``CudaLauncher.__call__`` only adds those arguments and allocates scratch memory, which
    a kernel without scratch (``*_scratch_size == 0``) does not use. Saves a Python frame
    and two calls per launch; None elsewhere (``run`` is called)."""
    # ``CompiledKernel.run`` is the launcher object itself (a bound ``__call__`` also comes)
    launcher = run if type(run).__name__ == "CudaLauncher" else getattr(run, "__self__", None)
    if (
        not _TRITON_VERSION.startswith("3.6.")
        or type(launcher).__name__ != "CudaLauncher"
        or getattr(launcher, "global_scratch_size", 1) != 0
        or getattr(launcher, "profile_scratch_size", 1) != 0
        or not hasattr(launcher, "launch")
    ):
        return None
    pdl = launcher.launch_pdl
    return launcher.launch, (launcher.launch_cooperative_grid, pdl, None, None)


def enabled(options, device: torch.device) -> bool:
    """Whether plans may be used for a call on ``device`` with the backend's ``options``
    (module comment)."""
    return (
        device.type == "cuda"
        and _launch.compiled_launches(options)
        and not torch._C._autograd._profiler_enabled()
    )


def key(roles: tuple[torch.Tensor, ...], *extra) -> tuple:
    """The plan key of a call (module comment): the caller, the roles' shapes, dtypes and
    alignments; ``extra``: the call's other facts (options and the like)."""
    device = roles[0].device
    return (
        caller(device),
        device.index,
        *[(tuple(t.shape), t.dtype, t.data_ptr() & 15) for t in roles],
        *extra,
    )


def plans_of(prepared: PreparedWeights) -> OrderedDict:
    """The plans of calls on ``prepared`` (they die with the prepared weights)."""
    plans = prepared.tensors.get("plans")
    if plans is None:
        plans = prepared.tensors["plans"] = OrderedDict()
    return plans


def replay(plans: OrderedDict, plan_key: tuple, roles: tuple[torch.Tensor, ...]) -> bool:
    """Replay the plan of ``plan_key`` in ``plans`` with ``roles``; False where there is none
    (or it died): run the call the usual way, inside ``recorded``."""
    plan = plans.get(plan_key)
    if not isinstance(plan, LaunchPlan):
        return False
    if not plan.alive():
        plans.pop(plan_key, None)
        return False
    try:
        plans.move_to_end(plan_key)
    except KeyError:  # evicted meanwhile by another thread's plan (keys name the thread)
        pass
    plan.replay(roles)
    return True


class recorded:  # noqa: N801  (a context manager)
    """Run a call's kernel sequence inside ``with recorded(plans, key, roles):`` to make its
    plan for later calls of ``key`` (module comment). Keys that gave no plan
    ``MAX_ATTEMPTS`` times are run without recording from then on."""

    def __init__(
        self, plans: OrderedDict, plan_key: tuple, roles: tuple[torch.Tensor, ...]
    ) -> None:
        self.plans = plans
        self.key = plan_key
        self.roles = roles
        attempts = self.plans.get(plan_key, 0)
        self.active = isinstance(attempts, int) and attempts < MAX_ATTEMPTS
        self.attempts = attempts if isinstance(attempts, int) else MAX_ATTEMPTS

    def __enter__(self) -> recorded:
        if self.active:
            self._recording = _launch.recording()
            self.rec = self._recording.__enter__()
            self.watch = _OpWatch()
            self.watch.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.active:
            return
        self.watch.__exit__(exc_type, exc, tb)
        self._recording.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        plan = None
        if self.rec.complete and not self.watch.other and self.rec.launches:
            plan = LaunchPlan.build(self.rec.launches, self.roles, self.rec.buffers)
        if plan is None:
            self.plans[self.key] = self.attempts + 1
            return
        self.plans[self.key] = plan
        while len(self.plans) > MAX_PLANS:
            try:
                self.plans.popitem(last=False)
            except KeyError:  # emptied meanwhile by another thread
                break
