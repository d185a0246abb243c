"""What the actors answer by one shared deadline: for the counters a run gathers as it ends,
which are worth a short wait and never a stop's (a scheduler's SIGTERM grace is often 30 s).

Each `ray.get(ref, timeout=30)` in turn waited 30 s for every actor busy with a held batch:
a stopped run took 33 s to exit with one reward actor busy, and more with more."""

from __future__ import annotations

from collections.abc import Hashable

import ray
from ray.exceptions import RayActorError, RayTaskError

# Seconds to wait for the counters: at a run's end the actors are idle and answer at once;
# on a stop they may be in the middle of a batch, and the stop is what matters.
AT_END_S = 30.0
ON_STOP_S = 2.0


def answers(refs: dict[Hashable, ray.ObjectRef], timeout: float) -> dict[Hashable, object]:
    """The values of the refs ready within `timeout` seconds, all of them together; a ref
    not ready by then, or whose actor died or raised, is left out."""
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    ready = set(ready)
    out = {}
    for key, ref in refs.items():
        if ref in ready:
            try:
                out[key] = ray.get(ref, timeout=0)
            except (RayActorError, RayTaskError):
                continue
    return out

