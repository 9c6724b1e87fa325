"""Pieces every benchmark shares: paths, the recorded command line, the machine line, result writing, prompts."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path

from eagle_core.shipped import shipped_draft

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SHIPPED_DRAFT = shipped_draft()


def command(module: str, argv=None) -> str:
    """The command line that reproduces this run, e.g. `python -m bench.decode --num-prompts 2`, shell-quoted so
    that it pastes back as it ran (a `--note "two words"` stays one argument)."""
    args = argv if argv is not None else sys.argv[1:]
    return " ".join([f"python -m bench.{module}", *map(shlex.quote, map(str, args))]).rstrip()


def shown_path(path) -> str:
    """A folder as a result file names it: relative to the checkout when it lies inside it (a reader's checkout
    is elsewhere), else as given."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def machine(threads: int | None = None) -> str:
    """`x86_64, 2 CPU cores, 2 torch threads, OMP_WAIT_POLICY unset` on CPU, `GPU <name>` on CUDA.

    The OpenMP wait policy is part of the machine: PASSIVE costs small-op decoding ~25 % on 2 cores (DESIGN 4.3)."""
    import torch

    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name(0)}"
    line = f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPU cores ({cpu_flags()})"
    line += f", {threads} torch threads" if threads else ", no GPU"
    return line + f", OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    """The CPU's matrix-relevant flags: bf16 is native with avx512_bf16 / amx_bf16, emulated (slow) on AVX2 alone."""
    flags = set()
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return " ".join(shown) or "no AVX2"


def write_json(path, data, indent: int = 2) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def write_markdown(path, text: str) -> Path:
    """Writes `text` next to a result's JSON (same stem, .md) and prints it."""
    path = Path(path).with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text, flush=True)
    return path


def user_turn(text: str) -> list[dict]:
    """One chat: a single user message."""
    return [{"role": "user", "content": text}]


def smollm2_recipe():
    """The recipe of the benchmarks' target, the embedded SmolLM2 (eagle_core/recipes/smollm2-135m-instruct.toml)."""
    from eagle_core.recipe import load_recipe

    return load_recipe("smollm2-135m-instruct")


def add_draft_training_args(p, *, steps: int, max_length: int) -> None:
    """The flags of the benchmarks that train a draft: optimiser steps, conversation length, TTT steps and draft
    vocab (those two default to the SmolLM2 recipe's, the benchmarks' target)."""
    recipe = smollm2_recipe()
    p.add_argument("--steps", type=int, default=steps, help="optimiser steps")
    p.add_argument("--max-length", type=int, default=max_length, help="tokens per training conversation")
    p.add_argument("--ttt-steps", type=int, default=recipe.ttt_steps, help="training-time-test steps")
    p.add_argument("--draft-vocab-size", type=int, default=recipe.draft_vocab_size,
                   help="draft vocabulary (the most frequent loss-masked target tokens)")
