"""Run a function on every rank of a gloo process group spawned by the test (CPU, fork).

``run_world(fn, world_size)`` forks ``world_size`` processes, joins them into a gloo group
whose collectives time out after ``collective_timeout_s`` (a bug fails instead of hanging),
calls ``fn(rank, world_size)`` on each and returns the per-rank return values. Any exception
in a rank, or the whole run exceeding ``deadline_s``, fails the calling test.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, fn, port, out_dir, collective_timeout_s):
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        result = fn(rank, world_size)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        torch.save({"ok": False, "result": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn, world_size: int, *, collective_timeout_s: float = 20.0, deadline_s: float = 60.0
) -> list:
    """Per-rank results of ``fn(rank, world_size)`` run in a fresh gloo group."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _child,
            args=(world_size, fn, _free_port(), out_dir, collective_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + deadline_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(
                    f"world of {world_size} ranks still running after {deadline_s} s"
                )
        results = []
        for rank in range(world_size):
            record = torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            if not record["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{record['result']}")
            results.append(record["result"])
        return results
