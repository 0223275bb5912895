"""Measured backend choice per token-count bucket: the table format and files, the choice
``backend="auto"`` makes from it (memoised, falling back where the winner cannot serve), the
prepared forms it needs, and the CLI that writes and prints it."""

from __future__ import annotations

import json
import logging
import os
import warnings

import pytest
import torch
from cases import TOLERANCE, Case

import moerunner
from moerunner import backend_table as bt
from moerunner.backend_table import BackendTable, BackendTableError, Bucket, ShapeKey
from moerunner.backends.base import MoeProblem
from moerunner.backends.torch_native import TorchBackend
from moerunner.runner import MoeRunner, form_bytes, prepare_forms, prepared_for
from moerunner.testing import assert_close

# -- helpers ---------------------------------------------------------------------------------


class CopyingTorch(TorchBackend):
    """The torch backend under another name, holding a copy of w13 in its prepared form (a
    form with memory of its own) and recording every call of its fused op."""

    def __init__(self, name: str, calls: list, serves_fp32: bool = True) -> None:
        super().__init__()
        self.name = name
        base = self.fused_ops["standard"]

        def fused(dispatch_output, prepared, **kw):
            calls.append((name, dispatch_output.num_tokens))
            return base(dispatch_output, prepared, **kw)

        self.fused_ops = {"standard": fused}
        self.serves_fp32 = serves_fp32

    def supports(self, problem):
        if not self.serves_fp32 and problem.dtype == torch.float32:
            return False, "fp32 not served (test)"
        return super().supports(problem)

    def prepare_weights(self, weights, spec):
        prepared = super().prepare_weights(weights, spec)
        prepared.tensors["w13_copy"] = weights.w13.clone()
        return prepared


def _registry(calls: list, b_serves: bool = True) -> moerunner.Registry:
    """torch, plus ``a`` and ``b``: torch variants that count their calls."""
    registry = moerunner.default_registry().copy()
    registry.register_backend(CopyingTorch("a", calls))
    registry.register_backend(CopyingTorch("b", calls, serves_fp32=b_serves))
    return registry


def _problem(case: Case, dtype=torch.float32):
    x, weights, tw, ids = case.build(dtype)
    spec = weights.spec(moerunner.Activation(case.activation))
    return x, weights, tw, ids, spec, MoeProblem.of(x, weights, spec, "standard")


def _buckets(*winners: tuple[int | None, str, dict]) -> tuple[Bucket, ...]:
    return tuple(Bucket(top, top or 4096, name, times) for top, name, times in winners)


# decode (T <= 4) won by a, the middle by b, prefill by a again
PLAN = _buckets(
    (4, "a", {"a": 10.0, "b": 12.0}),
    (64, "b", {"a": 30.0, "b": 20.0}),
    (None, "a", {"a": 100.0, "b": 150.0, "torch": 400.0}),
)


def _table(problem: MoeProblem, top_k: int, buckets=PLAN) -> BackendTable:
    return BackendTable("cpu", {ShapeKey.of(problem, top_k): buckets})


# -- the table and its files -----------------------------------------------------------------


def test_round_trip_through_a_file(tmp_path):
    *_, problem = _problem(Case("rt"))
    table = _table(problem, 2)
    path = table.write(tmp_path / bt.table_file_name("cpu"))
    loaded = bt.load_table_file(str(path))
    assert loaded.device == "cpu" and loaded.paths == (path,)
    assert dict(loaded.entries) == dict(table.entries)
    assert json.loads(path.read_text())["schema"] == bt.SCHEMA


@pytest.mark.parametrize(
    ("tokens", "winner", "top"),
    [
        (0, "a", 4),
        (1, "a", 4),
        (4, "a", 4),
        (5, "b", 64),
        (64, "b", 64),
        (65, "a", None),
        (10**6, "a", None),
    ],
)
def test_lookup_by_bucket(tokens, winner, top):
    *_, problem = _problem(Case("lk"))
    table = _table(problem, 2)
    bucket = table.bucket_of(ShapeKey.of(problem, 2), tokens)
    assert (bucket.backend, bucket.max_tokens) == (winner, top)
    assert table.bucket_of(ShapeKey.of(problem, 3), tokens) is None  # another top-k: no entry


