"""The command line runs end to end on this machine."""

from __future__ import annotations

import pytest

from moerunner.cli import SUBCOMMANDS, main


def test_info_lists_torch_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "[torch] available" in out and "dispatch formats" in out


def test_info_says_when_auto_passes_over_an_available_backend(capsys, monkeypatch, tmp_path):
    """A backend that runs here but is not ready (``Backend.ready``: its kernels would build
    for minutes at a first call) is listed as available, with why ``auto`` passes over it."""
    import json

    from moerunner.registry import DEFAULT_REGISTRY

    torch_backend = DEFAULT_REGISTRY.backends["torch"]
    monkeypatch.setattr(torch_backend, "ready", lambda: (False, "kernels not built (test)"))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "[torch] available (auto passes over it: kernels not built (test))" in out
    assert main(["info", "--json", str(tmp_path / "info.json")]) == 0
    record = json.loads((tmp_path / "info.json").read_text())["backends"]["torch"]
    assert record["available"] and not record["ready_for_auto"]
    assert record["not_ready_reason"] == "kernels not built (test)"


def test_demo_small_passes(capsys):
    assert (
        main(["demo", "--tokens", "4", "--hidden", "64", "--intermediate", "32", "--repeats", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "torch" in out and " ok" in out


def test_unknown_command():
    assert main(["frobnicate"]) == 2


def test_check_torch_selected_schemes(capsys):
    assert (
        main(
            [
                "check",
                "--backend",
                "torch",
                "--scheme",
                "fp8_block",
                "--scheme",
                "mxfp4",
                "--hidden",
                "128",
                "--intermediate",
                "128",
                "--tokens",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("pass") == 2 and "FAIL" not in out


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_prints_its_help(name, capsys):
    # argparse formats help strings with %, so a bare "%" in one breaks --help.
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


# --- usage errors, one flag vocabulary, outputs (issue 24 item 5, probe D7 / D16) -------------

import json  # noqa: E402

import torch  # noqa: E402
from cases import cli_usage_error, run_cli  # noqa: E402

from moerunner.cli import bench as cli_bench  # noqa: E402
from moerunner.cli import tune as cli_tune  # noqa: E402

run = run_cli
assert_usage_error = cli_usage_error


BAD = [
    # D16: tracebacks
    "demo --tokens -5",
    "demo --hidden -8",
    "demo --repeats 0",
    "demo --repeats -1",
    "demo --device cuda",
    "demo --device bogus",
    "check --tokens -1",
    "check --experts 0",
    "check --top-k 0",
    "check --top-k 99",
    "check --hidden 0",
    "check --hidden 48 --schemes mxfp4",
    "check --device cuda",
    "bench --replay {tmp}/missing.json",
    "bench --replay {tmp}/notes.txt",
    "bench --device cuda",
    "bench --device bogus",
    "bench --threads -2",
    # D16: values silently replaced or ignored
    "demo --hidden 0",
    "demo --intermediate 0",
    "bench --preset cpu-tiny --preset-schemes nosuch=fp8_block",
    "bench --dispatcher masked",
    "bench --capacity-factor 2",
    "bench --zipf-exponent -1",
    "bench --capacity-factor -1",
    "bench --min-time -1",
    # the rest of the vocabulary
    "check --schemes nosuch",
    "check --backends nosuch",
    "bench --schemes nosuch",
    "bench --routing nosuch",
    "bench --backends nosuch",
    "bench --baselines nosuch",
    "bench --ep-size 2 --dispatcher nosuch",
    "bench --tokens -1",
    "bench --shape 8,64,64",
    "bench --preset nope",
    "tune",
    "tune --preset nosuch",
    "tune --shape 8,64,64",
    "tune --shape 2,64,64,8",
    "tune --preset qwen3-30b-a3b --tokens 0",
    "info --bogus",
    # empty items in comma lists (a stray comma ran as if it were not there)
    "bench --tokens 1,,2",
    "bench --tokens 1,",
    "bench --schemes ,bf16",
    "bench --backends ,",
    "bench --baselines ,",
    "check --schemes bf16,",
    "tune --shape 8,64,96,2 --backends , --device cpu",
    # --png writes a PNG: another suffix failed in matplotlib after the whole run
    "bench --png {tmp}/plot.svg",
    "bench --png {tmp}/plot.txt",
]


@pytest.mark.parametrize("line", BAD)
def test_bad_argument_is_a_one_line_usage_error(line, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # same on a GPU machine
    (tmp_path / "notes.txt").write_text("notes\n")
    argv = line.format(tmp=tmp_path).split()
    code, _, err = run(argv, capsys)
    assert_usage_error(code, err, argv[0] if argv else "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written


def test_bench_png_without_suffix_is_the_png_file_it_writes(tmp_path, capsys):
    # matplotlib adds ".png" to a path without a suffix: the overwrite check looked at the path
    # as given and let the plot replace a file moerunner did not write.
    pytest.importorskip("matplotlib")
    (tmp_path / "plot.png").write_text("precious\n")
    base = ["bench", "--preset", "cpu-tiny", "--tokens", "1", "--baselines", "none"]
    code, _, err = run([*base, "--png", str(tmp_path / "plot")], capsys)
    assert_usage_error(code, err, "bench")
    assert "plot.png" in err and (tmp_path / "plot.png").read_text() == "precious\n"


def test_unknown_command_is_one_line(capsys):
    code, _, err = run(["frobnicate"], capsys)
    assert_usage_error(code, err, "")
    assert "info, demo, check, bench, tune" in err
    code, _, err = run(["--json", "-"], capsys)  # an option before the command
    assert_usage_error(code, err, "")
    assert "'--json' before the command" in err


@pytest.mark.parametrize(
    "argv", [["--version"], ["-V"], ["info", "--version"], ["bench", "--version"]]
)
def test_version(argv, capsys):
    from moerunner import __version__

    code, out, _ = run(argv, capsys)
    assert code == 0 and out.strip() == f"moerunner {__version__}"


def test_one_vocabulary_across_subcommands():
    parsers = {
        "check": __import__("moerunner.cli.check", fromlist=["x"]).build_parser(),
        "bench": cli_bench.build_parser(),
        "tune": cli_tune.build_parser(),
    }
    flags = {name: set(p._option_string_actions) for name, p in parsers.items()}
    for name in ("check", "bench", "tune"):
        assert "--schemes" in flags[name], name
        assert "--version" in flags[name], name
    for name in ("check", "bench"):
        assert {"--json", "--device", "--backends"} <= flags[name], name
    # lists are comma-separated everywhere; --shape is E,H,I,K in bench and tune
    bench = parsers["bench"].parse_args(["--shape", "8,64,96,2", "--tokens", "1,16"])
    tune = parsers["tune"].parse_args(["--shape", "8,64,96,2", "--tokens", "1,16"])
    assert cli_bench.config_from_args(bench).shapes[0].num_experts == 8
    assert cli_tune._shapes(parsers["tune"], tune)[0][1][:4] == (64, 96, 8, 2)
    assert cli_tune._tokens(parsers["tune"], tune.tokens) == bench.tokens == (1, 16)


def test_tune_new_and_deprecated_flags_reach_the_search(tmp_path, capsys, monkeypatch):
    from moerunner.backends.triton import tune as search

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(
        search, "tune_preset", lambda *a, **k: calls.append((a, k)) or (tmp_path / "f.json", {})
    )
    new = ["tune", "--shape", "8,4096,1024,2", "--schemes", "bf16,fp8_block"]
    code, _, err = run([*new, "--tokens", "1,16", "--out-dir", str(tmp_path)], capsys)
    assert code == 0 and "warning" not in err
    assert [c[0][:8] for c in calls] == [
        (4096, 1024, 8, 2, "silu", s, (1, 16), tmp_path) for s in ("bf16", "fp8_block")
    ]
    calls.clear()
    old = ["tune", "--shape", "4096", "1024", "8", "2", "--scheme", "bf16", "--tokens", "1", "16"]
    code, _, err = run([*old, "--out", str(tmp_path)], capsys)
    assert code == 0 and err.count("deprecated") == 4  # --shape, --scheme, --tokens, --out
    assert [c[0][:8] for c in calls] == [(4096, 1024, 8, 2, "silu", "bf16", (1, 16), tmp_path)]


def test_tune_checks_triton_and_the_gpu_before_any_work(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    code, _, err = run(["tune", "--preset", "qwen3-30b-a3b"], capsys)
    assert_usage_error(code, err, "tune")
    assert "needs triton" in err and "moerunner[triton]" in err
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(["tune", "--preset", "qwen3-30b-a3b"], capsys)
    assert_usage_error(code, err, "tune")
    assert "needs a CUDA GPU" in err


def test_bench_png_needs_matplotlib_before_the_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    code, _, err = run(["bench", "--png", str(tmp_path / "p.png")], capsys)
    assert_usage_error(code, err, "bench")
    assert "moerunner[bench]" in err and not list(tmp_path.iterdir())


def test_check_plain_scheme_runs_in_its_dtype_and_says_when_nothing_ran(capsys):
    small = ["--hidden", "64", "--intermediate", "64", "--tokens", "4", "--backends", "torch"]
    code, out, err = run(["check", "--schemes", "bf16", *small], capsys)
    assert code == 0 and out.count("pass") == 1 and "hidden bfloat16" in out
    code, out, err = run(["check", "--schemes", "bf16", "--dtype", "fp32", *small], capsys)
    assert code == 1
    assert "skipped: plain bf16 weights with --dtype fp32" in out
    assert "nothing was checked" in err


@pytest.mark.parametrize("command", ["info", "check", "demo"])
def test_json_to_stdout(command, capsys):
    extra = {
        "info": [],
        "check": ["--schemes", "fp32", "--backends", "torch", "--hidden", "64", "--tokens", "4"],
        "demo": ["--tokens", "4", "--hidden", "64", "--intermediate", "32", "--repeats", "1"],
    }[command]
    code, out, _ = run([command, *extra, "--json", "-"], capsys)
    assert code == 0
    record = json.loads(out)  # nothing but the JSON on stdout
    assert record["schema"] == f"moerunner-{command}/1"
    if command == "info":
        assert record["backends"]["torch"]["available"] is True
    else:
        assert record["rows"] and record["rows"][0]["backend"] == "torch"


def test_outputs_only_where_flags_point_and_never_over_foreign_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = ["check", "--schemes", "fp32", "--backends", "torch", "--hidden", "64", "--tokens", "4"]
    assert run(small, capsys)[0] == 0
    assert not list(tmp_path.iterdir())  # no flag, no file
    assert run([*small, "--json", "c.json"], capsys)[0] == 0
    first = (tmp_path / "c.json").read_text()
    assert json.loads(first)["schema"] == "moerunner-check/1"
    assert run([*small, "--json", "c.json"], capsys)[0] == 0  # its own file: rewritten
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    (tmp_path / "notes.md").write_text("# my notes\n")
    for flag, name in (("--json", "notes.json"), ("--md", "notes.md"), ("--json", "notes.md")):
        command = small if name.endswith("json") else ["bench", "--quiet"]
        code, _, err = run([*command, flag, name], capsys)
        assert_usage_error(code, err, command[0])
        assert "refusing to overwrite" in err
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'
    assert (tmp_path / "notes.md").read_text() == "# my notes\n"
    code, _, err = run(["bench", "--json", "same", "--md", "same"], capsys)
    assert_usage_error(code, err, "bench")


def _ceilings(path):
    from moerunner.bench import roofline

    key = roofline.device_key(torch.device("cpu"))
    path.write_text(
        json.dumps({key: {"device": key, "copy_gbps": 10.0, "peak_tflops": {"fp32": 0.1}}})
    )
    return path


TINY_BENCH = [
    "bench", "--shape", "8,64,64,2", "--tokens", "1", "--backends", "torch", "--routing",
    "uniform", "--min-time", "0.001", "--max-reps", "3", "--rotations", "1", "--quiet",
]  # fmt: skip


def test_d7_ceilings_never_overwrite_a_foreign_file(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    code, _, err = run([*TINY_BENCH, "--baselines", "none", "--ceilings", str(notes)], capsys)
    assert_usage_error(code, err, "bench")
    assert notes.read_text() == "notes\n"
    from moerunner.bench import roofline

    for text in ("notes\n", '{"a": 1}', "[1, 2]"):
        notes.write_text(text)
        with pytest.raises(ValueError, match="not a moerunner ceilings cache"):
            roofline.load_or_measure(torch.device("cpu"), notes)
        assert notes.read_text() == text


def test_replay_never_writes_the_file_it_replays(tmp_path, capsys):
    cache = _ceilings(tmp_path / "ceilings.json")
    record = tmp_path / "run.json"
    argv = [*TINY_BENCH[1:], "--baselines", "none", "--ceilings", str(cache)]
    code, out, _ = run(
        ["bench", *argv, "--json", str(record), "--md", str(tmp_path / "r.md")], capsys
    )
    assert code == 0 and "spread%" in out
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, _ = run(["bench", "--replay", str(record)], capsys)
    assert code == 0 and "shape-8x64x64x2" in out and "wrote" not in out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    code, _, err = run(["bench", "--replay", str(record), "--json", str(record)], capsys)
    assert_usage_error(code, err, "bench")
    code, out, _ = run(
        ["bench", "--replay", str(record), "--json", str(tmp_path / "b.json")], capsys
    )
    assert code == 0 and (tmp_path / "b.json").exists()
    assert json.loads((tmp_path / "b.json").read_text())["argv"][-2:] == [
        "--json",
        str(tmp_path / "b.json"),
    ]


def test_baselines_without_transformers_are_not_labelled_transformers(
    tmp_path, capsys, monkeypatch
):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    cache = _ceilings(tmp_path / "ceilings.json")
    argv = [*TINY_BENCH, "--baselines", "eager", "--ceilings", str(cache)]
    code, out, err = run([*argv, "--md", str(tmp_path / "r.md")], capsys)
    assert code == 0
    assert "torch-eq:eager" in out and "hf:" not in out
    assert "transformers is not installed" in err
    md = (tmp_path / "r.md").read_text()
    assert "hf:" not in md and "stand-ins" in md


# --- tune: tile files identify themselves; foreign files are never merged into -------------

FAKE_GPU = "Fake GPU 80GB"


def _tile_file(path, by_tokens):
    from moerunner.backends.triton.tile_config import MoeTiles, TileConfig, write_config_file

    tiles = MoeTiles(TileConfig(16, 32, 64), TileConfig(16, 64, 32))
    write_config_file(path, 8, 1024, 4096, "bf16", FAKE_GPU, dict.fromkeys(by_tokens, tiles))


def test_tune_refuses_a_foreign_file_under_a_tile_name_before_any_work(
    tmp_path, capsys, monkeypatch
):
    pytest.importorskip("triton")
    from moerunner.backends.triton import tune as search
    from moerunner.backends.triton.tile_config import config_file_name

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: FAKE_GPU)
    monkeypatch.setattr(
        search, "tune_preset", lambda *a, **k: calls.append(a) or (tmp_path / "f.json", {})
    )
    argv = ["tune", "--shape", "8,4096,1024,2", "--tokens", "1", "--out-dir", str(tmp_path)]
    foreign_texts = ('{"by_tokens": {}}', "not json\n", '{"schema": "someone-else/1"}', "[1]")
    for layout in (None, "fragment"):  # any layout of this shape, scheme and device
        name = config_file_name(8, 1024, 4096, "bf16", FAKE_GPU, layout)
        for text in foreign_texts:
            (tmp_path / name).write_text(text)
            code, _, err = run(argv, capsys)
            assert_usage_error(code, err, "tune")
            assert name in err and "not a moerunner tile file" in err and "--out-dir" in err
            assert (tmp_path / name).read_text() == text and not calls
        (tmp_path / name).unlink()
    # its own file (and other shapes' files, foreign or not) do not stop it
    _tile_file(tmp_path / config_file_name(8, 1024, 4096, "bf16", FAKE_GPU), (1,))
    (tmp_path / config_file_name(8, 1024, 2048, "bf16", FAKE_GPU)).write_text("mine\n")
    code, _, err = run(argv, capsys)
    assert code == 0, err
    assert len(calls) == 1


def test_tune_merges_into_its_own_file_and_refuses_others(tmp_path):
    pytest.importorskip("triton")
    from moerunner.backends.triton import tune as search
    from moerunner.backends.triton.tile_config import (
        SCHEMA,
        MoeTiles,
        TileConfig,
        is_tile_file,
        load_config_file,
    )

    path = tmp_path / "tiles.json"
    key = (8, 1024, 4096, "bf16", FAKE_GPU, None)
    new = MoeTiles(TileConfig(64, 64, 64), TileConfig(64, 128, 64))
    assert search.merge_tuned(path, key, {16: new}, {16: 0.5}) == {16: 0.5}  # a new file
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA and is_tile_file(path)
    _tile_file(path, (1, 16, 256))  # an earlier run: T = 1, 16, 256
    earlier = load_config_file(str(path))
    timings = search.merge_tuned(path, key, {16: new}, {16: 0.25})
    merged = load_config_file(str(path))
    assert sorted(merged) == [1, 16, 256]
    assert merged[16] == new and merged[1] == earlier[1] and merged[256] == earlier[256]
    assert timings == {16: 0.25}
    for text in ('{"by_tokens": {}}', "notes\n"):
        path.write_text(text)
        assert not is_tile_file(path)
        with pytest.raises(ValueError, match="not a moerunner tile file"):
            search.merge_tuned(path, key, {16: new}, {16: 0.5})
        assert path.read_text() == text


# --- bench writes files only where its flags point ------------------------------------------


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_bench_writes_nothing_outside_its_flags(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    home, cache, cwd = (tmp_path / d for d in ("home", "cache", "cwd"))
    for d in (home, cache, cwd):
        d.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(cache),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),  # this checkout's moerunner
    }
    tiny = [*TINY_BENCH[1:], "--baselines", "none"]

    def bench(*extra):
        done = subprocess.run(
            [sys.executable, "-m", "moerunner", "bench", *tiny, *extra],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done

    bench()  # no file flag: the ceilings are measured, nothing is written anywhere
    assert _files(tmp_path) == []
    ceilings = tmp_path / "out" / "ceilings.json"
    bench("--ceilings", str(ceilings), "--json", "r.json")
    assert _files(tmp_path) == ["cwd/r.json", "out/ceilings.json"]
    cached = json.loads(ceilings.read_text())
    assert [v["copy_gbps"] > 0 for v in cached.values()] == [True]
    bench("--ceilings", str(ceilings))  # read back, not measured again
    assert json.loads(ceilings.read_text()) == cached
    bench("--replay", str(cwd / "r.json"))  # the recorded --json and --ceilings are dropped
    assert _files(tmp_path) == ["cwd/r.json", "out/ceilings.json"]
    assert json.loads(ceilings.read_text()) == cached


# --- usage errors caught before any work, with the reason named -----------------------------

BAD_WITH_REASON = [
    ("tune --shape 8,64,64,2 --activation nosuch", "argument --activation: invalid choice"),
    ("tune --shape 8,64,64,2 --jobs 0", "--jobs: expected an int >= 1"),
    ("tune --shape 8,64,48,2 --schemes mxfp4", "--schemes mxfp4: shape 8,64,48,2 cannot be"),
    ("bench --shape 8,64,48,2 --schemes mxfp4 --baselines none", "scheme mxfp4: the weights of"),
    ("bench --shape 8,64,64,2 --preset-schemes shape-8x64x64x2=int4_g128", "int4_g128"),
    ("check --schemes mxfp4 --shape 8,64,48,2", "--schemes mxfp4: a layer with hidden size 64"),
    ("check --shape 8,64,64,2 --hidden 64", "give --shape E,H,I,K or --hidden, not both"),
    ("check --shape 8,64,64", "argument --shape: expected four positive ints"),
    ("check --shape 2,64,64,4", "top-k 4 is more than the 2 experts"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_WITH_REASON)
def test_usage_error_names_its_reason_before_any_work(line, reason, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # tune: checks come first
    monkeypatch.chdir(tmp_path)
    argv = line.split()
    code, out, err = run(argv, capsys)
    assert_usage_error(code, err, argv[0])
    assert reason in err and out == ""
    assert not list(tmp_path.iterdir())


def test_check_shape_flag_equals_the_size_flags(capsys):
    base = ["check", "--schemes", "fp32", "--backends", "torch", "--tokens", "3", "--json", "-"]
    code, out, _ = run([*base, "--shape", "4,64,32,3"], capsys)
    assert code == 0
    one = json.loads(out)
    code, out, _ = run(
        [*base, "--experts", "4", "--hidden", "64", "--intermediate", "32", "--top-k", "3"],
        capsys,
    )
    assert code == 0
    four = json.loads(out)
    assert one["shape"] == four["shape"] == {"T": 3, "E": 4, "K": 3, "H": 64, "I": 32}
    assert one["rows"] == four["rows"]
    code, out, _ = run(base, capsys)  # neither: the documented defaults
    assert code == 0 and json.loads(out)["shape"] == {"T": 3, "E": 8, "K": 2, "H": 256, "I": 256}


def test_an_output_folder_not_writable_is_a_usage_error(tmp_path, capsys, monkeypatch):
    import os

    real = os.access
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(
        os, "access", lambda p, m, **k: False if str(p) == str(locked) else real(p, m, **k)
    )
    code, _, err = run(["info", "--json", str(locked / "sub" / "info.json")], capsys)
    assert_usage_error(code, err, "info")
    assert "is not writable here" in err and not list(locked.iterdir())


def test_bench_json_to_stdout(tmp_path, capsys):
    cache = _ceilings(tmp_path / "ceilings.json")
    argv = [*TINY_BENCH, "--baselines", "none", "--ceilings", str(cache), "--json", "-"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    record = json.loads(out)  # nothing but the JSON on stdout; the table went to stderr
    assert str(record["schema"]).startswith("moerunner")
    assert {row["impl"] for row in record["rows"]} == {"torch"}
    assert "spread%" in err


def test_info_names_the_tile_folders_and_their_files_for_this_device(capsys, monkeypatch, tmp_path):
    """``moerunner info`` lists the triton backend's tile folders in search order, each with
    its tuned files for this device or "missing" (it named no tile file before)."""
    import json

    import torch

    pytest.importorskip("moerunner.backends.triton")
    from moerunner.device_files import device_key, hardware_name
    from moerunner.registry import DEFAULT_REGISTRY

    if not DEFAULT_REGISTRY.backends["triton"].available()[0]:
        pytest.skip("the triton backend does not run here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = device_key(hardware_name(device))
    tiles = tmp_path / "moerunner" / "tiles"
    tiles.mkdir(parents=True)
    (tiles / f"E=8,N=16,K=32,scheme=bf16,device={key}.json").write_text("{}")
    (tiles / "E=8,N=16,K=32,scheme=bf16,device=OTHER_GPU.json").write_text("{}")
    assert main(["info", "--json", str(tmp_path / "info.json")]) == 0
    out = capsys.readouterr().out
    assert f"    {tiles}: 1 tuned file(s) for {key}" in out
    folders = json.loads((tmp_path / "info.json").read_text())["backends"]["triton"]["tile_folders"]
    assert folders[0] == {
        "path": str(tiles),
        "exists": True,
        "device_key": key,
        "files_for_device": 1,
    }
    assert folders[-1]["path"].endswith("configs")  # the shipped files come last
    tiles.joinpath(f"E=8,N=16,K=32,scheme=bf16,device={key}.json").unlink()
    tiles.joinpath("E=8,N=16,K=32,scheme=bf16,device=OTHER_GPU.json").unlink()
    tiles.rmdir()
    assert main(["info"]) == 0
    assert f"    {tiles}: missing" in capsys.readouterr().out
