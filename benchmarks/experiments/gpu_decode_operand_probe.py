# Which four bytes of the fragment layout does the fp4 decode's inline assembly receive as
# one 32-bit operand? A decode that mixes bits across bytes needs to know.
#
#   python benchmarks/experiments/gpu_decode_operand_probe.py
#
# Two child processes (each with its own Triton cache, since the assembly is a compile-time
# constant of the kernel), small mxfp4 layer (E 4, H = I = 256, T 64, k 2, bf16 activations):
#   rotated  the kernel whose assembly first rotates its operand's bytes (byte i takes byte
#            i + 1 mod 4), on the prepared weights as they are;
#   permuted the plain kernel on weights whose bytes were moved within each 4-byte memory word
#            the way each hypothesis of the operand's byte order says the rotation acts.
# The hypothesis whose output equals the rotated kernel's, bit for bit, names the order
# ("memory order": the operand is the stored word as it lies in memory).

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ORDERS = {  # operand byte p is memory byte order[p] of the word
    "memory order": [0, 1, 2, 3],
    "middle bytes swapped": [0, 2, 1, 3],
    "pairs swapped": [1, 0, 3, 2],
    "reversed": [3, 2, 1, 0],
}


def _rotating(asm: str) -> str:
    """``asm`` reading its packed operand ``$4`` with the bytes rotated (byte i <- i + 1)."""
    asm = asm.replace("$4", "w")
    return asm.replace("{\n", "{\n.reg .b32 w;\nprmt.b32 w, $4, 0, 0x0321;\n", 1)


def child(mode: str, out: str) -> None:
    import torch
    import triton.language as tl

    from moerunner.backends.triton import _weight_decode as D

    if mode == "rotated":  # before any kernel is compiled; every fp4 decode assembly
        for name in dir(D):
            value = getattr(D, name)
            if name.startswith("_E2M1") and name.endswith("ASM"):
                setattr(D, name, tl.constexpr(_rotating(value.value)))

    import moerunner
    from moerunner.backends.triton import TritonBackend
    from moerunner.backends.triton import experts as X
    from moerunner.weights import ExpertWeights

    dev = torch.device("cuda")
    torch.manual_seed(0)
    E, H, I, T, k = 4, 256, 256, 64, 2
    w13 = moerunner.quantize(torch.randn(E, 2 * I, H, device=dev) / 16, "mxfp4")
    w2 = moerunner.quantize(torch.randn(E, H, I, device=dev) / 16, "mxfp4")
    weights = ExpertWeights(w13, w2)
    x = torch.randn(T, H, device=dev).bfloat16()
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, device=dev)
    prepared = TritonBackend().prepare_weights(weights, weights.spec(moerunner.Activation("silu")))
    if prepared.tensors["w13"].layout.kind != "fragment":
        raise SystemExit("the weights are not in the fragment layout")
    res = {}
    if mode == "rotated":
        res["rotated"] = X.fused_standard(x, wts, ids, prepared).float().cpu()
    else:
        orig = {n: prepared.tensors[n].data.clone() for n in ("w13", "w2")}
        for name, order in ORDERS.items():
            for n, data in orig.items():
                words = data.reshape(-1, 4)
                moved = torch.empty_like(words)
                for p in range(4):
                    moved[:, order[p]] = words[:, order[(p + 1) % 4]]
                prepared.tensors[n].data.copy_(moved.reshape(data.shape))
            res[name] = X.fused_standard(x, wts, ids, prepared).float().cpu()
    torch.save(res, out)


def main() -> None:
    ap = argparse.ArgumentParser(description="probe the fp4 decode's operand byte order")
    ap.add_argument("--child", choices=("rotated", "permuted"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out)
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for mode in ("rotated", "permuted"):
            paths[mode] = os.path.join(tmp, f"{mode}.pt")
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, f"cache-{mode}"))
            cmd = [sys.executable, __file__, "--child", mode, "--out", paths[mode]]
            subprocess.run(cmd, check=True, env=env)
        rotated = torch.load(paths["rotated"])["rotated"]
        for name, out in torch.load(paths["permuted"]).items():
            diff = (out - rotated).abs().max().item()
            print(f"{name:22s} equal: {torch.equal(out, rotated)}  max difference {diff:.4g}")


if __name__ == "__main__":
    main()
