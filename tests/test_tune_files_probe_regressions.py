"""Regressions of faults a prober found in ``moerunner tune``, Ctrl-C, file writes, tile files,
backend tables and the user cache folder: each test fails on the code before its fix."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cases import cli_usage_error, run_cli

from moerunner import backend_table as bt
from moerunner.backend_table import BackendTableError

REPO = Path(__file__).resolve().parents[1]
FAKE_GPU = "Fake GPU 80GB"

run = run_cli
usage_error = cli_usage_error


def _env(tmp_path) -> dict:
    return {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),  # this checkout's moerunner
    }


def _no_interrupt(argv, capsys):
    """``run_cli``, failing the test (not the session) where Ctrl-C escapes the CLI."""
    try:
        return run(argv, capsys)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped moerunner.cli.main (a traceback for the user)")


# -- 5: tune --backends --preset without triton ------------------------------------------------

WITHOUT_TRITON = (
    "import sys; sys.modules['triton'] = None; from moerunner.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)  # import triton raises ImportError, as where it is not installed


def _tune_without_triton(tmp_path, *argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON, "tune", *argv],
        env=_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_tune_backends_reads_presets_without_triton(tmp_path):
    """The presets were read through the triton tuner: ModuleNotFoundError and a traceback.
    Here the preset reaches the backend check, which names it (flashinfer is absent)."""
    done = _tune_without_triton(
        tmp_path, "--preset", "olmoe-1b-7b", "--backends", "flashinfer", "--device", "cpu"
    )
    line = usage_error(done.returncode, done.stderr, "tune")
    assert "olmoe-1b-7b bf16: cannot time olmoe-1b-7b" in line


def test_tune_unknown_preset_is_a_usage_error_without_triton(tmp_path):
    """Without triton ``--preset`` was not checked at parse time: a traceback, exit 1."""
    done = _tune_without_triton(tmp_path, "--preset", "nosuch", "--backends", "--device", "cpu")
    line = usage_error(done.returncode, done.stderr, "tune")
    assert "unknown preset 'nosuch'; accepted: " in line
    assert "deepseek-v3" in line and "olmoe-1b-7b" in line


def test_tune_presets_are_the_tuners(capsys):
    """Read from ``bench.presets``, the names are the tile tuner's, as before."""
    pytest.importorskip("triton")
    from moerunner.backends.triton import tune as search
    from moerunner.cli import tune as cli_tune

    assert cli_tune._preset_names() == sorted(search.PRESETS)
    args = cli_tune.build_parser().parse_args(["--preset", "gpt-oss-120b"])
    assert cli_tune._shapes(None, args) == [("gpt-oss-120b", search.PRESETS["gpt-oss-120b"])]


# -- 6: Ctrl-C ---------------------------------------------------------------------------------


def test_ctrl_c_in_tune_backends_keeps_the_finished_shapes(tmp_path):
    """The table was written after the whole loop: Ctrl-C in the second shape lost the first,
    with a traceback. SIGINT here goes once the first shape's entry is on disk; the second
    shape times T=2048 for at least a second, so it is still running."""
    table = tmp_path / "cache" / "moerunner" / "backends" / bt.table_file_name("cpu")
    argv = [
        "tune", "--shape", "4,32,32,2", "--shape", "8,512,512,2", "--schemes", "fp32",
        "--backends", "torch", "--device", "cpu", "--tokens", "1,2048", "--min-time", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerunner", *argv],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Python turns SIGINT into KeyboardInterrupt unless it starts with SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not table.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert lines[-1] == (
        f"moerunner tune: interrupted; 1 of 2 shape/scheme entries saved in {table}"
    ), err
    bt.load_table_file.cache_clear()
    entries = bt.load_table_file(str(table)).entries
    assert [key.num_experts for key in entries] == [4]


