"""Regressions of faults a prober found in the CLI, the bench package, backend-table loading
and the benchmark scripts: each test fails on the code before its fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from cases import cli_usage_error, run_cli

import moerunner
from moerunner import backend_table as bt
from moerunner.backend_table import BackendTable, BackendTableError, Bucket, ShapeKey
from moerunner.backends.torch_native import TorchBackend
from moerunner.bench import roofline
from moerunner.bench.presets import BenchShape
from moerunner.bench.roofline import DeviceCeilings
from moerunner.bench.sweep import BenchConfig, Sweep
from moerunner.testing import DTYPE_BOUND, error_bound

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = [
    "--shape", "4,32,32,2", "--tokens", "1", "--backends", "torch", "--routing", "uniform",
    "--min-time", "0.001", "--max-reps", "3", "--rotations", "1", "--quiet", "--baselines",
    "none",
]  # fmt: skip


run = run_cli
usage_error = cli_usage_error


def ceilings_cache(path: Path, **entry) -> Path:
    key = roofline.device_key(torch.device("cpu"))
    fields = {"device": key, "copy_gbps": 10.0, "peak_tflops": {"fp32": 0.1, "bf16": 0.1}}
    path.write_text(json.dumps({key: {**fields, **entry}}))
    return path


def key_dict(**change) -> dict:
    base = dict(
        dtype="float32", w13_scheme="fp32", w2_scheme="fp32", activation="silu", num_experts=4,
        hidden_size=32, intermediate_size=32, top_k=2,
    )  # fmt: skip
    return {**base, **change}


def table_doc(device: str = "cpu", **change) -> dict:
    bucket = {"max_tokens": None, "tokens": 1, "backend": "torch", "times_us": {"torch": 1.0}}
    return {
        "schema": bt.SCHEMA,
        "device": device,
        "entries": [{"key": key_dict(**change), "buckets": [bucket]}],
    }


# -- 1: JSON outputs never overwrite another kind of moerunner file ---------------------------


def test_info_json_refuses_to_overwrite_a_backend_table(cache_home, capsys):
    path = BackendTable("cpu").write(cache_home / bt.table_file_name("cpu"))
    before = path.read_bytes()
    code, _, err = run(["info", "--json", str(path)], capsys)
    line = usage_error(code, err, "info")
    assert str(path) in line and bt.SCHEMA in line
    assert path.read_bytes() == before
    for command in (["check", "--backends", "torch", "--schemes", "fp32", "--hidden", "32"],):
        code, _, err = run([*command, "--json", str(path)], capsys)
        usage_error(code, err, "check")
        assert path.read_bytes() == before
    own = cache_home.parent / "info.json"
    assert run(["info", "--json", str(own)], capsys)[0] == 0
    assert run(["info", "--json", str(own)], capsys)[0] == 0  # its own kind: rewritten


def test_an_unusable_user_table_warns_once_and_auto_falls_back(cache_home):
    path = cache_home / bt.table_file_name("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(table_doc(hidden_size=0)))
    with pytest.warns(RuntimeWarning, match="hidden_size") as caught:
        table = bt.default_table("cpu")
    assert str(path) in str(caught[0].message)
    assert path not in table.paths  # left out: no table file of the CPU ships
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # memoised: no second read, no second warning
        assert bt.default_table("cpu") is table
        x, logits = torch.randn(3, 32), torch.randn(3, 4)
        w13, w2 = torch.randn(4, 64, 32) / 8, torch.randn(4, 32, 32) / 8
        topk = moerunner.select_experts(logits, 2, renormalize=True)
        out = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)  # auto: any shape runs
    assert out.shape == (3, 32)
    with pytest.raises(BackendTableError, match="hidden_size"):  # named explicitly: raises
        bt.find_table("cpu")
    with pytest.raises(BackendTableError, match="hidden_size"):
        bt.load_table_file(str(path))


def test_an_unreadable_user_table_is_a_backend_table_error(tmp_path, monkeypatch):
    path = tmp_path / bt.table_file_name("cpu")
    path.write_text(json.dumps(table_doc()))
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    bt.load_table_file.cache_clear()
    with pytest.raises(BackendTableError, match="cannot be read"):
        bt.load_table_file(str(path))


# -- 2, 12: --replay never overwrites what it replays, and reads bench records only ----------


def test_replay_of_an_abbreviated_output_flag_never_writes_the_record(tmp_path, capsys):
    record = tmp_path / "run.json"
    cache = ceilings_cache(tmp_path / "ceilings.json")
    argv = [*TINY, "--ceilings", str(cache), "--js", str(record)]
    text = json.dumps({"schema": "moerunner-bench/1", "argv": argv, "rows": []})
    record.write_text(text)
    code, _, err = run(["bench", "--replay", str(record)], capsys)
    usage_error(code, err, "bench")
    assert "--js" in err
    assert record.read_text() == text
    code, _, err = run(["bench", *TINY, "--jso", str(tmp_path / "x.json")], capsys)
    usage_error(code, err, "bench")  # abbreviations are not taken: records spell flags out


def test_replay_refuses_a_json_of_another_schema(tmp_path, capsys):
    other = tmp_path / "check.json"
    other.write_text(json.dumps({"schema": "moerunner-check/1", "argv": ["--tokens", "1"]}))
    code, _, err = run(["bench", "--replay", str(other)], capsys)
    line = usage_error(code, err, "bench")
    assert "moerunner-check/1" in line and "moerunner-bench/1" in line


# -- 3: '-' is stdout for --json only ----------------------------------------------------------


@pytest.mark.parametrize("flag", ["--md", "--ceilings", "--png"])
def test_dash_is_refused_where_a_flag_writes_a_file(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = ceilings_cache(tmp_path / "c.json")
    extra = [] if flag == "--ceilings" else ["--ceilings", str(cache)]
    code, _, err = run(["bench", *TINY, *extra, flag, "-"], capsys)
    line = usage_error(code, err, "bench")
    assert f"{flag} -" in line
    assert not (tmp_path / "-").exists() and not (tmp_path / "-.png").exists()


# -- 4: malformed ceilings caches -----------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"copy_gbps": 0}, "copy_gbps"),
        ({"copy_gbps": "fast"}, "copy_gbps"),
        ({"copy_gbps": -3.0}, "copy_gbps"),
        ({"peak_tflops": {}}, "peak_tflops"),
        ({"peak_tflops": {"fp32": 0}}, "peak_tflops"),
        ({"peak_tflops": "x"}, "peak_tflops"),
        ({"peak_tflops": None}, "peak_tflops"),
        ({"device": 3}, "device"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_malformed_ceilings_entry_names_the_file_and_field(entry, field, tmp_path, capsys):
    path = ceilings_cache(tmp_path / "ceil.json", **entry)
    with pytest.raises(ValueError, match=field) as info:
        roofline.load_or_measure(torch.device("cpu"), path)
    assert str(path) in str(info.value)
    code, _, err = run(["bench", *TINY, "--ceilings", str(path)], capsys)
    assert field in usage_error(code, err, "bench")


def test_a_ceilings_entry_without_its_fields_is_a_clear_error(tmp_path):
    key = roofline.device_key(torch.device("cpu"))
    path = tmp_path / "ceil.json"
    path.write_text(json.dumps({key: {"copy_gbps": 10.0}}))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['device', 'peak_tflops'\]"):
        roofline.load_or_measure(torch.device("cpu"), path)


# -- 5, 6: tune --backends checks first, shows progress, keeps what finished ---------------


def test_tune_backends_refuses_a_backend_that_cannot_serve_before_any_work(tmp_path, capsys):
    argv = ["tune", "--shape", "4,32,32,2", "--schemes", "fp32", "--tokens", "1", "--device"]
    code, _, err = run(
        [*argv, "cpu", "--backends", "torch,flashinfer", "--out-dir", str(tmp_path)], capsys
    )
    line = usage_error(code, err, "tune")
    assert "flashinfer" in line
    assert not list(tmp_path.iterdir())


class FailsAtHidden64(TorchBackend):
    """The torch backend under another name, raising at run time for H = 64."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "fails64"
        base = self.fused_ops["standard"]

        def fused(dispatch_output, prepared, **kw):
            if dispatch_output.hidden_states.shape[-1] == 64:
                raise RuntimeError("broken at H=64 (test)")
            return base(dispatch_output, prepared, **kw)

        self.fused_ops = {"standard": fused}