def test_user_file_overrides_shipped(tmp_path, monkeypatch):
    *_, problem = _problem(Case("uo"))
    *_, other = _problem(Case("uo2", hidden=16))
    shipped, user = tmp_path / "shipped", tmp_path / "cache"
    monkeypatch.setattr(bt, "SHIPPED_DIR", shipped)
    monkeypatch.setenv("XDG_CACHE_HOME", str(user))
    name = bt.table_file_name("cpu")
    only_b = _buckets((None, "b", {"b": 1.0}))
    BackendTable("cpu", {ShapeKey.of(problem, 2): PLAN, ShapeKey.of(other, 2): only_b}).write(
        shipped / name
    )
    BackendTable("cpu", {ShapeKey.of(problem, 2): only_b}).write(bt.user_table_dir() / name)
    table = bt.find_table("cpu")
    assert table.paths == (bt.user_table_dir() / name, shipped / name)
    assert table.buckets(ShapeKey.of(problem, 2)) == only_b  # the user's entry wins
    assert table.buckets(ShapeKey.of(other, 2)) == only_b  # the shipped one still applies
    bt.default_table.cache_clear()
    try:
        assert bt.default_table("cpu").buckets(ShapeKey.of(problem, 2)) == only_b
    finally:
        bt.default_table.cache_clear()


def _valid_doc() -> dict:
    *_, problem = _problem(Case("mf"))
    return _table(problem, 2).to_dict()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(schema="moerunner.backend_table/0"), "'schema'"),
        (lambda d: d.pop("device"), "'device'"),
        (lambda d: d.update(entries={}), "'entries'"),
        (lambda d: d["entries"][0].pop("buckets"), "entries[0]"),
        (lambda d: d["entries"][0]["key"].pop("num_experts"), "entries[0].key.num_experts"),
        (lambda d: d["entries"][0]["key"].update(top_k="2"), "entries[0].key.top_k"),
        (lambda d: d["entries"][0]["key"].update(colour=1), "entries[0].key"),
        (lambda d: d["entries"][0]["buckets"][0].update(backend=""), "buckets[0].backend"),
        (lambda d: d["entries"][0]["buckets"][1].update(max_tokens=2), "buckets[1].max_tokens"),
        (lambda d: d["entries"][0]["buckets"][2].update(max_tokens=999), "buckets[2].max_tokens"),
        (lambda d: d["entries"][0]["buckets"][0].update(times_us={"a": -1}), "times_us"),
        (lambda d: d["entries"][0].update(buckets=[]), "buckets"),
        (lambda d: d["entries"].append(d["entries"][0]), "entries[1].key"),
    ],
)
def test_malformed_files_name_the_file_and_the_field(tmp_path, edit, field):
    doc = _valid_doc()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(BackendTableError) as err:
        bt.load_table_file(str(path))
    assert str(path) in str(err.value) and field in str(err.value)


def test_a_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(BackendTableError, match="bad.json: not valid JSON"):
        bt.load_table_file(str(path))
    assert bt.load_table_file(str(tmp_path / "absent.json")) is None


# -- the choice ------------------------------------------------------------------------------


def test_auto_takes_the_measured_winner_per_bucket_and_the_result_is_right():
    calls: list = []
    registry = _registry(calls)
    x, weights, tw, ids, spec, problem = _problem(Case("win", tokens=70))
    runner = MoeRunner(registry=registry, table=_table(problem, 2))
    for tokens, winner in ((1, "a"), (4, "a"), (5, "b"), (64, "b"), (65, "a"), (70, "a")):
        calls.clear()
        out = moerunner.api.run_experts(
            runner, weights, x[:tokens], tw[:tokens], ids[:tokens], moerunner.Activation("silu")
        )
        assert calls == [(winner, tokens)] and runner.backend == winner
        ref = moerunner.reference_moe(x[:tokens], weights, tw[:tokens], ids[:tokens])
        assert_close(out, ref, TOLERANCE[torch.float32])
    reason = runner.select(problem, 10, 2).reason
    assert reason == "T 5-64: measured: b 20 us vs a 30 us"


