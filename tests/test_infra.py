"""The cluster files agree with the code and with each other: manifests parse, entrypoints run our parsers,
versions match, every pod finds the target it is told to load, the service serves its draft's own target,
jobs fit the cluster's GPUs, and scheduled retrainings never overlap."""

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
IMAGE = "ghcr.io/eagle3-pipeline/eagle3-pipeline"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_manifests() -> dict[str, list[dict]]:
    return {p.name: documents(p) for p in sorted(INFRA.glob("*.yaml"))}


def job_parser(script: str):
    spec = importlib.util.spec_from_file_location(f"job_{Path(script).stem}", REPO / "jobs" / Path(script).name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def entrypoints() -> list[tuple[str, str]]:
    found = []
    for name, docs in all_manifests().items():
        for doc in docs:
            if doc.get("kind") == "RayJob":
                found.append((name, doc["spec"]["entrypoint"]))
    return found


def test_every_manifest_parses_and_has_a_kind():
    manifests = all_manifests()
    assert {"raycluster.yaml", "rayjob-extract.yaml", "rayjob-train.yaml", "rayjob-retrain.yaml",
            "retrain-schedule.yaml", "mlflow.yaml", "ray-up.yaml", "models.yaml"} <= set(manifests)
    for name, docs in manifests.items():
        assert docs, name
        for doc in docs:
            if name not in ("ray-up.yaml", "serve.yaml"):
                assert doc.get("apiVersion") and doc.get("kind"), name


@pytest.mark.parametrize("manifest,entrypoint", entrypoints())
def test_rayjob_entrypoints_name_scripts_whose_parsers_accept_the_arguments(manifest, entrypoint):
    argv = shlex.split(entrypoint)
    assert argv[0] == "python" and argv[1].startswith("/app/jobs/"), entrypoint
    script = REPO / "jobs" / Path(argv[1]).name
    assert script.is_file(), f"{manifest}: {argv[1]} does not exist in jobs/"
    job_parser(script.name).parse_args(argv[2:])  # SystemExit on an unknown or malformed argument


def test_images_and_ray_versions_agree_across_files():
    dockerfile = (INFRA / "Dockerfile").read_text()
    ray_version = re.search(r"ARG RAY_VERSION=(\S+)", dockerfile).group(1)
    images, versions = set(), set()
    for name, docs in all_manifests().items():
        text = (INFRA / name).read_text()
        images.update(re.findall(r"(ghcr\.io/eagle3-pipeline/[\w.-]+):([\w.-]+)", text))
        for doc in docs:
            if doc.get("kind") in ("RayCluster", "RayService"):
                versions.add(doc["spec"].get("rayVersion") or doc["spec"]["rayClusterConfig"]["rayVersion"])
    assert versions == {ray_version}
    project_version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert images == {(IMAGE, project_version)}
    ray_range = re.search(r'"ray\[[^\]]+\]([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    from packaging.specifiers import SpecifierSet

    assert ray_version in SpecifierSet(ray_range)


def _schedule():
    docs = {d["kind"]: d for d in documents(INFRA / "retrain-schedule.yaml")}
    cron = docs["CronJob"]["spec"]
    container = cron["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    return docs, cron, container


SUBMIT_SCRIPT = INFRA / "retrain-submit.sh"


def _runs_the_submit_script(container: dict, pod: dict) -> None:
    """The container runs infra/retrain-submit.sh from the ConfigMap that holds it beside the RayJob."""
    assert container["command"] == ["/bin/bash", "/rayjob/submit.sh"]
    mount = _mounts(pod)["/rayjob"]
    assert mount["configMap"]["name"] == "eagle3-retrain-rayjob"
    assert "--from-file=submit.sh=infra/retrain-submit.sh" in (INFRA / "retrain-schedule.yaml").read_text()
    assert "kubectl create -f /rayjob/rayjob.yaml" in SUBMIT_SCRIPT.read_text()


def test_schedule_submits_the_retrain_rayjob():
    docs, cron, container = _schedule()
    assert len(cron["schedule"].split()) == 5 and cron["concurrencyPolicy"] == "Forbid"
    _runs_the_submit_script(container, cron["jobTemplate"]["spec"]["template"]["spec"])
    rules = docs["Role"]["rules"][0]
    assert "rayjobs" in rules["resources"] and {"create", "get", "list"} <= set(rules["verbs"])
    env = {e["name"]: e["value"] for e in container["env"]}
    retrain = documents(INFRA / "rayjob-retrain.yaml")[0]
    key, value = env["SELECTOR"].split("=")
    assert retrain["metadata"]["labels"][key] == value  # the running-job check finds what the pod creates
    assert cron["jobTemplate"]["spec"]["activeDeadlineSeconds"] < 7 * 24 * 3600  # weekly schedule


FAKE_KUBECTL = """#!/bin/bash
echo "$*" >> "$FAKE/calls"
case "$1 $2" in
  "create -f") echo rayjob.ray.io/eagle3-retrain-x1 ;;
  "get rayjobs") cat "$FAKE/listing" ;;
  "get configmap") cat "$FAKE/configmap-$3" ;;
  "patch configmap") ;;
  "get rayjob.ray.io/eagle3-retrain-x1")
      line=$(head -n 1 "$FAKE/states"); sed -i 1d "$FAKE/states"; echo "${line:-Failed/EXHAUSTED}" ;;
  *) exit 2 ;;
esac
"""


def _run_schedule(tmp_path, listing: str, states: list[str], container: dict | None = None,
                  configmaps: dict | None = None):
    """Run the CronJob's script (infra/retrain-submit.sh, with the container's environment: the weekly CronJob's
    unless `container` says otherwise) against a fake kubectl; returns (exit code, kubectl calls)."""
    container = container or _schedule()[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    (tmp_path / "listing").write_text(listing)
    (tmp_path / "states").write_text("".join(f"{s}\n" for s in states))
    (tmp_path / "calls").write_text("")
    for name, value in (configmaps or {}).items():
        (tmp_path / f"configmap-{name}").write_text(value)
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]},
           "POLL_SECONDS": "0", "FAKE": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["/bin/bash", str(SUBMIT_SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, (tmp_path / "calls").read_text().splitlines()


@pytest.mark.parametrize("listing", ["eagle3-retrain-a Running\n", "eagle3-retrain-a Complete\neagle3-retrain-b \n",
                                     "eagle3-retrain-a Suspended\n"])
def test_schedule_never_starts_a_retrain_while_one_is_unfinished(tmp_path, listing):
    code, calls = _run_schedule(tmp_path, listing, [])
    assert code == 0 and not any(c.startswith("create") for c in calls)


@pytest.mark.parametrize("states,code", [(["/", "Initializing/PENDING", "Running/RUNNING", "Complete/SUCCEEDED"], 0),
                                         (["Running/RUNNING", "Failed/FAILED"], 1),
                                         (["Complete/FAILED"], 1)])
def test_schedule_creates_one_retrain_and_waits_for_its_end(tmp_path, states, code):
    """The pod lives as long as its RayJob, so `concurrencyPolicy: Forbid` covers the RayJob too."""
    got, calls = _run_schedule(tmp_path, "eagle3-retrain-a Complete\neagle3-retrain-b Failed\n", states)
    assert got == code
    assert sum(c.startswith("create") for c in calls) == 1
    assert sum(c.startswith("get rayjob.ray.io/") for c in calls) == len(states)  # polled until the end


def test_rayservice_deploys_the_serve_yaml_applications():
    serve = documents(INFRA / "serve.yaml")[0]
    service = documents(INFRA / "rayservice.yaml")[0]
    deployed = yaml.safe_load(service["spec"]["serveConfigV2"])
    ours, theirs = serve["applications"], deployed["applications"]
    assert len(ours) == len(theirs) == 1
    for key in ("name", "route_prefix", "import_path"):
        assert ours[0][key] == theirs[0][key]
    differing = {k for k in set(ours[0]["args"]) | set(theirs[0]["args"])
                 if ours[0]["args"].get(k) != theirs[0]["args"].get(k)}
    # the cluster's target (next test), the same champion alias; on Kubernetes the bearer token from a Secret file
    assert differing <= {"target", "model_name", "api_key_file"}
    assert theirs[0]["args"]["draft"] == ours[0]["args"]["draft"] == "models:/eagle3-draft@champion"
    assert serve["http_options"]["host"] == "127.0.0.1"


@pytest.mark.parametrize("config", ["serve.yaml", "rayservice.yaml"])
def test_serve_config_imports_and_builds_the_app(config):
    """The import path resolves and the builder accepts every arg (it refuses unknown keys)."""
    from ray.serve import Application

    doc = documents(INFRA / config)[0]
    apps = (yaml.safe_load(doc["spec"]["serveConfigV2"]) if config == "rayservice.yaml" else doc)["applications"]
    for app in apps:
        module, attr = app["import_path"].split(":")
        builder = getattr(importlib.import_module(module), attr)
        assert isinstance(builder(dict(app["args"])), Application)


# ---------------------------------------------------------------------------------------------------
# every pod finds its target; the service serves its draft's own target


def ray_pod_specs() -> list[tuple[str, dict]]:
    """(where, pod spec) of every Ray pod: RayCluster and RayService heads and worker groups."""
    found = []
    for name, docs in all_manifests().items():
        for doc in docs:
            spec = {"RayCluster": lambda d: d["spec"], "RayService": lambda d: d["spec"]["rayClusterConfig"]}.get(
                doc.get("kind"), lambda d: None)(doc)
            if spec is None:
                continue
            found.append((f"{name} head", spec["headGroupSpec"]["template"]["spec"]))
            for group in spec["workerGroupSpecs"]:
                found.append((f"{name} {group['groupName']}", group["template"]["spec"]))
    return found


def _mounts(pod: dict) -> dict[str, dict]:
    """mount path -> the volume behind it, for the pod's first container."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in pod["containers"][0].get("volumeMounts", [])}


def _models():
    docs = documents(INFRA / "models.yaml")
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    job = next(d for d in docs if d["kind"] == "Job")
    return claim, job


def _parsed(manifest: str):
    doc = documents(INFRA / manifest)[0]
    argv = shlex.split(doc["spec"]["entrypoint"])
    return doc, job_parser(Path(argv[1]).name).parse_args(argv[2:])


def _served_args() -> dict:
    service = documents(INFRA / "rayservice.yaml")[0]
    return yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]


def test_the_model_volume_is_filled_from_the_hub_with_a_token_secret():
    claim, job = _models()
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", env["TARGET_REPO"]["value"])  # a hub model id
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
    assert "snapshot_download" in container["args"][0]
    mount = _mounts(pod)
    target_dir = env["TARGET_DIR"]["value"]
    root = next(p for p in mount if target_dir.startswith(p + "/"))
    assert mount[root]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


@pytest.mark.parametrize("where,pod", ray_pod_specs(), ids=[w for w, _ in ray_pod_specs()])
def test_ray_pods_mount_the_models_and_a_memory_dev_shm(where, pod):
    claim, job = _models()
    mounts = _mounts(pod)
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", where
    download_mounts = _mounts(job["spec"]["template"]["spec"])
    for path, volume in download_mounts.items():  # the same claim, at the same path as the download Job
        assert mounts[path]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], where


def test_every_target_a_manifest_names_is_the_downloaded_one():
    """RayJobs and the Serve app load /models/... paths: each must be the folder the download Job fills."""
    _, job = _models()
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    targets = {manifest: _parsed(manifest)[1].target for manifest, _ in entrypoints()}
    targets["rayservice.yaml"] = _served_args()["target"]
    for manifest, target in targets.items():
        assert target == env["TARGET_DIR"], f"{manifest} loads {target!r}, which no manifest provides"


def test_the_service_serves_the_target_its_draft_was_trained_on():
    """The champion alias is written by the jobs that register into that model; they train on one target."""
    args = _served_args()
    registered = re.fullmatch(r"models:/([^@/]+)@champion", args["draft"]).group(1)
    trainers = {}
    for manifest, _ in entrypoints():
        _, parsed = _parsed(manifest)
        name = getattr(parsed, "registered_model", None) or getattr(parsed, "registered_model_name", None)
        if name == registered:
            trainers[manifest] = parsed.target
    assert set(trainers) == {"rayjob-retrain.yaml", "rayjob-train.yaml"}
    assert set(trainers.values()) == {args["target"]}


def test_rayjob_train_resumes_when_rerun():
    doc, args = _parsed("rayjob-train.yaml")
    assert args.resume  # train.py refuses to touch an existing --output without it
    assert "resumes" in (INFRA / "rayjob-train.yaml").read_text()


def _cluster_max_gpus() -> int:
    cluster = documents(INFRA / "raycluster.yaml")[0]["spec"]
    return sum(int(g["maxReplicas"]) * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get(
        "nvidia.com/gpu", 0)) for g in cluster["workerGroupSpecs"])


def _extract_gpus(cfg) -> float:
    stages = 2 if cfg.regenerate else 1  # regenerate and extract run as two fixed-size actor pools at once
    return stages * cfg.num_workers * (cfg.gpus_per_worker if cfg.gpus_per_worker is not None else 1)


def _train_gpus(cfg) -> float:
    return cfg.num_workers * (1 if cfg.use_gpu else 0)


def test_rayjob_retrain_runs_on_gpus_and_its_overrides_are_config_fields():
    from pipelines.extract import ExtractConfig
    from pipelines.train import TrainJobConfig

    doc, args = _parsed("rayjob-retrain.yaml")
    assert doc["spec"]["entrypointNumGpus"] >= 1  # the driver evaluates drafts with the target
    for overrides, cls in ((args.extract, ExtractConfig), (args.train, TrainJobConfig)):
        assert set(overrides) <= {f.name for f in dataclasses.fields(cls)}, cls.__name__
    extract = ExtractConfig(**args.extract)
    train = TrainJobConfig(**{**args.train, "features": "s3://x"})  # retrain adds features, target, output
    assert extract.gpus_per_worker >= 1 and train.use_gpu


def test_every_rayjob_fits_the_clusters_gpus():
    """Fixed-size actor pools and Ray Train workers wait forever for GPUs the autoscaler can never add."""
    from pipelines.extract import ExtractConfig
    from pipelines.train import TrainJobConfig

    limit = _cluster_max_gpus()
    assert limit >= 1
    for manifest, _ in entrypoints():
        doc, args = _parsed(manifest)
        driver = doc["spec"].get("entrypointNumGpus", 0)
        if manifest == "rayjob-extract.yaml":
            need = _extract_gpus(args)
        elif manifest == "rayjob-train.yaml":
            need = _train_gpus(args)
        elif manifest == "rayjob-retrain.yaml":  # extraction, then training, one after the other
            train = TrainJobConfig(**{**args.train, "features": "s3://x"})
            need = max(_extract_gpus(ExtractConfig(**args.extract)), _train_gpus(train))
        else:
            raise AssertionError(f"no GPU accounting for {manifest}")
        assert driver + need <= limit, f"{manifest} needs {driver + need} GPUs, the cluster has at most {limit}"


def test_image_installs_the_object_store_extras():
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert re.search(r'pip install [^\n]*-e "\.\[[^\]]*s3[^\]]*\]"', dockerfile)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^s3 = \["s3fs', pyproject, re.M) and re.search(r'^gcs = \["gcsfs', pyproject, re.M)


# ---------------------------------------------------------------------------------------------------
# closed to strangers: every pod non-root with limits, images pinned, Ray and MLflow behind auth and policies

def pod_specs() -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod any manifest makes: workloads, Ray heads and workers, RayJob submitters."""
    found = list(ray_pod_specs())
    for name, docs in all_manifests().items():
        for doc in docs:
            kind = doc.get("kind")
            if kind in ("Deployment", "StatefulSet", "Job"):
                found.append((f"{name} {kind}", doc["spec"]["template"]["spec"]))
            elif kind == "CronJob":
                found.append((f"{name} CronJob", doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
            elif kind == "RayJob":
                found.append((f"{name} submitter", doc["spec"]["submitterPodTemplate"]["spec"]))
    return found


@pytest.mark.parametrize("where,pod", pod_specs(), ids=[w for w, _ in pod_specs()])
def test_every_pod_runs_non_root_without_escalation_and_with_limits(where, pod):
    pod_ctx = pod.get("securityContext", {})
    for container in pod["containers"] + pod.get("initContainers", []):
        ctx = container.get("securityContext", {})
        assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, where
        assert ctx.get("runAsUser", pod_ctx.get("runAsUser", 1)) != 0, where
        assert ctx.get("allowPrivilegeEscalation") is False and not ctx.get("privileged"), where
        assert "ALL" in ctx.get("capabilities", {}).get("drop", []), where
        limits = container.get("resources", {}).get("limits", {})
        assert limits.get("cpu") and limits.get("memory"), f"{where}: {container['name']} has no cpu/memory limit"


def test_every_image_is_ours_at_the_project_version_or_pinned():
    """Our image by its release tag (the previous test of versions); any other by digest or an exact x.y version;
    nothing from Bitnami's withdrawn free catalog, no `latest`."""
    texts = {p.name: p.read_text() for p in sorted(INFRA.glob("*.yaml"))}
    images = [(name, image) for name, text in texts.items() for image in re.findall(r"image:\s*(\S+)", text)]
    assert images
    for name, image in images:
        assert "bitnami" not in image and not image.endswith(":latest"), (name, image)
        if image.startswith(IMAGE + ":"):
            continue
        assert re.search(r"@sha256:[0-9a-f]{64}$", image) or re.search(r":\d+\.\d+(\.\d+)?$", image), (name, image)
    dockerfile = (INFRA / "Dockerfile").read_text()
    kubectl = re.search(r"COPY --from=(\S+)\s+\\?\s*/bin/kubectl", dockerfile)
    assert kubectl and re.fullmatch(r"registry\.k8s\.io/kubectl:v[\d.]+@sha256:[0-9a-f]{64}", kubectl.group(1))
    schedule = _schedule()[2]
    assert schedule["image"].startswith(IMAGE + ":")  # the image that holds that kubectl and bash


def _ray_cluster_specs() -> list[tuple[str, dict]]:
    out = []
    for name, docs in all_manifests().items():
        for doc in docs:
            if doc.get("kind") == "RayCluster":
                out.append((name, doc["spec"]))
            elif doc.get("kind") == "RayService":
                out.append((name, doc["spec"]["rayClusterConfig"]))
    return out


def test_ray_clusters_require_a_token_and_open_no_client_port():
    specs = _ray_cluster_specs()
    assert {name for name, _ in specs} == {"raycluster.yaml", "rayservice.yaml"}
    for name, spec in specs:
        assert spec["authOptions"]["mode"] == "token" and spec["authOptions"]["secretName"], name
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            for container in group["template"]["spec"]["containers"]:
                ports = {p["containerPort"] for p in container.get("ports", [])}
                assert 10001 not in ports, f"{name}: the Ray Client port is opened"
    for manifest in ("rayjob-extract.yaml", "rayjob-train.yaml", "rayjob-retrain.yaml"):
        submitter = documents(INFRA / manifest)[0]["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
        env = {e["name"]: e for e in submitter["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "auth_token", manifest


# ---------------------------------------------------------------------------------------------------
# issue 54: who reaches which port, who holds which credential -- the manifests evaluated as a table
# (no live cluster here: the NetworkPolicies are evaluated by Kubernetes' rules against the labels of every pod
# the manifests make, plus the pods and namespaces outside them that matter; docs/deployment.md holds the tables)

NAMESPACE = "eagle3"  # where the manifests are applied
# namespaces a connection can come from, with the labels the setup gives them (docs/deployment.md)
NAMESPACES = {NAMESPACE: {}, "ray-system": {}, "operators": {"eagle3.io/ray-operators": "true"},
              "serve-clients": {"eagle3.io/serve-clients": "true"}, "elsewhere": {}}
OTHER_PORT = 10002  # stands for every port no rule names (raylets, object transfers, NCCL)


@dataclasses.dataclass
class Pod:
    name: str
    namespace: str
    labels: dict
    spec: dict | None = None  # the pod spec where a manifest makes it
    ray_token: str | None = None  # the Secret whose Ray token KubeRay injects (authOptions)


def _ray_pods(name: str, label: str, cluster: str, spec: dict) -> list[Pod]:
    token = spec["authOptions"]["secretName"]
    base = {"ray.io/is-ray-node": "yes", "ray.io/cluster": cluster}
    groups = [("head", spec["headGroupSpec"])] + [(f"{g['groupName']} worker", g) for g in spec["workerGroupSpecs"]]
    return [Pod(f"{label} {kind}", NAMESPACE,
                {**base, "ray.io/node-type": kind.split()[-1],
                 **group["template"].get("metadata", {}).get("labels", {})}, group["template"]["spec"], token)
            for kind, group in groups]


def manifest_pods() -> list[Pod]:
    """Every pod the manifests make, with the labels Kubernetes and KubeRay give it."""
    pods = []
    for name, docs in all_manifests().items():
        for doc in docs:
            kind = doc.get("kind")
            if kind == "RayCluster":
                pods += _ray_pods("training", "training", doc["metadata"]["name"], doc["spec"])
            elif kind == "RayService":
                pods += _ray_pods("serving", "serving", doc["metadata"]["name"] + "-raycluster",
                                  doc["spec"]["rayClusterConfig"])
            elif kind == "RayJob":
                template = doc["spec"]["submitterPodTemplate"]
                pods.append(Pod(f"submitter of {name}", NAMESPACE, template.get("metadata", {}).get("labels", {}),
                                template["spec"]))
            elif kind in ("Deployment", "StatefulSet", "Job", "CronJob"):
                template = doc["spec"]["jobTemplate"]["spec"]["template"] if kind == "CronJob" else doc["spec"]["template"]
                pods.append(Pod(f"{kind} {doc['metadata'].get('name') or name}", doc["metadata"].get("namespace", NAMESPACE),
                                template.get("metadata", {}).get("labels", {}), template["spec"]))
    return pods


OUTSIDE_PODS = [Pod("KubeRay operator", "ray-system", {"app.kubernetes.io/name": "kuberay-operator"}),
                Pod("operators' namespace", "operators", {}),
                Pod("serve clients' namespace (ingress)", "serve-clients", {}),
                Pod("any other pod in eagle3", NAMESPACE, {"app": "something-else"}),
                Pod("any other namespace", "elsewhere", {})]


def _selects(selector: dict, labels: dict) -> bool:
    if set(selector) - {"matchLabels"}:
        raise AssertionError(f"selector {selector}: only matchLabels is evaluated here")
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def network_policies() -> list[tuple[str, dict]]:
    return [(doc["metadata"].get("namespace", NAMESPACE), doc) for docs in all_manifests().values() for doc in docs
            if doc.get("kind") == "NetworkPolicy"]


def _peer_admits(peer: dict, source: Pod, namespace: str) -> bool:
    if "ipBlock" in peer:
        return True  # an address range: anyone, as far as this table is concerned
    namespaces = peer.get("namespaceSelector")
    in_namespace = (_selects(namespaces, {"kubernetes.io/metadata.name": source.namespace,
                                          **NAMESPACES[source.namespace]})
                    if namespaces is not None else source.namespace == namespace)
    return in_namespace and ("podSelector" not in peer or _selects(peer["podSelector"], source.labels))


def admitted(source: Pod, dest: Pod, port: int) -> bool:
    """Kubernetes' ingress rule: a pod no policy selects admits everything; one that some policy selects admits
    what any rule of any of those policies admits (a rule without ports: every port; without from: everyone)."""
    selecting = [(ns, p) for ns, p in network_policies()
                 if ns == dest.namespace and "Ingress" in p["spec"]["policyTypes"]
                 and _selects(p["spec"]["podSelector"], dest.labels)]
    if not selecting:
        return True
    for namespace, policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if not rule.get("from") or any(_peer_admits(peer, source, namespace) for peer in rule["from"]):
                return True
    return False


def _pod(name: str) -> Pod:
    return next(p for p in manifest_pods() if p.name == name)


def reachability_columns() -> list[tuple[str, list[Pod], int]]:
    training = [p for p in manifest_pods() if p.name.startswith("training ")]
    serving = [p for p in manifest_pods() if p.name.startswith("serving ")]
    return [("training head 8265 (jobs)", [_pod("training head")], 8265),
            ("training head 6379 (GCS)", [_pod("training head")], 6379),
            ("training pods, other ports", training, OTHER_PORT),
            ("serving head 8265", [_pod("serving head")], 8265),
            ("serving head 8000 (API)", [_pod("serving head")], 8000),
            ("serving pods, other ports", serving, OTHER_PORT),
            ("MLflow 5000", [_pod("Deployment mlflow")], 5000),
            ("database 5432", [_pod("StatefulSet mlflow-db")], 5432)]


def reachability_table() -> str:
    """Markdown: a row per source pod, a column per destination port; "yes" when every pod of the column admits
    the source on that port, "some" when only some do, "-" when none does."""
    columns = reachability_columns()
    lines = ["| from \\ to | " + " | ".join(c[0] for c in columns) + " |", "|---|" + "---|" * len(columns)]
    for source in manifest_pods() + OUTSIDE_PODS:
        cells = []
        for _, dests, port in columns:
            got = [admitted(source, d, port) for d in dests if d is not source]
            cells.append("yes" if got and all(got) else "some" if any(got) else "-")
        lines.append(f"| {source.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _documented(table: str, doc: Path = REPO / "docs" / "deployment.md") -> None:
    assert table in doc.read_text(), f"{doc} must hold this table, as the manifests give it:\n{table}"


def test_the_reachability_table_is_the_documented_one():
    _documented(reachability_table())


def test_no_serving_pod_reaches_the_training_cluster_and_only_submitters_reach_its_jobs_port():
    """Issue 54 (1): a serving replica taken over must not `ray job submit` to the training head (it would run code
    with training's read-write S3 key and MLflow MANAGE), nor reach any other port of that cluster."""
    pods = manifest_pods()
    training = [p for p in pods if p.name.startswith("training ")]
    serving = [p for p in pods if p.name.startswith("serving ")]
    assert len(training) >= 2 and len(serving) >= 2
    for source in serving:
        for dest in training:
            for port in (8265, 6379, 10001, 8000, OTHER_PORT):
                assert not admitted(source, dest, port), f"{source.name} reaches {dest.name}:{port}"
    head = _pod("training head")
    jobs_port = {p.name for p in pods + OUTSIDE_PODS if p is not head and admitted(p, head, 8265)}
    submitters = {p.name for p in pods if p.name.startswith("submitter of ")}
    assert submitters and jobs_port == {p.name for p in training if p is not head} | submitters | {
        "KubeRay operator", "operators' namespace"}
    gcs = {p.name for p in pods + OUTSIDE_PODS if p is not head and admitted(p, head, 6379)}
    assert gcs == {p.name for p in training if p is not head}


def test_each_ray_cluster_has_a_token_of_its_own():
    pods = manifest_pods()
    tokens = {p.name.split()[0]: p.ray_token for p in pods if p.ray_token}
    assert set(tokens) == {"training", "serving"} and tokens["training"] != tokens["serving"]
    for pod in pods:
        if pod.name.startswith("serving "):
            assert tokens["training"] not in yaml.safe_dump(pod.spec), pod.name


def rbac_rights() -> dict[str, list[dict]]:
    """service account -> the rules every Role bound to it grants (the manifests bind Roles to accounts only)."""
    docs = [d for ds in all_manifests().values() for d in ds]
    roles = {d["metadata"]["name"]: d.get("rules", []) for d in docs if d.get("kind") == "Role"}
    rights: dict[str, list[dict]] = {}
    for binding in (d for d in docs if d.get("kind") == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role", binding["metadata"]["name"]  # no ClusterRole anywhere
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", binding["metadata"]["name"]
            rights.setdefault(subject["name"], []).extend(roles[binding["roleRef"]["name"]])
    return rights


def _secrets(spec: dict) -> set[str]:
    found = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
    for container in spec["containers"] + spec.get("initContainers", []):
        found |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
        found |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    return found


def _rule_text(rule: dict) -> str:
    names = "/" + ",".join(rule["resourceNames"]) if rule.get("resourceNames") else ""
    return f"{','.join(rule['verbs'])} {','.join(rule['resources'])}{names}"


def credentials_table() -> str:
    """Markdown: a row per pod the manifests make: the Secrets it reads (env, envFrom, volumes), the Ray token
    KubeRay injects into it, its service account and what that account may do in the Kubernetes API."""
    rights = rbac_rights()
    lines = ["| pod | Secrets | Ray token | service account | Kubernetes API |", "|---|---|---|---|---|"]
    for pod in manifest_pods():
        account = pod.spec.get("serviceAccountName", "default")
        api = "; ".join(_rule_text(r) for r in rights.get(account, [])) or "-"
        lines.append(f"| {pod.name} | {', '.join(sorted(_secrets(pod.spec))) or '-'} | {pod.ray_token or '-'} | "
                     f"{account} | {api} |")
    return "\n".join(lines)


def test_the_credentials_table_is_the_documented_one():
    _documented(credentials_table())


WORKLOADS = {"pods", "pods/exec", "jobs", "cronjobs", "deployments", "statefulsets", "daemonsets", "replicasets",
             "rayjobs", "rayclusters", "rayservices", "secrets", "serviceaccounts", "roles", "rolebindings"}


def test_the_serving_identity_can_start_no_workload_and_only_record_a_drift_alert():
    """Issue 54 (2): a pod that can create Jobs can run any image with any Secret of the namespace mounted; the
    serving pods' account may only get and patch the one ConfigMap where its drift hook records an alert."""
    accounts = {p.spec.get("serviceAccountName", "default") for p in manifest_pods() if p.name.startswith("serving ")}
    assert accounts == {"eagle3-serve"}
    rules = rbac_rights().get("eagle3-serve", [])
    for rule in rules:
        assert not set(rule["resources"]) & WORKLOADS, rule
    assert rules == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["eagle3-drift-alert"],
                      "verbs": ["get", "patch"]}]


def test_serving_pods_wait_for_the_apps_graceful_shutdown():
    """Issue 54 (12): Kubernetes kills a pod `terminationGracePeriodSeconds` (30 by default) after SIGTERM; the Serve
    app lets requests finish for `graceful_shutdown_timeout_s` (request_timeout_s + drain_s, build_app) and then
    writes the sink's buffered rows for up to traffic_close_s: every serving pod must wait for all of it."""
    from pipelines.serve.app import split_args

    config, _ = split_args(dict(_served_args()))
    needed = config.request_timeout_s + config.drain_s + config.traffic_close_s
    for pod in manifest_pods():
        if pod.name.startswith("serving "):
            assert pod.spec.get("terminationGracePeriodSeconds", 30) > needed, pod.name


def _drift_cronjob() -> tuple[dict, dict]:
    cron = next(d for d in documents(INFRA / "retrain-on-drift.yaml") if d["kind"] == "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return cron, pod


def test_drift_alerts_are_acted_on_by_the_retraining_identity_with_the_weekly_script():
    cron, pod = _drift_cronjob()
    weekly = _schedule()[1]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == weekly["serviceAccountName"] == "eagle3-retrain"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    _runs_the_submit_script(pod["containers"][0], pod)
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["SELECTOR"] == {e["name"]: e["value"] for e in weekly["containers"][0]["env"]}["SELECTOR"]
    configmaps = {d["metadata"]["name"] for d in documents(INFRA / "retrain-on-drift.yaml") if d["kind"] == "ConfigMap"}
    assert {env["DRIFT_ALERT"], env["DRIFT_HANDLED"]} == configmaps
    writable = {n for r in rbac_rights()["eagle3-serve"] if "patch" in r["verbs"] for n in r["resourceNames"]}
    assert env["DRIFT_HANDLED"] not in writable  # the serving identity cannot reset the retraining's record
    assert int(env["DRIFT_MIN_INTERVAL_S"]) >= 3600


@pytest.mark.parametrize("alert,handled_ago,listing,created", [
    ("now-60", 2 * 86400, "", True),  # a new alert, the last retraining on drift long ago: one RayJob
    ("now-60", 600, "", False),  # a new alert within the minimum interval: nothing
    ("0", 2 * 86400, "", False),  # no alert recorded
    ("now-60", 2 * 86400, "eagle3-retrain-a Running\n", False),  # a retraining is running: kept for later
    ("$(touch /tmp/x)", 2 * 86400, "", False),  # what the serving identity may write is read as a number or nothing
    ("now+86400", 2 * 86400, "", False)])  # an alert from the future is none
def test_the_drift_cronjob_starts_one_retraining_per_new_alert_at_most_once_an_interval(
        tmp_path, alert, handled_ago, listing, created):
    import time

    now = int(time.time())
    value = str(eval(alert, {"now": now})) if alert.startswith("now") else alert
    _, pod = _drift_cronjob()
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    code, calls = _run_schedule(tmp_path, listing, ["Complete/SUCCEEDED"], container=pod["containers"][0],
                                configmaps={env["DRIFT_ALERT"]: value, env["DRIFT_HANDLED"]: str(now - handled_ago)})
    assert code == 0
    creates = [c for c in calls if c.startswith("create")]
    patches = [c for c in calls if c.startswith("patch")]
    assert len(creates) == int(created)
    assert len(patches) == int(created) and all(f"configmap {env['DRIFT_HANDLED']} " in c for c in patches)


def _mlflow():
    docs = documents(INFRA / "mlflow.yaml")
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return docs, container


def _tracking_hosts() -> set[str]:
    """host:port of every MLFLOW_TRACKING_URI a manifest gives its pods or jobs."""
    uris = set()
    for p in INFRA.glob("*.yaml"):
        uris.update(re.findall(r"MLFLOW_TRACKING_URI\W+(?:value:\s*)?\"?(http://[^\s\"}]+)", p.read_text()))
    assert uris
    return {u.removeprefix("http://").rstrip("/") for u in uris}


def test_mlflow_accepts_its_service_names_requires_auth_and_keeps_passwords_off_command_lines():
    docs, container = _mlflow()
    command = container.get("command", []) + container.get("args", [])
    flags = dict(a.removeprefix("--").split("=", 1) for a in command if a.startswith("--") and "=" in a)
    assert _tracking_hosts() <= set(flags["allowed-hosts"].split(","))
    assert flags["app-name"] == "basic-auth"
    text = " ".join(command)
    assert "pip install" not in text and "${" not in text and "$(" not in text
    assert not re.search(r"postgresql://[^@/]*:[^@/]*@", text)  # no password in the URI
    env = {e["name"]: e for e in container["env"]}
    for name in ("PGPASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD"):
        assert env[name]["valueFrom"]["secretKeyRef"], name
    ini = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["basic_auth.ini"]
    assert "admin_password" not in ini and not re.search(r"postgresql://[^@/]*:[^@/]*@", ini)
    for where, pod in ray_pod_specs():  # Ray pods log in to it with a Secret's credentials (serving: its own)
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        secret = "mlflow-serve-reader" if where.startswith("rayservice.yaml") else "mlflow-client"
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == secret, where
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["mlflow-db"]["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"app": "mlflow"}}}]
    assert policies["mlflow"]["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 5000}]


def test_the_served_api_key_is_a_secret_file_on_every_replica_pod():
    args = _served_args()
    folder = os.path.dirname(args["api_key_file"])
    assert "api_key" not in args
    service = documents(INFRA / "rayservice.yaml")[0]["spec"]["rayClusterConfig"]
    for group in [service["headGroupSpec"], *service["workerGroupSpecs"]]:
        mounts = _mounts(group["template"]["spec"])
        assert mounts[folder]["secret"]["secretName"] == "eagle3-serve-api-key"
    for p in INFRA.glob("*.yaml"):
        assert "EAGLE3_SERVE_API_KEY:" not in p.read_text() and "name: EAGLE3_SERVE_API_KEY\n" not in p.read_text()


def test_serving_beyond_loopback_without_a_key_is_refused(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("job_serve", REPO / "jobs" / "serve.py")
    serve_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_job)
    for name in ("EAGLE3_SERVE_API_KEY", "EAGLE3_SERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="refusing to serve on 0.0.0.0:8000 without an API key"):
        serve_job.main(["--host", "0.0.0.0"])
    from pipelines.serve.config import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("eagle3.example.com")


@pytest.fixture(scope="module")
def auth_mlflow(tmp_path_factory):
    """`mlflow server` started with the manifest's own --allowed-hosts (plus its own loopback address, for the
    Python clients of the lock test) and --app-name (its basic auth, which needs Flask-WTF, `mlflow[auth]`, as the
    image installs it); stores swapped for local ones, bound to 127.0.0.1. Yields (port, admin password)."""
    pytest.importorskip("flask_wtf", reason="MLflow's basic-auth app needs Flask-WTF: pip install 'mlflow[auth]'")
    import sys

    from process_helpers import free_port, kill_session, wait_until

    tmp_path = tmp_path_factory.mktemp("mlflow-auth")
    _, container = _mlflow()
    port = free_port()
    args = []
    for arg in container["command"][2:]:
        key = arg.split("=", 1)[0]
        if key in ("--host", "--port", "--backend-store-uri", "--artifacts-destination", "--workers"):
            continue
        if key == "--allowed-hosts":
            arg += f",127.0.0.1:{port}"
        args.append(arg)
    args += ["--host=127.0.0.1", f"--port={port}", "--workers=1",
             f"--backend-store-uri=sqlite:///{tmp_path / 'mlflow.db'}", f"--artifacts-destination={tmp_path / 'a'}"]
    ini = tmp_path / "basic_auth.ini"
    ini.write_text(documents(INFRA / "mlflow.yaml")[2]["data"]["basic_auth.ini"].replace(
        "postgresql://mlflow@mlflow-db:5432/mlflow", f"sqlite:///{tmp_path / 'auth.db'}"))
    # the container's environment as the manifest gives it; each Secret's value made up here
    env = {**os.environ}
    for e in container["env"]:
        env[e["name"]] = e.get("value") or f"secret-{e['valueFrom']['secretKeyRef']['key']}-Passw0rd!"
    env.pop("PGPASSWORD", None)
    env["MLFLOW_AUTH_CONFIG_PATH"] = str(ini)
    password = env["MLFLOW_AUTH_ADMIN_PASSWORD"]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", *args], env=env,
                              cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "server.log", "w"))
    try:
        wait_until(lambda: server.poll() is not None or _status(port, password, "127.0.0.1:5000", True) != -1,
                   "the MLflow server", timeout=240)
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        yield port, password
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        kill_session(server.pid)


def _status(port: int, password: str, host_header: str, auth: bool) -> int:
    import urllib.error
    import urllib.request
    from base64 import b64encode

    headers = {"Host": host_header}
    if auth:
        headers["Authorization"] = "Basic " + b64encode(f"admin:{password}".encode()).decode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return -1


@pytest.mark.slow
def test_mlflow_server_with_the_manifests_flags_admits_the_service_name_and_only_with_credentials(auth_mlflow):
    """A request with the cluster's Host header is answered with the admin's credentials (401 without them), one
    with a foreign Host header gets 403. (A second server, with --allowed-hosts alone, ran here until the suite had
    to fit 15 minutes: the manifest always sets both, and the Host check is the same one.)"""
    import time

    port, password = auth_mlflow
    host = sorted(_tracking_hosts())[0]
    time.sleep(1)
    assert _status(port, password, host, True) == 200
    assert _status(port, password, host, False) == 401
    assert _status(port, password, "attacker.example:5000", True) == 403


@pytest.mark.slow
def test_a_promotion_lock_made_by_another_mlflow_user_is_refused_at_once_naming_it(auth_mlflow, monkeypatch):
    """Issue 54 (3), on the manifest's MLflow with basic auth: the read-only serving user may create registered
    models, so it can create `<model>.promotion-lock` with a far-future expiry, which the trainers can neither take
    over nor delete. A trainer must refuse it at once, naming it, not wait `wait_s` for an expiry that never comes;
    a lock another process of the trainers' own user holds is still waited for (a plain PromotionConflict)."""
    import json as _json
    import time
    import urllib.request
    from base64 import b64encode

    from mlflow import MlflowClient

    from pipelines.promotion_lock import ForeignLock, PromotionConflict, PromotionLease

    port, password = auth_mlflow
    url = f"http://127.0.0.1:{port}"
    for user in ("eagle3", "eagle3-serve"):  # docs/deployment.md: the trainers' user, the serving reader
        request = urllib.request.Request(
            f"{url}/api/2.0/mlflow/users/create", method="POST",
            data=_json.dumps({"username": user, "password": f"{user}-Passw0rd!"}).encode(),
            headers={"Content-Type": "application/json",
                     "Authorization": "Basic " + b64encode(f"admin:{password}".encode()).decode()})
        assert urllib.request.urlopen(request, timeout=10).status == 200
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "eagle3-serve")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "eagle3-serve-Passw0rd!")
    MlflowClient(url).create_registered_model("eagle3-draft.promotion-lock", tags={
        "owner": "serve:1:0123abcd", "expires_0123abcd": f"{time.time() + 10 * 365 * 86400:.3f}"})

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "eagle3")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "eagle3-Passw0rd!")
    started = time.monotonic()
    with pytest.raises(ForeignLock, match=r"'eagle3-draft\.promotion-lock'.*may not write it"):
        PromotionLease("eagle3-draft", wait_s=30, poll_s=0.2).acquire()
    assert time.monotonic() - started < 10  # refused at once, not after wait_s
    with PromotionLease("other-draft", ttl_s=60).acquire():  # the trainers' own lock: taken, released
        with pytest.raises(PromotionConflict) as waited:
            PromotionLease("other-draft", wait_s=1, poll_s=0.2).acquire()
        assert not isinstance(waited.value, ForeignLock)


def test_training_jobs_resume_from_their_last_checkpoint_when_a_worker_fails():
    from pipelines.train import TrainJobConfig

    assert TrainJobConfig(features="s3://x").max_failures > 0  # the jobs' default
    _, train = _parsed("rayjob-train.yaml")
    assert train.max_failures > 0 and train.resume
    _, retrain = _parsed("rayjob-retrain.yaml")
    assert TrainJobConfig(**{**retrain.train, "features": "s3://x"}).max_failures > 0


# ---------------------------------------------------------------------------------------------------
# issue 42: serving only reads; Ray's token on VMs too; the base image and the target by immutable ids

def test_serve_pods_read_the_registry_and_the_object_store_with_credentials_of_their_own():
    """Training's MLflow user may move @champion (MANAGE on the model) and its S3 key writes; the Serve pods get
    neither: a user with no grant, which the server's default_permission = READ leaves read-only, and a
    read-only object-store Secret. Replicas follow the alias."""
    ini = next(d for d in _mlflow()[0] if d["kind"] == "ConfigMap")["data"]["basic_auth.ini"]
    assert re.search(r"^default_permission = READ$", ini, re.M)
    serve_secrets, train_secrets = set(), set()
    for where, pod in ray_pod_specs():
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        names = {env[n]["valueFrom"]["secretKeyRef"]["name"]
                 for n in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
        names |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
        (serve_secrets if where.startswith("rayservice.yaml") else train_secrets).update(names)
    assert serve_secrets == {"mlflow-serve-reader", "eagle3-s3-serve-readonly"}
    assert not serve_secrets & train_secrets
    assert _served_args()["draft_poll_s"] > 0 and "@champion" in _served_args()["draft"]


def test_ray_up_starts_every_node_with_token_auth():
    """RAY_AUTH_MODE=token with the token file that file_mounts copies to every node (Ray >= 2.52 has it)."""
    from packaging.version import Version

    config = documents(INFRA / "ray-up.yaml")[0]
    ray_version = re.search(r"ARG RAY_VERSION=(\S+)", (INFRA / "Dockerfile").read_text()).group(1)
    assert Version(ray_version) >= Version("2.52")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts, key
        for command in starts:
            env = dict(re.findall(r"\b(RAY_AUTH_\w+)=(\S+)", command))
            assert env.get("RAY_AUTH_MODE") == "token", command
            assert env.get("RAY_AUTH_TOKEN_PATH") in config["file_mounts"], command
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


def test_the_base_image_is_pulled_by_digest_and_the_target_by_commit():
    dockerfile = (INFRA / "Dockerfile").read_text()
    base = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert base == ["rayproject/ray:${RAY_VERSION}-py311-gpu@${RAY_IMAGE_DIGEST}"]
    default = re.search(r"^ARG RAY_IMAGE_DIGEST(=\S*)?$", dockerfile, re.M)
    assert default, "RAY_IMAGE_DIGEST must be a build ARG"
    # no default: every build passes one (an empty digest is refused by docker); a default must be a digest
    assert default.group(1) is None or re.fullmatch(r"=sha256:[0-9a-f]{64}", default.group(1))
    _, job = _models()
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert re.fullmatch(r"[0-9a-f]{40}", env["TARGET_REVISION"])  # a commit, not a branch or tag
    assert 'revision=os.environ["TARGET_REVISION"]' in container["args"][0]
