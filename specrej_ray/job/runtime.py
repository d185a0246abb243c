"""What a process runs with: torch's threads and the package versions (Ray-free)."""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata

PACKAGES = ("specrej-ray", "torch", "transformers", "ray", "datasets", "pydantic")


def set_torch_threads(threads: int | None) -> int:
    """Ray sets OMP_NUM_THREADS=1 in workers; give torch the cores we were told to use."""
    n = threads or os.cpu_count() or 1
    if "torch" not in sys.modules:
        # torch takes its threads from these when it is imported (MKL's first; at most the
        # cores): a process that never needs torch (a reward actor with a Python callable)
        # does not pay for importing it.
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
        return n
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()


def package_versions(packages=PACKAGES) -> dict[str, str | None]:
    return dict(_versions(tuple(packages)))


@functools.cache  # read once a process: run.json is built more than once at a run's end
def _versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for pkg in packages:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions
