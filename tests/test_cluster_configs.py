"""cluster/: Ray launcher YAMLs (checked against the ray-schema.json in the ray wheel) and
KubeRay manifests (structure, GPU workers, autoscaling, entrypoints naming valid job specs).
Fast: no cluster, no cloud, no Kubernetes."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.runtime_env import RuntimeEnv

from specrej_ray.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
LAUNCHER = ["aws.yaml", "gcp.yaml"]
KUBERAY = ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml", "kuberay-rayjob-vllm-8b.yaml",
           "kuberay-rayjob-vllm-70b.yaml"]
RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


def _words(text: str) -> set[str]:
    return set(text.split())


# Field names of the KubeRay v1 API, the union over its releases (ray-operator/apis/ray/v1/
# *_types.go, json tags): a typo such as `enableInTreeAutoScaling` would be dropped or refused
# by the API server, so catch it here.
CLUSTER_SPEC_FIELDS = _words(
    """
    headGroupSpec workerGroupSpecs rayVersion enableInTreeAutoscaling autoscalerOptions
    headServiceAnnotations suspend managedBy gcsFaultToleranceOptions upgradeStrategy
    authOptions historyServerOptions networkPolicy tlsOptions
    """
)
HEAD_GROUP_FIELDS = _words(
    """
    serviceType headService enableIngress ingressOptions resources labels rayStartParams template
    """
)
WORKER_GROUP_FIELDS = _words(
    """
    groupName replicas minReplicas maxReplicas numOfHosts rayStartParams template scaleStrategy
    suspend idleTimeoutSeconds priority resources labels
    """
)
AUTOSCALER_FIELDS = _words(
    """
    resources image imagePullPolicy env envFrom volumeMounts securityContext idleTimeoutSeconds
    upscalingMode version command args
    """
)
RAYJOB_SPEC_FIELDS = _words(
    """
    activeDeadlineSeconds backoffLimit rayClusterSpec submitterPodTemplate metadata
    clusterSelector submitterConfig managedBy deletionPolicy deletionStrategy entrypoint
    runtimeEnvYAML jobId submissionMode entrypointResources entrypointNumCpus entrypointNumGpus
    ttlSecondsAfterFinished shutdownAfterJobFinishes suspend schedule
    """
)


def _load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((CLUSTER / name).read_text())
    assert isinstance(data, dict), f"{name}: not a YAML mapping"
    return data


def _unknown(where: str, data: dict[str, Any], allowed: set[str]) -> list[str]:
    return [f"{where}.{k}" for k in sorted(set(data) - allowed)]


# --- Ray cluster launcher ---------------------------------------------------------------


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_config_matches_ray_schema(name):
    schema = json.loads(RAY_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{name}: {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(_load(name))
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_config_with_ray_defaults_still_validates(name):
    """What `ray up` really runs: our config merged over the provider's defaults.yaml."""
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    merged = fillout_defaults(_load(name))
    validate_config(merged)
    # The defaults start the dashboard on 0.0.0.0; ours must win.
    head_start = " ".join(merged["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in head_start


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_has_cpu_head_and_autoscaling_spot_gpu_workers(name):
    cfg = _load(name)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head runs the driver, not models"
    assert cfg["idle_timeout_minutes"] > 0

    gpu_types = {k: t for k, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu_types, f"{name}: no worker type with GPUs"
    for key, t in gpu_types.items():
        assert key != cfg["head_node_type"]
        assert t["min_workers"] == 0, f"{key}: GPU workers must scale to zero"
        assert 1 <= t["max_workers"] <= cfg["max_workers"], key
        node = t["node_config"]
        provider = cfg["provider"]["type"]
        if provider == "aws":
            assert node["InstanceMarketOptions"]["MarketType"] == "spot", key
        elif provider == "gcp":
            sched = node["scheduling"]
            spot = sched.get("provisioningModel") == "SPOT" or sched.get("preemptible") is True
            assert spot, f"{key}: not a Spot / preemptible VM"
            assert sched.get("onHostMaintenance") == "TERMINATE", f"{key}: GPUs cannot migrate"
        else:
            pytest.fail(f"{name}: unexpected provider {provider}")


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_installs_specrej_ray(name):
    cfg = _load(name)
    commands = cfg.get("setup_commands", [])
    installs = [c for c in commands if "pip install" in c and "specrej-ray" in c]
    assert installs, f"{name}: no setup command installs specrej-ray"


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_dashboard_on_loopback(name):
    cfg = _load(name)
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in yaml.safe_dump(cfg), f"{name}: something binds 0.0.0.0"


# --- KubeRay ------------------------------------------------------------------------------


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def _limits(container: dict[str, Any]) -> dict[str, Any]:
    return (container.get("resources") or {}).get("limits") or {}


@pytest.mark.parametrize("name,kind", [(KUBERAY[0], "RayCluster"), (KUBERAY[1], "RayJob")])
def test_kuberay_api_version_and_kind(name, kind):
    doc = _load(name)
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == kind
    assert doc["metadata"]["name"]


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_field_names_are_kuberay_v1(name):
    doc = _load(name)
    spec = _cluster_spec(doc)
    bad = _unknown("spec", spec, CLUSTER_SPEC_FIELDS)
    bad += _unknown("headGroupSpec", spec["headGroupSpec"], HEAD_GROUP_FIELDS)
    for g in spec.get("workerGroupSpecs", []):
        bad += _unknown(f"workerGroupSpecs[{g.get('groupName')}]", g, WORKER_GROUP_FIELDS)
    bad += _unknown("autoscalerOptions", spec.get("autoscalerOptions", {}), AUTOSCALER_FIELDS)
    if doc["kind"] == "RayJob":
        bad += _unknown("RayJob.spec", doc["spec"], RAYJOB_SPEC_FIELDS)
    assert not bad, f"{name}: not KubeRay v1 fields: {bad}"


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_head_autoscaling_and_gpu_workers(name):
    spec = _cluster_spec(_load(name))
    assert spec["enableInTreeAutoscaling"] is True

    head = spec["headGroupSpec"]
    # A string, as Kubernetes requires for map[string]string; 0 keeps actors off the head.
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", "keep the dashboard internal"
    for c in head["template"]["spec"]["containers"]:
        assert "nvidia.com/gpu" not in _limits(c), "the head needs no GPU"

    def gpus(group: dict[str, Any]) -> int:
        containers = group["template"]["spec"]["containers"]
        return sum(int(_limits(c).get("nvidia.com/gpu", 0)) for c in containers)

    gpu_groups = [g for g in spec["workerGroupSpecs"] if gpus(g) >= 1]
    assert gpu_groups, "no worker group with an nvidia.com/gpu limit"
    for g in gpu_groups:
        assert g["groupName"]
        assert g["minReplicas"] == 0, f"{g['groupName']}: GPU workers must scale to zero"
        assert g["minReplicas"] <= g.get("replicas", 0) <= g["maxReplicas"]
        assert g["maxReplicas"] >= 1


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_images_match_ray_version(name):
    spec = _cluster_spec(_load(name))
    version = spec["rayVersion"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    images = [c["image"] for g in groups for c in g["template"]["spec"]["containers"]]
    wrong = [i for i in images if i.startswith("rayproject/") and f":{version}" not in i]
    assert not wrong, f"{name}: images {wrong} are not Ray {version}"


def test_all_configs_use_one_ray_version():
    versions = {_cluster_spec(_load(n))["rayVersion"] for n in KUBERAY}
    for name in LAUNCHER:
        docker = _load(name)["docker"]
        for image in (docker.get("image"), docker.get("head_image"), docker.get("worker_image")):
            if image:
                versions.add(image.split(":")[1].split("-")[0])
    assert len(versions) == 1, f"Ray versions differ across cluster/: {sorted(versions)}"


@pytest.mark.parametrize("name", [n for n in KUBERAY if "rayjob" in n])
def test_rayjob_runs_to_completion_and_shuts_down(name):
    spec = _load(name)["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in spec, "the RayJob brings its own rayClusterSpec"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict)
    unknown = set(runtime_env) - set(RuntimeEnv.known_fields)
    assert not unknown, f"not runtime env fields: {sorted(unknown)}"
    RuntimeEnv(**runtime_env)  # Ray's own checks of each field
    assert runtime_env.get("working_dir"), "the job specs and prompts come from working_dir"


# --- entrypoints --------------------------------------------------------------------------


def _entrypoints() -> list[tuple[str, str]]:
    return [(n, _load(n)["spec"]["entrypoint"]) for n in KUBERAY if _load(n)["kind"] == "RayJob"]


def _run_spec_path(entrypoint: str) -> str:
    """The job spec of `specrej-ray run SPEC [--set K=V ...] [--overwrite]`."""
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["specrej-ray", "run"], f"not `specrej-ray run`: {entrypoint!r}"
    positional, rest = [], argv[2:]
    while rest:
        arg = rest.pop(0)
        if arg == "--set":
            assert rest and "=" in rest[0], f"--set needs KEY=VALUE: {entrypoint!r}"
            rest.pop(0)
        elif arg.startswith("--set="):
            assert "=" in arg[len("--set=") :]
        elif arg == "--overwrite":
            pass
        else:
            assert not arg.startswith("-"), f"unknown option {arg} in {entrypoint!r}"
            positional.append(arg)
    assert len(positional) == 1, f"want one job spec, got {positional} in {entrypoint!r}"
    return positional[0]


def test_console_script_is_specrej_ray():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "specrej-ray" in scripts


@pytest.mark.parametrize("name,entrypoint", _entrypoints())
def test_entrypoint_names_a_valid_job_spec_in_jobs(name, entrypoint):
    spec_path = Path(_run_spec_path(entrypoint))
    assert not spec_path.is_absolute(), f"{name}: spec path must be relative to working_dir"
    assert spec_path.parts[0] == "jobs", f"{name}: {spec_path} is not under jobs/"
    assert (ROOT / spec_path).is_file(), f"{name}: {spec_path} does not exist"
    spec = load_spec(ROOT / spec_path)  # raises SpecError with one line per problem
    # The manifests are GPU clusters: the spec should use them.
    gpus = max(spec.cluster.gpus_per_generator, spec.generator.tensor_parallel_size)
    assert gpus >= 1, f"{spec_path}: generators take no GPU"


@pytest.mark.parametrize("name", [n for n in KUBERAY if "vllm" in n])
def test_vllm_manifests_install_vllm_and_fit_a_tp_group_in_one_pod(name):
    """A tensor-parallel generator stays on one node: some worker pod has its k GPUs."""
    doc = _load(name)
    spec = load_spec(ROOT / _run_spec_path(doc["spec"]["entrypoint"]))
    assert spec.generator.engine == "vllm"
    pip = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["pip"]
    assert any(p.startswith("specrej-ray[vllm]") for p in pip), pip
    groups = _cluster_spec(doc)["workerGroupSpecs"]
    per_pod = [sum(int(_limits(c).get("nvidia.com/gpu", 0))
                   for c in g["template"]["spec"]["containers"]) for g in groups]
    k = spec.generator.tensor_parallel_size
    assert max(per_pod) >= k, f"{name}: no pod holds the {k} GPUs of a generator"
    big = sum(g["maxReplicas"] for g, n in zip(groups, per_pod, strict=True) if n >= k)
    assert big * (max(per_pod) // k) >= spec.cluster.generators, \
        f"{name}: room for fewer than {spec.cluster.generators} generators"


def test_entrypoint_parser_rejects_other_commands():
    for bad in [
        "python -m specrej_ray run jobs/demo.yaml",
        "specrej-ray validate jobs/demo.yaml",
        "specrej-ray run",
        "specrej-ray run jobs/a.yaml jobs/b.yaml",
        "specrej-ray run jobs/demo.yaml --bogus",
    ]:
        with pytest.raises(AssertionError):
            _run_spec_path(bad)
    assert _run_spec_path("specrej-ray run 'jobs/demo.yaml' --set search.n=8") == "jobs/demo.yaml"
