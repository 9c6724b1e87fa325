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


def _fail_second_call(monkeypatch, fs, method: str, error: OSError, writes_to=lambda dst: True):
    """Patch `fs.<method>(src, dst, ...)` so that its second call with a `dst` that `writes_to` accepts raises
    `error` (a disk filling up, a connection lost half-way through a folder); returns the real method."""
    real, calls = getattr(fs, method), []

    def failing(src, dst, *args, **kwargs):
        if writes_to(dst):
            calls.append(dst)
            if len(calls) == 2:
                raise error
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(fs, method, failing)
    return real


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

    assert url_to_fs(url)[0] is fs  # fsspec hands out one instance per filesystem: patching it reaches the upload
    real_put = _fail_second_call(monkeypatch, fs, "put_file", OSError(errno.ENOSPC, "No space left on device"))
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


@pytest.mark.parametrize("fault", ["exchange", "second-rename"])
def test_a_failure_while_swapping_a_local_folder_in_keeps_the_old_one_where_readers_look(tmp_path, monkeypatch, fault):
    """Issue 54 (9): the swap itself fails: the atomic exchange (`exchange`), or, where the filesystem has none, the
    rename of the new folder into place after the old one was moved aside (`second-rename`). The old folder must be
    at its path, whole, and nothing left beside it (before: the new copy was deleted and the old one stranded at
    `.old-*`)."""
    import pipelines.storage as storage

    url = tmp_path / "out" / "draft"
    storage.upload_folder(_folder(tmp_path / "old", {"config.json": "old", "stale.txt": "old only"}), str(url))
    new = _folder(tmp_path / "new", {"config.json": "new", "model.safetensors": "weights"})
    real_rename = os.rename

    def failing_rename(src, dst, *args, **kwargs):
        if str(dst) == str(url) and ".tmp-" in str(src):
            raise OSError(errno.EIO, "I/O error")
        return real_rename(src, dst, *args, **kwargs)

    def failing_exchange(a, b):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "rename", failing_rename)
    if hasattr(storage, "_exchange"):
        monkeypatch.setattr(storage, "_exchange", failing_exchange if fault == "exchange" else lambda a, b: False)
    with pytest.raises(OSError, match="I/O error"):
        storage.upload_folder(new, str(url))
    monkeypatch.undo()
    assert {p.name: p.read_text() for p in url.iterdir()} == {"config.json": "old", "stale.txt": "old only"}
    assert sorted(p.name for p in url.parent.iterdir()) == ["draft"]
    storage.upload_folder(new, str(url))
    assert {p.name: p.read_text() for p in url.iterdir()} == {"config.json": "new", "model.safetensors": "weights"}


def test_a_failure_while_an_object_store_folder_is_overwritten_leaves_the_old_one_whole(s3_endpoint, tmp_path,
                                                                                        monkeypatch):
    """Issue 54 (9): on an object store the new files are copied over the old keys one by one; a failure half-way
    (the second copy) must put the old folder back whole, not leave a mix of old and new files."""
    from pipelines.storage import upload_folder, url_to_fs

    url = f"s3://eagle3/upload-mix-{os.getpid()}/draft"
    fs, root = url_to_fs(url)
    upload_folder(_folder(tmp_path / "old", {"a.json": "old a", "b.json": "old b", "stale.txt": "old only"}), url)
    new = _folder(tmp_path / "new", {"a.json": "new a", "b.json": "new b", "c.json": "new c"})
    _fail_second_call(monkeypatch, fs, "copy", OSError(errno.EIO, "connection reset"),
                      lambda dst: dst.startswith(root + "/"))
    with pytest.raises(OSError, match="connection reset"):
        upload_folder(new, url)
    monkeypatch.undo()
    files = {p[len(root) + 1:]: fs.cat_file(p).decode() for p in fs.find(root)}
    assert files == {"a.json": "old a", "b.json": "old b", "stale.txt": "old only"}
    parent = root.rsplit("/", 1)[0]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(parent, detail=False)) == ["draft"]


def test_a_failed_distillation_save_keeps_the_previous_draft_and_state(tmp_path, monkeypatch):
    """Issue 54 (9): distillation's save writes the state under a name of its own and the draft beside draft/, then
    swaps it in: a save that fails half-way through the draft leaves the previous draft/ whole and no temporary."""
    import torch

    import pipelines.distill as distill

    out = tmp_path / "run"
    _folder(out / "draft", {"config.json": "previous", "model.safetensors": "previous weights"})
    saver = distill.Distiller.__new__(distill.Distiller)
    saver.out, saver.cfg = out, distill.DistillConfig(output=str(out))
    monkeypatch.setattr(distill, "train_state_dict", lambda draft, opt, sched, step: {"step": torch.tensor(step)})

    def half_a_draft(draft, folder, dtype=None):
        _folder(Path(folder), {"config.json": "half"})
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(distill, "save_draft", half_a_draft)
    with pytest.raises(OSError, match="No space"):
        saver.save(None, None, None, distill.Progress(step=7), {})
    assert {p.name: p.read_text() for p in (out / "draft").iterdir()} == {
        "config.json": "previous", "model.safetensors": "previous weights"}
    assert sorted(p.name for p in out.iterdir()) == ["draft", "state.pt"]
    assert torch.load(out / "state.pt", weights_only=True)["step"].item() == 7

    monkeypatch.setattr(distill, "save_draft", lambda draft, folder, dtype=None: _folder(Path(folder), {
        "config.json": "next", "model.safetensors": "next weights"}))
    saver.save(None, None, None, distill.Progress(step=8), {"loss": 1.0})
    assert sorted(p.name for p in (out / "draft").iterdir()) == ["config.json", "model.safetensors", "training.json"]
    assert (out / "draft" / "config.json").read_text() == "next" and sorted(p.name for p in out.iterdir()) == [
        "draft", "state.pt"]


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