def test_the_plan_says_which_backend_serves_each_run_of_buckets(caplog):
    registry = _registry([])
    *_, problem = _problem(Case("summary", tokens=70))
    with caplog.at_level(logging.DEBUG, logger="moerunner"):
        plan = MoeRunner(registry=registry, table=_table(problem, 2)).bucket_plan(problem, 2)
    summary = "T <= 4: a; 4 < T <= 64: b; T > 64: a"
    assert plan.summary() == summary
    assert any(summary in r.getMessage() for r in caplog.records)  # logged once, when made
    one = MoeRunner(registry=registry, table=_table(problem, 2), backend_forms=1)
    assert one.bucket_plan(problem, 2).summary() == "every T: a"
    table = _table(problem, 2)
    MoeRunner(registry=registry, table=table).bucket_plan(problem, 2)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="moerunner"):
        MoeRunner(registry=registry, table=table).bucket_plan(problem, 2)
        assert not caplog.records  # memoised: made and logged once
        registry.forget_choices()
        MoeRunner(registry=registry, table=table).bucket_plan(problem, 2)
    assert any(summary in r.getMessage() for r in caplog.records)  # chosen again


def test_no_table_entry_takes_the_preference_order():
    calls: list = []
    registry = _registry(calls)
    *_, problem = _problem(Case("pref"))
    runner = MoeRunner(registry=registry, table=_table(problem, 3), preference={"cpu": ("b",)})
    assert runner.select(problem, 1, 2).backend.name == "b"  # top-k 2 has no entry
    assert runner.bucket_plan(problem, 2) is None
    named = MoeRunner("a", registry=registry, table=_table(problem, 2))
    assert named.select(problem, 10, 2).backend.name == "a"  # a named backend ignores tables


def test_a_winner_that_cannot_serve_falls_back():
    calls: list = []
    registry = _registry(calls, b_serves=False)  # b rejects fp32
    *_, problem = _problem(Case("fb"))
    runner = MoeRunner(registry=registry, table=_table(problem, 2))
    chosen = runner.select(problem, 10, 2)
    assert chosen.backend.name == "a"  # the fastest measured one that serves
    assert "measured winner 'b' cannot serve (fp32 not served (test))" in chosen.reason
    # a winner that is not registered, with no serving backend measured: the preference order
    table = _table(problem, 2, _buckets((None, "gone", {"gone": 1.0})))
    runner = MoeRunner(registry=registry, table=table, preference={"cpu": ("torch",)})
    chosen = runner.select(problem, 10, 2)
    assert (
        chosen.backend.name == "torch" and "'gone' cannot serve (not registered)" in chosen.reason
    )


def test_auto_passes_over_a_backend_that_is_not_ready_and_a_named_call_takes_it():
    """A backend whose first call would build kernels for minutes (``Backend.ready`` False,
    as flashinfer without its module built) serves no ``auto`` choice, neither from the
    preference order nor as a table's winner; named, it serves (and would build)."""
    calls: list = []
    registry = _registry(calls)
    slow = registry.backends["b"]
    slow.ready = lambda: (False, "kernels not built (test)")
    x, weights, tw, ids, spec, problem = _problem(Case("ready", tokens=10))
    runner = MoeRunner(registry=registry, table=_table(problem, 2))
    chosen = runner.select(problem, 10, 2)  # b's bucket in the table
    assert chosen.backend.name == "a"
    assert "measured winner 'b' cannot serve (not ready for 'auto': kernels not built" in (
        chosen.reason
    )
    pref = MoeRunner(registry=registry, preference={"cpu": ("b", "a")}, table=BackendTable("none"))
    assert pref.select(problem, 10, 2).backend.name == "a"
    named = MoeRunner("b", registry=registry)
    assert named.select(problem, 10, 2).backend.name == "b"
    out = moerunner.api.run_experts(named, weights, x, tw, ids, moerunner.Activation("silu"))
    assert calls[-1] == ("b", 10)
    ref = moerunner.reference_moe(x, weights, tw, ids)
    assert_close(out, ref, TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    ("buckets", "kept"),
    [
        (PLAN, "a"),  # a wins two buckets of three
        (_buckets((8, "b", {"a": 2.0, "b": 1.0}), (None, "a", {"a": 1.0, "b": 2.0})), "b"),
    ],
)
def test_one_form_serves_every_bucket(buckets, kept):
    calls: list = []
    registry = _registry(calls)
    x, weights, tw, ids, spec, problem = _problem(Case("one", tokens=70))
    runner = MoeRunner(registry=registry, table=_table(problem, 2, buckets), backend_forms=1)
    plan = runner.bucket_plan(problem, 2)
    assert plan.forms == (kept,)  # most buckets won; a tie goes to the decode buckets' winner
    forms = prepare_forms(runner, weights, problem, spec, 2)
    assert list(forms) == [kept]
    for tokens in (1, 10, 70):
        assert runner.select(problem, tokens, 2).backend.name == kept
    two = MoeRunner(registry=registry, table=_table(problem, 2, buckets))
    assert sorted(prepare_forms(two, weights, problem, spec, 2)) == ["a", "b"]


