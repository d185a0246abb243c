"""Security basics (docs/security.md): nothing reaches a shell, trust_remote_code is opt-in,
a run's own Ray listens on loopback only."""

from __future__ import annotations

import ast
import contextlib
import socket
from pathlib import Path

import psutil
import pytest
import ray
import transformers
from ray._common.network_utils import find_free_port
from ray._private import ray_constants

from specrej_ray.distributed.cluster import connect_ray
from specrej_ray.distributed.local_ray import is_loopback
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.job.local import load_local
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_jsonl
from tests.tiny import save_tiny_classifier

PACKAGE = Path(__file__).resolve().parents[1] / "specrej_ray"
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("os", "spawnlp"), ("pty", "spawn")}


def shell_uses(source: str) -> list[str]:
    """Calls that hand a string to a shell: os.system / os.popen / ..., or any call with a
    `shell=` keyword that is not the constant False."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and (f.value.id, f.attr) in SHELL_CALLS):
            found.append(f"{f.value.id}.{f.attr} (line {node.lineno})")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                          and kw.value.value is False):
                found.append(f"shell= (line {node.lineno})")
    return found


def test_the_checker_sees_shell_calls():
    code = "import os, subprocess\nos.system('ls')\nsubprocess.run('ls', shell=True)\n"
    assert shell_uses(code) == ["os.system (line 2)", "shell= (line 3)"]
    assert shell_uses("subprocess.run(['ls'], shell=False)\n") == []


def test_no_shell_anywhere_in_the_package():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = {str(f.relative_to(PACKAGE)): shell_uses(f.read_text()) for f in files}
    assert {f: uses for f, uses in found.items() if uses} == {}


def _spec(tmp_path: Path, lm: Path, rm: Path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hi."}])
    rewards = [{"type": "classifier", "model": str(rm), "threads": 1},
               {"type": "lm_likelihood", "model": str(lm), "threads": 1, "name": "lm"}]
    return validate_spec(tiny_job(tmp_path, lm, prompts, reward=rewards))


def test_trust_remote_code_is_false_unless_asked(tmp_path, tiny_lm_dir):
    spec = _spec(tmp_path, tiny_lm_dir, tmp_path / "rm")

    def flags(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from [value] if key == "trust_remote_code" else flags(value)
        elif isinstance(node, list):
            for item in node:
                yield from flags(item)

    assert list(flags(spec.model_dump())) == [False, False, False]  # generator, 2 rewards


def test_models_load_without_remote_code(tmp_path, tiny_lm_dir, monkeypatch):
    """Every from_pretrained that load_local (the same loaders as the actors) makes is told
    trust_remote_code=False."""
    rm = save_tiny_classifier(tmp_path / "rm")
    spec = _spec(tmp_path, tiny_lm_dir, rm)
    calls: list[tuple[str, object]] = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer,
                transformers.AutoModelForCausalLM,
                transformers.AutoModelForSequenceClassification):
        original = cls.from_pretrained

        def spy(*args, _original=original, _name=cls.__name__, **kwargs):
            calls.append((_name, kwargs.get("trust_remote_code", "absent")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    job = load_local(spec)
    assert len(job.rewards) == 2 and job.tasks
    loaded = {name for name, _ in calls}
    assert {"AutoTokenizer", "AutoModelForCausalLM",
            "AutoModelForSequenceClassification"} <= loaded
    assert [c for c in calls if c[1] is not False] == []



def test_the_loopback_check_tells_loopback_from_all_interfaces():
    hosts = ["127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1",
             "0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1"]
    assert [is_loopback(h) for h in hosts] == [True] * 4 + [False] * 4


def bound_sockets(procs: list[psutil.Process]) -> set[tuple[int, str, str, int]]:
    """(pid, name, ip, port) of every listening TCP socket and every bound, unconnected UDP
    socket of these processes."""
    found = set()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = p.name()
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM
                                                      and not c.raddr):
                    found.add((p.pid, name, c.laddr.ip, c.laddr.port))
    return found


@pytest.mark.ray
def test_the_local_ray_of_a_run_listens_on_loopback_only(tmp_path, tiny_lm_dir, monkeypatch):
    """connect_ray with no cluster.address: every port that the driver's Ray opens, in this
    process or any process it started, is bound to loopback, not to 0.0.0.0 / :: / the
    machine's address."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # The autoscaler's and dashboard's metrics exports use fixed ports (44217, 44227): where
    # another Ray on this machine holds them ours would skip them silently, so give ours free
    # ones, where they would show.
    metrics_ports = {find_free_port(), find_free_port()}
    assert len(metrics_ports) == 2
    monitor_port, dashboard_port = sorted(metrics_ports)
    monkeypatch.setenv("AUTOSCALER_METRIC_PORT", str(monitor_port))
    monkeypatch.setenv("DASHBOARD_METRIC_PORT", str(dashboard_port))
    ray.shutdown()
    me = psutil.Process()
    before = bound_sockets([me])
    spec = validate_spec(tiny_job(tmp_path, tiny_lm_dir, tmp_path / "p.jsonl"))
    clusters_enabled = ray_constants.ENABLE_RAY_CLUSTER
    try:
        connect_ray(spec, Interrupt())
        assert clusters_enabled == ray_constants.ENABLE_RAY_CLUSTER  # restored after the start
        ray.get(ray.remote(lambda: 1).remote())  # start a worker too
        ports = bound_sockets([me, *me.children(recursive=True)]) - before
    finally:
        ray.shutdown()
    names = {name for _, name, _, _ in ports}
    assert {"gcs_server", "raylet"} <= names
    bound = {port for *_, port in ports}
    # Neither export: the autoscaler's monitor and Ray's API server (dashboard.py) are not
    # started at all for a run's own Ray (ray_internals.no_head_services).
    assert not metrics_ports & bound
    offenders = sorted(f"{name} (pid {pid}) on {ip}:{port}"
                       for pid, name, ip, port in ports if not is_loopback(ip))
    assert offenders == []
