import atexit
import os
import shutil
import tempfile
from unittest import mock

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads spin by default; on a small shared CPU that makes small ops many times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray Train tears a worker group down ("placement group removed") when it has not started within 60 s; with two
# test processes on two cores (pytest-xdist), a training worker's imports alone can take that long. Set before the
# session's Ray cluster starts, so its raylet and the Train controller inherit it.
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")
# The suite's Ray settings (process_helpers.TEST_RAY_ENV: CPU on two shared cores, nothing under test), before any
# Ray cluster starts.
from process_helpers import TEST_RAY_ENV  # noqa: E402

for _key, _value in TEST_RAY_ENV.items():
    os.environ.setdefault(_key, _value)
# The tests' MLflow store and work folder: one per test process (a pytest-xdist worker is one), never the
# checkout's ./work nor a tracking server the user exported. Set before any Ray cluster starts, so its workers
# inherit it. (`mlflow.set_tracking_uri` exports MLFLOW_TRACKING_URI itself: the first store used would stick.)
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ["EAGLE3_WORK"] = tempfile.mkdtemp(prefix="eagle3-work-")
atexit.register(shutil.rmtree, os.environ["EAGLE3_WORK"], True)

import pytest
import torch

from eagle_core.target import load_target, make_tiny_llama


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (float32, CPU) and its tokenizer, loaded once per session."""
    return load_target("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer alone (no model weights loaded)."""
    from transformers import AutoTokenizer

    from eagle_core.target import materialize_hf_folder

    return AutoTokenizer.from_pretrained(materialize_hf_folder("smollm2-135m"))


@pytest.fixture
def tiny_target():
    """A random-weight 6-layer Llama (vocab 512, hidden 64) for fast unit tests."""
    return make_tiny_llama()


class _SessionRay:
    """The test process's one local Ray cluster, and whether its head runs the dashboard.

    The dashboard (its head process and its module processes) costs ~2.3 CPU-s to start and ~1.4 CPU-s a minute
    while idle (measured on this 2-core machine: 2.6 against 1.2 CPU-s a minute for a head without it), ~25 CPU-s
    per test process over a 15-minute suite. Only `ray job submit` needs it (its job API), so a cluster has one only
    when a module that submits jobs (`RAY_JOB_API = True` at its top) asks for it: started with one if that module
    is the first to use Ray in this process (as `make test`'s schedule makes it), restarted with one otherwise."""

    def __init__(self):
        self.cluster, self.temp_dir, self.dashboard = None, None, False
        self.old_dirs = []  # the folders of clusters this process stopped, removed when the session ends
        self.current_item = None  # the test being set up (pytest_runtest_setup)

    def start(self, dashboard: bool) -> None:
        import ray
        from ray._common.utils import get_default_ray_temp_dir
        from ray.cluster_utils import Cluster

        from process_helpers import free_port

        # A short folder: Ray's unix sockets live under it and their paths must fit 107 bytes (pytest's own
        # temporary folders under xdist, .../popen-gw1/ray0/session_.../sockets/..., do not: the dashboard then
        # fails to start).
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        # Cluster also records the head's address in Ray's default folder (RAY_TMPDIR/ray/ray_current_cluster,
        # /tmp/ray/... without it, whatever temp_dir says), and a Ray worker that asks the state API without an
        # address (Ray Train's placement-group cleaner asks whether its controller is alive) looks the cluster up
        # there. Shared by two test processes' clusters, that file names the one started last: the other's cleaner
        # then asked a foreign dashboard, was told its live controller did not exist, and removed its run's
        # placement group, killing the training workers (a CI run's "Destroying worker since its placement group
        # was removed"). So each cluster gets a folder of its own: RAY_TMPDIR is exported while its processes
        # start, which inherit it, and restored after, so that no later subprocess of this test process (another
        # test's `ray start`) records its own cluster there. Cluster does not create the folder.
        with mock.patch.dict(os.environ, {"RAY_TMPDIR": self.temp_dir}):
            # Not the tracking URI of an earlier test of this process (`mlflow.set_tracking_uri` exports it): the
            # raylet's environment is every worker's and every submitted job's, whose runs would go to that store
            # (a CI run's job logged to another test's database, and its test found no run).
            os.environ.pop("MLFLOW_TRACKING_URI", None)
            os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
            # No log monitor: it scans the session's log files ten times a second to forward them to drivers, and
            # this driver takes none (log_to_driver=False): ~20 CPU-s per cluster over a suite, measured here.
            self.cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=4, include_dashboard=dashboard, dashboard_host="127.0.0.1", dashboard_port=0,
                dashboard_agent_listen_port=free_port(), temp_dir=self.temp_dir, object_store_memory=None,
                include_log_monitor=False))
            # No runtime_env: the workers inherit the raylet's environment, i.e. this process's, with the S3
            # endpoint exported (s3_endpoint) and usage stats off. A job's runtime_env would start every worker
            # through Ray's setup_worker.py, a second interpreter that imports Ray before exec'ing the worker
            # (~0.4 CPU-s per worker, ~150 workers in a suite).
            context = ray.init(address=self.cluster.address, log_to_driver=False)
        self.dashboard = dashboard
        ray.dashboard_address = f"http://{context.dashboard_url}" if dashboard else None

    def stop(self, final: bool = True) -> None:
        """Stop the cluster; its folder is removed only at the end (`final`): Ray Data's log handlers in this
        process keep the first session's log file and reopen it by path (a restarted cluster's later dataset
        failed with FileNotFoundError on .../session_.../logs/ray-data/ray-data.log when it was removed)."""
        import ray

        if self.cluster is not None:
            ray.shutdown()
            self.cluster.shutdown()
            self.old_dirs.append(self.temp_dir)
            self.cluster = None
        if final:
            for folder in self.old_dirs:
                shutil.rmtree(folder, ignore_errors=True)
            self.old_dirs = []


