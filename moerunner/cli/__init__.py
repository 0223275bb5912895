"""Command line: ``moerunner {info,demo,check,bench,tune} [options]``.

Each subcommand lives in its own module with a ``main(argv) -> int``; Ctrl-C ends any of them
with one line and exit status 130 (a command that saved part of its work raises
``KeyboardInterrupt("what was saved")`` again, and that line says so). This is the edge of the
program: configuration (flags, and environment where a subcommand documents it) is read here
and travels into the library as arguments. The flag vocabulary the subcommands share (comma
lists, ``--shape E,H,I,K``, ``--json``, ``--device``, usage errors) is in ``_common``.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "info": ("moerunner.cli.info", "each backend: available here?, what it supports, why not"),
    "demo": (
        "moerunner.cli.demo",
        "run a mid-size MoE on every available backend vs the reference",
    ),
    "check": ("moerunner.cli.check", "error of each backend and scheme against the reference"),
    "bench": ("moerunner.cli.bench", "benchmark backends and baselines against the roofline"),
    "tune": (
        "moerunner.cli.tune",
        "search Triton tile configs on this GPU, or measure backends (--backends, CPU too)",
    ),
}


def _usage() -> str:
    lines = ["usage: moerunner [-V | --version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<6} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n'moerunner <command> --help' shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moerunner`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"moerunner {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        if name.startswith("-"):
            problem = f"option {name!r} before the command; options follow it"
        else:
            problem = f"unknown command {name!r}"
        print(
            f"moerunner: error: {problem}; commands: {', '.join(SUBCOMMANDS)} "
            "(see 'moerunner --help')",
            file=sys.stderr,
        )
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, not a traceback of wherever it hit
        # A command that saved part of its work says what, in the interrupt it raises again.
        saved = f"; {exc}" if str(exc) else ""
        print(f"moerunner {name}: interrupted{saved}", file=sys.stderr)
        return 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped
    except OSError as exc:  # an output that could not be written after all, a full disk...
        problem = f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else "")
    except RuntimeError as exc:  # torch's allocation failures: sizes past this machine
        if not _out_of_memory(exc):
            raise
        problem = f"out of memory ({str(exc).splitlines()[0][:200]}); try smaller sizes"
    print(f"moerunner {name}: error: {problem}", file=sys.stderr)
    return 1


def _out_of_memory(exc: RuntimeError) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text
