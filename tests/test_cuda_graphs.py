"""CUDA graphs: capture once, replay per step (the recipe of docs/transformers.md, "Graphs
and compile"). Skipped without CUDA (marker ``gpu``).

- The ``MoE`` layer captured with ``torch.cuda.CUDAGraph`` on static input buffers (bf16,
  plain and fp8_block-quantized): each replay, with new inputs copied into the buffers,
  matches an eager call on the same inputs.
- A tiny transformers model's decode step: ``generate(cache_implementation="static")`` with
  transformers' compiled decode step in ``mode="reduce-overhead"`` (inductor's CUDA graphs,
  replayed per token) gives the eager greedy tokens, plain and fp8_block-quantized.
"""

from __future__ import annotations

import pytest
import torch

import moerunner

pytestmark = pytest.mark.gpu

E, H, I, TOP_K, T = 8, 256, 128, 2, 4


def _capture(fn, *static_inputs):
    """Warm up on a side stream (prepares weights, compiles kernels), then capture ``fn``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_inputs)
    return graph, out


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_layer_captured_once_and_replayed_matches_eager(scheme):
    torch.manual_seed(0)
    cfg = moerunner.MoeConfig(E, H, I, TOP_K, routing=moerunner.RoutingConfig(renormalize=True))
    layer = moerunner.MoE(cfg, backend="triton", dtype=torch.bfloat16, device="cuda")
    if scheme is not None:
        layer.quantize_(scheme)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)  # static input buffers
    logits = torch.randn(T, E, device="cuda")
    with torch.no_grad():
        graph, out = _capture(layer, x, logits)
        for step in range(3):
            gen = torch.Generator(device="cuda").manual_seed(step)
            x.copy_(torch.randn(T, H, device="cuda", generator=gen))
            logits.copy_(torch.randn(T, E, device="cuda", generator=gen))
            graph.replay()
            eager = layer(x.clone(), logits.clone())
            torch.testing.assert_close(out, eager)


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
@pytest.mark.parametrize("path", ["layer", "fused_moe"])
def test_state_kept_across_calls_is_not_taken_from_a_graph_pool(path, scheme):
    """A first call made while a CUDA graph's pool takes the thread's allocations (as
    inductor's cudagraph trees warm up a graph) leaves nothing of its own in that pool: the
    only live block there is the output. Prepared weights, workspaces, flag buffers and a
    layer's step are made outside it (``moerunner.memory.kept``)."""
    T, E, H, I, TOP_K = 5, 8, 256, 128, 2
    torch.manual_seed(0)
    cfg = moerunner.MoeConfig(E, H, I, TOP_K, routing=moerunner.RoutingConfig(renormalize=True))
    layer = moerunner.MoE(cfg, backend="triton", dtype=torch.bfloat16, device="cuda")
    if scheme is not None:
        layer.quantize_(scheme)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    topk = moerunner.select_experts(logits, TOP_K, renormalize=True)
    pool = torch.cuda.MemPool()
    with torch.no_grad():
        for _ in range(3):  # the layer makes its step on a later call than the first
            with torch.cuda.use_mem_pool(pool):
                if path == "layer":
                    out = layer(x, logits)
                else:
                    w = layer.expert_weights()
                    out = moerunner.fused_moe(
                        x, w.w13, w.w2, topk.weights, topk.ids, backend="triton"
                    )
            torch.cuda.synchronize()
            live = [
                b["address"]
                for seg in pool.snapshot()
                for b in seg["blocks"]
                if b["state"] == "active_allocated"
            ]
            assert live == [out.untyped_storage().data_ptr()], (len(live), path, scheme)
            del out


def test_kept_state_made_inside_kept_state_does_not_wait_on_itself():
    """A ``make`` that makes kept state of its own (preparing weights may build a workspace)
    runs it in place on the worker thread instead of queueing behind itself."""
    import threading

    from moerunner.memory import kept

    dev = torch.device("cuda")
    threads = []

    def inner():
        threads.append(threading.get_ident())
        return torch.ones(4, device=dev)

    def outer():
        threads.append(threading.get_ident())
        return kept(inner, dev) * 2

    done = []
    worker = threading.Thread(target=lambda: done.append(kept(outer, dev)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done, "kept inside kept did not return"
    assert torch.equal(done[0], torch.full((4,), 2.0, device=dev))
    assert len(threads) == 2 and threads[0] == threads[1] != worker.ident


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_transformers_static_cache_generate_with_graphed_decode_matches_eager(scheme):
    pytest.importorskip("transformers")
    from integrations._tiny_models import build
    from transformers import CompileConfig

    import moerunner.integrations.transformers as mt

    torch._dynamo.reset()
    model = build("qwen3_moe", implementation="moerunner").to("cuda")
    model.config.moerunner_backend = "triton"
    if scheme is not None:
        mt.quantize_experts(model, scheme)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3)).cuda()
    kwargs = dict(
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kwargs)
        graphed = model.generate(ids, compile_config=config, **kwargs)
        again = model.generate(ids, compile_config=config, **kwargs)  # replays only
    assert hasattr(model, "_compiled_call")  # the decode step ran compiled
    assert torch.equal(graphed, eager)
    assert torch.equal(again, eager)


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_users_function_with_fused_moe_compiled_reduce_overhead_matches_eager(scheme):
    """A user's routing + ``fused_moe`` function under torch.compile(fullgraph=True,
    mode="reduce-overhead"): traced as the custom op, replayed from inductor's CUDA graphs,
    step after step with new inputs, equal to the eager calls."""
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(4)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.05).bfloat16()
    if scheme is not None:
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)

    def moe(x, logits):
        topk = moerunner.select_experts(logits, TOP_K, renormalize=True)
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)

    compiled = torch.compile(moe, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(T, E, device="cuda", generator=g)
            out = compiled(x, logits).clone()
            # Same expert kernels; the routing's softmax is inductor's (fp32, last-bit
            # differences in the weights), so bf16 outputs may differ by an ulp.
            torch.testing.assert_close(out, moe(x, logits), rtol=1e-2, atol=1e-3)
