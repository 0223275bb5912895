"""``moerunner bench --ep-size 2`` under torchrun: 2 gloo processes, a tiny custom shape.

The command is launched as a user would (``python -m torch.distributed.run``) in a
subprocess with a deadline; rank 0's JSON rows must each be measured (status ok: the output
of every rank within the bench's bf16 tolerance of the float64 reference) with positive
dispatch / experts / combine times.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from moerunner.cli.bench import main

DISPATCHERS = ("standard", "all_to_all", "masked")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_ep_size_2_under_torchrun(tmp_path):
    out = tmp_path / "ep2.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "moerunner", "bench", "--ep-size", "2", "--shape", "8,32,32,2",
        "--tokens", "0,5", "--routing", "uniform", "--dispatcher", ",".join(DISPATCHERS),
        "--backends", "torch", "--device", "cpu", "--threads", "1", "--min-time", "0.01",
        "--max-reps", "3", "--quiet", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert (
        "ExpertParallel" not in record["config"]
        and "EpOptions(ep_size=2" in (record["expert_parallel"])
    )
    rows = record["rows"]
    assert sorted((r["dispatcher"], r["tokens"]) for r in rows) == sorted(
        (d, t) for d in DISPATCHERS for t in (0, 5)
    )
    for r in rows:
        assert r["status"] == ("ok" if r["tokens"] else "n/a"), r  # (T=0: nothing checked)
        assert r["ep_size"] == 2 and r["impl"] == "torch"
        stages = [r["dispatch_us"], r["experts_us"], r["combine_us"]]
        assert all(s > 0 for s in stages), r
        assert r["time_us"] >= max(stages)
        if r["tokens"]:
            assert r["checked_tokens"] > 0 and r["max_rel_err"] <= 3e-2, r
    assert "dispatch us" in done.stdout and "masked" in done.stdout


def test_bench_ep_size_without_torchrun_names_the_launch(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--ep-size", "2", "--preset", "cpu-small"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2 -m moerunner bench --ep-size 2" in err


def test_bench_ep_size_rejects_a_mismatched_world(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--ep-size", "2"]) == 2
    assert "WORLD_SIZE=4" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [(["--tp", "2"], "--tp"), (["--dispatcher", "x"], "'x'")])
def test_bench_ep_size_bad_flags(monkeypatch, capsys, flags, words):
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        code = main(["--ep-size", "2", "--preset", "cpu-small", *flags])
    except SystemExit as exc:  # an unknown --dispatcher is argparse's usage error
        code = exc.code
    assert code == 2
    assert words in capsys.readouterr().err
