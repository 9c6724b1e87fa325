"""The newcomer's terminal: stage lines and results shown, library noise sent to the log file."""

import subprocess
import sys
import textwrap

from pipelines.console import tagged


def test_tagged_strips_ray_worker_prefix_and_keeps_only_stage_lines():
    assert tagged("(RayTrainWorker pid=123) [train] step 3/9 loss 1.0\n") == "[train] step 3/9 loss 1.0"
    assert tagged("\x1b[36m(_Actor pid=9, ip=127.0.0.1)\x1b[0m [extract] shard 2\n") == "[extract] shard 2"
    assert tagged("2026-12-01 INFO worker.py:1 -- Started a local Ray instance.\n") is None
    assert tagged("UserWarning: [train] inside a warning\n") is None


def test_quiet_terminal_shows_stages_and_logs_everything(tmp_path):
    log = tmp_path / "demo.log"
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from pipelines.console import quiet_terminal, say
        with quiet_terminal({str(log)!r}):
            say("=== 1/2 stage one")
            print("INFO ray noise from the driver", flush=True)
            sys.stderr.write("UserWarning: something\\n")
            subprocess.run([sys.executable, "-c", "print('(Worker pid=1) [train] step 1/2 loss 0.5')"])
            subprocess.run([sys.executable, "-c", "import os; os.write(2, b'C++ log line\\\\n')"])
            os.write(1, b"[train] a line written "); time.sleep(0.6); os.write(1, b"in two parts\\n")
            say("[demo] result 1.23")
            time.sleep(0.5)
        print("after: back on the terminal")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = out.stdout.splitlines()
    assert shown == ["=== 1/2 stage one", "[train] step 1/2 loss 0.5",
                     "[train] a line written in two parts", "[demo] result 1.23", "after: back on the terminal"], shown
    assert out.stderr == ""
    logged = log.read_text()
    for line in ("INFO ray noise from the driver", "UserWarning: something", "C++ log line",
                 "(Worker pid=1) [train] step 1/2 loss 0.5", "[demo] result 1.23"):
        assert line in logged


def _run_on_a_terminal(script: str) -> str:
    """Run `script` with its stdout and stderr on a pseudo-terminal; what the terminal received."""
    import os
    import pty

    master, slave = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", script], stdout=slave, stderr=slave)
    os.close(slave)
    received = b""
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        received += data
    os.close(master)
    assert child.wait(timeout=60) == 0, received.decode(errors="replace")
    return received.decode(errors="replace")


def test_progress_bars_reach_the_terminal_but_not_the_log_or_a_pipe(tmp_path):
    log = tmp_path / "demo.log"
    script = textwrap.dedent(f"""
        import time
        from pipelines.console import progress, quiet_terminal, say
        with quiet_terminal({str(log)!r}):
            say("[demo] stage")
            with progress(total=3, desc="[extract] shards", unit="shard") as bar:
                for i in range(3):
                    bar.set_postfix_str(f"{{8 * (i + 1)}} rows, 123 tokens/s")
                    bar.update(1)
            time.sleep(0.5)
    """)
    shown = _run_on_a_terminal(script)
    assert "[demo] stage" in shown and "[extract] shards" in shown and "3/3" in shown and "24 rows" in shown
    assert "[extract] shards" not in log.read_text()  # the log holds lines, not bar redraws
    piped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and "[extract] shards" not in piped.stdout + piped.stderr