def test_tune_backends_keeps_what_finished_and_shows_progress(tmp_path, capsys):
    from moerunner.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.register_backend(FailsAtHidden64())
    try:
        code, out, err = run(
            ["tune", "--shape", "4,32,32,2", "--shape", "4,64,32,2", "--schemes", "fp32",
             "--tokens", "1", "--device", "cpu", "--backends", "fails64", "--min-time", "0.01",
             "--out-dir", str(tmp_path)],
            capsys,
        )  # fmt: skip
    finally:
        del DEFAULT_REGISTRY.backends["fails64"]
        DEFAULT_REGISTRY._selections.clear()
    assert code == 1
    assert "broken at H=64" in err and "tune --backends" in err  # the progress bar
    table = bt.load_table_file(str(tmp_path / bt.table_file_name("cpu")))
    assert [(k.hidden_size, b[0].backend) for k, b in table.entries.items()] == [(32, "fails64")]


def test_tune_out_dir_under_a_file_is_a_usage_error_before_any_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run(
        ["tune", "--shape", "4,32,32,2", "--schemes", "fp32", "--tokens", "1", "--device", "cpu",
         "--backends", "torch", "--out-dir", str(afile / "sub")],
        capsys,
    )  # fmt: skip
    line = usage_error(code, err, "tune")
    assert "is not a directory" in line and afile.read_text() == "x"


