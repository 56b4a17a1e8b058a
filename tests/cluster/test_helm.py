"""The Helm chart, rendered and linted offline (helm-python-sdk), its manifests checked against the Kubernetes
schema (kubernetes-validate) and the project's schemas for the CRDs, and its serveConfigV2 against
`braid serve-config` and Ray Serve's deploy schema."""

import contextlib
import io
import json
import os

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from braid.cli import main as braid_main
from braid.cluster.config import ClusterConfig
from braid.runtime.dashboard import dashboard_json, grafana_dashboard
from braid.runtime.metrics import metrics

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "helm")
CHART = os.path.join(ROOT, "braid")
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".yaml"))
KUBE = "1.30.0"
CRD_SCHEMAS = {"RayService": "rayservice.schema.json", "PodMonitor": "podmonitor.schema.json"}
# cluster config fields the chart sets from its own values (the model volume, Redis, keys, node groups)
CHART_OWNED = ("model_path", "redis_url", "grpc_port", "api_keys_file", "worker_resources", "synthesizer_resources")


def example(name: str) -> dict:
    with open(os.path.join(ROOT, "examples", name)) as f:
        return yaml.safe_load(f)


def render(values: dict | None = None) -> list[dict]:
    out = helm.Chart.load(CHART).render(values or {}, name="braid", namespace="serving")
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])


def pod_templates(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster.get("workerGroupSpecs", []))]


def cli(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert braid_main(list(argv)) == 0
    return out.getvalue()


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_chart_lints_strictly(values):
    report = helm.lint(CHART, example(values) if values else None, strict=True, kube_version=f"v{KUBE}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_every_manifest_validates(values):
    docs = render(example(values) if values else None)
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service", "ConfigMap"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_SCHEMAS:
            with open(os.path.join(ROOT, "schemas", CRD_SCHEMAS[doc["kind"]])) as f:
                jsonschema.validate(doc, json.load(f))
        else:
            kubernetes_validate.validate(doc, KUBE, strict=True)
    for template in pod_templates(one(docs, "RayService")):  # the Ray pods, as core PodTemplates
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ray"},
                                      "template": template}, KUBE, strict=True)


@pytest.mark.parametrize("values", [None, *EXAMPLES])
def test_serve_config_is_what_braid_serve_config_prints(values, tmp_path):
    """One source of truth: the chart's serveConfigV2 equals `braid serve-config` for the cluster config it
    carries, and both pass Ray Serve's own deploy schema."""
    rendered = serve_config(render(example(values) if values else None))
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text(yaml.safe_dump(rendered["applications"][0]["args"]["config"]))
    assert yaml.safe_load(cli("serve-config", "--config", str(config_file))) == rendered
    ServeDeploySchema.model_validate(rendered)


def test_config_values_schema_is_generated_from_cluster_config():
    with open(os.path.join(CHART, "values.schema.json")) as f:
        chart = json.load(f)["properties"]["config"]
    expected = json.loads(cli("serve-config", "--json-schema"))
    expected.pop("required")
    for name in CHART_OWNED:
        expected["properties"].pop(name)
    chart.pop("description")
    assert chart == expected, "regenerate the config section of values.schema.json from `braid serve-config " \
                              "--json-schema` (less the chart-owned fields)"


def test_every_engine_setting_a_gpu_needs_reaches_the_engines_from_the_chart(checkpoint):
    """The attention backend, compile, overlap and decode graphs, set in the chart's values, reach each replica's
    engine as the cluster config the app is built from gives it (workers' and synthesizer's alike)."""
    from braid.cluster.config import ClusterConfig

    settings = {"attention": "flex", "compile": True, "overlap": True, "decode_graphs": "off"}
    config = serve_config(render({"config": settings}))["applications"][0]["args"]["config"]
    assert {k: config[k] for k in settings} == settings
    cluster = ClusterConfig.from_dict({**config, "model_path": checkpoint("llama"), "api_keys_file": None})
    for role in ("worker", "synthesizer"):
        engine = cluster.engine_config(role)
        assert {k: getattr(engine, k) for k in settings} == settings, role


