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


def test_schedule_submits_the_retrain_rayjob():
    docs, cron, container = _schedule()
    assert len(cron["schedule"].split()) == 5 and cron["concurrencyPolicy"] == "Forbid"
    assert container["command"] == ["/bin/bash", "-c"]
    assert "kubectl create -f /rayjob/rayjob.yaml" in container["args"][0]
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
  "get rayjob.ray.io/eagle3-retrain-x1")
      line=$(head -n 1 "$FAKE/states"); sed -i 1d "$FAKE/states"; echo "${line:-Failed/EXHAUSTED}" ;;
  *) exit 2 ;;
esac
"""


def _run_schedule(tmp_path, listing: str, states: list[str]):
    """Run the CronJob's script against a fake kubectl; returns (exit code, kubectl calls)."""
    _, _, container = _schedule()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    (tmp_path / "listing").write_text(listing)
    (tmp_path / "states").write_text("".join(f"{s}\n" for s in states))
    (tmp_path / "calls").write_text("")
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]},
           "POLL_SECONDS": "0", "FAKE": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(container["command"] + container["args"], env=env, capture_output=True, text=True,
                          timeout=60)
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
    assert differing <= {"target", "model_name"}  # the cluster's target (next test), the same champion alias
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
