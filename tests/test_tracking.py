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