def test_dashboard_is_generated_and_queries_only_metrics_braid_exports():
    with open(os.path.join(CHART, "dashboards", "braid.json")) as f:
        assert f.read() == dashboard_json()
    exported = {f"ray_{m._name}" for m in metrics().values()}
    queries = " ".join(t["expr"] for p in grafana_dashboard()["panels"] for t in p["targets"])
    used = {w.split("[")[0].removesuffix("_bucket").removesuffix("_total")
            for w in queries.replace("(", " ").replace(")", " ").split() if w.startswith("ray_braid_")}
    assert used and used <= exported, used - exported
    dashboard = one(render(), "ConfigMap")
    assert json.loads(dashboard["data"]["braid.json"]) == grafana_dashboard()
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


@pytest.mark.parametrize("values, message", [
    ({"config": {"worker_replicas": -1}}, "/config/worker_replicas"),
    ({"workerGroups": {"workers": {"replicasPerPod": 0}}}, "/workerGroups/workers/replicasPerPod"),
    ({"config": {"worker_autoscaling": {"min_replicas": 0, "max_replicas": 2}}},
     "/config/worker_autoscaling"),
    ({"config": {"kv_transport": "pigeon"}}, "/config/kv_transport"),
    ({"config": {"attention": "flash"}}, "/config/attention"),
    ({"config": {"decode_graphs": True}}, "/config/decode_graphs"),
    ({"config": {"model_path": "/elsewhere"}}, "'model_path' not allowed"),
    ({"ingress": {"enabled": True, "tls": {"enabled": True}}}, "ingress.tls.secretName is required"),
    ({"redis": {"mode": "external"}}, "redis.external.url is required"),
    ({"config": {"gpus_per_worker": 1}}, "workerGroups.workers.gpus is 0"),
    ({"grpcPort": 70000}, "/grpcPort"),
    ({"config": {"worker_autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
     "config.worker_autoscaling: min_replicas (3) is above max_replicas (2)"),
    ({"config": {"synthesizer_autoscaling": {}}}, "missing properties 'min_replicas', 'max_replicas'"),
])
def test_bad_values_fail_at_render_naming_the_value(values, message):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert message in str(e.value)


def test_the_chart_wires_keys_redis_and_gpus_where_they_are_used():
    docs = render({**example("tls.yaml"), **example("external-redis.yaml")})
    rs = one(docs, "RayService")
    config = serve_config(docs)["applications"][0]["args"]["config"]
    cluster = rs["spec"]["rayClusterConfig"]
    # API keys: the Secret mounted on every Ray pod, at the file the app reads
    for template in pod_templates(rs):
        mounts = {m["name"]: m for m in template["spec"]["containers"][0]["volumeMounts"]}
        assert os.path.join(mounts["api-keys"]["mountPath"], "keys") == config["api_keys_file"]
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["BRAID_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "braid-redis", "key": "password"}
        assert template["spec"]["volumes"][-2]["hostPath"]["path"] == "/mnt/models/braid-reference"
    # one Redis for the control plane and GCS fault tolerance; external: no StatefulSet
    assert config["redis_url"] == "redis://redis.infra.svc.cluster.local:6379/2"
    gcs = cluster["gcsFaultToleranceOptions"]["redisAddress"]  # Ray takes host:port: no scheme, database, password
    assert gcs == "redis.infra.svc.cluster.local:6379" and int(gcs.rsplit(":", 1)[1]) == 6379
    assert cluster["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "braid-redis"
    assert not [d for d in docs if d["kind"] == "StatefulSet"] and cluster["authOptions"]["mode"] == "token"
    ingress = one(docs, "Ingress")
    assert ingress["spec"]["tls"] == [{"hosts": ["braid.example.com"], "secretName": "braid-tls"}]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == \
        one(docs, "Service")["metadata"]["name"]
    assert one(docs, "PodMonitor")["metadata"]["labels"]["release"] == "prometheus"
    # only this release's pods reach the Ray ports and Redis; the agent API and metrics are open
    policies = {d["metadata"]["name"]: d for d in render() if d["kind"] == "NetworkPolicy"}
    ray_policy = policies["braid-ray"]["spec"]["ingress"]
    assert ray_policy[0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "braid"
    assert {p["port"] for p in ray_policy[1]["ports"]} == {9000, 8080} and "braid-redis" in policies

    gpu = render(example("gpu.yaml"))
    groups = {g["groupName"]: g for g in one(gpu, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    # two worker replicas (1 GPU each) fit one 2-GPU pod; the synthesizer takes a 1-GPU pod
    assert groups["workers"]["replicas"] == 1 and groups["synthesizers"]["replicas"] == 1
    worker = groups["workers"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert groups["workers"]["rayStartParams"]["resources"] == '"{\\"braid_worker\\": 2}"'
    config = serve_config(gpu)["applications"][0]["args"]["config"]
    assert config["worker_resources"] == {"braid_worker": 1} and config["gpus_per_worker"] == 1
    assert one(gpu, "StatefulSet")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] \
        == "1Gi"


def test_autoscaling_and_colocated_shapes():
    docs = render(example("autoscaling.yaml"))
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert cluster["enableInTreeAutoscaling"] is True
    # 1-4 worker replicas at 2 a pod: 1-2 pods; 1-2 synthesizers at 1 a pod
    assert (groups["workers"]["minReplicas"], groups["workers"]["maxReplicas"]) == (1, 2)
    assert (groups["synthesizers"]["minReplicas"], groups["synthesizers"]["maxReplicas"]) == (1, 2)
    config = ClusterConfig.from_dict(serve_config(docs)["applications"][0]["args"]["config"], local_paths=False)
    assert config.worker_autoscaling.max_replicas == 4 and config.workflow_config().branch_groups == 4

    colocated = render(example("colocated.yaml"))
    cluster = one(colocated, "RayService")["spec"]["rayClusterConfig"]
    assert [g["groupName"] for g in cluster["workerGroupSpecs"]] == ["synthesizers"]
    assert cluster["workerGroupSpecs"][0]["replicas"] == 2 and cluster["enableInTreeAutoscaling"] is False
    assert "worker_resources" not in serve_config(colocated)["applications"][0]["args"]["config"]


def test_serve_config_cli_refuses_what_a_replica_would():
    for argv, message in [(["--set", "model_path=/m"], "needs redis_url"),
                          (["--set", "model_path=/m", "--set", "redis_url=localhost:6379"], "must start with redis://"),
                          (["--set", "model_path=/m", "--set", "redis_url=redis://r", "--set", "session_ttl_s=0"],
                           "session_ttl_s must be >= 1"),
                          (["--set", "model_path=/m", "--set", "redis_url=redis://r", "--set", "colour=blue"],
                           "unknown cluster config field(s) colour"),
                          (["--set", "model_path=/m", "--set", "redis_url=redis://r", "--set",
                            "worker_autoscaling={min_replicas: 3, max_replicas: 2}"], "min_replicas <= max_replicas")]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert braid_main(["serve-config", *argv]) == 2
        assert message in err.getvalue(), err.getvalue()



def test_image_and_chart_match_the_package():
    """The Dockerfile copies every package folder and pins torch as pyproject does; the chart's rayVersion is
    the ray the package pins (KubeRay starts that version's `ray start` in the image)."""
    import tomllib

    with open(os.path.join(ROOT, "..", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    with open(os.path.join(ROOT, "..", "Dockerfile")) as f:
        dockerfile = f.read()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line}
    assert set(project["tool"]["setuptools"]["package-dir"].values()) <= copied
    pins = dict(d.split("==") for d in project["project"]["dependencies"] if "==" in d)
    assert dockerfile.count(f"torch=={pins['torch']}") == 2
    with open(os.path.join(CHART, "values.yaml")) as f:
        assert yaml.safe_load(f)["rayVersion"] == pins["ray[serve]"]


def test_package_data_ships_every_file_of_the_reference_model():
    """A non-editable install (the image's `pip install /opt/braid`) holds only what pyproject's package-data
    globs name: every file under models/braid-reference must match one, as setuptools globs them (from the
    package's folder, `*` within one folder), or an install misses it (the turn LoRA once did)."""
    import glob
    import tomllib

    with open(os.path.join(ROOT, "..", "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    models = os.path.join(ROOT, "..", setuptools["package-dir"]["braid.models"])
    shipped = {os.path.normpath(path) for pattern in setuptools["package-data"]["braid.models"]
               for path in glob.glob(pattern, root_dir=models, recursive=True)
               if os.path.isfile(os.path.join(models, path))}
    files = {os.path.relpath(os.path.join(folder, name), models)
             for folder, _, names in os.walk(os.path.join(models, "braid-reference"))
             if "__pycache__" not in folder for name in names}
    assert os.path.join("braid-reference", "calibration", "turns", "adapter_model.safetensors") in files
    assert not files - shipped, f"not in pyproject's package-data for braid.models: {sorted(files - shipped)}"


def test_every_pod_reads_the_cluster_token_from_one_secret():
    """The replicas' shared secret for their internal KV ports: the chart's own Secret (48 random characters)
    unless values name one, read into $BRAID_CLUSTER_TOKEN on every Ray pod."""
    import base64

    from braid.kv.peer_auth import ENV

    for values, secret, key in (({}, "braid-cluster-token", "token"),
                                ({"clusterToken": {"secretName": "mine", "secretKey": "t"}}, "mine", "t")):
        docs = render(values)
        made = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
        if values:
            assert set(made) == {"braid-api-keys"}  # (the API key's, which the next test checks)
        else:
            own = made[secret]
            assert len(base64.b64decode(own["data"][key])) == 48
        for template in pod_templates(one(docs, "RayService")):
            env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
            assert env[ENV]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}


def test_the_agent_api_needs_a_key_unless_values_open_it():
    """By default the chart keeps a key Secret of its own (48 random characters, a valid key file) mounted on every
    Ray pod at the file the app reads its keys from; a Secret named in values takes its place; apiKeys.open serves
    without keys (no Secret, no mount, no key file), and refuses a Secret named beside it."""
    import base64

    from braid.api.auth import ApiKeys, client_metadata

    for values, secret in (({}, "braid-api-keys"), ({"apiKeys": {"secretName": "mine", "secretKey": "keys"}}, "mine"),
                           ({"apiKeys": {"open": True}}, None)):
        docs = render(values)
        config = serve_config(docs)["applications"][0]["args"]["config"]
        made = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
        assert ("braid-api-keys" in made) == (not values)
        if not values:  # (its entry is a key file as the ingress reads it, holding one key)
            key = base64.b64decode(made["braid-api-keys"]["data"]["keys"]).decode()
            assert len(key) == 48 and ApiKeys.parse([key], "the chart's Secret").check(client_metadata(key))
        assert config.get("api_keys_file") == (secret and "/etc/braid/api-keys/keys")
        for template in pod_templates(one(docs, "RayService")):
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            mounts = {m["name"]: m for m in template["spec"]["containers"][0]["volumeMounts"]}
            if secret is None:
                assert "api-keys" not in volumes and "api-keys" not in mounts
            else:
                assert volumes["api-keys"]["secret"] == {"secretName": secret}
                assert mounts["api-keys"] == {"name": "api-keys", "mountPath": "/etc/braid/api-keys",
                                              "readOnly": True}
    with pytest.raises(helm.HelmError) as e:
        render({"apiKeys": {"open": True, "secretName": "mine"}})
    assert "apiKeys.open serves the agent API without keys, but apiKeys.secretName names Secret mine" in str(e.value)
