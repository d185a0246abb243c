"""What the figures were measured on: CPU, cores, threads, device, memory, versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from specrej_ray.distributed.run_record import package_versions


def machine_info(device: torch.device) -> dict:
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _mem_gib(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": package_versions(),
    }


def _proc_field(path: str, key: str) -> str | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def _mem_gib() -> float | None:
    value = _proc_field("/proc/meminfo", "MemTotal")  # "24576000 kB"
    return int(value.split()[0]) / 2**20 if value else None
