"""The Ray instance a run starts for itself (no cluster.address): every port on loopback.

Ray binds its gRPC servers (GCS, raylet, object manager, core workers), the dashboard agent
and the runtime-env agent to the node's address, or to all interfaces when that address is
not loopback. On Linux Ray will not take 127.0.0.1 as the node address it is given: it swaps
it for the routable address unless Ray clusters are turned off (what Ray does on macOS and
Windows). So that switch is turned off while the instance starts; both the node address and
the switch are Ray's private parts (ray_internals). See docs/security.md.
"""

from __future__ import annotations

import ipaddress
import logging

import ray

from specrej_ray.distributed.ray_internals import clusters_off, no_head_services, node_address

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def start_local_ray(num_cpus: int, num_gpus: int | None) -> None:
    """A new single-node Ray (never a `ray start` one on this machine) with no dashboard, job
    server or autoscaler (neither the API server, which ray.init waits for, nor the autoscaler's
    monitor: two processes and two fixed ports that a run never uses), listening on loopback
    only."""
    with clusters_off(), no_head_services():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            dashboard_host=LOOPBACK,
            **node_address(LOOPBACK),
            log_to_driver=True,
        )
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):  # a Ray release that no longer honours the switch
        log.warning("the local Ray listens on %s, not loopback; firewall its ports "
                    "(docs/security.md)", node_ip)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (::ffff:127.0.0.1) of a dual-stack socket."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
