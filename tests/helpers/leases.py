"""What every conditional lease store passes (S3 on moto, GCS through gcsfs): its writes
refused on a stale version, a stale lease taken over with a message, and its old holder,
whose conditional renewal fails, stopping."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from specrej_ray.data.dataset import Location
from specrej_ray.data.lease_object import Conflict
from specrej_ray.data.output_lock import Lease, OutputInUse

QUIET = lambda *a, **k: None  # noqa: E731


class Clock:
    """A wall clock the test moves (the lease's heartbeat and staleness)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def conditions_hold(obj) -> tuple[str, str]:
    """A fresh lease object refuses a create over it and a replace or delete of a version
    gone by; returns the tags of the two versions it wrote."""
    assert obj.read() is None
    first = obj.create(b'{"id": "a"}')
    with pytest.raises(Conflict):  # only if absent
        obj.create(b'{"id": "b"}')
    got = obj.read()
    assert got.data == {"id": "a"} and got.tag == first
    second = obj.replace(b'{"id": "a", "n": 2}', first)
    with pytest.raises(Conflict):  # a replace from the version before
        obj.replace(b'{"id": "c"}', first)
    with pytest.raises(Conflict):
        obj.delete(first)
    assert obj.read().data == {"id": "a", "n": 2}
    obj.delete(second)
    assert obj.read() is None
    return first, second


def take_over_a_stale_lease(out: Location, stored_run: Callable[[], str | None]) -> None:
    """`stored_run()`: the run named by the lease object in the store now (None: no lease)."""
    clock = Clock()
    lease = dict(ttl_s=60, clock=clock, heartbeat=False, echo=QUIET)
    first = Lease(out, "first", **lease)
    clock.now += 30
    with pytest.raises(OutputInUse, match="'first'.*renewed 30 s ago"):
        Lease(out, "second", **lease)
    clock.now += 31
    said: list[str] = []
    second = Lease(out, "second", **{**lease, "echo": said.append})
    assert "taking over the stale lease" in said[0] and "'first'" in said[0]
    first.renew()  # its conditional renewal fails: the version is the taker's
    with pytest.raises(OutputInUse, match="taken over by .*'second'"):
        first.check()
    first.release()  # not its lease any more: left alone
    assert stored_run() == "second"
    second.renew()
    second.check()
    second.release()
    assert stored_run() is None
