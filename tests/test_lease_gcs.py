"""The output lease on Google Cloud Storage: generation preconditions through gcsfs's own calls
(tests/helpers/gcs.py answers them as GCS's JSON API does; no GCS server is at hand)."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("gcsfs", reason="gcsfs is a dev dependency (make setup installs it)")

from specrej_ray.data.dataset import Location  # noqa: E402
from specrej_ray.data.lease_object import GcsObject, lease_object  # noqa: E402
from specrej_ray.data.output_lock import Lease, OutputInUse  # noqa: E402
from tests.helpers.gcs import FakeGcs, FakeGcsFileSystem  # noqa: E402
from tests.helpers.leases import QUIET, conditions_hold, take_over_a_stale_lease  # noqa: E402


@pytest.fixture
def store():
    return FakeGcs()


def location(store: FakeGcs, root: str = "bkt/out") -> Location:
    fs = FakeGcsFileSystem(store=store, skip_instance_cache=True)
    return Location(f"gs://{root}", fs, root)


def test_gs_paths_get_the_conditional_object(store):
    assert isinstance(lease_object(location(store), "x.json"), GcsObject)


def test_writes_are_conditional_on_the_generation(store):
    first, second = conditions_hold(GcsObject(location(store), ".specrej-lease.json"))
    # every call went through gcsfs with the precondition GCS checks
    conditions = [p.get("ifGenerationMatch") for m, _, p in store.requests if m != "GET"]
    assert conditions == ["0", "0", first, first, first, second]


def test_two_racing_starts_leave_exactly_one_holder(store):
    """Two runs start on one output at the same instant, 50 times: one holds the lease, the
    other is refused in one line naming it."""
    for trial in range(50):
        out = location(store, f"bkt/race{trial}")
        gate, got = threading.Barrier(2), {}

        def start(label: str, out=out, gate=gate, got=got) -> None:
            gate.wait()
            try:
                got[label] = Lease(out, label, heartbeat=False, echo=QUIET)
            except OutputInUse as e:
                got[label] = e

        threads = [threading.Thread(target=start, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        held = [v for v in got.values() if isinstance(v, Lease)]
        refused = [v for v in got.values() if isinstance(v, OutputInUse)]
        assert len(held) == 1 and len(refused) == 1, got
        assert len(str(refused[0]).splitlines()) == 1
        assert f"'{held[0].me['run']}'" in str(refused[0])
        held[0].release()


def test_a_stale_lease_is_taken_over_and_its_old_holder_stops(store):
    key = ("bkt", "out/.specrej-lease.json")
    take_over_a_stale_lease(location(store), lambda: json.loads(store.objects[key][1])["run"]
                            if key in store.objects else None)