def test_backend_forms_is_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="backend_forms"):
            MoeRunner(backend_forms=bad)
    with pytest.raises(TypeError, match="table must be a BackendTable"):
        MoeRunner(table={"a": 1})


def test_selection_is_memoised_without_per_call_table_work(monkeypatch):
    calls: list = []
    registry = _registry(calls)
    x, weights, tw, ids, spec, problem = _problem(Case("memo", tokens=70))
    table = _table(problem, 2)
    lookups = []
    original = BackendTable.buckets
    monkeypatch.setattr(
        BackendTable, "buckets", lambda self, key: lookups.append(key) or original(self, key)
    )
    runner = MoeRunner(registry=registry, table=table)
    for _ in range(3):
        for tokens in (1, 10, 70):
            prepared_for(runner, weights, problem, spec, tokens, 2)
    assert len(lookups) == 1  # one table lookup for the problem, whatever the calls
    registry.register_backend(CopyingTorch("c", calls))  # the registry changed: plan again
    runner.select(problem, 1, 2)
    assert len(lookups) == 2


def test_two_forms_hold_their_own_memory_and_are_prepared_once():
    calls: list = []
    registry = _registry(calls)
    x, weights, tw, ids, spec, problem = _problem(Case("mem", tokens=70))
    runner = MoeRunner(registry=registry, table=_table(problem, 2))
    forms = prepare_forms(runner, weights, problem, spec, 2)
    w13_bytes = weights.w13.numel() * weights.w13.element_size()
    assert {n: form_bytes(p, weights) for n, p in forms.items()} == {"a": w13_bytes, "b": w13_bytes}
    assert prepared_for(runner, weights, problem, spec, 1, 2) is forms["a"]
    assert prepared_for(runner, weights, problem, spec, 10, 2) is forms["b"]


# -- the layer -------------------------------------------------------------------------------


def _layer(calls, backend_forms=None):
    registry = _registry(calls)
    config = moerunner.MoeConfig(num_experts=4, hidden_size=32, intermediate_size=24, top_k=2)
    torch.manual_seed(0)
    layer = moerunner.MoE(config, registry=registry, backend_forms=backend_forms)
    x, _, _, _, _, _ = _problem(Case("layer"))
    spec = layer.expert_weights().spec(config.activation)
    problem = MoeProblem.of(x, layer.expert_weights(), spec, "standard")
    layer.runner.table = _table(problem, 2)
    return layer


def test_layer_runs_each_bucket_on_its_backend_and_reports_the_plan():
    calls: list = []
    layer = _layer(calls)
    plan = layer.backend_plan(torch.float32)
    assert [b[1] for b in plan["buckets"]] == ["a", "b", "a"]
    assert plan["buckets"][1][0] == "T 5-64" and plan["buckets"][1][2].startswith("measured: b")
    w13 = layer.w13
    assert plan["forms"] == {"a": w13.numel() * 4, "b": w13.numel() * 4}
    for tokens, winner in ((3, "a"), (20, "b"), (100, "a")):
        calls.clear()
        x = torch.randn(tokens, 32)
        logits = torch.randn(tokens, 4)
        with torch.no_grad():
            out = layer(x, logits)
        assert calls == [(winner, tokens)]
        topk = moerunner.select_experts(logits, 2)
        ref = moerunner.reference_moe(x, layer.expert_weights(), topk.weights, topk.ids)
        assert_close(out, ref, TOLERANCE[torch.float32])
    one = _layer(calls, backend_forms=1)
    assert list(one.backend_plan(torch.float32)["forms"]) == ["a"]


def test_layer_step_is_made_for_the_backend_of_the_calls_bucket():
    """Steps are keyed by the call's shapes, T included, so each is made from the prepared
    weights of the backend T's bucket chose (``MoE._make_step``)."""
    calls: list = []
    layer = _layer(calls)
    made = []
    for name in ("a", "b"):
        fused = layer.runner.registry.backends[name].fused_ops["standard"]
        fused.layer_step = lambda x, logits, routing, prepared: made.append(prepared.backend)
    for tokens in (3, 20):
        x = torch.randn(tokens, 32)
        layer._make_step(("key", tokens), x, torch.randn(tokens, 4))
    assert made == ["a", "b"]


# -- the CLI ---------------------------------------------------------------------------------


