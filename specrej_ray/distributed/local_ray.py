"""The Ray instance a run starts for itself (no cluster.address): every port on loopback.

Ray binds its gRPC servers (GCS, raylet, object manager, core workers), the dashboard agent,
the runtime-env agent and the autoscaler's and dashboard's Prometheus exports to the node's
address, or to all interfaces when that address is not loopback. On Linux Ray 2.60 will not
take 127.0.0.1 as the node address: `ray.init(_node_ip_address="127.0.0.1")` goes through
`services.resolve_ip_for_localhost`, which swaps it for the routable address unless Ray
clusters are turned off (`ray_constants.ENABLE_RAY_CLUSTER`, what Ray does on macOS and
Windows). So that switch is turned off while the instance starts. See docs/security.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Iterator

import ray
from ray._private import ray_constants

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def start_local_ray(num_cpus: int, num_gpus: int | None) -> None:
    """A new single-node Ray (never a `ray start` one on this machine) with no dashboard or job
    server, listening on loopback only."""
    with _ray_clusters_off():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            dashboard_host=LOOPBACK,
            _node_ip_address=LOOPBACK,
            log_to_driver=True,
        )
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):  # a Ray release that no longer honours the switch
        log.warning("the local Ray listens on %s, not loopback; firewall its ports "
                    "(docs/security.md)", node_ip)


@contextlib.contextmanager
def _ray_clusters_off() -> Iterator[None]:
    # Only for the start: once Ray runs, the node address comes from the node, and a later
    # ray.init(address=<a real cluster>) in this process must see the routable address again.
    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (::ffff:127.0.0.1) of a dual-stack socket."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
