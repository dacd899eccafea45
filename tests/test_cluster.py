"""A real two-node Ray cluster on this machine (ray.cluster_utils.Cluster): jobs submitted with
``fedsweep submit`` run the smoke experiment across both nodes and a two-trial study.
The cluster is started and stopped here, by its own processes, never with ``ray stop``."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from fedsweep.orchestrator import jobs as submit
from fedsweep.config import ConfigError
from fedsweep.config.loading import apply_override

ROOT = Path(__file__).resolve().parents[1]
# under `pytest -n` (make test) this module stays on one worker: its module fixture is built once
pytestmark = pytest.mark.xdist_group("cluster")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    port = free_port()
    # every raylet runs a dashboard agent; give these their own ports so that they never collide
    # with the test session's runtime (or any other Ray on the machine) on the default 52365
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 3, "include_dashboard": True, "dashboard_host": "127.0.0.1",
                                "dashboard_port": port, "dashboard_agent_listen_port": free_port(),
                                "resources": {"fedsweep_head": 1}})
    c.add_node(num_cpus=2, resources={"fedsweep_worker": 1}, dashboard_agent_listen_port=free_port())
    yield f"http://127.0.0.1:{port}"
    c.shutdown()


# what the jobs test is placement, submission, log streaming and tracking across nodes, not training:
# one round without generation (each job's CPU is mostly its processes' imports anyway)
SHORT = ["rounds=1", "eval.max_new_tokens=0"]


def _smoke(tmp_path, tracking_uri, **extra) -> Path:
    raw = yaml.safe_load((ROOT / "configs/experiments/smoke.yaml").read_text())
    for assignment in SHORT:
        apply_override(raw, assignment)
    raw["tracking"] = {"uri": tracking_uri, "experiment": "cluster_smoke"}
    raw["checkpoint"] = {"dir": str(tmp_path / "runs")}
    raw.update(extra)
    path = tmp_path / "smoke_job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_runtime_env_carries_no_secrets_and_the_entrypoint_quotes_overrides():
    with pytest.raises(ConfigError, match="RAY_AUTH_TOKEN: secrets do not travel"):
        submit.runtime_env(".", None, None, None, {"RAY_AUTH_TOKEN": "x"})
    env = submit.runtime_env(".", None, ["fedsweep"], "img:1", {"HF_HOME": "/cache"})
    assert env["working_dir"] == "." and ".venv/" in env["excludes"] and env["image_uri"] == "img:1"
    assert "RAY_AUTH_TOKEN" not in json.dumps(env)
    cmd = submit.entrypoint("python", "run", "c.yaml", ["model.name=a b"])
    assert cmd == "python -m fedsweep.cli run c.yaml --set 'model.name=a b' --quiet"


def test_a_bad_config_is_refused_before_anything_is_sent(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nclients: {fraction: 3}\n")
    with pytest.raises(ConfigError, match="clients.fraction = 3"):
        submit.submit(str(bad), "http://127.0.0.1:1", [])


@pytest.mark.system
def test_smoke_job_spreads_client_actors_over_both_nodes(cluster, tmp_path, tracking_uri):
    # actors of 2 CPUs: one fits beside the server on the 3-CPU head, the other needs the worker; one
    # torch thread each, as these logical CPUs share the machine's two cores with the other pytest worker
    path = _smoke(tmp_path, tracking_uri, clients={"num_clients": 4, "clients_per_actor": 2, "placement_strategy": "SPREAD",
                                                   "resources": {"num_cpus": 2, "torch_threads": 1}})
    job = submit.submit(str(path), cluster, [], python=sys.executable, working_dir=None, retry_s=120)
    out: list[str] = []
    assert submit.follow(cluster, job, out.append) == "SUCCEEDED", "".join(out)[-2000:]
    logs = "".join(out)
    assert "final evaluation" in logs and "MLflow run" in logs  # the logs streamed back
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("cluster_smoke").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    nodes = runs[0].data.tags["fedsweep.actor_nodes"].split(",")
    assert len(nodes) == 2 and len(set(nodes)) == 2
    assert submit.status(cluster, job)["status"] == "SUCCEEDED"


@pytest.mark.system
def test_two_trial_study_as_a_job(cluster, tmp_path, tracking_uri):
    sweep = {"name": "cluster_study", "experiment": str(ROOT / "configs/experiments/smoke.yaml"),
             "set": ["clients.clients_per_actor=4", f"checkpoint.dir={tmp_path / 'runs'}", *SHORT],
             "variants": {"fedavg": {"algorithm": "fedavg"}, "local": {"algorithm": "local"}}, "seeds": [0],
             "metric": "test_loss", "mode": "min", "tracking_uri": tracking_uri, "storage": str(tmp_path / "tune")}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(sweep))
    job = submit.submit(str(path), cluster, [], python=sys.executable, working_dir=None, retry_s=120)
    out: list[str] = []
    assert submit.follow(cluster, job, out.append) == "SUCCEEDED", "".join(out)[-2000:]
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("cluster_study").experiment_id])
    kinds = sorted(r.data.tags.get("fedsweep.kind", "trial") for r in runs)
    assert kinds == ["study", "trial", "trial"] and all(r.info.status == "FINISHED" for r in runs)


def test_cluster_launcher_file_validates_against_rays_schema():
    import importlib.resources

    import jsonschema

    schema = json.loads((importlib.resources.files("ray") / "autoscaler" / "ray-schema.json").read_text())
    launcher = yaml.safe_load((ROOT / "cluster/ray-cluster-aws.yaml").read_text())
    jsonschema.validate(launcher, schema)
    types = launcher["available_node_types"]
    assert types["a100_80gb"]["resources"]["accelerator_type:A100"] == 8
    assert types["h100"]["resources"]["GPU"] == 8


@pytest.mark.parametrize("name,kind", [("kuberay-raycluster.yaml", "RayCluster"), ("kuberay-rayjob.yaml", "RayJob")])
def test_kuberay_manifests_are_well_formed(name, kind):
    doc = yaml.safe_load((ROOT / "cluster" / name).read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    spec = doc["spec"] if kind == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == "2.60.0" and spec["headGroupSpec"]["template"]["spec"]["containers"]
    for group in spec["workerGroupSpecs"]:
        assert "accelerator_type:" in group["rayStartParams"]["resources"]
    assert "RAY_AUTH_TOKEN" not in (doc["spec"].get("entrypoint", "") + doc["spec"].get("runtimeEnvYAML", ""))
