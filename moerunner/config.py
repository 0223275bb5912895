"""Frozen configuration values that travel as arguments through every stage.

``Activation`` names the expert's non-linearity (and its parameters); ``ExpertSpec`` is the
static description of the expert computation that a backend needs at run time. Both are
frozen dataclasses whose ``repr`` can be pasted back to rebuild them, so benchmark logs replay.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, fields

import torch

from .errors import MoeInputError

# name -> gated (act(gate) * up) or not (act(x)). One table: the torch backend, the Triton
# kernels and the reference all accept exactly these names.
ACTIVATIONS: dict[str, bool] = {
    "silu": True,
    "gelu": True,
    "gelu_tanh": True,
    "swiglu_oai": True,
    "swiglu_step": True,
    "situ": True,
    "relu2": False,
    # non-gated forms of the gated ones (act(x W1^T), w13 [E, I, H]; vLLM's names)
    "silu_no_mul": False,
    "gelu_no_mul": False,
    "gelu_tanh_no_mul": False,
}

#: ``select_experts``' scores of the router logits, and a group's score in grouped top-k.
SCORING_FUNCS = ("softmax", "sigmoid", "topk_sigmoid")
GROUP_SCORES = ("top2_sum", "max")

SWIGLU_OAI_DEFAULT_ALPHA = 1.702
SWIGLU_OAI_DEFAULT_LIMIT = 7.0
SWIGLU_OAI_DEFAULT_BETA = 1.0
SWIGLU_STEP_DEFAULT_LIMIT = 7.0
SITU_DEFAULT_BETA = 4.0  # Kimi-K3's
SITU_DEFAULT_LINEAR_BETA = 25.0


# An argument left out, where None is a value of its own (``situ_linear_beta=None``: no
# linear clamp). Ellipsis: a constant torch.compile traces (an instance of a class of ours
# is a graph break where Activation is built in compiled code).
_UNSET = ...


def _real(name: str, value: object, default: float) -> float:
    """``value`` as a float (``default`` for None); TypeError naming ``name`` otherwise."""
    if value is None:
        return default
    if torch.compiler.is_compiling() and isinstance(value, (int, float, torch.SymFloat)):
        return value  # traced: a float argument may be symbolic (no host checks)
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(
            f"{name} must be a number, a 1-D floating tensor [E] or None, "
            f"got {type(value).__name__} {value!r}"
        )
    try:  # (a numpy array of several values, an int past float's range)
        return float(value)
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(
            f"{name} must be a number, a 1-D floating tensor [E] or None, got "
            f"{type(value).__name__} {value!r:.80} ({err})"
        ) from None


def _param(name: str, value: object, default: float):
    """A swiglu_oai parameter: a float, or a per-expert 1-D floating tensor ``[E]`` (checked
    against E where the weights are known, ``ExpertWeights.validate``)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or not value.is_floating_point():
            raise TypeError(
                f"{name} as a tensor must be 1-D floating [E] (one value per expert), got "
                f"{value.dtype} of shape {list(value.shape)}"
            )
        return value
    return _real(name, value, default)


def _check_param_values(name: str, value, rule: str) -> None:
    """``rule`` "finite" or "positive" on a float, or on a CPU tensor's values (a GPU tensor
    is not read: that would synchronise; nothing is read while torch.compile traces, where
    values may be symbolic)."""
    if torch.compiler.is_compiling():
        return
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() == 0:
            return
        v = value.double()
        bad = ~torch.isfinite(v) if rule == "finite" else ~(v > 0)
        if bool(bad.any()):
            index = int(torch.nonzero(bad)[0])
            raise MoeInputError(
                f"{name} must be {'finite' if rule == 'finite' else '> 0'} for every expert, "
                f"got {float(v[index])} at expert {index}"
            )
        return
    if rule == "finite" and not math.isfinite(value):
        raise MoeInputError(f"{name} must be a finite number, got {value}")
    if rule == "positive" and not value > 0:
        raise MoeInputError(f"{name} must be > 0, got {value}")