def test_tune_on_cpu_between_torch_and_the_triton_interpreter_then_info(tmp_path, monkeypatch):
    """``moerunner tune --backends`` on a tiny shape with the Triton interpreter (fp32), in a
    fresh process (the interpreter is chosen at import), then ``moerunner info`` prints it."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "XDG_CACHE_HOME": str(tmp_path)}
    args = ["--shape", "4,32,32,2", "--schemes", "fp32", "--tokens", "1,16", "--device", "cpu"]
    cmd = [sys.executable, "-m", "moerunner", "tune", *args, "--backends", "--min-time", "0.01"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "moerunner" / "backends" / bt.table_file_name("cpu")
    table = bt.load_table_file(str(path))
    (key,) = table.entries
    assert (key.num_experts, key.hidden_size, key.intermediate_size, key.top_k) == (4, 32, 32, 2)
    buckets = table.entries[key]
    assert [b.tokens for b in buckets] == [1, 16] and [b.max_tokens for b in buckets] == [4, None]
    for b in buckets:
        assert set(b.times_us) == {"torch", "triton"} and b.backend == min(
            b.times_us, key=b.times_us.get
        )
    info = subprocess.run(
        [sys.executable, "-m", "moerunner", "info"], env=env, capture_output=True, text=True
    )
    assert info.returncode == 0, info.stderr
    assert "E=4 H=32 I=32 k=2 fp32 float32 silu" in info.stdout
    assert "T 0-4: " in info.stdout and "T >= 5: " in info.stdout
    assert "measured: " in info.stdout and "other shapes: no table: preference order" in info.stdout


class UntunedTorch(CopyingTorch):
    """A torch variant that, like a backend whose autotuner failed, notes at its first call
    that its kernels run untuned (``PreparedWeights.untuned``), and returns the right result."""

    def __init__(self, name: str, calls: list) -> None:
        super().__init__(name, calls)
        base = self.fused_ops["standard"]

        def fused(dispatch_output, prepared, **kw):
            if prepared.untuned() is None:
                prepared.notes.append(f"{moerunner.weights.UNTUNED_NOTE}tuning failed (test)")
            return base(dispatch_output, prepared, **kw)

        self.fused_ops = {"standard": fused}


def test_tune_leaves_out_a_backend_whose_kernels_ran_untuned():
    """A backend that ran right but untuned (its weights' note) gets rows of status
    ``untuned`` at every T, and no time of it reaches the table: the fastest tuned backend
    wins each bucket, however fast the untuned one looked."""
    from moerunner.bench.backend_choice import tune_backends
    from moerunner.bench.presets import BenchShape

    calls: list = []
    registry = _registry(calls)
    registry.register_backend(UntunedTorch("u", calls))
    shape = BenchShape("tiny", 4, 32, 32, 2)
    _, buckets, rows = tune_backends(
        shape, "fp32", (1, 16), backends=("a", "u"), device="cpu", registry=registry,
        min_time_s=0.01,
    )  # fmt: skip
    status = {(r.impl, r.tokens): r.status for r in rows}
    assert status == {("a", 1): "ok", ("a", 16): "ok", ("u", 1): "untuned", ("u", 16): "untuned"}
    assert all("tuning failed (test)" in r.note for r in rows if r.impl == "u")
    assert ("u", 1) in calls and ("u", 16) in calls  # it ran at both counts
    assert [(b.backend, set(b.times_us)) for b in buckets] == [("a", {"a"}), ("a", {"a"})]


def test_tune_cli_says_which_backend_it_left_out_as_untuned(tmp_path, capsys):
    """``moerunner tune --backends`` names a backend whose kernels ran untuned and keeps its
    times out of the table it writes."""
    from moerunner.cli import main
    from moerunner.registry import DEFAULT_REGISTRY

    calls: list = []
    added = [CopyingTorch("a", calls), UntunedTorch("u", calls)]
    for backend in added:
        DEFAULT_REGISTRY.register_backend(backend)
    try:
        code = main(
            ["tune", "--shape", "4,32,32,2", "--schemes", "fp32", "--tokens", "1,16",
             "--device", "cpu", "--backends", "a,u", "--min-time", "0.01",
             "--out-dir", str(tmp_path)]
        )  # fmt: skip
    finally:
        for backend in added:
            del DEFAULT_REGISTRY.backends[backend.name]
        DEFAULT_REGISTRY._selections.clear()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "u left out: its kernels ran untuned (tuning failed (test))" in err
    (key,) = bt.load_table_file(str(tmp_path / bt.table_file_name("cpu"))).entries.items()
    assert all(b.backend == "a" and set(b.times_us) == {"a"} for b in key[1])


def test_tune_backends_usage_errors(tmp_path, capsys):
    from moerunner.cli import tune

    with pytest.raises(SystemExit) as exit_:
        tune.main(["--shape", "4,32,32,2", "--backends", "nope", "--device", "cpu"])
    assert exit_.value.code == 2 and "unknown 'nope'" in capsys.readouterr().err
    foreign = tmp_path / bt.table_file_name("cpu")
    foreign.write_text("{}")
    with pytest.raises(SystemExit):
        tune.main(
            [
                "--shape",
                "4,32,32,2",
                "--backends",
                "torch",
                "--device",
                "cpu",
                "--out-dir",
                str(tmp_path),
            ]
        )
    assert "is not a moerunner backend table" in capsys.readouterr().err
    assert foreign.read_text() == "{}"
    if not torch.cuda.is_available():
        assert tune.main(["--shape", "4,32,32,2", "--backends"]) == 2
        assert "--device cpu" in capsys.readouterr().err


def test_info_reports_a_malformed_table(tmp_path, monkeypatch, capsys):
    from moerunner.cli import info

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = bt.user_table_dir() / bt.table_file_name("cpu")
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": "x"}')
    bt.default_table.cache_clear()
    try:
        if torch.cuda.is_available():
            pytest.skip("info reads the GPU's table here")
        assert info.main([]) == 0
    finally:
        bt.default_table.cache_clear()
    out = capsys.readouterr().out
    assert f"error: {path}: field 'schema'" in out


def test_shipped_tables_load_under_their_device_name_and_name_each_buckets_fastest():
    paths = sorted(bt.SHIPPED_DIR.glob("*.json"))
    assert paths, "no backend table ships with the package"
    for path in paths:
        table = bt.load_table_file(path)
        assert path.name == bt.table_file_name(table.device)
        assert table.entries
        for key, buckets in table.entries.items():
            for bucket in buckets:
                fastest = min(bucket.times_us, key=bucket.times_us.get)
                assert bucket.backend == fastest, (path.name, key, bucket)


class OutOfMemory(CopyingTorch):
    """A backend whose prepared form does not fit in memory (counts its attempts)."""

    def __init__(self, name: str, calls: list, attempts: list) -> None:
        super().__init__(name, calls)
        self.attempts = attempts

    def prepare_weights(self, weights, spec):
        self.attempts.append(self.name)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 60.00 GiB (test)")


def test_a_second_form_that_runs_out_of_memory_leaves_the_first_serving():
    """A table naming two backends: the second form's preparation runs out of device memory.
    ``auto`` warns once and the form already held serves those counts (right answer, no
    retry per call); a named backend, or a first form, keeps the error."""
    calls: list = []
    attempts: list = []
    registry = _registry(calls)
    registry.register_backend(OutOfMemory("b", calls, attempts), replace=True)
    x, weights, tw, ids, spec, problem = _problem(Case("oom", tokens=70))
    runner = MoeRunner(registry=registry, table=_table(problem, 2))
    act = moerunner.Activation("silu")
    run = moerunner.api.run_experts
    out = run(runner, weights, x[:2], tw[:2], ids[:2], act)  # a's bucket: a's form
    assert calls == [("a", 2)]
    with pytest.warns(RuntimeWarning, match="'b' form .* ran out of device memory .* 'a' form"):
        out = run(runner, weights, x[:10], tw[:10], ids[:10], act)  # b's bucket
    assert calls[-1] == ("a", 10) and attempts == ["b"]
    assert_close(
        out, moerunner.reference_moe(x[:10], weights, tw[:10], ids[:10]), TOLERANCE[torch.float32]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(runner, weights, x[:20], tw[:20], ids[:20], act)
    assert calls[-1] == ("a", 20) and attempts == ["b"]  # no second attempt
    with pytest.raises(torch.OutOfMemoryError):  # named: not replaced
        run(MoeRunner("b", registry=registry), weights, x[:10], tw[:10], ids[:10], act)
    fresh = Case("oom-first", tokens=70).build(torch.float32)[1]
    with pytest.raises(torch.OutOfMemoryError):  # b's form first: nothing to fall back on
        run(runner, fresh, x[:10], tw[:10], ids[:10], act)
