"""Every private part of Ray a run reaches, checked when this module is imported.

Ray has no public way to keep its own signal handlers out of a driver's start, to start a node
that listens on loopback only, or to read each node's free resources. What is reached:

- `ray._private.utils.set_sigterm_handler`, through which ray.init and the local node set
  their SIGTERM handlers (both look it up on that module at each call, so replacing it there
  reaches them), and `ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER`, which keeps the
  driver's core worker from installing absl's failure handler (`sigterm_handlers_off`,
  which also filters `ray._private.worker.logger`'s warning that ray.init, run off the main
  thread, set no SIGTERM handler);
- `ray_constants.ENABLE_RAY_CLUSTER`, read through that module when Ray resolves a node's
  address (`clusters_off`), and ray.init's private `_node_ip_address` (`node_address`);
- `ray._private.state.available_resources_per_node` (`free_per_node`);
- `ray._private.worker._global_node` and its `is_head()`: whether this process started the
  Ray it is connected to (`started_here`);
- `node.Node.start_api_server` and `node.Node.start_monitor`, which the head's start calls to
  start Ray's API server even with include_dashboard=False, and the autoscaler's monitor
  (`no_head_services`).

A Ray without one of them, or where one is no longer reached that way, fails the import with
one line naming Ray's version and the part (LibraryChanged).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator

import ray
from ray._private import node, ray_constants, services, state, utils, worker

from specrej_ray.errors import LibraryChanged

SUPPORTED = "ray>=2.60,<2.61"  # pyproject.toml's bound (tests/test_library_seams.py)


def changed(what: str) -> LibraryChanged:
    return LibraryChanged("Ray", ray.__version__, what, SUPPORTED)


def check() -> None:
    """What this module reaches is there, and reached as assumed; raises LibraryChanged."""
    for module, name in ((utils, "set_sigterm_handler"), (state, "available_resources_per_node"),
                         (worker, "logger"), (worker, "_global_node"),
                         (ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"),
                         (ray_constants, "ENABLE_RAY_CLUSTER")):
        if not hasattr(module, name):
            raise changed(f"{module.__name__}.{name} is missing")
    for name in ("is_head", "start_api_server", "start_monitor", "start_head_processes"):
        if not callable(getattr(node.Node, name, None)):
            raise changed(f"ray._private.node.Node.{name} is missing")
    for module in (worker, node):  # a copy of their own would not see ours
        if hasattr(module, "set_sigterm_handler"):
            raise changed(f"{module.__name__} holds its own set_sigterm_handler")
    reads = (  # (module or class, function, what its source holds, what it no longer does without)
        (services, "get_node_ip_address", "ray_constants.ENABLE_RAY_CLUSTER",
         "no longer reads ray_constants.ENABLE_RAY_CLUSTER"),
        (worker, "init", '"_node_ip_address"', "no longer takes _node_ip_address"),
        (node.Node, "start_head_processes", "self.start_api_server(",
         "no longer starts the API server through Node.start_api_server"),
        (node.Node, "start_head_processes", "self.start_monitor()",
         "no longer starts the autoscaler's monitor through Node.start_monitor"),
    )
    for owner, name, text, what in reads:
        if text not in inspect.getsource(inspect.unwrap(getattr(owner, name))):
            where = owner.__name__ if inspect.ismodule(owner) else \
                f"{owner.__module__}.{owner.__qualname__}"
            raise changed(f"{where}.{name} {what}")


check()


@contextlib.contextmanager
def sigterm_handlers_off() -> Iterator[None]:
    """While Ray starts: its SIGTERM handlers are not set, nor absl's failure handler in the
    driver's core worker; and ray.init, on a thread other than the main one, does not warn
    that it set none."""
    original = utils.set_sigterm_handler
    no_dump = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    utils.set_sigterm_handler = lambda handler: None
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    worker.logger.addFilter(_no_handler_warning)
    try:
        yield
    finally:
        utils.set_sigterm_handler = original
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = no_dump
        worker.logger.removeFilter(_no_handler_warning)


def _no_handler_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("SIGTERM handler is not set")


@contextlib.contextmanager
def clusters_off() -> Iterator[None]:
    """Ray clusters turned off, as Ray has them on macOS and Windows: a node's address is
    then taken as given, loopback included. Only for a start: once Ray runs, the address
    comes from the node, and a later ray.init(address=<a real cluster>) in this process must
    see the routable address again."""
    old = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old


@contextlib.contextmanager
def no_head_services() -> Iterator[None]:
    """While a local Ray starts: its head starts neither the API server (`dashboard.py`: the
    job server, the state API, usage stats, a Prometheus export on port 44227), which Ray
    starts even with include_dashboard=False, nor the autoscaler's monitor (`monitor.py`: a
    local instance has nothing to scale; a Prometheus export on port 44217). A run's own Ray
    uses none of them."""
    api_server, monitor = node.Node.start_api_server, node.Node.start_monitor
    node.Node.start_api_server = lambda self, **kwargs: None
    node.Node.start_monitor = lambda self: None
    try:
        yield
    finally:
        node.Node.start_api_server, node.Node.start_monitor = api_server, monitor


def node_address(ip: str) -> dict[str, str]:
    """ray.init's keyword for the address of the node it starts."""
    return {"_node_ip_address": ip}


def free_per_node() -> list[dict[str, float]]:
    """Each live node's free resources."""
    return list(state.available_resources_per_node().values())


def started_here() -> bool:
    """This process started the head of the Ray it is connected to (ray.init with no address:
    a local instance with the resources it started with, and no autoscaler), rather than
    joining a cluster."""
    return worker._global_node is not None and worker._global_node.is_head()
