"""The scripts under ``benchmarks/`` and the project's one table of model shapes.

The product benchmarks must at least start on a CPU (``--help`` imports everything they
use); the kernel experiments must at least parse their arguments. Model shapes live only in
``moerunner/bench/presets.py``: ``moerunner tune`` and the scripts read them from there, and
no other source file spells a model's hidden or intermediate size.
"""

from __future__ import annotations

import ast
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
from cases import run_without_interpreter

from moerunner.bench import presets

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PRODUCT_SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
EXPERIMENTS = sorted((BENCHMARKS / "experiments").glob("*.py"))


def _help(script: Path, capsys) -> str:
    """Run ``script --help`` in this process; its help text."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), "--help"]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    assert exit_info.value.code in (0, None), exit_info.value.code
    return capsys.readouterr().out


def test_benchmark_folders_hold_what_the_readmes_say():
    names = {p.name for p in PRODUCT_SCRIPTS}
    assert names == {
        "cpu_torch_vs_transformers.py",
        "ep_gpu_check.py",
        "ep_scaling.py",
        "host_cost.py",
        "training_step.py",
        "transformers_e2e.py",
        "version_ab.py",
    }
    readme = (BENCHMARKS / "experiments" / "README.md").read_text()
    for script in EXPERIMENTS:
        assert f"`{script.name}`" in readme, f"{script.name} has no entry in the README"
    assert (BENCHMARKS / "results" / "README.md").exists()


@pytest.mark.parametrize("script", PRODUCT_SCRIPTS, ids=lambda p: p.name)
def test_product_benchmark_starts_on_cpu(script, capsys):
    assert "usage:" in _help(script, capsys)


@pytest.mark.parametrize("script", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_parses_its_arguments(script, capsys):
    pytest.importorskip("triton")
    if script.name == "triton_offline_compile.py" and os.environ.get("TRITON_INTERPRET"):
        pytest.skip("compiles for the GPU: refuses to run under Triton's interpreter")
    assert "usage:" in _help(script, capsys)


def test_offline_compile_builds_a_block_fp8_gemm_for_hopper():
    """The offline compile still builds the GEMM kernel as the launcher calls it (it had
    rotted: a renamed operand constant made every variant fail). Runs Triton's own ptxas, in
    a process without the interpreter; nothing runs on a GPU."""
    pytest.importorskip("triton")
    script = BENCHMARKS / "experiments" / "triton_offline_compile.py"
    done = run_without_interpreter([str(script), "fp8_block:1:16:32:256:4:5"], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fp8_block:1:16:32:256:4:5" in done.stdout and "spill   0 B" in done.stdout


def test_results_follow_the_naming_scheme():
    """``<device>-<suite>-<date>.<ext>``, besides the index and the kernel notes; the index
    names every file (its stem, for a ``{md,json,png}`` group)."""
    pattern = re.compile(
        r"(cpu|nvidia-h\d00(x\d)?)-[a-z0-9-]+-\d{4}-\d{2}-\d{2}\.(md|json|png|txt)"
    )
    results = BENCHMARKS / "results"
    odd = [
        p.name
        for p in results.iterdir()
        if p.name not in ("README.md", "kernel-notes.md") and not pattern.fullmatch(p.name)
    ]
    assert odd == []
    index = (results / "README.md").read_text()
    missing = [p.name for p in results.iterdir() if p.name != "README.md" and p.stem not in index]
    assert missing == []


def test_results_name_no_folder_of_the_machine_that_recorded_them():
    """Records speak of the project: file names as the commands wrote them, not the absolute
    folders of the machine a run happened on (output folders, virtual environments)."""
    machine = re.compile(r"(?<![\w.])/(root|tmp|opt|work|home|mnt|scratch)/")
    found = [
        f"{p.name}:{n}: {line.strip()[:80]}"
        for p in sorted((BENCHMARKS / "results").iterdir())
        if p.suffix in (".md", ".json", ".txt")
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if machine.search(line)
    ]
    assert found == [], "\n".join(found[:20])


def test_tune_reads_the_preset_table():
    tune = pytest.importorskip("moerunner.backends.triton.tune")
    assert set(tune.PRESETS) == set(presets.MODEL_PRESETS)
    for name, (h, i, e, k, act) in tune.PRESETS.items():
        s = presets.PRESETS[name]
        assert (h, i, e, k, act) == (
            s.hidden_size,
            s.intermediate_size,
            s.num_experts,
            s.top_k,
            s.activation,
        )


def test_transformers_e2e_reads_the_preset_table(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    e2e = __import__("transformers_e2e")
    qwen, gpt = e2e.SHAPES["qwen3-30b-a3b"][1], e2e.SHAPES["gpt-oss-120b"][1]
    q, g = presets.get_preset("qwen3-30b-a3b"), presets.get_preset("gpt-oss-120b")
    assert (qwen["hidden_size"], qwen["moe_intermediate_size"]) == (q.hidden_size, 768)
    assert (qwen["num_experts"], qwen["num_experts_per_tok"]) == (q.num_experts, q.top_k)
    assert (gpt["hidden_size"], gpt["intermediate_size"]) == (g.hidden_size, g.intermediate_size)
    assert (gpt["num_local_experts"], gpt["num_experts_per_tok"]) == (g.num_experts, g.top_k)
    ds, mx = e2e.SHAPES["deepseek-v3"][1], e2e.SHAPES["mixtral-8x7b"][1]
    d, m = presets.get_preset("deepseek-v3"), presets.get_preset("mixtral-8x7b")
    assert (ds["hidden_size"], ds["moe_intermediate_size"]) == (d.hidden_size, 2048)
    assert (ds["n_routed_experts"], ds["num_experts_per_tok"]) == (d.num_experts, d.top_k)
    assert (mx["hidden_size"], mx["intermediate_size"]) == (m.hidden_size, m.intermediate_size)
    assert (mx["num_local_experts"], mx["num_experts_per_tok"]) == (m.num_experts, m.top_k)
    assert {name: family for name, (family, _) in e2e.SHAPES.items()} == {
        "qwen3-30b-a3b": "qwen3_moe",
        "gpt-oss-120b": "gpt_oss",
        "deepseek-v3": "deepseek_v3",
        "mixtral-8x7b": "mixtral",
    }


def test_model_presets_match_the_published_configs():
    """H, I, E, k as the models' config.json files give them."""
    published = {
        "deepseek-v3": (7168, 2048, 256, 8),
        "qwen3-30b-a3b": (2048, 768, 128, 8),
        "qwen3-235b-a22b": (4096, 1536, 128, 8),
        "mixtral-8x7b": (4096, 14336, 8, 2),
        "gpt-oss-120b": (2880, 2880, 128, 4),
        "gpt-oss-20b": (2880, 2880, 32, 4),
        "olmoe-1b-7b": (2048, 1024, 64, 8),
        "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
        "phi-3.5-moe": (4096, 6400, 16, 2),
        "dbrx": (6144, 10752, 16, 4),
    }
    for name, dims in published.items():
        s = presets.PRESETS[name]
        assert (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k) == dims, name


def test_no_other_source_spells_a_model_shape():
    """Integer literals that only a model's shape would use (DeepSeek-V3's H, Mixtral's I,
    Nemotron-H's, Phi-3.5-MoE's and DBRX's I) appear in the preset table and this test,
    nowhere else."""
    distinctive = {7168, 14336, 7688, 6400, 10752}
    here = Path(__file__).resolve()
    sources = [
        p
        for folder in ("moerunner", "tests", "benchmarks")
        for p in (ROOT / folder).rglob("*.py")
        if p.resolve() not in (here, Path(presets.__file__).resolve())
    ]
    found = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in sources
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value in distinctive
    ]
    assert found == []


def test_peer_bar_floor_reads_the_recorded_h100_table(capsys):
    # The record's claim (nvidia-h100-peer-bar-floor-2026-12-07.txt), recomputed from the
    # peer table and the library's byte and flop count: two points lie past the floor.
    main = runpy.run_path(str(BENCHMARKS / "experiments" / "peer_bar_floor.py"))["main"]
    main([str(BENCHMARKS / "results" / "nvidia-h100-peer-triton-2026-11-28.json")])
    out = capsys.readouterr().out
    assert "points past the floor (bar unreachable): 2; needing 95-100 %: 5" in out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines()}
    assert rows[("deepseek-v3", "16")][-1] == "100.8%"