def test_ctrl_c_ends_any_command_with_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C printed a traceback of wherever it hit and exited killed by SIGINT."""
    import moerunner.cli.info as info

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "default_registry", interrupted)
    code, out, err = _no_interrupt(["info"], capsys)
    assert code == 130 and out == ""
    assert err == "moerunner info: interrupted\n"


def test_ctrl_c_in_tile_tuning_says_which_files_were_written(tmp_path, capsys, monkeypatch):
    pytest.importorskip("triton")
    import torch

    from moerunner.backends.triton import tune as search

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: FAKE_GPU)
    calls = []

    def tune_preset(*args, **kwargs):  # the second search is interrupted
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return tmp_path / "first.json", {}

    monkeypatch.setattr(search, "tune_preset", tune_preset)
    argv = ["tune", "--shape", "8,4096,1024,2", "--schemes", "bf16,fp8_block", "--tokens", "1"]
    code, out, err = _no_interrupt([*argv, "--out-dir", str(tmp_path)], capsys)
    assert code == 130 and f"wrote {tmp_path / 'first.json'}" in out
    assert err == f"moerunner tune: interrupted; 1 of 2 tile files written to {tmp_path}\n"


def test_an_interrupted_write_leaves_the_earlier_file(tmp_path):
    """Files were written in place: an interrupted write left a truncated file, which the
    next run refused ("it is not JSON"). A write that fails midway now leaves the old file
    whole, and no temporary file."""
    from moerunner.device_files import write_text_atomic

    path = tmp_path / "table.json"
    path.write_text('{"old": 1}\n')
    with pytest.raises(UnicodeEncodeError):  # fails after the first 100 kB are written
        write_text_atomic(path, "x" * 100_000 + "\ud800")
    assert path.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]
    assert write_text_atomic(tmp_path / "new" / "f.json", "new\n").read_text() == "new\n"


def test_table_tile_and_json_writers_replace_the_file_whole(tmp_path):
    """Each writer (backend table, tile file, ``--json``) renames a whole new file over the
    old one: a reader that opened the old file reads it whole, never a truncated or
    half-written one."""
    from moerunner.cli import _common

    tile_config = _tile_config()
    tiles = tile_config.MoeTiles(
        tile_config.TileConfig(16, 32, 64), tile_config.TileConfig(16, 64, 32)
    )
    writers = {
        "t.json": lambda p: bt.BackendTable("cpu").write(p),
        "f.json": lambda p: tile_config.write_config_file(p, 8, 64, 32, "bf16", "G", {1: tiles}),
        "j.json": lambda p: _common.write_json(p, {"schema": "x/1"}),
    }
    for name, write in writers.items():
        path = tmp_path / name
        path.write_text("old, complete\n")
        with open(path) as reader:
            write(path)
            assert reader.read() == "old, complete\n", name
        json.loads(path.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(writers)


# -- 8: malformed tile files ------------------------------------------------------------------

TILE = {"block_m": 16, "block_n": 64, "block_k": 64, "group_m": 1, "num_warps": 4,
        "num_stages": 3}  # fmt: skip
ENTRY = {"gemm1": TILE, "gemm2": TILE}
KEY = {"E": 8, "N": 96, "K": 64, "scheme": "bf16", "device": FAKE_GPU}


def _tile_config():
    pytest.importorskip("triton")
    from moerunner.backends.triton import tile_config

    return tile_config


def _tile_path(folder: Path) -> Path:
    return folder / _tile_config().config_file_name(8, 96, 64, "bf16", FAKE_GPU)


def _find(folder):
    return _tile_config().find_tiles(8, 96, 64, "bf16", FAKE_GPU, tile_dirs=[folder])


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"key": None}, "'key' is missing or not an object"),
        ({"key": "whatever"}, "'key' is missing or not an object"),
        ({"by_tokens": {"1": ENTRY, "01": ENTRY}}, "token counts '1' and '01' are the same"),
        ({"by_tokens": {"\u00b2": ENTRY}}, "token count '\u00b2' is not a positive integer"),
        ({"by_tokens": {"1": {**ENTRY, "gemm2": {**TILE, "num_stages": 1000}}}}, "num_stages"),
        ({"by_tokens": {"1": {**ENTRY, "gemm1": {**TILE, "group_m": 10**9}}}}, "group_m"),
        ({"by_tokens": {}}, "'by_tokens' holds no token counts"),
    ],
)
def test_a_malformed_tile_file_is_refused_naming_it(tmp_path, change, why):
    """Before: no or a non-object key, "1" and "01", absurd stages and groups and an empty
    table were used (or silently skipped); "²" raised a bare ValueError without the file."""
    doc = {"schema": _tile_config().SCHEMA, "key": KEY, "by_tokens": {"1": ENTRY}, **change}
    if doc["key"] is None:
        del doc["key"]
    path = _tile_path(tmp_path)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not a usable moerunner tile file") as info:
        _find(tmp_path)
    assert str(path) in str(info.value) and why in str(info.value)
    if why in ("num_stages", "group_m"):
        assert f"{why} must be a positive int up to" in str(info.value)


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_a_folder_or_dangling_link_at_a_tile_file_warns(tmp_path, kind):
    """Both were passed over without a word, the default tiles answering."""
    path = _tile_path(tmp_path)
    if kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "gone.json")
    with pytest.warns(RuntimeWarning, match="ignoring the tile file") as seen:
        source = _find(tmp_path)
    assert source.path is None and str(path) in str(seen[0].message)


@pytest.mark.parametrize("kind", ["file", "missing folder"])
def test_tile_dirs_naming_a_file_or_a_missing_folder_warns(tmp_path, kind):
    """A mistyped ``tile_dirs`` dropped the user's tuned tiles without a word."""
    from moerunner.backends.triton import TritonOptions

    folder = tmp_path / ("notes.txt" if kind == "file" else "no-such-folder")
    if kind == "file":
        folder.write_text("notes\n")
    options = TritonOptions(tile_dirs=str(folder))
    why = "is not a folder" if kind == "file" else "does not exist"
    with pytest.warns(RuntimeWarning, match=re.escape(f"tile_dirs entry '{folder}' {why}")):
        source = _tile_config().find_tiles(8, 96, 64, "bf16", FAKE_GPU, tile_dirs=options.tile_dirs)
    assert source.path is None


