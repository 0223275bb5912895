"""Where measured per-device files live, and how they name a device.

Measured files (the triton backend's tile files, the backend tables of ``backend_table``)
are keyed by device name, one file per device, and searched in the user's cache folder
before the folders shipped with the package. The environment is read in one place: where
the user's cache folder is (``user_cache_dir``). Files are written whole or not at all
(``write_text_atomic``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import secrets
import stat
from pathlib import Path

import torch

__all__ = [
    "device_key",
    "device_name",
    "gpu_name",
    "hardware_name",
    "user_cache_dir",
    "write_text_atomic",
]


def user_cache_dir() -> Path:
    """moerunner's user cache folder: ``$XDG_CACHE_HOME/moerunner``, or
    ``~/.cache/moerunner`` where that variable is unset, empty or a relative path (the XDG
    base directory convention: a relative path would name another folder from each working
    folder, so a file written from one would not be found from another). ``moerunner tune``
    writes its measured files below it; the runtime reads them first."""
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"
    return base / "moerunner"


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all; return ``path``.

    The text goes to a temporary file in the same folder, which then replaces ``path`` in
    one rename (``os.replace``): a write interrupted by Ctrl-C, a full disk or a crash
    leaves the earlier file (or none), never a truncated one that the next run refuses to
    read or to merge into, and a reader never sees half a file. Missing folders are
    created. A symbolic link at ``path`` is written through (its target is replaced, the
    link kept), as a plain write would; the file keeps an earlier file's permissions."""
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    # In the same folder, so on the same file system: only there is a rename atomic.
    temp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    # 0o666 less the umask, as a plain write makes a new file (mkstemp would make it 0o600).
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temp, target)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return path


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
