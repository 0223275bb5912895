"""The command line runs end to end on this machine."""

from __future__ import annotations

import pytest

from moerunner.cli import SUBCOMMANDS, main


def test_info_lists_torch_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "[torch] available" in out and "dispatch formats" in out


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
