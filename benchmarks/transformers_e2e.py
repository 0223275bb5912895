"""End-to-end transformers benchmark: prefill and decode tokens/s per experts implementation.

Builds a random model with real per-layer shapes (Qwen3-30B-A3B, GPT-OSS-120B, DeepSeek-V3,
Mixtral-8x7B) but only a few layers and a reduced vocabulary, then times, for each experts
implementation (transformers' "eager" loop, its "grouped_mm", moerunner, and a zero-cost
implementation that returns zeros without reading the weights), one prefill forward of
``batch x prompt`` tokens and ``decode_steps`` single-token steps over a KV cache, ``repeats``
times (min / median / max). Before timing, the prefill logits of every implementation are
compared with the first one's (max |d| / max |ref|). Every implementation but
``moerunner+relayout`` and ``moerunner+auto`` runs on GPT-OSS's experts as stored
(transposed), chosen on purpose (``relayout_experts(model, "stored")``), so moerunner reads
them through strided views there; ``moerunner+relayout`` runs moerunner on them re-laid as
``use_moerunner`` lays them; ``moerunner+auto`` leaves the layout to moerunner, as a model
loaded with ``experts_implementation="moerunner"`` does (its first inference call re-lays
each layer in place; each row says which layout its experts ended in). A last ``+routers``
(``moerunner@fp8_block+routers``) also runs the MoE blocks' routers on moerunner's routing
kernel (``fuse_routers``); every other row runs the routers' own forwards, the zero-cost row
too, so a ``+routers`` row's time in experts also counts what its routers saved.

Before the first implementation is timed, a warm-up pass runs the zero-cost implementation
through the same prefill and decode sequence (every KV-cache length the timed runs reach):
attention kernels that build a plan per new sequence length (cuDNN's scaled dot-product
attention does) build them there, not inside whichever implementation happens to be timed
first. Without it the first implementation's eager decode steps measured about 40 ms against
4-6 ms for the same implementation timed second (H200, DeepSeek-V3 shape, 2026-11-28).

"Time in experts" is an implementation's step time minus the zero-cost implementation's step
time (medians): everything else in the step (attention, routers, norms, LM head, the host's
work between them) is the same. The table gives it per implementation for prefill and decode,
and its ratio to grouped_mm's. Where the step is host-bound (the GPU waits for the host), that
difference hides GPU work that overlaps the host's: an implementation whose own host work is
long can show no time in experts at all. The table therefore also gives the experts' span:
the time on the GPU's timeline from the point the experts call is reached to the end of its
last kernel (CUDA events recorded by hooks around every experts module, summed over a step;
on a CPU the calls' wall time), which counts an implementation's kernels and the GPU's idle
time inside its own call, and nothing of the rest of the step.

Then (``--rounds``, default 3) the implementations are timed again in turns: each round one
prefill and one block of decode steps per implementation, so a drift of the host's speed
during the run (an eager decode step is host-bound) falls on all of them alike; a table of
its medians follows the others.

Options:

- ``--graph``: decode again with a static cache, uncompiled ("static"), with the decode step
  under ``torch.compile(mode="default", fullgraph=True)`` ("compile") and, on CUDA, with the
  step captured by hand in a CUDA graph, uncompiled ("cudagraph") and compiled
  ("compile+cudagraph"), and with the forward under ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` ("reduce-overhead": inductor's CUDA graphs, the next token made eagerly
  between steps, as transformers' generate runs it). Every implementation but eager (a
  data-dependent loop) is tried; a mode that fails is reported with its error and the run
  goes on.
- ``--breakdown``: profile a few decode steps (``torch.profiler``) and split one step into
  embedding, attention, norms, router (the MoE block less its experts), experts, shared
  experts, LM head and the rest; host time per stage and, on CUDA, kernel time per stage and
  the GPU's idle time (the step's wall time less its kernel time: host gaps).

    python benchmarks/transformers_e2e.py --out results_dir            # GPU, real shapes
    python benchmarks/transformers_e2e.py --tiny --device cpu          # a quick CPU check
    python benchmarks/transformers_e2e.py --graph --breakdown --shapes qwen3-30b-a3b

Prints compact tables last; writes ``transformers_e2e.json`` (with the environment) to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

import torch

import moerunner
import moerunner.integrations.transformers as mt
from moerunner.bench.presets import get_preset
from moerunner.cli import _common
from moerunner.integrations._hf_experts import quantized_weights, set_quantized

#: The zero-cost experts implementation: its row in the results, and the name under which it
#: is registered in transformers' experts functions.
ZERO_IMPL = "zero-cost"
ZERO_NAME = "zero_cost"


def zero_experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs):
    """Experts that cost (almost) nothing: zeros of the output's shape and dtype.

    The weights are not read and the routing is ignored; one fill is the whole work. A step
    that runs these experts times everything in the model but the experts.
    """
    return hidden_states.new_zeros(hidden_states.shape)


def register_zero_cost(name: str = ZERO_NAME) -> str:
    """Register the zero-cost experts beside transformers' own and moerunner's; ``name``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, zero_experts_forward)
    return name


def _moe_dims(preset: str, experts_key: str, inter_key: str) -> dict:
    """The MoE layer's H, I, E and k under a transformers config's names, from the project's
    one preset table (``moerunner.bench.presets``)."""
    s = get_preset(preset)
    return {
        "hidden_size": s.hidden_size,
        inter_key: s.intermediate_size,
        experts_key: s.num_experts,
        "num_experts_per_tok": s.top_k,
    }


