"""``moerunner info``: every registered backend, whether it runs here, what it supports, why not."""

from __future__ import annotations

import argparse
import platform

import torch

from ..runner import DEFAULT_PREFERENCE, default_registry


def main(argv: list[str]) -> int:
    """Print the backends of this installation on this machine."""
    parser = argparse.ArgumentParser(prog="moerunner info", description=__doc__)
    parser.parse_args(argv)
    registry = default_registry()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(
        f"moerunner on {device} ({name}); torch {torch.__version__}, python "
        f"{platform.python_version()}"
    )
    print(f"auto preference on {device}: {' > '.join(DEFAULT_PREFERENCE.get(device, ()))}")
    for backend_name, backend in registry.backends.items():
        ok, reason = backend.available()
        print(f"\n[{backend_name}] {'available' if ok else 'NOT available: ' + reason}")
        paths = registry.paths(backend_name)
        print("  dispatch formats: " + ", ".join(f"{f} ({p})" for f, p in paths.items()))
        for key, value in backend.capabilities.describe().items():
            if isinstance(value, list):
                value = ", ".join(map(str, value))
            print(f"  {key}: {value}")
    return 0
