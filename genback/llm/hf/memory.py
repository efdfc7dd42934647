"""Memory facts the HF runner sizes itself by: the free bytes of a device, and handing freed
heap pages back to the OS."""

from __future__ import annotations

import ctypes
import os

import torch


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` in bytes: CUDA's ``mem_get_info`` free bytes, else the host's
    ``MemAvailable`` (``/proc/meminfo``), else physical pages x page size."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def trim_host_memory() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise), so RSS drops after
    the tree is cleared. A no-op where glibc's ``malloc_trim`` is missing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
