"""Error types raised by moerunner.

Every check of user input raises one of these (or a plain ``TypeError`` for a wrong type),
with a message that names the argument, what was given and what is accepted. They subclass
``ValueError`` so callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations

import torch
from torch._C._functorch import is_batchedtensor, is_gradtrackingtensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd import forward_ad
from torch.fx.experimental.proxy_tensor import get_proxy_mode


class MoeInputError(ValueError):
    """An argument has the wrong shape, value or combination with other arguments."""


def compile_disabled(fn, reason: str):
    """``fn`` run outside any graph torch.compile traces (a graph break; under fullgraph an
    error that gives ``reason``, where this torch takes one)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # a torch without ``reason``
        return torch.compiler.disable(fn)


def _refuse(message: str) -> None:
    """Raise ``MoeInputError(message)``, outside any graph torch.compile traces: without
    fullgraph it reaches the caller as it is (raised inside the traced region, dynamo wraps it
    in an ``Unsupported`` error that shows it only in its debug context); under fullgraph the
    graph break's error says that moerunner refused the call and how to read why."""
    raise MoeInputError(message)


refuse = compile_disabled(
    _refuse,
    "moerunner refused this call with a MoeInputError saying why: run it once without "
    "fullgraph=True (or eagerly) to read it",
)


class BackendUnavailableError(ValueError):
    """No registered backend can serve a request; the message lists each and why not."""


class ExtensionContractError(TypeError):
    """A registered backend or dispatcher (an extension) does not keep its contract
    (``moerunner.backends.base``, ``moerunner.dispatch.base``): the message names it, what it
    declared or returned, and what is expected."""


class CapacityOverflowError(RuntimeError):
    """A fixed-capacity (masked) layout received more tokens for an expert than it holds."""


class RankFailedError(RuntimeError):
    """A step of a process group failed on some ranks; raised on every rank alike.

    ``ranks``: the ranks that failed; ``errors``: each one's ``"Type: message"``. On a rank
    that failed, the local exception is the ``__cause__``.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = (), errors: tuple[str, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.errors = tuple(errors)


#: The dtypes ids may have (expert ids, adapter ids): the integer dtypes PyTorch computes
#: on. Its other unsigned ones (uint16/32/64) lack most CPU ops (``aminmax``, which the id
#: checks use, among them), and a uint64 id past int64's range wrapped into range when cast.
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_NAMES = [str(d).removeprefix("torch.") for d in INDEX_DTYPES]
INDEX_DTYPES_TEXT = f"{', '.join(_NAMES[:-1])} or {_NAMES[-1]}"  # (as messages name them)


def is_index_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` holds ids of a dtype of ``INDEX_DTYPES``."""
    return t.dtype in INDEX_DTYPES


def check_forward_mode(where: str, tensors: dict) -> None:
    """MoeInputError where a tensor carries a forward-mode tangent (``torch.func.jvp``,
    ``torch.autograd.forward_ad``): the experts have no forward-mode derivative, and the
    custom ops dropped the tangent silently (a zero JVP); the eager GEMMs failed inside
    PyTorch."""
    if forward_ad._current_level < 0:  # (no dual level open: the common case, one read)
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            raise MoeInputError(
                f"{where}: {name} carries a forward-mode tangent (torch.func.jvp, "
                "torch.autograd.forward_ad); moerunner's experts are differentiated in "
                "reverse mode only: use backward(), torch.autograd.grad or torch.func.vjp / "
                "grad / jacrev"
            )


def check_op_inputs(where: str, **tensors: object) -> None:
    """The custom ops' eager caller (the layer's training calls on a backend other than
    torch): no forward-mode tangent (``check_forward_mode``), and no tensor of a
    ``torch.func`` gradient transform, whose wrapped tensors the ops' autograd cannot take
    (PyTorch's "must override the setup_context staticmethod"). Traced calls pass."""
    if torch.compiler.is_compiling():
        return
    check_forward_mode(where, tensors)
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and is_gradtrackingtensor(t):
            raise MoeInputError(
                f"{where}: {name} is a tensor of a torch.func transform (grad, vjp, jacrev), "
                "which this call's custom op cannot be differentiated under: use backward() "
                "or torch.autograd.grad, or call moerunner.fused_moe, whose eager "
                "differentiable path takes torch.func.grad / vjp"
            )


def make_fx_tracing() -> bool:
    """Whether ``make_fx`` (a proxy dispatch mode) is tracing the current code, outside the
    compilers' own traces (``torch.compiler.is_compiling``)."""
    return get_proxy_mode() is not None


def check_eager_inputs(where: str, **tensors: object) -> None:
    """MoeInputError where an eager call gets tensors it cannot run on: batched by
    ``torch.func.vmap`` (an input, or weights stacked for model ensembling), or fake
    (``FakeTensorMode`` outside a trace). The experts size their work from the routing's
    values on the host, which neither gives, so they would fail inside PyTorch instead.
    Traced calls (torch.compile, torch.export) are the custom ops, which take fake tensors."""
    if torch.compiler.is_compiling():
        return
    if make_fx_tracing():
        raise MoeInputError(
            f"{where}: traced by make_fx, which would record this eager call's routing (the "
            "experts' row counts, read on the host) as constants of the graph, wrong for any "
            "other input: trace it with torch.export or torch.compile, where it is a custom op"
        )
    check_forward_mode(where, tensors)
    for name, t in tensors.items():
        if isinstance(t, FakeTensor):
            raise MoeInputError(
                f"{where}: {name} is a fake tensor (FakeTensorMode outside a trace), without the "
                "values the eager call sizes its work from: trace the call with "
                "torch.compile or torch.export instead, where it is a custom op whose fake "
                "gives the output"
            )
        if isinstance(t, torch.Tensor) and is_batchedtensor(t):
            raise MoeInputError(
                f"{where}: {name} is batched by torch.func.vmap, which moerunner's experts do "
                "not run under: call it once per batch element (stacked weights: once per "
                "model), or fold a batch of inputs into the token dimension"
            )
