"""A newcomer's terminal: stage banners, progress lines and results; everything else goes to a log file.

Ray, Ray Data, MLflow and transformers write INFO lines and warnings from the driver and from every worker
(Ray forwards worker output to the driver). `quiet_terminal(log)` points the process's stdout and stderr
(file descriptors 1 and 2, so child processes and C++ logs follow) at `log`, and a thread echoes to the
real terminal only the lines that carry one of the project's stage tags (`[extract] ...`, `[train] ...`),
without Ray's `(RayTrainWorker pid=...)` prefix. `say` writes for the user: its lines reach the terminal
through the log, in order with the stage lines. `progress` is a tqdm bar drawn on the user's terminal directly
(under quiet_terminal too), and only where that is a terminal: logs and captured output get no bars.
"""

from __future__ import annotations

import contextlib
import collections
import os
import re
import sys
import threading
import time

TAGS = ("demo", "ingest", "extract", "train", "retrain", "serve", "distill", "eagle3")
_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*\((?P<who>[^)]*)\)(\x1b\[[0-9;]*m)*\s*")
_said: collections.deque = collections.deque()  # lines say() wrote to the log, not yet echoed
_active = False
_terminal = None  # the user's terminal while quiet_terminal points stdout and stderr at the log


def say(text: str = "") -> None:
    """Print for the user: on the terminal, and in the log (in order with the rest) under quiet_terminal."""
    if _active:
        _said.extend(text.split("\n"))
    print(text, flush=True)


def tagged(line: str, tags=TAGS) -> str | None:
    """The line without Ray's worker prefix if it starts with a stage tag, else None."""
    line = _PREFIX.sub("", line.rstrip("\n"))
    return line if any(line.startswith(f"[{t}]") for t in tags) else None


@contextlib.contextmanager
def quiet_terminal(log_path: str, tags=TAGS):
    global _active, _terminal
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    log = open(log_path, "a", buffering=1)
    start = log.seek(0, os.SEEK_END)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stop = threading.Event()

    def show(line):
        if _said and line.rstrip("\n") == _said[0]:
            terminal.write(_said.popleft() + "\n")
        elif (shown := tagged(line, tags)) is not None:
            terminal.write(shown + "\n")

    def echo():
        line = ""  # a line is shown once complete: a read can end inside a line still being written
        with open(log_path) as f:
            f.seek(start)
            while True:
                part = f.readline()
                line += part
                if line.endswith("\n"):
                    show(line)
                    line = ""
                if part:
                    continue
                if stop.is_set():
                    if line:
                        show(line)
                    return
                time.sleep(0.2)

    thread = threading.Thread(target=echo, daemon=True)
    _active = True
    _terminal = terminal
    thread.start()
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        stop.set()
        thread.join(timeout=5)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _active = False
        _terminal = None
        _said.clear()
        terminal.close()
        log.close()


def progress(total: int | None = None, desc: str = "", unit: str = "it", initial: int = 0):
    """A tqdm progress bar on the user's terminal (the real one under quiet_terminal, else stderr); disabled
    where that is not a terminal, so logs and captured output stay free of bar redraws."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=_terminal or sys.stderr, disable=None,
                leave=True)