_SESSION_RAY = _SessionRay()


def _wants_job_api(item) -> bool:
    return item is not None and bool(getattr(item.module, "RAY_JOB_API", False))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a job-submitting module's test sets up its fixtures: a cluster started earlier in this process
    without the dashboard is restarted with one (pytest has torn the previous module's fixtures down by now)."""
    if _SESSION_RAY.cluster is not None and not _SESSION_RAY.dashboard and _wants_job_api(item):
        _SESSION_RAY.stop(final=False)
        _SESSION_RAY.start(dashboard=True)
    _SESSION_RAY.current_item = item


@pytest.fixture(scope="session")
def ray_cluster(s3_endpoint):
    """One local Ray cluster for the whole session (more logical CPUs than cores: see DESIGN.md), as the `ray`
    module, connected. Its workers reach the session's S3 endpoint, as a real cluster's nodes are configured for
    theirs. Where a module submits jobs, its head runs the dashboard on a free port (`ray.dashboard_address` names
    it; None otherwise), so the job-submission test needs no second head (`_SessionRay`).

    The head is started through Ray's `cluster_utils.Cluster` rather than `ray.init(address="local")` because only
    the former lets every port be chosen: `ray.init` always binds the dashboard agent to 52365, so a second
    cluster on the machine (another pytest-xdist worker, another checkout's suite) has no job agent and refuses
    submissions ("No available agent to submit job")."""
    import ray

    assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint["AWS_ENDPOINT_URL"]  # exported before the raylet starts
    _SESSION_RAY.start(dashboard=_wants_job_api(_SESSION_RAY.current_item))
    yield ray
    _SESSION_RAY.stop()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer):
    """An HF folder holding a tiny random Llama with SmolLM2's tokenizer: a real `--target` for job tests."""
    folder = tmp_path_factory.mktemp("tiny-target")
    # Untied embeddings: a tied random model just repeats its last token ("\n"), i.e. empty replies.
    model = make_tiny_llama(vocab_size=len(smollm2_tokenizer), num_hidden_layers=4, seed=3, tie_word_embeddings=False)
    model.config.bos_token_id = smollm2_tokenizer.bos_token_id
    model.config.eos_token_id = smollm2_tokenizer.eos_token_id
    model.config.pad_token_id = smollm2_tokenizer.pad_token_id
    model.generation_config.eos_token_id = smollm2_tokenizer.eos_token_id
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint on 127.0.0.1 (moto's threaded server) with bucket `eagle3`; returns the environment
    (endpoint, dummy credentials) that s3fs, pyarrow and MLflow read. It is exported into this process too."""
    from moto.server import ThreadedMotoServer

    from process_helpers import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fsspec.filesystem("s3").mkdir("eagle3")
    yield env
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# `make test` runs two test processes (pytest-xdist, `--dist loadfile --no-loadscope-reorder`): whole files are handed
# out in collection order, each to the first process that runs short of work. The files that take longest go
# first, so that none of them starts near the end while the other process idles (longest-first scheduling).
# Measured serially (`pytest --durations=0`, tests/README.md); a file missing here keeps its place after them.
# test_serve_vllm.py: ~150-250 s under -n 2. test_engines.py: ~330 s under -n 2 before dbae12b, ~180-250 s expected
# after it (not yet timed under -n 2; its serial runs went from 885-965 s to 412-496 s on a loaded machine).
LONGEST_FIRST = (
    "test_serve_vllm.py", "test_cluster_s3.py", "test_engines.py", "test_retrain.py", "test_extract.py",
    "test_train.py", "test_gemma3.py", "test_train_smollm2.py", "test_families.py", "test_extract_streaming.py",
    "test_fingerprints.py",
    "test_static_cache.py", "test_registry.py", "test_data.py", "test_target.py", "test_recipes.py",
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept inside