# Real per-layer shapes: the MoE dimensions from the presets, the rest (attention, the dense
# MLP size, routing groups) from the published configs, under transformers 5's config field
# names; vocab reduced (LM head is not the subject).
SHAPES = {
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            **_moe_dims("qwen3-30b-a3b", "num_experts", "moe_intermediate_size"),
            intermediate_size=6144,
            norm_topk_prob=True,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    "gpt-oss-120b": (
        "gpt_oss",
        dict(
            **_moe_dims("gpt-oss-120b", "num_local_experts", "intermediate_size"),
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
        ),
    ),
    "deepseek-v3": (
        "deepseek_v3",
        dict(
            **_moe_dims("deepseek-v3", "n_routed_experts", "moe_intermediate_size"),
            intermediate_size=18432,  # the dense layers' MLP; none here (see below)
            first_k_dense_replace=0,  # the model's first 3 layers are dense: here every one is MoE
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            # Multi-head latent attention.
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "mixtral-8x7b": (
        "mixtral",
        dict(
            **_moe_dims("mixtral-8x7b", "num_local_experts", "intermediate_size"),
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
}
_TINY_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY = {
    "qwen3-30b-a3b": dict(
        hidden_size=64,
        moe_intermediate_size=32,
        intermediate_size=64,
        num_experts=16,
        **_TINY_ATTENTION,
    ),
    "gpt-oss-120b": dict(
        hidden_size=64, intermediate_size=32, num_local_experts=16, **_TINY_ATTENTION
    ),
    "deepseek-v3": dict(
        hidden_size=64,
        moe_intermediate_size=32,
        intermediate_size=64,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    "mixtral-8x7b": dict(hidden_size=64, intermediate_size=32, **_TINY_ATTENTION),
}


def build_model(name: str, layers: int, vocab: int, tiny: bool, dtype, device):
    """Random model of preset ``name`` with ``layers`` decoder layers on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = SHAPES[name]
    kwargs = {**kwargs, **(TINY[name] if tiny else {})}
    kwargs.update(
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    if model_type == "gpt_oss":
        kwargs["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2) + [
            "sliding_attention"
        ] * (layers % 2)
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and p.dim() == 1:
                continue
            # Routers start at zero in some families: random values give realistic loads.
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
    # GPT-OSS's experts stay as stored, chosen on purpose (no first call re-lays them):
    # only the "+relayout" rows re-lay them (``use_impl``).
    mt.relayout_experts(model, "stored")
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(samples_s: list[float]) -> dict:
    """min / median / max of ``samples_s`` (seconds), in milliseconds."""
    return {
        "min": 1e3 * min(samples_s),
        "median": 1e3 * statistics.median(samples_s),
        "max": 1e3 * max(samples_s),
    }


def time_prefill(model, ids, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` forwards over ``ids`` (no cache), after one warm-up."""
    samples = []
    for _ in range(repeats + 1):
        _sync(ids.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
        _sync(ids.device)
        samples.append(time.perf_counter() - t0)
    return samples[1:]


def _dynamic_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers 5.x
        return DynamicCache()


def time_decode(model, ids, steps: int, repeats: int) -> list[float]:
    """Seconds per decode step (batch of single tokens) after a prefill of ``ids``: one
    sample per block of ``steps`` steps, ``repeats`` blocks after two warm-up steps."""
    samples = []
    with torch.no_grad():
        cache = _dynamic_cache(model)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            token = model(token, past_key_values=cache, use_cache=True).logits.argmax(-1)
        for _ in range(repeats):
            _sync(ids.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                token = model(token, past_key_values=cache, use_cache=True).logits.argmax(-1)
            _sync(ids.device)
            samples.append((time.perf_counter() - t0) / steps)
    return samples


class ExpertsSpan:
    """Hooks around every experts module that time each call's span on the device's
    timeline (module docstring): a CUDA event pair per call on CUDA, read after the step's
    synchronisation, or the call's wall time on a CPU. ``take()`` returns the milliseconds
    of the calls since the last ``take()`` and starts over. Each call also counts the
    experts its routing hits (on the device, queued before the call's first event, so
    outside its span; read by ``take_hit()``): the weight bytes a decode step must read."""

    def __init__(self, model, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.hit: list = []
        self.handles = []
        for _, module in mt.experts_modules(model):
            self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave))

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _enter(self, module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        experts = getattr(module, "num_experts", None)
        if isinstance(ids, torch.Tensor) and isinstance(experts, int):
            flags = torch.zeros(experts + 1, device=ids.device, dtype=torch.int32)
            ids = ids.reshape(-1).long().clamp(-1, experts - 1) % (experts + 1)  # -1: the spare
            self.hit.append(flags.index_fill_(0, ids, 1)[:experts].sum())
        self.pending.append([self._stamp(), None])

    def _leave(self, module, args, output):
        self.pending[-1][1] = self._stamp()

    def take(self) -> float:
        if self.cuda:
            ms = sum(a.elapsed_time(b) for a, b in self.pending)
        else:
            ms = sum(1e3 * (b - a) for a, b in self.pending)
        self.pending = []
        return ms

    def take_hit(self) -> float | None:
        """Mean experts hit per call since the last ``take_hit()`` (None: no call counted)."""
        hit, self.hit = self.hit, []
        return torch.stack(hit).float().mean().item() if hit else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def time_spans(model, prompt, decode_ids, steps: int, repeats: int) -> tuple[list, list, dict]:
    """Experts' span (ms) per prefill of ``prompt`` and per decode step after a prefill of
    ``decode_ids``: ``repeats`` samples each, after a warm-up, in runs of their own (the
    events are not in the timed runs); and the experts hit per call in each phase."""
    span = ExpertsSpan(model, prompt.device)
    prefill, decode, hit = [], [], {}
    try:
        with torch.no_grad():
            for i in range(repeats + 1):
                model(prompt, use_cache=False, logits_to_keep=1)
                _sync(prompt.device)
                ms = span.take()
                if i:
                    prefill.append(ms)
            hit["prefill"] = span.take_hit()
            cache = _dynamic_cache(model)
            out = model(decode_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            token = model(token, past_key_values=cache, use_cache=True).logits.argmax(-1)
            _sync(prompt.device)
            span.take()
            span.take_hit()
            for _ in range(repeats):
                for _ in range(steps):
                    token = model(token, past_key_values=cache, use_cache=True).logits.argmax(-1)
                _sync(prompt.device)
                decode.append(span.take() / steps)
            hit["decode"] = span.take_hit()
    finally:
        span.remove()
    return [ms / 1e3 for ms in prefill], [ms / 1e3 for ms in decode], hit


class BackendLog(logging.Handler):
    """The backends moerunner ran while a row was measured, from the registry's debug log:
    each per-bucket plan of a measured table (``T <= 2048: triton; T > 2048: flashinfer``)
    and each single choice, logged once per problem when first made."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.plans: dict[str, None] = {}
        self.chosen: dict[str, None] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("backend plan"):
            self.plans[str(record.args[0])] = None
        elif record.msg.startswith("backend %r selected"):
            self.chosen[getattr(record.args[0], "name", str(record.args[0]))] = None

    def served(self) -> list[str]:
        """The plans if a table chose per bucket, else the backends chosen."""
        return list(self.plans) or list(self.chosen)

    def __enter__(self) -> BackendLog:
        moerunner.default_registry().forget_choices()  # every choice made again, and logged
        log = logging.getLogger("moerunner")
        self._level = log.level
        log.addHandler(self)
        log.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        log = logging.getLogger("moerunner")
        log.removeHandler(self)
        log.setLevel(self._level)


RELAYOUT = "+relayout"
AUTO = "+auto"
#: ``...+routers`` (last): the MoE blocks' routers also run on moerunner's routing kernel
#: (``fuse_routers``); every other implementation runs the routers' own forwards.
ROUTERS = "+routers"
IMPL_W = 30  # the tables' implementation column ("moerunner@fp8_block+routers" and a gap)
#: ``moerunner@SCHEME``: moerunner on the experts quantized into SCHEME (``quantize_experts``
#: with the float weights kept, so the other implementations still run on them).
QUANTIZED = "@"


def impl_scheme(impl: str) -> tuple[str, str | None]:
    """``impl`` without its ``@SCHEME`` part (and ``ROUTERS``), and that scheme (None if
    there is none)."""
    impl = impl.removesuffix(ROUTERS)
    name, _, scheme = impl.partition(QUANTIZED)
    if not scheme:
        return impl, None
    for suffix in (RELAYOUT, AUTO):  # "moerunner@fp8_block+relayout": the suffix stays
        if scheme.endswith(suffix):
            return name + suffix, scheme.removesuffix(suffix)
    return name, scheme


def use_scheme(model, scheme: str | None) -> None:
    """Run the experts quantized into ``scheme`` (quantized once per model and scheme, then
    pinned again when asked), or on their float weights (None)."""
    done = model.__dict__.setdefault("_e2e_quantized", {})
    if scheme is not None and scheme not in done:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mt.quantize_experts(model, scheme, keep_float_weights=True)
        done[scheme] = {path: quantized_weights(m) for path, m in mt.experts_modules(model)}
    for path, module in mt.experts_modules(model):
        set_quantized(module, None if scheme is None else done[scheme][path])


def base_impl(impl: str) -> str:
    """``impl`` without its layout suffix (``RELAYOUT``, ``AUTO``) and its ``@SCHEME``."""
    return impl_scheme(impl)[0].removesuffix(RELAYOUT).removesuffix(AUTO)


def use_impl(model, impl: str, registered: str, first=None) -> None:
    """Switch the experts to ``impl`` (registered as ``registered``). GPT-OSS's transposed
    experts: ``...+relayout`` re-lays them into the canonical layout (what ``use_moerunner``
    does); ``...+auto`` leaves the layout to moerunner as for a model loaded with
    ``experts_implementation="moerunner"`` (``relayout_experts(model, "auto")``: its first
    inference call re-lays each layer in place), that first call made here on ``first``
    (token ids, untimed) where given; every other implementation runs on the stored layout.
    ``...+routers`` fuses the routers (``fuse_routers``); any other restores them."""
    routers = impl.endswith(ROUTERS)
    if routers != getattr(model, "_e2e_routers", False):
        mt.fuse_routers(model, enable=routers)
        model._e2e_routers = routers
    impl, scheme = impl_scheme(impl)
    layout = "canonical" if impl.endswith(RELAYOUT) else "auto" if impl.endswith(AUTO) else "stored"
    if layout == "auto" or layout != getattr(model, "_e2e_layout", "stored"):
        mt.relayout_experts(model, layout)
        model._e2e_layout = layout
    model.set_experts_implementation(registered)
    if scheme is not None or "_e2e_quantized" in model.__dict__:
        use_scheme(model, scheme)
    if layout == "auto" and first is not None:
        with torch.no_grad():
            model(first)


def experts_layout(model) -> str | None:
    """ "canonical" or "stored" for transposed (GPT-OSS) experts, as they are now; None for
    experts stored canonical."""
    from moerunner.integrations import _relayout

    layers = [m for _, m in mt.experts_modules(model) if _relayout.describe(m).transposed]
    if not layers:
        return None
    canonical = all(_relayout.in_layout(m.gate_up_proj, "canonical") for m in layers)
    return "canonical" if canonical else "stored"


def warm_pass(model, zero_name: str, prompt, decode_prompt, args) -> None:
    """The timed runs' prefill and decode sequence once, untimed, with the zero-cost
    experts (module docstring: per-length attention plans are built here)."""
    model.set_experts_implementation(zero_name)
    time_prefill(model, prompt, 1)
    time_decode(model, decode_prompt, args.decode_steps, args.repeats)


def measure(model, shape, impl, registered, prompt, decode_prompt, ref, args):
    """One implementation's row: logits error vs the first implementation, prefill, decode,
    and (moerunner) the backends that served it."""
    with BackendLog() as backends:
        row, ref = _measure(model, shape, impl, registered, prompt, decode_prompt, ref, args)
    if impl.startswith("moerunner"):
        row["backends"] = backends.served()
        served = " | ".join(row["backends"]) or "?"
        print(f"[{shape}] {impl:<{IMPL_W - 1}} served by: {served}", flush=True)
    return row, ref


def _measure(model, shape, impl, registered, prompt, decode_prompt, ref, args):
    use_impl(model, impl, registered)
    with torch.no_grad():  # (for "+auto" the first call: it re-lays GPT-OSS's experts)
        logits = model(prompt[:1, :256]).logits.float()
    err = None
    if impl != ZERO_IMPL:  # zeros for experts: its logits are not an answer
        if ref is None:
            ref = logits
        err = ((logits - ref).abs().max() / ref.abs().max()).item()
    prefill = spread(time_prefill(model, prompt, args.repeats))
    decode = spread(time_decode(model, decode_prompt, args.decode_steps, args.repeats))
    prefill_span, decode_span, hit = time_spans(
        model, prompt, decode_prompt, args.decode_steps, args.repeats
    )
    row = {
        "shape": shape,
        "impl": impl,
        "layers": args.layers,
        "prefill_tokens": prompt.numel(),
        "prefill_ms": prefill,
        "prefill_tok_s": prompt.numel() / prefill["median"] * 1e3,
        "decode_batch": decode_prompt.shape[0],
        "decode_ms": decode,
        "decode_tok_s": decode_prompt.shape[0] / decode["median"] * 1e3,
        "max_rel_vs_first": err,
        "prefill_span_ms": spread(prefill_span),
        "decode_span_ms": spread(decode_span),
        "experts_hit_per_call": hit,
        "experts_layout": experts_layout(model),
    }
    layout = f"  experts {row['experts_layout']}" if row["experts_layout"] else ""
    print(
        f"[{shape}] {impl:<{IMPL_W - 1}} prefill {row['prefill_tok_s']:>10.0f} tok/s  "
        f"decode {row['decode_tok_s']:>8.1f} tok/s  err {_fmt(err, '.2e')}{layout}",
        flush=True,
    )
    return row, ref


# --- static cache, torch.compile and CUDA graphs ------------------------------------------


def graph_modes(device: torch.device) -> tuple[str, ...]:
    """The decode modes ``--graph`` times on ``device`` (CUDA graphs need CUDA)."""
    if device.type == "cuda":
        return ("static", "compile", "cudagraph", "compile+cudagraph", "reduce-overhead")
    return ("static", "compile")


def _capture(fn, token: torch.Tensor, pos: torch.Tensor):
    """Capture ``fn`` (one decode step on the static buffers ``token``/``pos``, both advanced
    in place by the graph itself) in a CUDA graph after warm-up on a side stream; a callable
    that replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # chooses backends, prepares weights, compiles kernels
            fn(token, pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(token, pos)
    return lambda token, pos: graph.replay()


def time_static_decode(model, ids, steps: int, repeats: int, mode: str, backend: str) -> dict:
    """Decode over a static cache in ``mode`` (see ``graph_modes``): seconds per step per block
    of ``steps`` (``repeats`` blocks) and the seconds the first (compiling) call took."""
    from transformers import StaticCache

    device = ids.device
    batch, prompt = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=prompt + (repeats + 1) * steps + 8)

    def step(token, pos):  # advances its inputs in place: no host work between steps
        logits = model(token, past_key_values=cache, cache_position=pos, use_cache=True).logits
        token.copy_(logits[:, -1:].argmax(-1))
        pos.add_(1)

    fn = step
    if mode.startswith("compile"):
        torch._dynamo.reset()
        fn = torch.compile(step, mode="default", fullgraph=True, backend=backend)
    elif mode == "reduce-overhead":
        # As generate(compile_config=CompileConfig(mode="reduce-overhead")) runs it: the
        # forward compiled, its CUDA graphs managed by inductor's cudagraph trees, the next
        # token and position made eagerly from the logits between steps.
        torch._dynamo.reset()

        def forward(token, pos):
            return model(token, past_key_values=cache, cache_position=pos, use_cache=True).logits

        forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

        def fn(token, pos):
            token.copy_(forward(token, pos)[:, -1:].argmax(-1))
            pos.add_(1)

    with torch.no_grad():
        out = model(
            ids,
            past_key_values=cache,
            cache_position=torch.arange(prompt, device=device),
            use_cache=True,
            logits_to_keep=1,
        )
        token = out.logits[:, -1:].argmax(-1)
        pos = torch.full((1,), prompt, dtype=torch.long, device=device)
        _sync(device)
        t0 = time.perf_counter()
        fn(token, pos)
        _sync(device)
        first_s = time.perf_counter() - t0
        if mode.endswith("cudagraph"):
            fn = _capture(fn, token, pos)
        fn(token, pos)
        samples = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn(token, pos)
            _sync(device)
            samples.append((time.perf_counter() - t0) / steps)
    return {"samples": samples, "first_call_s": first_s}


def measure_graphs(model, shape, impl, registered, decode_prompt, args) -> list[dict]:
    """One implementation's ``--graph`` rows, one per mode; a failing mode keeps its error."""
    rows = []
    for mode in args.graph_modes or graph_modes(decode_prompt.device):
        row = {"shape": shape, "impl": impl, "mode": mode, "decode_batch": decode_prompt.shape[0]}
        if base_impl(impl) == "eager":
            row["error"] = "skipped: transformers' eager loop is data-dependent (not captured)"
        else:
            try:
                use_impl(model, impl, registered, first=decode_prompt[:1, :8])
                got = time_static_decode(
                    model, decode_prompt, args.decode_steps, args.repeats, mode, args.backend
                )
                row["decode_ms"] = spread(got["samples"])
                row["decode_tok_s"] = decode_prompt.shape[0] / row["decode_ms"]["median"] * 1e3
                row["first_call_s"] = got["first_call_s"]
            except Exception as exc:  # noqa: BLE001  (one failing mode: keep going)
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            finally:
                torch._dynamo.reset()
        msg = row.get("error") or f"decode {row['decode_tok_s']:>8.1f} tok/s"
        print(f"[{shape}] {impl:<{IMPL_W - 1}} {mode:<18} {msg}", flush=True)
        rows.append(row)
    return rows


# --- per-stage breakdown of a decode step -------------------------------------------------

STAGES = (
    "embedding",
    "attention",
    "norms",
    "router",
    "experts",
    "shared experts",
    "dense mlp",
    "rope",
    "lm head",
)
_PREFIX = "stage::"


def stage_labels(model) -> dict[str, str]:
    """{module path: stage} for the modules a decode step is split into. Nested modules are
    labelled only where a stage is computed by difference: the MoE block (``moe block``)
    holds the experts and shared experts, and router = moe block - experts - shared."""
    experts = {path for path, _ in mt.experts_modules(model)}
    blocks = {path.rsplit(".", 1)[0] for path in experts}
    labels: dict[str, str] = {}
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        inside = any(path.startswith(p + ".") for p in labels if labels[p] != "moe block")
        if inside or not path:
            continue
        if path in experts:
            labels[path] = "experts"
        elif path in blocks:
            labels[path] = "moe block"
        elif leaf in ("shared_experts", "shared_expert") and path.rsplit(".", 1)[0] in blocks:
            labels[path] = "shared experts"
        elif leaf in ("self_attn", "attention"):
            labels[path] = "attention"
        elif leaf == "mlp":
            labels[path] = "dense mlp"
        elif leaf == "lm_head":
            labels[path] = "lm head"
        elif leaf == "embed_tokens":
            labels[path] = "embedding"
        elif leaf == "rotary_emb":
            labels[path] = "rope"
        elif "norm" in type(module).__name__.lower():
            labels[path] = "norms"
    return labels


def _label_modules(model, labels: dict[str, str]) -> list:
    """Forward hooks that open a profiler range named after each labelled module's stage."""
    from torch.autograd.profiler import record_function

    stack: list = []
    handles = []
    modules = dict(model.named_modules())
    for path, stage in labels.items():

        def enter(module, args, stage=stage):
            rf = record_function(_PREFIX + stage)
            rf.__enter__()
            stack.append(rf)

        def leave(module, args, output):
            stack.pop().__exit__(None, None, None)

        handles.append(modules[path].register_forward_pre_hook(enter))
        handles.append(modules[path].register_forward_hook(leave))
    return handles


def profile_decode(model, ids, steps: int) -> dict:
    """Per-stage host and device milliseconds of one decode step (mean over ``steps``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = ids.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    handles = _label_modules(model, stage_labels(model))
    try:
        with torch.no_grad():
            cache = _dynamic_cache(model)
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(2):
                token = model(token, past_key_values=cache, use_cache=True).logits.argmax(-1)
            _sync(device)
            wall = 0.0
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    with record_function(_PREFIX + "step"):
                        out = model(token, past_key_values=cache, use_cache=True)
                        token = out.logits.argmax(-1)
                        _sync(device)
                    wall += time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    host = dict.fromkeys(STAGES + ("moe block", "step"), 0.0)
    dev = dict(host)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue  # a range's copy on the GPU timeline: its kernels count below, once
        if event.name.startswith(_PREFIX) and event.name[len(_PREFIX) :] in host:
            key = event.name[len(_PREFIX) :]
            host[key] += event.cpu_time_total / 1e3 / steps
            dev[key] += event.device_time_total / 1e3 / steps
    for d in (host, dev):
        d["router"] = d.pop("moe block") - d["experts"] - d["shared experts"]
    stages = {s: {"host_ms": host[s], "device_ms": dev[s]} for s in STAGES}
    labelled = sum(host[s] for s in STAGES)
    result = {
        "step_ms": 1e3 * wall / steps,
        "stages": stages,
        "host_other_ms": host["step"] - labelled,
    }
    if device.type == "cuda":
        result["device_busy_ms"] = dev["step"]
        result["device_other_ms"] = dev["step"] - sum(dev[s] for s in STAGES)
        result["device_idle_ms"] = result["step_ms"] - dev["step"]
    return result


def measure_breakdown(model, shape, impl, registered, decode_prompt, args) -> dict:
    use_impl(model, impl, registered, first=decode_prompt[:1, :8])
    row = {"shape": shape, "impl": impl, "decode_batch": decode_prompt.shape[0]}
    try:
        row.update(profile_decode(model, decode_prompt, args.profile_steps))
    except Exception as exc:  # noqa: BLE001  (keep going)
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


# --- the run ------------------------------------------------------------------------------


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    impls = [i for i in args.impls.split(",") if i != ZERO_IMPL] + [ZERO_IMPL]
    names = {ZERO_IMPL: register_zero_cost()}
    for impl in impls[:-1]:  # "moerunner:triton" -> a name bound to that backend
        base, _, backend = base_impl(impl).partition(":")
        names[impl] = mt.register(f"moerunner_{backend}", backend=backend) if backend else base
    results = {
        "args": dict(vars(args)),
        "rows": [],
        "round_rows": [],
        "graph_rows": [],
        "breakdown": [],
    }
    for name in args.shapes.split(","):
        t0 = time.perf_counter()
        model = build_model(name, args.layers, args.vocab, args.tiny, dtype, device)
        print(f"[{name}] built in {time.perf_counter() - t0:.1f}s", flush=True)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=gen).to(device)
        # its own rows: a slice of the prefill prompt would hold only ``--batch`` of them
        dims = (args.decode_batch, args.decode_prompt)
        decode_prompt = torch.randint(0, args.vocab, dims, generator=gen).to(device)
        t0 = time.perf_counter()
        warm_pass(model, names[ZERO_IMPL], prompt, decode_prompt, args)
        print(f"[{name}] warm-up pass in {time.perf_counter() - t0:.1f}s", flush=True)
        ref = None
        for impl in impls:
            try:
                row, ref = measure(model, name, impl, names[impl], prompt, decode_prompt, ref, args)
            except Exception as exc:  # noqa: BLE001  (one failing implementation: keep going)
                row = {"shape": name, "impl": impl, "error": f"{type(exc).__name__}: {exc}"}
                print(f"[{name}] {impl} failed: {row['error']}", flush=True)
            results["rows"].append(row)
            if args.graph:
                graph = measure_graphs(model, name, impl, names[impl], decode_prompt, args)
                results["graph_rows"].extend(graph)
            if args.breakdown:
                results["breakdown"].append(
                    measure_breakdown(model, name, impl, names[impl], decode_prompt, args)
                )
        if args.rounds:
            ran = [r["impl"] for r in results["rows"] if r["shape"] == name and "error" not in r]
            picked = {impl: names[impl] for impl in impls if impl in ran}
            results["round_rows"].extend(
                measure_rounds(model, name, picked, prompt, decode_prompt, args)
            )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_experts_time(results["rows"], ("prefill", "decode"))
    add_experts_time(results["round_rows"], ("prefill", "decode"))
    add_experts_time(results["graph_rows"], ("decode",), key=("shape", "mode"))
    return results


def measure_rounds(model, shape, names: dict, prompt, decode_prompt, args) -> list[dict]:
    """Prefill and eager decode once more, the implementations taking turns: ``--rounds``
    rounds, each timing one prefill and one block of decode steps of every implementation
    in order, so a drift of the host's speed during the run falls on all of them alike (an
    eager decode step is host-bound: its time moved by a third between two processes on one
    machine). One row per implementation: medians over the rounds."""
    samples = {impl: {"prefill": [], "decode": []} for impl in names}
    for _ in range(args.rounds):
        for impl, registered in names.items():
            use_impl(model, impl, registered, first=prompt[:1, :8])
            samples[impl]["prefill"] += time_prefill(model, prompt, 1)
            samples[impl]["decode"] += time_decode(model, decode_prompt, args.decode_steps, 1)
    return [
        {
            "shape": shape,
            "impl": impl,
            "rounds": args.rounds,
            "prefill_ms": spread(got["prefill"]),
            "decode_ms": spread(got["decode"]),
        }
        for impl, got in samples.items()
    ]


def add_experts_time(rows: list[dict], phases, key=("shape",)) -> None:
    """Time in experts (median step time minus the zero-cost row's of the same ``key``) and
    its ratio to grouped_mm's, added to each row in place."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault(tuple(r[k] for k in key), {})[r["impl"]] = r
    for group in groups.values():
        zero, grouped = group.get(ZERO_IMPL), group.get("grouped_mm")
        for r in group.values():
            for phase in phases:
                if zero is None:
                    continue
                ms = r[f"{phase}_ms"]["median"] - zero[f"{phase}_ms"]["median"]
                r[f"{phase}_experts_ms"] = ms
        for r in group.values():
            for phase in phases:
                mine = r.get(f"{phase}_experts_ms")
                base = None if grouped is None else grouped.get(f"{phase}_experts_ms")
                if mine is not None and base is not None and r["impl"] != ZERO_IMPL:
                    # a difference below zero is noise (the zero-cost step came out slower):
                    # no ratio is shown for it (None), rather than a negative one
                    ok = mine >= 0 and base > 0
                    r[f"{phase}_experts_vs_grouped_mm"] = mine / base if ok else None
                span, base = r.get(f"{phase}_span_ms"), (grouped or {}).get(f"{phase}_span_ms")
                if span and base and base["median"] > 0 and r["impl"] != ZERO_IMPL:
                    r[f"{phase}_span_vs_grouped_mm"] = span["median"] / base["median"]


def _fmt(value, spec: str, width: int = 0) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def _exp(value, width: int) -> str:
    """An "exp ms" cell: ``n/a`` where the difference is negative (below the noise)."""
    return f"{'n/a':>{width}}" if value is not None and value < 0 else _fmt(value, ".2f", width)


NOISE_NOTE = (
    "n/a: the zero-cost step was slower than this one (the time in experts is below the "
    "timing noise; no ratio)"
)


def _noisy(rows: list[dict]) -> bool:
    return any(
        (r.get(f"{phase}_experts_ms") or 0) < 0 for r in rows for phase in ("prefill", "decode")
    )


def _spread_text(s: dict) -> str:
    return f"{s['min']:.2f}/{s['median']:.2f}/{s['max']:.2f}"


def table(results: dict) -> str:
    """Compact table: tok/s with speedups against the first implementation of each shape,
    step times min/median/max, time in experts and its ratio to grouped_mm's."""
    lines = [
        f"{'shape':<15}{'impl':<{IMPL_W}}{'prefill tok/s':>14}{'x':>7}"
        f"{'prefill ms min/med/max':>26}"
        f"{'exp ms':>9}{'/gm':>6}{'decode tok/s':>13}{'x':>6}{'decode ms min/med/max':>24}"
        f"{'exp ms':>9}{'/gm':>6}{'err':>10}"
    ]
    base: dict[str, dict] = {}
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"{r['shape']:<15}{r['impl']:<{IMPL_W}}failed: {r['error'][:90]}")
            continue
        b = base.setdefault(r["shape"], r)
        lines.append(
            f"{r['shape']:<15}{r['impl']:<{IMPL_W}}{r['prefill_tok_s']:>14.0f}"
            f"{r['prefill_tok_s'] / b['prefill_tok_s']:>7.2f}"
            f"{_spread_text(r['prefill_ms']):>26}"
            f"{_exp(r.get('prefill_experts_ms'), 9)}"
            f"{_fmt(r.get('prefill_experts_vs_grouped_mm'), '.2f', 6)}"
            f"{r['decode_tok_s']:>13.1f}{r['decode_tok_s'] / b['decode_tok_s']:>6.2f}"
            f"{_spread_text(r['decode_ms']):>24}"
            f"{_exp(r.get('decode_experts_ms'), 9)}"
            f"{_fmt(r.get('decode_experts_vs_grouped_mm'), '.2f', 6)}"
            f"{_fmt(r['max_rel_vs_first'], '.2e', 10)}"
        )
    lines.append(
        "exp ms: median step time minus the zero-cost row's (time in experts); "
        "/gm: that time over grouped_mm's"
    )
    if _noisy(results["rows"]):
        lines.append(NOISE_NOTE)
    lines += ["", span_table(results["rows"])]
    if results.get("round_rows"):
        lines += ["", rounds_table(results["round_rows"])]
    if results.get("graph_rows"):
        lines += ["", graph_table(results["graph_rows"])]
    if results.get("breakdown"):
        lines += ["", breakdown_table(results["breakdown"])]
    return "\n".join(lines)


def rounds_table(rows: list[dict]) -> str:
    """The implementations timed in turns (``measure_rounds``): step times and time in
    experts with its ratio to grouped_mm's."""
    lines = [
        f"{'shape':<15}{'impl':<{IMPL_W}}{'prefill ms min/med/max':>26}{'exp ms':>9}{'/gm':>6}"
        f"{'decode ms min/med/max':>24}{'exp ms':>9}{'/gm':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:<15}{r['impl']:<{IMPL_W}}{_spread_text(r['prefill_ms']):>26}"
            f"{_exp(r.get('prefill_experts_ms'), 9)}"
            f"{_fmt(r.get('prefill_experts_vs_grouped_mm'), '.2f', 6)}"
            f"{_spread_text(r['decode_ms']):>24}"
            f"{_exp(r.get('decode_experts_ms'), 9)}"
            f"{_fmt(r.get('decode_experts_vs_grouped_mm'), '.2f', 6)}"
        )
    if _noisy(rows):
        lines.append(NOISE_NOTE)
    rounds = rows[0]["rounds"] if rows else 0
    lines.append(
        f"in turns ({rounds} rounds): each round one prefill and one decode block per "
        "implementation, in order; medians over the rounds"
    )
    return "\n".join(lines)


def span_table(rows: list[dict]) -> str:
    """The experts' span per prefill and per decode step (min/median/max) and the median's
    ratio to grouped_mm's."""
    lines = [
        f"{'shape':<15}{'impl':<{IMPL_W}}{'prefill span ms min/med/max':>30}{'/gm':>6}"
        f"{'decode span ms min/med/max':>29}{'/gm':>6}{'hit prefill':>12}{'hit decode':>11}"
    ]
    for r in rows:
        if "error" in r or r["impl"] == ZERO_IMPL or "prefill_span_ms" not in r:
            continue
        hit = r.get("experts_hit_per_call") or {}
        lines.append(
            f"{r['shape']:<15}{r['impl']:<{IMPL_W}}{_spread_text(r['prefill_span_ms']):>30}"
            f"{_fmt(r.get('prefill_span_vs_grouped_mm'), '.2f', 6)}"
            f"{_spread_text(r['decode_span_ms']):>29}"
            f"{_fmt(r.get('decode_span_vs_grouped_mm'), '.2f', 6)}"
            f"{_fmt(hit.get('prefill'), '.1f', 12)}{_fmt(hit.get('decode'), '.1f', 11)}"
        )
    lines.append(
        "span: the experts calls' time on the device's timeline per prefill / decode step "
        "(CUDA events around each call, summed); /gm: median over grouped_mm's; hit: experts "
        "hit per experts call (mean), whose weights the call reads"
    )
    return "\n".join(lines)


def graph_table(rows: list[dict]) -> str:
    lines = [
        f"{'shape':<15}{'impl':<{IMPL_W}}{'decode mode':<19}{'decode tok/s':>13}"
        f"{'ms min/med/max':>24}{'exp ms':>9}{'/gm':>6}{'1st call s':>11}"
    ]
    for r in rows:
        head = f"{r['shape']:<15}{r['impl']:<{IMPL_W}}{r['mode']:<19}"
        if "error" in r:
            lines.append(head + f"{'failed' if 'skipped' not in r['error'] else ''} {r['error']}")
            continue
        lines.append(
            head + f"{r['decode_tok_s']:>13.1f}{_spread_text(r['decode_ms']):>24}"
            f"{_exp(r.get('decode_experts_ms'), 9)}"
            f"{_fmt(r.get('decode_experts_vs_grouped_mm'), '.2f', 6)}"
            f"{r['first_call_s']:>11.1f}"
        )
    return "\n".join(lines)


def _cells(rows: list[dict], cell: int, host, device=None) -> str:
    """One table line's cells: ``host(row)`` ms, and `` / device(row)`` ms where given."""
    out = ""
    for r in rows:
        text = f"{host(r):.3f}" + ("" if device is None else f" / {device(r):.3f}")
        out += f"{text:>{cell}}"
    return out


def breakdown_table(rows: list[dict]) -> str:
    """One block per shape: a decode step's stages (rows) per implementation (columns), host
    ms and, where measured, device (kernel) ms."""
    lines = []
    by_shape: dict[str, list[dict]] = {}
    for r in rows:
        by_shape.setdefault(r["shape"], []).append(r)
    for shape, group in by_shape.items():
        ok = [r for r in group if "error" not in r]
        cuda = any("device_busy_ms" in r for r in ok)
        cell = 18 if cuda else 12
        lines.append(
            f"decode step breakdown, {shape} (ms per step; "
            + ("host / gpu kernels" if cuda else "host")
            + "; profiled, so host times carry the profiler's overhead)"
        )
        lines.append(f"{'stage':<22}" + "".join(f"{r['impl'][: cell - 1]:>{cell}}" for r in ok))
        for s in STAGES:
            if not any(r["stages"][s]["host_ms"] for r in ok):
                continue
            host = lambda r, s=s: r["stages"][s]["host_ms"]  # noqa: E731
            dev = (lambda r, s=s: r["stages"][s]["device_ms"]) if cuda else None
            lines.append(f"{s:<22}" + _cells(ok, cell, host, dev))
        dev = (lambda r: r["device_other_ms"]) if cuda else None
        lines.append(
            f"{'other (between stages)':<22}" + _cells(ok, cell, lambda r: r["host_other_ms"], dev)
        )
        if cuda:
            lines.append(f"{'gpu busy':<22}" + _cells(ok, cell, lambda r: r["device_busy_ms"]))
            lines.append(
                f"{'gpu idle (host gaps)':<22}" + _cells(ok, cell, lambda r: r["device_idle_ms"])
            )
        lines.append(f"{'step (wall)':<22}" + _cells(ok, cell, lambda r: r["step_ms"]))
        for r in group:
            if "error" in r:
                lines.append(f"{r['impl']}: failed: {r['error'][:100]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument(
        "--impls",
        default="eager,grouped_mm,moerunner",
        help="comma list; 'moerunner:BACKEND' pins a moerunner backend (default: auto), "
        "'moerunner+relayout' also re-lays GPT-OSS's transposed experts as use_moerunner does, "
        "'moerunner+auto' leaves them to moerunner's first-call re-lay (a loaded model's path); "
        "'moerunner@SCHEME' runs moerunner on the experts quantized into SCHEME "
        "(e.g. moerunner@fp8_block); a last '+routers' also runs the routers on moerunner's "
        "routing kernel (fuse_routers; e.g. moerunner@fp8_block+routers); "
        f"the zero-cost implementation ({ZERO_IMPL}) is always added",
    )
    p.add_argument("--layers", type=_common.int_type(1), default=2)
    p.add_argument("--vocab", type=_common.int_type(1), default=8192)
    p.add_argument("--batch", type=_common.int_type(1), default=4, help="prefill batch")
    p.add_argument(
        "--prompt", type=_common.int_type(1), default=1024, help="prefill tokens per sequence"
    )
    p.add_argument("--decode-batch", type=_common.int_type(1), default=32)
    p.add_argument("--decode-prompt", type=_common.int_type(1), default=128)
    p.add_argument(
        "--decode-steps", type=_common.int_type(1), default=16, help="decode steps per timed block"
    )
    p.add_argument(
        "--repeats", type=_common.int_type(1), default=3, help="timed prefills / decode blocks"
    )
    p.add_argument(
        "--rounds",
        type=_common.int_type(0),
        default=3,
        help="then time the implementations in turns, this many rounds (0: not)",
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16; float32 for --tiny on a CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, for a CPU check")
    p.add_argument(
        "--graph",
        "--compile",
        action="store_true",
        help="also decode with a static cache: plain, torch.compile'd, CUDA-graph captured",
    )
    p.add_argument(
        "--graph-modes",
        default=None,
        help="comma list of the --graph decode modes to time (default: every mode of the "
        "device: static, compile, cudagraph, compile+cudagraph, reduce-overhead on CUDA)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend for --graph (default: inductor on CUDA; aot_eager on a CPU, "
        "which traces the whole step under fullgraph=True but generates no code)",
    )
    p.add_argument(
        "--breakdown", action="store_true", help="profile a decode step's stages (torch.profiler)"
    )
    p.add_argument(
        "--profile-steps",
        type=_common.int_type(1),
        default=4,
        help="decode steps --breakdown profiles",
    )
    p.add_argument("--out", default=None, help="directory for transformers_e2e.json")
    args = p.parse_args(argv)
    # transformers 5.2x renames ``past_key_values``; the name kept here runs on every 5.x.
    warnings.filterwarnings(
        "ignore", message=".*past_key_values.*deprecated", category=FutureWarning
    )
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; accepted: {', '.join(SHAPES)}")
    if args.graph_modes is not None:
        args.graph_modes = args.graph_modes.split(",")
        known = graph_modes(torch.device(args.device))
        wrong = [m for m in args.graph_modes if m not in known]
        if wrong:
            p.error(
                f"--graph-modes: unknown on {args.device}: {wrong}; accepted: {', '.join(known)}"
            )
    if args.out:
        _common.check_writable_dir(p, "--out", Path(args.out))
    if args.backend is None:
        args.backend = "inductor" if torch.device(args.device).type == "cuda" else "aot_eager"
    if args.dtype is None:  # a CPU's bf16 matrix products are slow: --tiny stays quick
        cpu = torch.device(args.device).type == "cpu"
        args.dtype = "float32" if args.tiny and cpu else "bfloat16"
    if args.tiny:
        args.repeats = min(args.repeats, 2)
        args.rounds = min(args.rounds, 1)
        args.prompt, args.batch, args.decode_prompt = min(args.prompt, 64), 1, 16
        args.decode_batch = min(args.decode_batch, 2)
        args.decode_steps = min(args.decode_steps, 4)
    results = run(args)
    from moerunner.bench.report import environment

    results["environment"] = environment(torch.device(args.device))
    results["args"]["out"] = "OUT" if args.out else None  # no machine paths in results
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "transformers_e2e.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))


if __name__ == "__main__":
    main()
