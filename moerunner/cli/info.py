"""``moerunner info``: every registered backend, whether it runs here, what it supports, why not;
and the measured backend table of this device: per shape and token-count bucket, which backend
``backend="auto"`` takes and why."""

from __future__ import annotations

import platform

import torch

from ..device_files import device_key, hardware_name
from ..registry import verdict
from ..runner import DEFAULT_PREFERENCE, default_registry
from . import _common

SCHEMA = "moerunner-info/1"


def main(argv: list[str]) -> int:
    """Print the backends of this installation on this machine."""
    parser = _common.parser("info", __doc__)
    parser.add_argument(
        "--json",
        type=_common.path_type,
        default=None,
        help="write the result as JSON here ('-': stdout)",
    )
    args = parser.parse_args(argv)
    _common.check_outputs(parser, {"--json": (args.json, _common.json_output(SCHEMA))})
    registry = default_registry()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = hardware_name(device)
    preference = list(DEFAULT_PREFERENCE.get(device, ()))
    backends = {}
    for backend_name, backend in dict(registry.backends).items():
        # As the choice reads them: an extension whose method raises or answers something
        # else than (bool, str) is listed as unavailable, with why.
        ok, reason = verdict(backend, "available")
        ready, not_ready = verdict(backend, "ready") if ok else (False, "")
        capabilities = {
            key: list(map(str, value)) if isinstance(value, list | tuple | set) else value
            for key, value in backend.capabilities.describe().items()
        }
        backends[backend_name] = {
            "available": bool(ok),
            "reason": "" if ok else reason,
            # an available backend that `auto` passes over until its kernels are built
            "ready_for_auto": bool(ok and ready),
            "not_ready_reason": not_ready,
            "dispatch_formats": {str(f): str(p) for f, p in registry.paths(backend_name).items()},
            "capabilities": capabilities,
            "options": None if backend.options is None else repr(backend.options),
            "tile_folders": _tile_folders(backend, name) if ok else None,
        }
    table_rows, table_paths, table_error = _table(registry, device)
    if args.json is not None:
        from .. import __version__

        record = {
            "schema": SCHEMA,
            "moerunner": __version__,
            "device": device,
            "device_name": name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "auto_preference": preference,
            "backends": backends,
            "backend_table": {
                "files": table_paths,
                "error": table_error,
                "entries": table_rows,
            },
        }
        _common.write_json(args.json, record)
        if str(args.json) == _common.STDOUT:
            return 0
    print(
        f"moerunner on {device} ({name}); torch {torch.__version__}, python "
        f"{platform.python_version()}"
    )
    print(f"auto preference on {device}: {' > '.join(preference)}")
    for backend_name, info in backends.items():
        status = "available" if info["available"] else "NOT available: " + info["reason"]
        if info["available"] and not info["ready_for_auto"]:
            status += " (auto passes over it: " + info["not_ready_reason"] + ")"
        print(f"\n[{backend_name}] {status}")
        print(
            "  dispatch formats: "
            + ", ".join(f"{f} ({p})" for f, p in info["dispatch_formats"].items())
        )
        for key, value in info["capabilities"].items():
            if isinstance(value, list):
                value = ", ".join(value)
            print(f"  {key}: {value}")
        if info["options"] is not None:
            print(f"  options: {info['options']}")
        if info["tile_folders"] is not None:
            where = "" if device == "cuda" else " (read on CUDA GPUs only)"
            print(f"  tile folders, searched in order{where}:")
            for folder in info["tile_folders"]:
                found = (
                    f"{folder['files_for_device']} tuned file(s) for {folder['device_key']}"
                    if folder["exists"]
                    else "missing"
                )
                print(f"    {folder['path']}: {found}")
    print(f"\nbackend table ({device}): " + (", ".join(table_paths) or "none"))
    if table_error:
        print(f"  error: {table_error}")
    for entry in table_rows:
        print(f"  {entry['shape']}")
        if entry.get("error"):
            print(f"    error: {entry['error']}")
        for bucket in entry["buckets"]:
            print(f"    {bucket['tokens']}: {bucket['backend']} ({bucket['reason']})")
    print("  other shapes: no table: preference order")
    if args.json is not None:
        print(f"wrote {args.json}")
    return 0


def _tile_folders(backend, device_name: str) -> list[dict] | None:
    """A backend with tuned tile files (options with ``tile_dirs``: triton): the folders it
    searches, in order, whether each exists and how many of its files name this device."""
    options = backend.options
    if options is None or not hasattr(options, "tile_dirs"):
        return None
    from ..backends.triton.tile_config import tile_folders, tuned_files

    return [
        {
            "path": str(folder),
            "exists": folder.is_dir(),
            "device_key": device_key(device_name),
            "files_for_device": len(tuned_files(folder, device_name)),
        }
        for folder in tile_folders(options.tile_dirs)
    ]


def _table(registry, device: str) -> tuple[list[dict], list[str], str]:
    """This device's backend table as the runner reads it: per entry and bucket, the
    backend ``auto`` takes and why; the files read; an error reading them ("" if none). A
    user table that cannot be used is reported here and left out, as the runtime leaves it
    out (``backend_table.default_table``): the shipped table is shown instead."""
    from ..backend_table import BackendTableError, find_table
    from ..device_files import device_name

    name = device_name(torch.device(device))
    error = ""
    try:
        table = find_table(name)
    except BackendTableError as exc:
        error = f"{exc} (ignored: auto uses the shipped table and the preference order)"
        try:
            table = find_table(name, table_dirs=())
        except BackendTableError as shipped:
            return [], [], f"{error}; {shipped}"
    rows = []
    for key in table.entries:
        try:
            plan = registry.bucket_plan(key.problem(device), key.top_k, table)
        except ValueError as exc:  # no backend serves it here, or a bad dtype name
            rows.append({"shape": key.describe(), "buckets": [], "error": str(exc)})
            continue
        rows.append(
            {
                "shape": key.describe(),
                "buckets": [
                    dict(zip(("tokens", "reason"), s.reason.split(": ", 1), strict=True))
                    | {"backend": s.backend.name}
                    for s in plan.selections
                ],
            }
        )
    return rows, [str(p) for p in table.paths], error
