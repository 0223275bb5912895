"""Generate with a transformers MoE model whose experts run on moerunner, against eager.

    python examples/generate.py --model PATH [--backend auto] [--quantize fp8_block]
    python examples/generate.py --tiny qwen3_moe            # a tiny random model, no download

Loads the model (or builds a tiny random one of a family), greedily generates with
transformers' eager experts loop and with moerunner, prints both texts (or token ids), whether
they agree, and tokens/s of each. A folder without a tokenizer (such as a tiny checkpoint
saved from a config) is given 8 random prompt ids, and the token ids are printed.
"""

from __future__ import annotations

import argparse
import time

import torch

import moerunner.integrations.transformers as mt
from moerunner.integrations.tiny_models import FAMILIES, tiny_config


def load(args):
    """(model, tokenizer or None) from --model or --tiny."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    if args.tiny:
        cfg = tiny_config(args.tiny, vocab_size=256)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        with torch.no_grad():  # routers start at zero in some families: make routing real
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
        return model.to(args.device).eval(), None
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=args.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:  # a checkpoint folder without tokenizer files
        print(f"no tokenizer for {args.model} ({type(exc).__name__}): random prompt ids")
        return model.eval(), None
    return model.eval(), tokenizer


def generate(model, ids, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy ids and tokens/s (new tokens of the whole batch per second)."""
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
    return out, ids.shape[0] * new_tokens / (time.perf_counter() - t0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory or hub id")
    src.add_argument("--tiny", choices=FAMILIES, help="build a tiny random model")
    p.add_argument("--prompt", default="The mixture of experts layer")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--backend", default="auto", help="moerunner backend: auto, torch, triton")
    p.add_argument("--quantize", default=None, help="quantize experts at load (e.g. fp8_block)")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    model, tokenizer = load(args)
    ids = None
    if tokenizer is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(args.device)
        if ids.numel() == 0:  # (transformers gives an empty tokenizer where files are missing)
            print(f"the tokenizer of {args.model} encodes the prompt to no ids: random ids")
            tokenizer = ids = None
    if ids is None:
        ids = torch.randint(0, model.config.vocab_size, (1, 8)).to(args.device)

    model.set_experts_implementation("eager")
    eager_ids, eager_tps = generate(model, ids, args.new_tokens)
    mt.use_moerunner(model, backend=args.backend)  # raises, naming any layer it cannot run
    if args.quantize:
        mt.quantize_experts(model, args.quantize, keep_float_weights=True)
    ours_ids, ours_tps = generate(model, ids, args.new_tokens)

    def show(t: torch.Tensor) -> str:
        return tokenizer.decode(t[0]) if tokenizer is not None else str(t[0].tolist())

    print(f"eager     : {show(eager_ids)}")
    print(f"moerunner : {show(ours_ids)}")
    print(f"same tokens: {torch.equal(eager_ids, ours_ids)}")
    print(
        f"tokens/s   eager {eager_tps:.1f}   moerunner ({args.backend}) {ours_tps:.1f}   "
        f"x{ours_tps / eager_tps:.2f}"
    )


if __name__ == "__main__":
    main()
