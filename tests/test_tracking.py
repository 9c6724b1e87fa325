"""Where MLflow writes: the local store keeps runs and artifacts inside the work folder, never in the checkout."""

import subprocess
import sys


def test_default_store_puts_artifacts_in_the_work_folder(tmp_path):
    work, cwd = tmp_path / "work", tmp_path / "cwd"
    cwd.mkdir()
    script = ("from pipelines import tracking\n"
              "mlflow = tracking.configure()\n"
              "eid = tracking.ensure_experiment('where')\n"
              "with tracking.start_run('where') as run:\n"
              "    mlflow.log_text('hello', 'note.txt')\n"
              "print(mlflow.get_experiment(eid).artifact_location)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "EAGLE3_WORK": str(work), "MLFLOW_TRACKING_URI": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    location = out.stdout.strip().splitlines()[-1]
    assert location == (work / "mlartifacts" / "where").as_uri()
    assert list((work / "mlartifacts" / "where").rglob("note.txt"))
    assert list(cwd.iterdir()) == []  # no ./mlruns beside the caller


def test_training_metrics_survive_a_tracking_server_outage(tmp_path, monkeypatch):
    """The rank-0 logger against a real `mlflow server`, stopped after step 5 and started again after step 20:
    logging never blocks or raises meanwhile, and after close() the run holds every step's metrics, in order.
    `tracking.retrying` waits through the same outage for a driver-side call."""
    import threading
    import time

    from mlflow import MlflowClient

    from mlflow_helpers import MlflowServer
    from pipelines import tracking
    from pipelines.train.report import RankZeroLogger

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # each failed call fails at once; we retry
    server = MlflowServer(tmp_path)
    server.start()
    try:
        client = MlflowClient(server.uri)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        logger = RankZeroLogger(server.uri, run_id, active=True, flush_timeout_s=120, max_backoff_s=2)
        for step in range(1, 6):
            logger.log({"loss": 1.0 / step, "acc_0": step / 100}, step)
        deadline = time.time() + 60
        while len(client.get_metric_history(run_id, "loss")) < 5:  # sent while the server is up
            assert time.time() < deadline
            time.sleep(0.2)
        server.stop()
        started = time.perf_counter()
        for step in range(6, 21):
            logger.log({"loss": 1.0 / step, "acc_0": step / 100}, step)
        assert time.perf_counter() - started < 1.0  # training does not wait for the server

        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        fetched = []
        waiter = threading.Thread(target=lambda: fetched.append(tracking.retrying(
            lambda: MlflowClient(server.uri).get_run(run_id).info.run_id, "reading the run", timeout_s=120)))
        waiter.start()
        time.sleep(3)  # both the logger and the waiter meet the outage
        assert logger.failures >= 1 and not fetched
        server.start()
        waiter.join(120)
        assert fetched == [run_id]
        logger.close()
        for key in ("loss", "acc_0"):
            points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
            assert [m.step for m in points] == list(range(1, 21)), key
        assert [round(m.value, 6) for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)] \
            == [round(1.0 / s, 6) for s in range(1, 21)]
    finally:
        server.stop()


def test_only_outages_are_retried():
    from mlflow.exceptions import MlflowException

    from pipelines import tracking

    calls = []

    def wrong_request():
        calls.append(1)
        raise MlflowException("no such run", error_code="RESOURCE_DOES_NOT_EXIST")

    import pytest

    with pytest.raises(MlflowException, match="no such run"):
        tracking.retrying(wrong_request, "reading", timeout_s=30)
    assert calls == [1]
    assert tracking.is_outage(ConnectionRefusedError()) and tracking.is_outage(
        MlflowException("API request to http://x failed with exception ...", error_code="INTERNAL_ERROR"))
