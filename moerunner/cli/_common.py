"""The flag vocabulary every subcommand shares, and its checks.

- Lists are comma-separated (``--tokens 1,16,64``, ``--schemes bf16,fp8_block``).
- A shape is ``--shape E,H,I,K`` (experts, hidden, intermediate, top-k).
- ``--json PATH`` writes the machine-readable result (``-``: to stdout, instead of the table).
- ``--device`` is checked before any work: unknown names and devices this machine lacks are
  usage errors.
- Usage errors print one line, ``moerunner <command>: error: <what>``, and exit with status 2.
  Ints are at most ``MAX_INT`` (int32; seeds ``MAX_SEED``). An error once the work has
  started (a write that fails after all, sizes past this machine's memory) prints one such
  line and exits with status 1, and Ctrl-C one line and status 130 (``moerunner.cli.main``).
- An output file is only written where an output flag points, and never over a file other
  than an earlier output of the same flag's kind (a JSON output: a record of the same schema;
  checked before the work starts). Only JSON outputs take ``-`` for stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

STDOUT = "-"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str):  # noqa: D401  (argparse's hook)
        message = " ".join(str(message).split())
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def parser(command: str, doc: str | None, **kw) -> Parser:
    """A subcommand's parser, with ``--version``."""
    from .. import __version__

    p = Parser(prog=f"moerunner {command}", description=doc, **kw)
    p.add_argument("--version", action="version", version=f"moerunner {__version__}")
    return p


def deprecated(p: argparse.ArgumentParser, old: str, new: str) -> None:
    """Warn (one line on stderr) that flag ``old`` is a deprecated alias of ``new``."""
    sys.stderr.write(f"{p.prog}: warning: {old} is deprecated, use {new}\n")


class ListError(argparse.ArgumentTypeError, ValueError):
    """A malformed comma-separated list: argparse prints the message as it is; code that
    parses lists after argparse catches it as a ValueError."""


def csv(text: str) -> list[str]:
    """``"a,b, c"`` -> ``["a", "b", "c"]``; ``""`` -> ``[]``. An empty item (``"a,,b"``,
    ``"a,"``, ``",a"``) raises ``ListError``: a stray comma is a typo, not a request."""
    text = str(text)
    if not text.strip():
        return []
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ListError(f"empty item in the comma-separated list {text!r}")
    return parts


#: The largest count or size a flag takes (tokens, experts, H, I...): int32, the kernels'
#: index type; seeds may use 63 bits.
MAX_INT = 2**31 - 1
MAX_SEED = 2**63 - 1


def int_type(minimum: int, what: str = "int", maximum: int = MAX_INT) -> Callable[[str], int]:
    """argparse type: an int in [``minimum``, ``maximum``]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected an int <= {maximum}, got {value}")
        return value

    parse.__name__ = what
    return parse


def float_type(minimum: float, *, strict: bool = False) -> Callable[[str], float]:
    """argparse type: a finite float >= ``minimum`` (> with ``strict``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad = value != value or value in (float("inf"), float("-inf"))
        bad = bad or (value <= minimum if strict else value < minimum)
        if bad:
            raise argparse.ArgumentTypeError(
                f"expected a number {'>' if strict else '>='} {minimum:g}, got {text!r}"
            )
        return value

    parse.__name__ = "number"
    return parse


def int_list(minimum: int) -> Callable[[str], tuple[int, ...]]:
    """argparse type: comma-separated ints, each >= ``minimum`` (a repeated one once)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(dict.fromkeys(int(p) for p in csv(text)))  # repeats: once
        except ListError:
            raise
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints, got {text!r}"
            ) from None
        if not values or any(v < minimum or v > MAX_INT for v in values):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints in [{minimum}, {MAX_INT}], got {text!r}"
            )
        return values

    parse.__name__ = "int list"
    return parse


def name_list(accepted: Callable[[], list[str]] | list[str] | None = None, what: str = "name"):
    """argparse type: comma-separated names, each one of ``accepted`` (when given)."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(csv(text)))
        if not names:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}s, got {text!r}")
        if accepted is not None:
            known = list(accepted() if callable(accepted) else accepted)
            unknown = [n for n in names if n not in known]
            if unknown:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {', '.join(map(repr, unknown))}; accepted: {', '.join(known)}"
                )
        return names

    parse.__name__ = f"{what} list"
    return parse


def path_type(text: str) -> Path:
    """argparse type of an output file: a non-empty path naming a file (not ``.``, ``..``, a
    root or a path ending in a separator); ``-`` passes (stdout, where the flag takes it)."""
    text = str(text)
    if text == STDOUT:
        return Path(text)
    name = Path(text).name
    if not text.strip() or text.endswith(("/", os.sep)) or name in ("", ".", ".."):
        raise argparse.ArgumentTypeError(f"expected the path of a file, got {text!r}")
    return Path(text)


path_type.__name__ = "file path"