def _situ_param(name: str, value: object, zero_is_none: bool = False) -> float:
    """A situ parameter: a finite float > 0; ``zero_is_none``: 0.0 also passes (the stored
    form of "no linear clamp")."""
    if isinstance(value, torch.Tensor) or (
        not torch.compiler.is_compiling()
        and (isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"))
    ):
        what = (
            "a tensor: situ takes no per-expert parameters"
            if isinstance(value, torch.Tensor)
            else f"{type(value).__name__} {value!r:.80}"
        )
        raise TypeError(f"{name} must be a number (a float > 0), got {what}")
    value = _real(name, value, 0.0)
    if zero_is_none and not torch.compiler.is_compiling() and value == 0.0:
        return 0.0
    _check_param_values(name, value, "finite")
    _check_param_values(name, value, "positive")
    return value


class HashedOnce:
    """For frozen dataclasses that every call hashes (memo keys): the hash, and the key it is
    computed from, are worked out once per object. Neither is pickled or copied (string
    hashes and tensor identities differ in another process). A class sets
    ``__hash__ = HashedOnce.__hash__`` in its body (a dataclass replaces an inherited one)."""

    def _hash_key(self) -> tuple:
        """What equal objects share: the fields (a subclass may narrow it)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def _memo(self, name: str, make):
        try:
            return self.__dict__[name]
        except KeyError:
            value = make()
            object.__setattr__(self, name, value)
            return value

    def __hash__(self) -> int:
        return self._memo("_hash", lambda: hash(self._hash_key()))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_key_memo")}


def _identity_key(value: object) -> object:
    """Tensors compare by identity inside ``Activation`` (their ``==`` is elementwise)."""
    return ("tensor", id(value)) if isinstance(value, torch.Tensor) else value


@dataclass(frozen=True, eq=False)
class Activation(HashedOnce):
    """The expert activation.

    ``alpha``, ``beta`` and ``limit`` apply to ``swiglu_oai`` (GPT-OSS clamped SwiGLU:
    gate clamped above at ``limit``, up clamped to ``[-limit, limit]``,
    ``out = (up + beta) * gate * sigmoid(alpha * gate)``; defaults 1.702, 1.0 and 7.0), and
    ``limit`` alone to ``swiglu_step`` (the clamp after the activation, Step-3.5 / Step-3.7 and
    Bailing-hybrid: ``out = min(silu(gate), limit) * clamp(up, -limit, limit)``; default 7). Each
    is a float or a per-expert 1-D floating tensor ``[E]`` (FlashInfer's ``swiglu_alpha`` /
    ``swiglu_beta`` / ``swiglu_limit``): expert ``e`` uses entry ``e``. Backends that take
    only scalars with ``beta == 1`` (the fused triton kernels) decline per-expert
    parameters and other betas (``Capabilities.extended_swiglu``). Tensor parameters
    compare by identity, so a value holding them stays hashable.

    ``situ`` (Kimi-K3's soft-capped gated activation, gate then up halves, in float32):
    ``out = situ_beta * tanh(gate / situ_beta) * sigmoid(gate) * up'`` with
    ``up' = situ_linear_beta * tanh(up / situ_linear_beta)``, or ``up' = up`` for
    ``situ_linear_beta=None`` (vLLM's ``activation_situ_beta`` /
    ``activation_situ_linear_beta``). Give them by name: ``Activation("situ")`` is Kimi-K3's
    (4.0 and 25.0), ``Activation("situ", situ_beta=3.0, situ_linear_beta=None)`` another; each
    a finite float > 0 (no per-expert tensors). They are stored in ``alpha`` and ``limit``, the
    scalar slots that the fused kernels and the custom op (``moerunner.ops``) carry, which is
    also what ``repr`` shows and what ``fused_moe``'s ``swiglu_alpha`` / ``swiglu_limit`` set
    for ``situ``: ``alpha`` the beta (None: 4.0), ``limit`` the linear beta (None: 25.0; 0.0:
    no linear clamp). ``act.situ_beta`` / ``act.situ_linear_beta`` read them back (None for
    other activations).
    """

    name: str = "silu"
    alpha: float | torch.Tensor | None = None
    limit: float | torch.Tensor | None = None
    beta: float | torch.Tensor | None = None
    # situ's parameters by name (``_UNSET``: left out), kept in alpha and limit
    situ_beta: InitVar[float | None] = _UNSET
    situ_linear_beta: InitVar[float | None] = _UNSET

    def __post_init__(self, situ_beta=_UNSET, situ_linear_beta=_UNSET) -> None:
        if not isinstance(self.name, str) or self.name not in ACTIVATIONS:
            raise MoeInputError(
                f"activation: got {self.name!r}; accepted: {', '.join(sorted(ACTIVATIONS))}"
            )
        if self.name == "situ":
            self._init_situ(situ_beta, situ_linear_beta)
            return
        for given, value in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
            if value is not _UNSET and value is not None:
                raise MoeInputError(
                    f"{given} applies to activation 'situ' only, got it with activation "
                    f"{self.name!r}"
                )
        params = (self.alpha, self.limit, self.beta)
        if self.name == "swiglu_step" and (self.alpha is not None or self.beta is not None):
            raise MoeInputError(
                "swiglu_alpha / swiglu_beta apply to activation 'swiglu_oai'; 'swiglu_step' "
                "takes swiglu_limit only"
            )
        if self.name not in ("swiglu_oai", "swiglu_step") and any(p is not None for p in params):
            raise MoeInputError(
                f"swiglu_alpha / swiglu_beta / swiglu_limit apply to activation 'swiglu_oai' "
                f"(swiglu_limit also to 'swiglu_step'), got them with activation {self.name!r}"
            )
        if self.name == "swiglu_step":
            limit = _param("swiglu_limit", self.limit, SWIGLU_STEP_DEFAULT_LIMIT)
            _check_param_values("swiglu_limit", limit, "positive")
            object.__setattr__(self, "limit", limit)
        if self.name == "swiglu_oai":
            alpha = _param("swiglu_alpha", self.alpha, SWIGLU_OAI_DEFAULT_ALPHA)
            limit = _param("swiglu_limit", self.limit, SWIGLU_OAI_DEFAULT_LIMIT)
            beta = _param("swiglu_beta", self.beta, SWIGLU_OAI_DEFAULT_BETA)
            _check_param_values("swiglu_alpha", alpha, "finite")
            _check_param_values("swiglu_beta", beta, "finite")
            _check_param_values("swiglu_limit", limit, "positive")
            object.__setattr__(self, "alpha", alpha)
            object.__setattr__(self, "limit", limit)
            object.__setattr__(self, "beta", beta)

    def _init_situ(self, situ_beta, situ_linear_beta) -> None:
        """situ's beta into ``alpha`` and its linear beta into ``limit`` (0.0: none)."""
        if self.beta is not None:
            raise MoeInputError(
                "swiglu_beta does not apply to activation 'situ' (its parameters: situ_beta "
                "and situ_linear_beta)"
            )
        # By name or in the stored form (alpha, limit); both only with the same value (as
        # dataclasses.replace passes them, reading the properties below).
        named_beta = named_linear = stored_beta = stored_linear = _UNSET
        if situ_beta is not None and situ_beta is not _UNSET:  # (None: the default)
            named_beta = _situ_param("situ_beta", situ_beta)
        if situ_linear_beta is None:  # given as None: no linear clamp
            named_linear = 0.0
        elif situ_linear_beta is not _UNSET:
            named_linear = _situ_param("situ_linear_beta", situ_linear_beta)
        if self.alpha is not None:
            stored_beta = _situ_param("situ_beta (given as alpha)", self.alpha)
        if self.limit is not None:  # (0.0: no linear clamp)
            stored_linear = _situ_param("situ_linear_beta (given as limit)", self.limit, True)
        picked = []
        for given, raw, named, stored, field, default in (
            ("situ_beta", situ_beta, named_beta, stored_beta, "alpha", SITU_DEFAULT_BETA),
            ("situ_linear_beta", situ_linear_beta, named_linear, stored_linear, "limit",
             SITU_DEFAULT_LINEAR_BETA),
        ):  # fmt: skip
            if named is not _UNSET and stored is not _UNSET and named != stored:
                raise MoeInputError(
                    f"situ: {given}={raw!r} and {field}={getattr(self, field)!r} (its stored form, "
                    f"swiglu_{field}) name the same parameter; give one"
                )
            picked.append(named if named is not _UNSET else default if stored is _UNSET else stored)
        beta, linear = picked
        object.__setattr__(self, "alpha", beta)
        object.__setattr__(self, "limit", linear)

    def _hash_key(self) -> tuple:
        return self._memo(
            "_key_memo",
            lambda: (
                (self.name,) + tuple(_identity_key(p) for p in (self.alpha, self.limit, self.beta))
            ),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Activation):
            return NotImplemented
        return self is other or self._hash_key() == other._hash_key()

    __hash__ = HashedOnce.__hash__

    @property
    def gated(self) -> bool:
        """True when GEMM1 produces gate and up halves (``act(gate) * up``)."""
        return ACTIVATIONS[self.name]

    @property
    def per_expert(self) -> bool:
        """Whether some parameter is a per-expert tensor ``[E]``."""
        return any(isinstance(p, torch.Tensor) for p in (self.alpha, self.limit, self.beta))

    @property
    def extended(self) -> bool:
        """A clamped SwiGLU beyond the fused kernels' form: per-expert parameters, or
        swiglu_oai with beta != 1."""
        return self.per_expert or (
            self.name == "swiglu_oai" and self.beta != SWIGLU_OAI_DEFAULT_BETA
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-expert parameters, by argument name (``swiglu_alpha`` ...)."""
        named = {"swiglu_alpha": self.alpha, "swiglu_limit": self.limit, "swiglu_beta": self.beta}
        return {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}

    @classmethod
    def of(cls, value: str | Activation) -> Activation:
        """Accept an ``Activation`` or its name."""
        if isinstance(value, Activation):
            return value
        if not isinstance(value, str):
            raise TypeError(f"activation must be a str or Activation, got {type(value).__name__}")
        return cls(value)


# (assigned after the class: in its body these names are situ's InitVar arguments)
Activation.situ_beta = property(
    lambda self: self.alpha if self.name == "situ" else None,
    doc="situ's beta (``alpha``), None for other activations.",
)
Activation.situ_linear_beta = property(
    lambda self: (self.limit or None) if self.name == "situ" else None,
    doc="situ's linear beta (``limit``; None: no linear clamp, or another activation).",
)


@dataclass(frozen=True)
class ExpertSpec(HashedOnce):
    """What a backend needs to know about the expert computation, besides the tensors.

    ``num_experts`` counts the experts held by this rank (the leading dim of the weights);
    ids in the routing are local ids in ``[0, num_experts)`` or -1 (not on this rank).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: Activation = Activation()
    gate_up_interleaved: bool = False

    __hash__ = HashedOnce.__hash__

    @property
    def gated(self) -> bool:
        """Whether GEMM1 output has gate and up halves."""
        return self.activation.gated


def check_groups(
    num_experts: int, top_k: int, num_expert_group: int | None, topk_group: int | None
) -> None:
    """Grouped top-k's settings against E and top_k (``MoeConfig``, ``select_experts``)."""
    if (num_expert_group is None) != (topk_group is None):
        raise MoeInputError("num_expert_group and topk_group must be given together")
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise MoeInputError(f"num_expert_group={num_expert_group} must divide E={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise MoeInputError(
                f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}"
            )
        if top_k > topk_group * (num_experts // num_expert_group):
            raise MoeInputError(
                f"top_k={top_k} exceeds the experts in the {topk_group} kept groups "
                f"({topk_group * (num_experts // num_expert_group)})"
            )


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become top-k weights and ids (see ``moerunner.select_experts``).

    Presets: Mixtral / Qwen3 (norm_topk_prob) / GPT-OSS: ``RoutingConfig(renormalize=True)``;
    DeepSeek-V3: ``RoutingConfig("sigmoid", True, 8, 4, 2.5, correction_bias=True)``;
    DeepSeek-V2: ``RoutingConfig("softmax", False, 8, 3, 16.0, group_score="max")``;
    Llama-4: ``RoutingConfig("topk_sigmoid")`` (top-1).
    """

    scoring_func: str = "softmax"
    renormalize: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    group_score: str = "top2_sum"

    def __post_init__(self) -> None:
        check_routing_values(self.renormalize, self.routed_scaling_factor)
        for name, accepted in (("scoring_func", SCORING_FUNCS), ("group_score", GROUP_SCORES)):
            if getattr(self, name) not in accepted:  # (else refused only at the first call)
                raise MoeInputError(
                    f"RoutingConfig.{name}: got {getattr(self, name)!r}; accepted: {accepted}"
                )
        if not isinstance(self.correction_bias, bool):
            raise TypeError(
                "correction_bias (in RoutingConfig: whether the layer has one) must be a bool, "
                f"got {type(self.correction_bias).__name__}"
            )


_FP32_TINY = torch.finfo(torch.float32).tiny
_FP32_MAX = torch.finfo(torch.float32).max


def check_routing_values(renormalize: object, routed_scaling_factor: object) -> None:
    """``renormalize`` is a bool; ``routed_scaling_factor`` a finite real number > 0 (a NaN
    or a non-number would give NaN weights or fail inside the arithmetic)."""
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {_type_name(renormalize)}")
    factor = routed_scaling_factor
    if isinstance(factor, torch.SymFloat):  # traced as a symbol (torch.compile): no value yet
        return
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"routed_scaling_factor must be a float, got {_type_name(factor)}")
    # (the weights are float32: a factor past its range would make them inf or 0)
    if not _FP32_TINY <= factor <= _FP32_MAX:  # (False for NaN; comparisons also trace)
        raise MoeInputError(
            f"routed_scaling_factor must be > 0 and within float32's normal range "
            f"[{_FP32_TINY:.3g}, {_FP32_MAX:.3g}] (the weights' dtype), got {factor!r}"
        )


def check_bool(name: str, value: object, where: str = "") -> None:
    """``value`` must be a bool: a string such as "False", a number or a 0-d tensor was read
    as a truth value."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}{name} must be a bool, got {_type_name(value)} {value!r}")


def _type_name(value: object) -> str:
    """``bool``, or ``numpy.bool`` for a type of another module (``bool`` alone would read
    as if the value were accepted)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


@dataclass(frozen=True)
class SharedExpertsConfig:
    """Shared experts of a layer (``moerunner.shared``): ``num_experts`` experts every token
    passes through, of intermediate size ``intermediate_size`` (None: the routed experts'),
    each scaled per token by ``sigmoid(hidden @ gate)`` when ``gate`` (Qwen2-MoE)."""

    num_experts: int = 1
    intermediate_size: int | None = None
    gate: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "intermediate_size"):
            value = getattr(self, name)
            if value is None and name == "intermediate_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MoeInputError(f"shared experts: {name} must be a positive int, got {value!r}")
        if not isinstance(self.gate, bool):
            raise TypeError(f"shared experts: gate must be a bool, got {type(self.gate).__name__}")


@dataclass(frozen=True)
class MoeConfig:
    """Static description of one MoE layer (shapes, activation, routing)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: Activation = Activation()
    bias: bool = False
    gate_up_interleaved: bool = False
    routing: RoutingConfig = RoutingConfig()
    shared_experts: SharedExpertsConfig | None = None

    def __post_init__(self) -> None:
        if self.shared_experts is not None and not isinstance(
            self.shared_experts, SharedExpertsConfig
        ):
            raise TypeError(
                "shared_experts must be a SharedExpertsConfig or None, got "
                f"{type(self.shared_experts).__name__}"
            )
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MoeInputError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise MoeInputError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if isinstance(self.activation, str):
            object.__setattr__(self, "activation", Activation(self.activation))
        if not isinstance(self.activation, Activation):
            raise TypeError(
                f"activation must be a name or an Activation, got {type(self.activation).__name__}"
            )
        check_bool("bias", self.bias)
        check_bool("gate_up_interleaved", self.gate_up_interleaved)
        if self.gate_up_interleaved and not self.activation.gated:
            raise MoeInputError("gate_up_interleaved=True needs a gated activation")
        r = self.routing
        if not isinstance(r, RoutingConfig):
            raise TypeError(
                f"routing must be a RoutingConfig (e.g. RoutingConfig.deepseek_v3(...)), "
                f"got {type(r).__name__}"
            )
        check_groups(self.num_experts, self.top_k, r.num_expert_group, r.topk_group)

    @property
    def w13_rows(self) -> int:
        """Rows of w13: 2I for gated activations, I otherwise."""
        return 2 * self.intermediate_size if self.activation.gated else self.intermediate_size
