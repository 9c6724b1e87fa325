"""tools/gpu_smoke.py: skips cleanly without CUDA, keeps up with eagle_core's APIs, and needs no Ray/MLflow."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_smoke.py"


def _run(*args, env=None, code=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, str(SCRIPT), *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_without_cuda_it_says_so_and_exits_0():
    done = _run(env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU visible, even on a GPU machine
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and "skipping" in done.stdout


def test_make_target_runs_it_without_the_venv_setup():
    makefile = (REPO / "Makefile").read_text()
    block = makefile[makefile.index("\ngpu-smoke:"):].split("\n\n")[0]
    assert "tools/gpu_smoke.py" in block and "$(STAMP)" not in block.splitlines()[1]


def test_cpu_dry_run_passes_and_imports_no_ray_mlflow_or_pipelines():
    code = (f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import gpu_smoke; "
            "rc = gpu_smoke.main(['--cpu-dry-run']); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'mlflow', 'pipelines')); "
            "print('FORBIDDEN', bad); sys.exit(rc)")
    done = _run(code=code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[gpu-smoke] PASSED" in done.stdout
    assert "FORBIDDEN []" in done.stdout