def dir_type(text: str) -> Path:
    """argparse type of an output folder: a non-empty path."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    return Path(text)


dir_type.__name__ = "folder"


def shape_type(text: str) -> tuple[int, int, int, int]:
    """argparse type: ``E,H,I,K`` (experts, hidden, intermediate, top-k), all positive."""
    try:
        values = tuple(int(p) for p in csv(text))
    except ValueError:
        values = ()
    if len(values) != 4 or any(v < 1 or v > MAX_INT for v in values):
        raise argparse.ArgumentTypeError(
            f"expected four positive ints E,H,I,K (at most {MAX_INT} each), got {text!r}"
        )
    e, h, i, k = values
    if k > e:
        raise argparse.ArgumentTypeError(f"top-k {k} is more than the {e} experts in {text!r}")
    return e, h, i, k


def scheme_names() -> list[str]:
    from ..quant import SCHEME_NAMES

    return list(SCHEME_NAMES)


def unstorable(scheme: str, shapes: list[tuple[int, int]]) -> str | None:
    """Why weights of these ``(N, K)`` shapes cannot be stored in ``scheme`` (None: they can),
    checked before any work (``quant.weight.check_storable``)."""
    from ..quant.weight import check_storable

    for n, k in shapes:
        try:
            check_storable(scheme, (1, n, k))
        except (ValueError, TypeError) as exc:
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def add_device(p: argparse.ArgumentParser, default_help: str = "cuda if available, else cpu"):
    p.add_argument("--device", default=None, help=f"cpu, cuda or cuda:N (default: {default_help})")


def resolve_device(p: argparse.ArgumentParser, text: str | None) -> torch.device:
    """``--device`` (or the default): a device this machine has, else a usage error."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        p.error(f"--device: unknown device {text!r}; accepted: cpu, cuda, cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {text}: no CUDA GPU is available here (torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            p.error(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            p.error(f"--device {text}: {device.type} is not available here")
    return device


def require_module(p: argparse.ArgumentParser, module: str, flag: str, extra: str) -> None:
    """Usage error unless ``module`` imports: ``flag`` needs it (install hint: the extra)."""
    if importlib.util.find_spec(module) is None:
        p.error(f"{flag} needs {module}, which is not installed (pip install 'moerunner[{extra}]')")


def json_output(schema: str) -> str:
    """The ``check_outputs`` kind of a JSON output whose records carry ``schema``: an
    existing file is overwritten only where it holds a record of that same schema."""
    return f"json:{schema}"


def _foreign(path: Path, kind: str) -> str | None:
    """Why the existing file ``path`` is not an earlier output of this ``kind`` (None: it is,
    and may be overwritten)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if kind.startswith("json:") or kind == "ceilings":
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "it is not JSON"
        if kind == "ceilings":  # the cache of bench.roofline: {device key: DeviceCeilings}
            from ..bench.roofline import is_ceilings_cache

            return None if is_ceilings_cache(doc) else "it is not a ceilings cache"
        want = kind[len("json:") :]
        got = doc.get("schema") if isinstance(doc, dict) else None
        if got == want:
            return None
        return f"its schema is {got!r}, not {want!r}" if got is not None else "it has no schema"
    if kind == "md":
        return None if data.startswith(b"# moerunner ") else "it is not a moerunner summary"
    if kind == "png":
        ok = data.startswith(b"\x89PNG") and b"moerunner" in data[:4096]
        return None if ok else "it is not a moerunner plot"
    raise ValueError(f"unknown output kind {kind!r}")


def check_outputs(p: argparse.ArgumentParser, outputs: dict[str, tuple[Path | None, str]]) -> None:
    """Before any work: every output path (flag -> (path, kind)) is writable here and is not
    an existing file other than an earlier output of the same kind (a JSON kind from
    ``json_output``: the same schema); no two flags share a path. ``-`` (stdout) is accepted
    for JSON kinds only."""
    seen: dict[Path, str] = {}
    for flag, (path, kind) in outputs.items():
        if path is None:
            continue
        if str(path) == STDOUT:
            if not kind.startswith("json:"):
                p.error(f"{flag} -: this flag writes a file, not stdout; give a path")
            continue
        resolved = Path(path).expanduser().resolve()
        if resolved in seen:
            p.error(f"{flag} and {seen[resolved]} name the same file {str(path)!r}")
        seen[resolved] = flag
        if resolved.exists():
            if not resolved.is_file():
                p.error(f"{flag} {path}: exists and is not a file")
            why = _foreign(resolved, kind)
            if why is not None:
                p.error(
                    f"{flag} {path}: refusing to overwrite it: {why} (it is not an "
                    f"earlier output of {flag}; remove it or choose another path)"
                )
            try:  # opened for appending, nothing written: fails where a write would
                with open(resolved, "ab"):
                    pass
            except OSError as exc:
                p.error(f"{flag} {path}: cannot be written here ({exc.strerror or exc})")
        else:
            check_writable_dir(p, flag, resolved.parent, shown=path)


def check_writable_dir(
    p: argparse.ArgumentParser, flag: str, folder: Path, shown: Path | None = None
) -> None:
    """Before any work: ``folder`` is, or can be created as, a writable folder here (its
    nearest existing ancestor is a writable folder); else a usage error naming ``flag`` and
    ``shown`` (default: the folder)."""
    shown = folder if shown is None else shown
    folder = Path(folder).expanduser().absolute()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        p.error(f"{flag} {shown}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        p.error(f"{flag} {shown}: {existing} is not writable here")
    try:  # a file made and removed: permission bits pass root, or a folder of /proc
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        p.error(f"{flag} {shown}: {existing} is not writable here ({exc.strerror or exc})")


def write_json(path: str | Path, record: dict) -> None:
    """``--json``: the record to a file (whole or not at all: an interrupted write leaves the
    earlier output, which the next run may overwrite, not a truncated file it refuses), or to
    stdout for ``-``."""
    from ..bench.report import json_text
    from ..device_files import write_text_atomic

    text = json_text(record)
    if str(path) == STDOUT:
        sys.stdout.write(text + "\n")
        return
    write_text_atomic(path, text + "\n")
