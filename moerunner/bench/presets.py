"""Model shapes: one MoE layer of a published model, as its serving engine would shard it.

This is the one table of model shapes in the project: ``moerunner bench``, ``moerunner
tune`` (``backends/triton/tune.py``), the tests and the scripts under ``benchmarks/`` all
read ``PRESETS`` from here; none keeps its own copy of H, I, E or k.

A ``BenchShape`` is the per-rank expert computation a benchmark row runs: E experts of hidden
size H and per-expert intermediate size I (already divided by the tensor-parallel size), k
slots per token, the activation, biases and gate/up layout. The model presets take their
numbers from the published configs as transformers 5 defines them (``MixtralConfig``,
``Qwen3MoeConfig``, ``DeepseekV3Config``, ``GptOssConfig``, ``NemotronHConfig``); the
``cpu-*`` presets are scaled-down shapes that run in seconds on a CPU (CI).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ACTIVATIONS
from ..errors import MoeInputError


@dataclass(frozen=True)
class BenchShape:
    """Per-rank shape of one MoE layer. ``eval(repr(shape))`` rebuilds it.

    ``intermediate_size`` is the per-rank I (the model's I divided by ``tp_size``);
    ``source`` says where the numbers come from.
    """

    name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: str = "silu"
    bias: bool = False
    gate_up_interleaved: bool = False
    tp_size: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("num_experts", "hidden_size", "intermediate_size", "top_k", "tp_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MoeInputError(f"{field} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise MoeInputError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.activation not in ACTIVATIONS:
            raise MoeInputError(
                f"activation: got {self.activation!r}; accepted: {', '.join(sorted(ACTIVATIONS))}"
            )

    @property
    def gated(self) -> bool:
        """True when GEMM1 has gate and up halves (w13 has 2I rows)."""
        return ACTIVATIONS[self.activation]

    @property
    def w13_rows(self) -> int:
        """Rows of w13 per expert: 2I gated, I otherwise."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    def with_tp(self, tp_size: int) -> BenchShape:
        """This layer as one of ``tp_size`` tensor-parallel ranks holds it (I split evenly)."""
        return shard_intermediate(self, tp_size)


def shard_intermediate(shape: BenchShape, tp_size: int) -> BenchShape:
    """Split the model's I over ``tp_size`` ranks as serving engines do: I must divide evenly.

    ``shape.intermediate_size`` is taken as the full-model I when ``shape.tp_size == 1``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise MoeInputError(f"tp_size must be a positive int, got {tp_size!r}")
    if shape.tp_size != 1:
        raise MoeInputError(f"{shape.name} is already sharded (tp_size={shape.tp_size})")
    full = shape.intermediate_size
    if full % tp_size:
        raise MoeInputError(
            f"tp_size={tp_size} does not divide {shape.name}'s intermediate size I={full}; "
            f"a serving engine shards each expert's I evenly over the tensor-parallel ranks"
        )
    if tp_size == 1:
        return shape
    return replace(
        shape,
        name=f"{shape.name}-tp{tp_size}",
        intermediate_size=full // tp_size,
        tp_size=tp_size,
    )


_HF = "transformers 5 {}"

# Full-model shapes (tp_size = 1). nemotron-h also has a TP-8 preset: 7688 / 8 = 961 per rank,
# not a multiple of 16 (the alignment case a kernel must pad for).
PRESETS: dict[str, BenchShape] = {
    s.name: s
    for s in (
        BenchShape("mixtral-8x7b", 8, 4096, 14336, 2, source=_HF.format("MixtralConfig()")),
        BenchShape("qwen3-30b-a3b", 128, 2048, 768, 8, source=_HF.format("Qwen3MoeConfig()")),
        BenchShape(
            "qwen3-235b-a22b",
            128,
            4096,
            1536,
            8,
            source="Qwen3MoeConfig(hidden_size=4096, moe_intermediate_size=1536) "
            "(Qwen3-235B-A22B config.json)",
        ),
        BenchShape(
            "deepseek-v3",
            256,
            7168,
            2048,
            8,
            source=_HF.format("DeepseekV3Config() (routed experts; 1 shared expert not included)"),
        ),
        BenchShape(
            "gpt-oss-20b",
            32,
            2880,
            2880,
            4,
            "swiglu_oai",
            bias=True,
            gate_up_interleaved=True,
            source="GptOssConfig(num_local_experts=32) (gpt-oss-20b config.json)",
        ),
        BenchShape(
            "gpt-oss-120b",
            128,
            2880,
            2880,
            4,
            "swiglu_oai",
            bias=True,
            gate_up_interleaved=True,
            source=_HF.format("GptOssConfig()"),
        ),
        BenchShape(
            "nemotron-h",
            8,
            4096,
            7688,
            2,
            "relu2",
            source=_HF.format("NemotronHConfig() (n_routed_experts=8, moe_intermediate_size=7688)"),
        ),
        # Models without a tuned tile file shipped: the shapes on which the triton backend's
        # default tiles are judged (benchmarks/experiments/unseen_shapes.py).
        BenchShape(
            "olmoe-1b-7b",
            64,
            2048,
            1024,
            8,
            source="OLMoE-1B-7B-0924 config.json (OlmoeConfig(intermediate_size=1024))",
        ),
        BenchShape(
            "qwen1.5-moe-a2.7b",
            60,
            2048,
            1408,
            4,
            source=_HF.format("Qwen2MoeConfig() (routed experts; the shared expert not included)"),
        ),
        BenchShape("phi-3.5-moe", 16, 4096, 6400, 2, source=_HF.format("PhimoeConfig()")),
        BenchShape(
            "dbrx",
            16,
            6144,
            10752,
            4,
            source="DBRX config.json (d_model 6144, ffn_hidden_size 10752, moe_num_experts 16, "
            "moe_top_k 4)",
        ),
        # Scaled-down shapes for CPUs and CI.
        BenchShape("cpu-tiny", 8, 64, 96, 2, source="scaled down for tests"),
        BenchShape("cpu-small", 128, 256, 96, 8, source="qwen3-30b-a3b routing, H and I / 8"),
        BenchShape(
            "cpu-gpt-oss",
            16,
            128,
            128,
            4,
            "swiglu_oai",
            bias=True,
            gate_up_interleaved=True,
            source="gpt-oss routing, scaled down",
        ),
        BenchShape("cpu-relu2", 8, 128, 961, 2, "relu2", source="nemotron-h per-rank I=961"),
    )
}
PRESETS["nemotron-h-tp8"] = shard_intermediate(PRESETS["nemotron-h"], 8)

#: The presets of published models, whole (tp_size 1): the shapes worth tuning a GPU for.
MODEL_PRESETS = tuple(
    name for name, s in PRESETS.items() if not name.startswith("cpu-") and s.tp_size == 1
)

#: The four presets of the GPU performance report.
GPU_REPORT_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b")

#: Model presets with no tuned tile file shipped (``backends/triton/configs``): where the
#: triton backend's default tiles answer.
UNSEEN_TILE_PRESETS = ("olmoe-1b-7b", "qwen1.5-moe-a2.7b", "phi-3.5-moe", "dbrx")


def parse_shape(text: str, activation: str = "silu") -> BenchShape:
    """``"E,H,I,k"`` -> a custom shape (I is the full-model intermediate size)."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise MoeInputError(f"--shape must be four positive ints E,H,I,k; got {text!r}")
    e, h, i, k = (int(p) for p in parts)
    return BenchShape(f"shape-{e}x{h}x{i}x{k}", e, h, i, k, activation, source="--shape")


def get_preset(name: str) -> BenchShape:
    """A preset by name; the error lists every preset."""
    if name not in PRESETS:
        raise MoeInputError(f"preset: unknown {name!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[name]
