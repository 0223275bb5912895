"""Where measured per-device files live, and how they name a device.

Measured files (the triton backend's tile files, the backend tables of ``backend_table``)
are keyed by device name, one file per device, and searched in the user's cache folder
before the folders shipped with the package. The environment is read in one place: where
the user's cache folder is (``user_cache_dir``).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

__all__ = ["device_key", "device_name", "gpu_name", "hardware_name", "user_cache_dir"]


def user_cache_dir() -> Path:
    """moerunner's user cache folder: ``$XDG_CACHE_HOME/moerunner``, or
    ``~/.cache/moerunner`` where that variable is unset (the XDG base directory convention).
    ``moerunner tune`` writes its measured files below it; the runtime reads them first."""
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache) if cache else Path.home() / ".cache"
    return base / "moerunner"


def device_key(name: str) -> str:
    """File-name-safe form of a device name ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3")."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name for a CUDA device, else None."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def device_name(device: torch.device | str) -> str:
    """The name measured files of ``device`` are keyed by: the GPU's name on CUDA (the
    current GPU where no index is given), else the device type (``"cpu"``)."""
    device = torch.device(device)
    return gpu_name(device) or device.type


def hardware_name(device: torch.device | str) -> str:
    """The hardware a run is on, as reports name it: the GPU's name on CUDA, else the
    processor (``platform.processor()``, or the machine type such as ``"x86_64"`` where the
    platform does not name the processor)."""
    device = torch.device(device)
    return gpu_name(device) or platform.processor() or platform.machine() or device.type