# -- 8: malformed backend tables -----------------------------------------------------------

KEY_FIELDS = dict(
    dtype="float32", w13_scheme="fp32", w2_scheme="fp32", activation="silu", num_experts=8,
    hidden_size=64, intermediate_size=96, top_k=2,
)  # fmt: skip


def _table_file(folder: Path, *buckets: dict) -> Path:
    doc = {"schema": bt.SCHEMA, "device": "cpu",
           "entries": [{"key": KEY_FIELDS, "buckets": list(buckets)}]}  # fmt: skip
    path = folder / bt.table_file_name("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))  # inf as Infinity, as Python's json reads it
    return path


def _bucket(top=None, tokens=1, backend="torch", **times) -> dict:
    return {"max_tokens": top, "tokens": tokens, "backend": backend,
            "times_us": times or {"torch": 1.0}}  # fmt: skip


@pytest.mark.parametrize(
    ("buckets", "why"),
    [
        ([{**_bucket(), "time_us": {"torch": 1.0}}], "buckets[0]: unknown field(s) ['time_us']"),
        ([_bucket(4, 1000), _bucket()], "buckets[0].tokens: 1000 is outside its bucket (T 0-4)"),
        ([_bucket(torch=float("inf"))], "buckets[0].times_us: must map backend names to positive"),
        ([_bucket(4, 1), _bucket(None, 3)], "buckets[1].tokens: 3 is outside its bucket (T >= 5)"),
    ],
)
def test_a_malformed_bucket_is_refused_naming_the_file_and_field(tmp_path, buckets, why):
    """Before: a typo'd field was dropped, a measured count outside its bucket and an infinite
    time were read ("inf us" in ``moerunner info``)."""
    path = _table_file(tmp_path, *buckets)
    with pytest.raises(BackendTableError) as info:
        bt.load_table_file(str(path))
    assert str(info.value).startswith(f"{path}: entries[0].") and why in str(info.value)


def test_a_winner_slower_than_its_own_times_warns(tmp_path):
    """A winner that is not the fastest of its bucket's times is read as the file says (it
    may be a hand-made choice, and refusing it would drop the whole table) but not in
    silence: the times or the winner were edited."""
    path = _table_file(tmp_path, _bucket(torch=100.0, triton=5.0))
    with pytest.warns(RuntimeWarning, match="'torch' is not the fastest") as seen:
        table = bt.load_table_file(str(path))
    assert f"{path}: entries[0].buckets[0].backend" in str(seen[0].message)
    assert [b.backend for b in table.entries[next(iter(table.entries))]] == ["torch"]


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_a_folder_or_dangling_link_at_the_user_table_is_reported(cache_home, capsys, kind):
    """Both were ignored without a word by ``info`` and at runtime; with a dangling link
    ``tune --backends`` measured everything, then failed to write (exit status 1)."""
    path = cache_home / bt.table_file_name("cpu")
    cache_home.mkdir(parents=True)
    if kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(cache_home / "gone" / "table.json")
    with pytest.raises(BackendTableError, match=f"^{re.escape(str(path))}: "):
        bt.load_table_file(str(path))
    with pytest.warns(RuntimeWarning, match="ignoring the user backend table"):
        assert bt.default_table("cpu").paths == ()
    code, out, _ = run(["info"], capsys)
    assert code == 0 and f"  error: {path}: " in out
    if kind == "dangling link":  # refused before any timing
        argv = ["tune", "--shape", "8,64,96,2", "--schemes", "fp32", "--backends", "torch"]
        code, out, err = run([*argv, "--device", "cpu", "--tokens", "1"], capsys)
        assert "exists and is not a moerunner backend table" in usage_error(code, err, "tune")
        assert out == "" and path.is_symlink()


# -- 9: a relative XDG_CACHE_HOME ---------------------------------------------------------------


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """It was taken relative to the working folder: a table written from one folder was not
    found from another. The XDG spec says to ignore relative values."""
    from moerunner.device_files import user_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert user_cache_dir() == tmp_path / ".cache" / "moerunner"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "abs"))
    assert user_cache_dir() == tmp_path / "abs" / "moerunner"


def test_tune_merge_names_the_file_of_a_non_ascii_token_count(tmp_path):
    """A tuned file whose recorded timings use a token count like "²" (str.isdigit takes
    it, int() does not) is refused naming the file, not by a bare ValueError from int()."""
    pytest.importorskip("triton")
    from moerunner.backends.triton import tune

    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"measured": {"gemm_ms": {"²": 1.0}}}))
    with pytest.raises(ValueError, match="tiles.json"):
        tune._measured_ms(path)
