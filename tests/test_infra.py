"""The cluster files agree with the code: manifests parse, entrypoints run our parsers, versions match."""

import importlib.util
import re
import shlex
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
            "retrain-schedule.yaml", "mlflow.yaml", "ray-up.yaml"} <= set(manifests)
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


def test_schedule_submits_the_retrain_rayjob():
    docs = {d["kind"]: d for d in documents(INFRA / "retrain-schedule.yaml")}
    cron = docs["CronJob"]["spec"]
    assert len(cron["schedule"].split()) == 5 and cron["concurrencyPolicy"] == "Forbid"
    container = cron["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["kubectl", "create"]
    rules = docs["Role"]["rules"][0]
    assert "rayjobs" in rules["resources"] and "create" in rules["verbs"]


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
    assert differing <= {"draft"}  # the cluster serves the registry's champion
    assert theirs[0]["args"]["draft"] == "models:/eagle3-draft@champion"
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
