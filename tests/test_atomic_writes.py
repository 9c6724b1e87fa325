"""Crash-safe writes: a write that fails (a full disk) or is killed between writing and renaming leaves the file a
later run reads whole (the previous version) and no temporary file; a folder upload that fails leaves the old
folder; a registration retried after a failure finds the version it registered instead of registering twice."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RUN_STATE = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pipelines.train import TrainJobConfig
    from pipelines.train.driver import _write_run_state

    output, fault = sys.argv[1], sys.argv[2]
    config = TrainJobConfig(features="unused", output=output)
    _write_run_state(config, {"name": "run", "step": 1})
    if fault == "full-disk":  # writes past 1 KiB fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
    else:  # killed after the bytes are written, before they are renamed into place
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = os.rename = die
    try:
        _write_run_state(config, {"name": "run", "step": 2, "padding": "x" * 65536})
    except OSError as err:
        print(json.dumps({"errno": err.errno}))
""")


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


@pytest.mark.parametrize("fault", ["full-disk", "killed-before-rename"])
def test_a_failed_run_state_write_leaves_the_previous_state_for_resume(tmp_path, fault):
    from pipelines.train import TrainJobConfig
    from pipelines.train.driver import _previous_run, _write_run_state

    output = tmp_path / "train"
    done = _run(RUN_STATE, str(output), fault)
    if fault == "full-disk":
        assert done.returncode == 0 and json.loads(done.stdout.splitlines()[-1])["errno"] == errno.EFBIG, done.stderr
        assert sorted(p.name for p in output.iterdir()) == ["train_run.json"]  # the temporary file was removed
    else:
        assert done.returncode == -signal.SIGKILL, done.stderr
    config = TrainJobConfig(features="unused", output=str(output), resume=True)
    assert _previous_run(config) == {"name": "run", "step": 1}  # whole: --resume reads the last committed state
    _write_run_state(config, {"name": "run", "step": 3})  # and the resumed run writes on
    assert _previous_run(config) == {"name": "run", "step": 3}


def test_a_killed_commit_leaves_no_shard_a_rerun_would_read(tmp_path):
    """A shard whose commit was killed before its rename is not committed: the rerun extracts it again."""
    from pipelines.feature_files import committed_shards

    output = tmp_path / "features-out"
    code = textwrap.dedent("""
        import os, signal, sys
        from pipelines.storage import commit_bytes
        commit_bytes(sys.argv[1] + "/features/shard-00000-aaaa.parquet", b"whole")
        os.replace = os.rename = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        commit_bytes(sys.argv[1] + "/features/shard-00001-bbbb.parquet", b"never renamed")
    """)
    assert _run(code, str(output)).returncode == -signal.SIGKILL
    assert committed_shards(str(output)) == {"shard-00000-aaaa"}
    assert (output / "features" / "shard-00000-aaaa.parquet").read_bytes() == b"whole"


def _folder(path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_upload_keeps_the_old_folder_and_a_good_one_replaces_it(tmp_path, monkeypatch, where, request):
    from pipelines.storage import upload_folder, url_to_fs

    if where == "s3":
        request.getfixturevalue("s3_endpoint")
        url = f"s3://eagle3/upload-{os.getpid()}/draft"
    else:
        url = str(tmp_path / "out" / "draft")
    fs, root = url_to_fs(url)
    upload_folder(_folder(tmp_path / "old", {"config.json": "old", "stale.txt": "only in the old draft"}), url)
    new = _folder(tmp_path / "new", {"config.json": "new", "model.safetensors": "weights", "sub/extra.txt": "x"})

    real_put, calls = fs.put_file, []
    assert url_to_fs(url)[0] is fs  # fsspec hands out one instance per filesystem: patching it reaches the upload

    def full_disk(lpath, rpath, *args, **kwargs):
        calls.append(rpath)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        upload_folder(new, url)
    monkeypatch.setattr(fs, "put_file", real_put)

    def listing():
        parent = root.rsplit("/", 1)[0]
        files = {p[len(root) + 1:]: fs.cat_file(p).decode() for p in fs.find(root)}
        return files, sorted(p.rsplit("/", 1)[1] for p in fs.ls(parent, detail=False))

    assert listing() == ({"config.json": "old", "stale.txt": "only in the old draft"}, ["draft"])
    upload_folder(new, url)
    assert listing() == ({"config.json": "new", "model.safetensors": "weights", "sub/extra.txt": "x"}, ["draft"])


def test_a_retried_registration_finds_the_version_it_registered(tmp_path, monkeypatch):
    """The server registers the version, then fails before the alias is set; `tracking.retrying` runs
    `_log_and_register` again, which finds that version by the draft's digest instead of registering a second."""
    import requests
    from mlflow import MlflowClient

    from pipelines import tracking
    from pipelines.train import TrainJobConfig
    from pipelines.train import driver

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    draft = _folder(tmp_path / "draft", {"config.json": "{}", "model.safetensors": "weights"})
    spec = _folder(tmp_path / "spec", {"config.json": "{}"})
    config = TrainJobConfig(features="unused", output=str(tmp_path / "out"), mlflow_experiment="atomic-writes",
                            registered_model_name="atomic-draft")
    with tracking.start_run(config.mlflow_experiment) as run:
        run_id = run.info.run_id
    monkeypatch.setattr(driver, "write_plots", lambda *args: [])  # no metrics to plot here
    real_alias, failures = MlflowClient.set_registered_model_alias, []

    def blink(self, *args):
        if not failures:
            failures.append(args)
            raise requests.exceptions.ConnectionError("the tracking server went away")
        return real_alias(self, *args)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", blink)
    out = tracking.retrying(lambda: driver._log_and_register(config, run_id, draft, spec, 5), "registering",
                            timeout_s=60)
    client = tracking.configure().tracking.MlflowClient()
    versions = client.search_model_versions("name = 'atomic-draft'")
    assert failures and [str(v.version) for v in versions] == [str(out["model_version"])]
    assert str(client.get_model_version_by_alias("atomic-draft", "candidate").version) == str(out["model_version"])
