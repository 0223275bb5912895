"""The example scripts run as their docstrings say, on the CPU (torch backend)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _generate_main():
    return runpy.run_path(str(ROOT / "examples" / "generate.py"))["main"]


def test_generate_tiny_agrees_with_eager(capsys):
    _generate_main()(["--tiny", "qwen3_moe", "--new-tokens", "3", "--device", "cpu"])
    assert "same tokens: True" in capsys.readouterr().out


def test_generate_from_a_folder_without_tokenizer(tmp_path, capsys):
    # A checkpoint saved from a config (docs/transformers.md's tiny-qwen3-moe) has no
    # tokenizer files: the example runs on random prompt ids instead of failing inside
    # generate on an empty prompt.
    pytest.importorskip("accelerate")  # device_map=
    from transformers import AutoModelForCausalLM

    from moerunner.integrations.tiny_models import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--new-tokens", "3", "--device", "cpu"]
    argv += ["--dtype", "float32"]
    _generate_main()(argv)
    out = capsys.readouterr().out
    assert "random" in out and "same tokens: True" in out