# -- 7: impossible table entries ------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_experts": 0}, "num_experts"),
        ({"top_k": 0}, "top_k"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"top_k": 5}, "top_k"),
        ({"w13_scheme": "nosuch"}, "w13_scheme"),
        ({"w2_scheme": "nosuch"}, "w2_scheme"),
        ({"dispatch_format": "weird"}, "dispatch_format"),
        ({"dtype": "float64"}, "dtype"),
        ({"activation": "nosuch"}, "activation"),
    ],
)
def test_an_impossible_table_key_is_rejected(change, field):
    with pytest.raises(BackendTableError, match=rf"key\.{field}"):
        BackendTable.from_dict(table_doc(**change), "t.json")


def test_a_table_of_another_device_under_this_devices_name_is_rejected(tmp_path):
    (tmp_path / bt.table_file_name("cpu")).write_text(json.dumps(table_doc(device="gpu-x")))
    with pytest.raises(BackendTableError, match="gpu-x"):
        bt.find_table("cpu", [tmp_path])


def test_info_prints_an_entrys_error_in_text_mode(cache_home, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("info reads the GPU's table here")
    key = ShapeKey.from_dict(key_dict(), "key")
    BackendTable("cpu", {key: (Bucket(None, 1, "torch", {"torch": 1.0}),)}).write(
        cache_home / bt.table_file_name("cpu")
    )

    def refuse(self, *args, **kwargs):
        raise ValueError("no backend serves it here (test)")

    monkeypatch.setattr(moerunner.Registry, "bucket_plan", refuse)
    code, out, _ = run(["info"], capsys)
    assert code == 0
    assert "E=4 H=32 I=32 k=2" in out and "error: no backend serves it here (test)" in out


# -- 8, 9, 10: one accuracy bound; T=0 rows; progress totals; baseline labels ---------------


def test_bench_rows_are_held_to_the_bound_check_uses():
    from moerunner.bench.sweep import accuracy_bound

    assert accuracy_bound("fp32", torch.float32) == DTYPE_BOUND[torch.float32] == 2e-5
    assert accuracy_bound("fp16", torch.float16) == DTYPE_BOUND[torch.float16]
    assert accuracy_bound("int8_w8a16", torch.bfloat16) == error_bound(torch.bfloat16, False)
    assert accuracy_bound("fp8_block", torch.bfloat16) == error_bound(torch.bfloat16, True)


class Off(TorchBackend):
    """The torch backend under another name, its output off by 6e-5 (relative)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "off"
        base = self.fused_ops["standard"]
        self.fused_ops = {"standard": lambda *a, **k: base(*a, **k) * (1 + 6e-5)}


def test_a_row_outside_checks_bound_is_wrong_and_a_t0_row_is_not_checked():
    registry = moerunner.default_registry().copy()
    registry.register_backend(Off())
    config = BenchConfig(
        shapes=(BenchShape("tiny", 4, 32, 32, 2),), tokens=(0, 4), schemes=("fp32",),
        backends=("torch", "off"), baselines=(), min_time_s=0.001, max_reps=2, rotations=1,
    )  # fmt: skip
    rows = Sweep(config, DeviceCeilings("cpu", 1.0, {"fp32": 1.0}), registry).run()
    status = {(r.impl, r.tokens): r.status for r in rows}
    assert status == {
        ("torch", 0): "n/a",
        ("off", 0): "n/a",
        ("torch", 4): "ok",
        ("off", 4): "wrong",
    }
    note = next(r.note for r in rows if r.impl == "off" and r.tokens == 4)
    assert note.startswith("max error ") and note.endswith("e-05 > bound 2.00e-05")  # was ""


def test_progress_total_is_the_rows_run_and_baselines_carry_their_dtype():
    config = BenchConfig(
        shapes=(BenchShape("tiny", 4, 128, 128, 2),), tokens=(1,), schemes=("fp32", "int8_w8a16"),
        backends=None, baselines=("eager",), dtype="fp16", min_time_s=0.001, max_reps=2,
        rotations=1,
    )  # fmt: skip
    sweep = Sweep(config, DeviceCeilings("cpu", 1.0, {"fp32": 1.0}))
    total = sweep.total_rows()
    rows = sweep.run()
    assert total == len(rows)
    baselines = [(r.scheme, r.dtype) for r in rows if r.impl.startswith("baseline:")]
    assert sorted(baselines) == [("fp16", "float16"), ("fp32", "float32")]


# -- 11: strict JSON ------------------------------------------------------------------------


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_bench_json_has_no_bare_nan_and_check_json_has_numbers(tmp_path, capsys):
    cache = ceilings_cache(tmp_path / "c.json")
    out_json = tmp_path / "b.json"
    argv = ["bench", *TINY, "--ceilings", str(cache), "--json", str(out_json)]
    argv[argv.index("--tokens") + 1] = "0"
    code, out, err = run(argv, capsys)
    assert code == 0, err
    (row,) = _strict(out_json.read_text())["rows"]
    assert row["status"] == "n/a" and row["max_rel_err"] is None and row["speedup"] == {}
    assert "n/a: T=0: no output to check" in out  # (the timing's note had replaced the reason)
    assert row["note"].startswith("T=0: no output to check")
    code, out, _ = run(
        [
            "check",
            "--backends",
            "torch",
            "--schemes",
            "fp32",
            "--shape",
            "4,32,32,2",
            "--json",
            "-",
        ],
        capsys,
    )
    assert code == 0
    (row,) = _strict(out)["rows"]
    assert isinstance(row["max_rel_err"], float) and row["bound"] == DTYPE_BOUND[torch.float32]


def test_json_text_writes_null_for_nan_and_inf():
    from moerunner.bench import report

    text = report.json_text({"a": float("nan"), "b": [float("inf"), 1.0]})
    assert _strict(text) == {"a": None, "b": [None, 1.0]}


# -- 13: benchmark scripts validate their flags before any work ------------------------------


def _script(name: str):
    spec = importlib.util.spec_from_file_location(Path(name).stem + "_probe", BENCHMARKS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv",
    [["--calls", "0"], ["--shrink", "0"], ["--shrink", "-2"], ["--repeats", "0"],
     ["--json", "{tmp}/afile/x.json"]],
)  # fmt: skip
def test_host_cost_refuses_bad_flags_before_any_work(argv, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    host_cost = _script("host_cost.py")
    with pytest.raises(SystemExit) as exc:
        host_cost.main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_cpu_script_refuses_an_unknown_dtype_before_any_work(capsys):
    pytest.importorskip("transformers")
    script = _script("cpu_torch_vs_transformers.py")
    with pytest.raises(SystemExit) as exc:
        script.main(["--dtypes", "fp16"])
    assert exc.value.code == 2 and "fp16" in capsys.readouterr().err


def test_e2e_shows_no_negative_time_in_experts_or_ratio():
    pytest.importorskip("transformers")
    e2e = _script("transformers_e2e.py")

    def row(impl, prefill, decode):
        spread = lambda m: {"min": m, "median": m, "max": m}  # noqa: E731
        return {"shape": "s", "impl": impl, "prefill_ms": spread(prefill),
                "decode_ms": spread(decode), "prefill_tok_s": 1.0, "decode_tok_s": 1.0,
                "max_rel_vs_first": None}  # fmt: skip

    rows = [row("grouped_mm", 5.0, 2.0), row("moerunner", 3.0, 3.0), row(e2e.ZERO_IMPL, 4.0, 1.0)]
    e2e.add_experts_time(rows, ("prefill", "decode"))
    mr = rows[1]
    assert mr["prefill_experts_vs_grouped_mm"] is None  # -1 ms: noise, no ratio
    assert mr["decode_experts_vs_grouped_mm"] == 2.0
    text = e2e.table({"rows": rows})
    line = next(t for t in text.splitlines() if t.startswith("s") and "moerunner" in t)
    assert "-1.00" not in line and "n/a" in line
    assert e2e.NOISE_NOTE in text


# -- 14: consistent names, no silently ignored flags -----------------------------------------


def test_info_and_bench_name_the_device_alike(capsys):
    from moerunner.bench.report import environment

    code, out, _ = run(["info", "--json", "-"], capsys)
    assert code == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert json.loads(out)["device_name"] == environment(torch.device(device))["device"]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("tune --shape 8,64,64,2 --min-time 1", "--min-time applies to --backends"),
        ("tune --shape 8,64,64,2 --jobs 2", "--jobs"),
        ("bench --ep-size 2 --capacity-factor 2", "masked"),
        ("bench --ep-size 2 --md x.md", "--md"),
        ("bench --min-time 0", "--min-time"),
    ],
)
def test_flags_that_would_be_ignored_are_usage_errors(line, reason, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if line.startswith("tune"):
        pytest.importorskip("triton")
    argv = line.split()
    code, _, err = run(argv, capsys)
    assert reason in usage_error(code, err, argv[0])
    assert not list(tmp_path.iterdir())


# --- the 2026-12-07 CLI probe ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--tokens", "99999999999999999999"], "--tokens: expected an int <= 2147483647"),
        (["demo", "--seed", "99999999999999999999"], "--seed: expected an int <= 92233720"),
        (["check", "--shape", "2,99999999999999999999,32,1"], "--shape: expected four posit"),
        (["bench", "--tokens", "99999999999999999999", *TINY[2:]], "--tokens: expected comma"),
        (["bench", "--backends", "", *TINY[4:]], "--backends: expected comma-separated back"),
        (["bench", "--png", "", *TINY], "--png: expected the path of a file, got ''"),
        (["bench", "--png", ".", *TINY], "--png: expected the path of a file, got '.'"),
        (["bench", "--png", "sub/", *TINY], "--png: expected the path of a file, got 'sub/'"),
        (["bench", "--shape", "4,64,64,8", *TINY[2:]], "--shape: top-k 8 is more than the 4 ex"),
        (["tune", "--backends", "--device", "cpu", "--out-dir", ""], "--out-dir: expected a fol"),
    ],
)
def test_values_past_the_flags_ranges_are_usage_errors(argv, needle, capsys):
    """Were tracebacks (int64 overflow, an empty PNG name), a bench that timed nothing with
    status 0 (``--backends ''``), a write into the current folder (``--out-dir ''``), and a
    top-k error that named no flag."""
    code, _, err = run(argv, capsys)
    assert needle in usage_error(code, err, argv[0])


def test_bench_preset_schemes_error_names_the_flag(capsys):
    argv = ["bench", "--preset", "cpu-tiny", "--preset-schemes", "cpu-tiny=nosuch", "--quiet"]
    code, _, err = run(argv, capsys)
    assert "--preset-schemes cpu-tiny=nosuch: " in usage_error(code, err, "bench")


def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys):
    """An earlier output that cannot be opened for writing, and a folder where no file can
    be made, are usage errors before any work (the writes failed after it, with a traceback;
    root passes permission bits, so the check opens the file)."""
    out = tmp_path / "info.json"
    code, _, err = run(["info", "--json", str(out)], capsys)
    assert code == 0, err
    real_open = open

    def refuse(path, mode="r", *a, **k):
        if Path(path) == out and "a" in mode:
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_open(path, mode, *a, **k)

    import builtins

    builtins_open = builtins.open
    try:
        builtins.open = refuse
        code, _, err = run(["info", "--json", str(out)], capsys)
    finally:
        builtins.open = builtins_open
    assert "cannot be written here (Operation not permitted)" in usage_error(code, err, "info")
    code, _, err = run(["info", "--json", "/proc/moerunner/x.json"], capsys)
    assert "is not writable here" in usage_error(code, err, "info")


def test_errors_after_the_work_starts_are_one_line_without_traceback(monkeypatch, capsys):
    """A write that fails late (a full disk) or sizes past the machine's memory ended in a
    traceback; they are one line with exit status 1."""
    from moerunner.cli import demo

    def full_disk(argv):
        raise OSError(28, "No space left on device", "out.json")

    monkeypatch.setattr(demo, "main", full_disk)
    code, _, err = run(["demo"], capsys)
    assert code == 1 and "Traceback" not in err
    assert err.strip() == "moerunner demo: error: No space left on device: 'out.json'"

    def too_big(argv):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9")

    monkeypatch.setattr(demo, "main", too_big)
    code, _, err = run(["demo"], capsys)
    assert code == 1 and err.startswith("moerunner demo: error: out of memory (")


def test_tune_backends_names_a_folder_at_the_table_path_and_a_dropped_token_count(
    tmp_path, capsys, monkeypatch
):
    """A folder named as the table was an IsADirectoryError after measuring; a token count no
    backend ran correctly vanished from the table without a word."""
    from moerunner.backend_table import table_file_name
    from moerunner.bench import backend_choice as tb
    from moerunner.device_files import device_name

    base = ["tune", "--shape", "4,32,32,2", "--schemes", "fp32", "--backends", "torch"]
    base += ["--device", "cpu", "--tokens", "1,2", "--min-time", "0.001"]
    folder = tmp_path / "t"
    (folder / table_file_name(device_name(torch.device("cpu")))).mkdir(parents=True)
    code, _, err = run([*base, "--out-dir", str(folder)], capsys)
    assert "exists and is not a file" in usage_error(code, err, "tune")
    real = tb.tune_backends

    def one_wrong(*a, **k):
        key, buckets, rows = real(*a, **k)
        wrong = [dataclasses.replace(r, status="wrong", note="") if r.tokens == 1 else r
                 for r in rows]  # fmt: skip
        return key, buckets, wrong

    monkeypatch.setattr(tb, "tune_backends", one_wrong)
    code, _, err = run([*base, "--out-dir", str(tmp_path / "u")], capsys)
    assert code == 0, err
    assert "T=1 left out of the table: no backend ran it correctly (torch: wrong)" in err
