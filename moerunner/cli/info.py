"""``moerunner info``: every registered backend, whether it runs here, what it supports, why not."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from ..runner import DEFAULT_PREFERENCE, default_registry
from . import _common

SCHEMA = "moerunner-info/1"


def main(argv: list[str]) -> int:
    """Print the backends of this installation on this machine."""
    parser = _common.parser("info", __doc__)
    parser.add_argument(
        "--json", type=Path, default=None, help="write the result as JSON here ('-': stdout)"
    )
    args = parser.parse_args(argv)
    _common.check_outputs(parser, {"--json": (args.json, "json")})
    registry = default_registry()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    preference = list(DEFAULT_PREFERENCE.get(device, ()))
    backends = {}
    for backend_name, backend in registry.backends.items():
        ok, reason = backend.available()
        capabilities = {
            key: list(map(str, value)) if isinstance(value, list | tuple | set) else value
            for key, value in backend.capabilities.describe().items()
        }
        backends[backend_name] = {
            "available": bool(ok),
            "reason": "" if ok else reason,
            "dispatch_formats": {str(f): str(p) for f, p in registry.paths(backend_name).items()},
            "capabilities": capabilities,
        }
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
        print(f"\n[{backend_name}] {status}")
        print(
            "  dispatch formats: "
            + ", ".join(f"{f} ({p})" for f, p in info["dispatch_formats"].items())
        )
        for key, value in info["capabilities"].items():
            if isinstance(value, list):
                value = ", ".join(value)
            print(f"  {key}: {value}")
    if args.json is not None:
        print(f"wrote {args.json}")
    return 0
