"""What a process runs with: torch's threads and the package versions (Ray-free)."""

from __future__ import annotations

import os
from importlib import metadata

PACKAGES = ("specrej-ray", "torch", "transformers", "ray", "datasets", "pydantic")


def set_torch_threads(threads: int | None) -> int:
    """Ray sets OMP_NUM_THREADS=1 in workers; give torch the cores we were told to use."""
    import torch

    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return torch.get_num_threads()


def package_versions(packages=PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for pkg in packages:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions
