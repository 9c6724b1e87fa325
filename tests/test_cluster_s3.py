"""The whole pipeline on a two-node Ray cluster with every path on S3 and MLflow behind a tracking server.

Real components on this machine: a Ray head and a Ray worker node (separate raylets, each with its own model
cache, as two hosts would have), moto's S3 HTTP server on 127.0.0.1, and `mlflow server` on 127.0.0.1 whose
artifacts go to S3. The jobs run as a user runs them (their CLIs, `RAY_ADDRESS` set) from an empty working
directory: ingest -> extract with regeneration -> train (two workers) -> evaluate and promote -> serve
`models:/...@champion` from the tracking server's S3 artifacts -> one answered request. One retraining scale: a
second scale's shard reuse and warm start from the champion are tests/test_retrain.py's (same code, local paths). Faults on the way: the tracking server
is killed as the first scale's training starts and restarted after it ended (the run completes, with every step's
metrics); another target on an existing extraction output is refused, naming the differing fields.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import fsspec
import pytest

from eagle_core.target import make_tiny_llama
from pipelines.storage import upload_folder
from process_helpers import TEST_RAY_ENV, accepts, free_port, kill_session, wait_until

REPO = Path(__file__).resolve().parents[1]


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except Exception:
        return False


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL for what is left after 5 s: the MLflow server and the Serve job end within 2 s, and a
    `ray start --head --block` does not end on SIGTERM at all (30 s of every run went to waiting for it)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    kill_session(process.pid)


def write_inputs(tmp: Path) -> None:
    fs = fsspec.filesystem("s3")
    rows = [json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i + 1}?"},
        {"from": "gpt", "value": f"{i} plus {i + 1} is {2 * i + 1}."}]}) for i in range(16)]
    fs.pipe_file("eagle3/data/corpus.jsonl", ("\n".join(rows) + "\n").encode())
    prompts = [json.dumps({"prompt": p}) for p in ("Hello there", "What is 2 plus 3?")]
    fs.pipe_file("eagle3/data/prompts.jsonl", ("\n".join(prompts) + "\n").encode())


def local_writes(home: Path, tmpdir: Path) -> list[str]:
    """Files under HOME and TMPDIR other than caches (~/.cache, matplotlib's font cache) and Ray's session files."""
    allowed = (".cache/", ".config/matplotlib/")
    left = [f"~/{p.relative_to(home)}" for p in home.rglob("*") if p.is_file()
            and not str(p.relative_to(home)).startswith(allowed)]
    left += [f"$TMPDIR/{p.relative_to(tmpdir)}" for p in tmpdir.rglob("*") if p.is_file()
             and not p.relative_to(tmpdir).parts[0].startswith(("ray", "_ray"))]  # _ray_lockfiles: Ray's
    return sorted(left)


@pytest.mark.slow
def test_pipeline_on_two_nodes_with_s3_and_an_mlflow_server(s3_endpoint, tiny_target_dir, tmp_path,
                                                            smollm2_tokenizer):
    upload_folder(tiny_target_dir, "s3://eagle3/models/tiny")
    write_inputs(tmp_path)
    bin_dir = Path(sys.executable).parent
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "EAGLE3_"))}
    base_env.update(s3_endpoint, **TEST_RAY_ENV, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                    MLFLOW_DISABLE_TELEMETRY="true", PYTHONPATH=str(REPO))
    # Every process gets its own HOME and TMPDIR, so the end can list all it left on local disk.
    home, tmpdir = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(), tmpdir.mkdir()
    base_env.update(HOME=str(home), TMPDIR=str(tmpdir))
    mlflow_port, ray_port = free_port(), free_port()
    tracking_uri = f"http://127.0.0.1:{mlflow_port}"
    caches = {node: tmp_path / f"cache-{node}" for node in ("head", "worker")}
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    processes = []

    def start(cmd, env):
        processes.append(subprocess.Popen(cmd, env=env, cwd=workdir, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{len(processes)}.log", "w")))

    try:
        def start_mlflow(wait: bool = True):  # processes[0]; a service of its own, not ours (TMPDIR)
            command = [str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                       "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                       "--artifacts-destination", "s3://eagle3/mlflow"]
            # Without MLflow's job runner (a consumer pool of ~8 interpreters importing MLflow, for features the
            # pipeline does not use), as tests/mlflow_helpers.py starts its servers.
            server = subprocess.Popen(command, env={**base_env, "TMPDIR": str(tmp_path),
                                                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, cwd=workdir,
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / "mlflow.log", "a"))
            if processes:
                processes[0] = server
            else:
                processes.append(server)
            if wait:
                wait_until(lambda: answers(f"{tracking_uri}/health"), "the MLflow server")

        # The tracking server (one interpreter importing MLflow, ~25 s here) and the Ray head start side by side;
        # nothing contacts the server before the retraining job below.
        start_mlflow(wait=False)
        node_env = {**base_env, "MLFLOW_TRACKING_URI": tracking_uri}
        start([str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={ray_port}",
               "--num-cpus=3", "--include-dashboard=false", f"--temp-dir={ray_tmp}",
               f"--dashboard-agent-listen-port={free_port()}"], {**node_env, "EAGLE3_CACHE": str(caches["head"])})
        # The head's port answers before its node is registered; a worker node started then competes with the
        # head's start-up, and on a loaded machine its raylet missed Ray's 30 s registration deadline. So the
        # worker node starts at least 5 s after the port answered (the wait for the tracking server counts).
        # 300 s, as for the Serve app: beside the other test process's engines the head once took more than 120 s
        wait_until(lambda: accepts(ray_port), "the Ray head", timeout=300)
        head_answered = time.monotonic()
        wait_until(lambda: answers(f"{tracking_uri}/health"), "the MLflow server")
        time.sleep(max(0.0, 5 - (time.monotonic() - head_answered)))
        start([str(bin_dir / "ray"), "start", "--block", f"--address=127.0.0.1:{ray_port}",
               "--node-ip-address=127.0.0.1", "--num-cpus=3", f"--dashboard-agent-listen-port={free_port()}"],
              {**node_env, "EAGLE3_CACHE": str(caches["worker"])})
        driver_env = {**node_env, "RAY_ADDRESS": f"127.0.0.1:{ray_port}", "EAGLE3_CACHE": str(caches["head"])}
        nodes = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"
        wait_until(lambda: subprocess.run([sys.executable, "-c", nodes], env=driver_env, capture_output=True,
                                          text=True).stdout.strip().endswith("2"), "the worker node")

        # Each actor and each training worker needs 2 of a node's 3 CPUs: one per node.
        extract = {"regenerate": True, "num_workers": 2, "cpus_per_worker": 2, "rows_per_shard": 4,
                   "max_length": 64, "max_new_tokens": 8}
        train = {"num_workers": 2, "cpus_per_worker": 2, "epochs": 1, "tokens_per_batch": 256, "ttt_steps": 2,
                 "draft_vocab_size": 128, "eval_fraction": 0.25, "checkpoint_every": 100, "log_every": 100,
                 "mlflow_experiment": "two-node-train"}
        retrain = subprocess.Popen(
            [sys.executable, "-m", "jobs.retrain", "--corpus", "s3://eagle3/data/corpus.jsonl", "--scales", "8",
             "--work", "s3://eagle3/retrain", "--target", "s3://eagle3/models/tiny", "--registered-model", "two-node",
             "--eval-prompts", "s3://eagle3/data/prompts.jsonl", "--eval-count", "2", "--eval-max-new-tokens", "6",
             "--margin", "-100", "--extract", json.dumps(extract), "--train", json.dumps(train),
             "--serving-gate", "off",  # vLLM cannot load the tiny target (head size 16)
             "--mlflow-experiment", "two-node"],
            env=driver_env, cwd=workdir, stdout=subprocess.PIPE, stderr=open(tmp_path / "retrain.log", "w"),
            text=True)
        # The tracking server dies as the first scale's training starts and comes back only after that training
        # wrote its last checkpoint: every step's metrics are logged during the outage.
        s3 = fsspec.filesystem("s3")
        first_draft = "eagle3/retrain/drafts/rows-8"
        wait_until(lambda: retrain.poll() is not None or s3.exists(f"{first_draft}/train_run.json"),
                   "the first scale's training", timeout=900)
        assert retrain.poll() is None, (tmp_path / "retrain.log").read_text()[-6000:]
        stop(processes[0])
        wait_until(lambda: retrain.poll() is not None or any(
            "checkpoint-" in p for p in s3.find(f"{first_draft}/ray")), "the first scale's last checkpoint",
            timeout=600)
        start_mlflow()  # same port, same database: the queued metrics and the driver's registration go through
        out, _ = retrain.communicate(timeout=900)
        assert retrain.returncode == 0, out[-4000:] + (tmp_path / "retrain.log").read_text()[-6000:]
        result = json.loads(out[out.index("{\n"):])
        (first,) = result["scales"]
        assert first["rows"] == 8 and first["promoted"] and first["shards"] == 2

        # The first scale's training ran through the outage and still holds every step's metrics.
        from mlflow import MlflowClient

        trained = json.loads(s3.cat_file(f"{first_draft}/summary.json"))
        history = MlflowClient(tracking_uri).get_metric_history(trained["mlflow_run_id"], "loss")
        # (distinct steps: a worker Ray Train restarts from a checkpoint logs the replayed steps again)
        assert sorted({m.step for m in history}) == list(range(1, trained["total_steps"] + 1))

        features = "eagle3/retrain/features/rows-8"
        assert len(s3.ls(f"{features}/features")) == 2 and len(s3.ls(f"{features}/regenerated")) == 2
        assert s3.exists(f"{first_draft}/draft/model.safetensors")
        assert s3.find("eagle3/mlflow")  # artifacts went through the tracking server to S3
        # The target was fetched into both nodes' caches: actors and training workers ran on both.
        for node, cache in caches.items():
            assert list((cache / "remote").glob("tiny-*/config.json")), node

        # Serve starts now (its controller, proxies and replica come up while the refusal below runs); it reads the
        # champion through the tracking server and writes nothing under the extraction output.
        port = free_port()
        start([sys.executable, "-m", "jobs.serve", "--target", "s3://eagle3/models/tiny", "--draft",
               "models:/two-node@champion", "--port", str(port), "--name", "two-node"], driver_env)

        # Another target on the same extraction output: refused before any work, naming the differing fields.
        other = tmp_path / "other-target"
        model = make_tiny_llama(vocab_size=len(smollm2_tokenizer), num_hidden_layers=4, seed=11,
                                tie_word_embeddings=False)
        model.save_pretrained(other)
        smollm2_tokenizer.save_pretrained(other)
        upload_folder(other, "s3://eagle3/models/tiny-other")
        before = {p: s3.info(p)["ETag"] for p in s3.find(features)}
        refused = subprocess.run(
            [sys.executable, "-m", "jobs.extract", "--corpus", "s3://eagle3/data/corpus.jsonl", "--limit", "8",
             "--output", f"s3://{features}", "--target", "s3://eagle3/models/tiny-other", "--rows-per-shard", "4",
             "--max-length", "64", "--max-new-tokens", "8", "--mlflow-experiment", ""],
            env=driver_env, cwd=workdir, capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and "FingerprintMismatch" in refused.stderr, refused.stderr[-4000:]
        assert "target_weights_hash:" in refused.stderr and "--overwrite" in refused.stderr
        assert {p: s3.info(p)["ETag"] for p in s3.find(features)} == before  # nothing there changed

        wait_until(lambda: answers(f"http://127.0.0.1:{port}/v1/models"), "the Serve app", timeout=300)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"content-type": "application/json"},
            data=json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode())
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert reply["usage"]["completion_tokens"] >= 1 and reply["choices"][0]["finish_reason"] in ("length", "stop")

        # Nothing was written to the working directory, and on local disk only to caches and Ray's temporary
        # folder: every output went to S3.
        assert sorted(p.name for p in workdir.iterdir()) == []
        left = local_writes(home, tmpdir)
        assert left == [], "written outside caches and Ray's temporary files:\n" + "\n".join(left)
    finally:
        for process in reversed(processes):
            stop(process)
        shutil.rmtree(ray_tmp, ignore_errors=True)
