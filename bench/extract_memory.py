"""Benchmark: the extraction driver's peak memory against the corpus size (issue 42, item 3).

    python -m bench.extract_memory --rows 10000 100000

For each row count N, a synthetic corpus of N tiny conversations (one short question, one short answer, JSONL
files of --rows-per-file rows) is extracted with `regenerate=False` onto a tiny random target (4 layers, hidden
64, SmolLM2's tokenizer) on a fresh local Ray cluster, in a child process that is the driver and nothing else
(Ray's workers and raylet are other processes). Recorded per N: the driver's RSS before `run_extract` (imports,
Ray started), its peak RSS while `run_extract` runs (psutil, sampled every 20 ms, and the kernel's `ru_maxrss`
high-water mark of the whole child), and the run's rows, shards and seconds. A driver that streams keeps the peak
roughly flat as N grows; one that collects the corpus grows with it.

The corpus and the target are made by this (parent) process, so they never count against the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, command, machine, write_json, write_markdown

MIB = 1 << 20


def write_corpus(folder: Path, rows: int, rows_per_file: int) -> None:
    """N tiny ShareGPT rows, written line by line (never held whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    for first in range(0, rows, rows_per_file):
        with open(folder / f"part-{first // rows_per_file:05d}.jsonl", "w") as f:
            for i in range(first, min(rows, first + rows_per_file)):
                f.write(json.dumps({"id": f"r{i}", "conversations": [
                    {"from": "human", "value": f"What is {i} plus one?"},
                    {"from": "gpt", "value": f"{i + 1}."}]}) + "\n")


def write_tiny_target(folder: Path) -> None:
    """A random 4-layer Llama (hidden 64) with SmolLM2's tokenizer, as tests/conftest.py's tiny_target_dir."""
    from transformers import AutoTokenizer

    from eagle_core.target import make_tiny_llama, materialize_hf_folder

    tokenizer = AutoTokenizer.from_pretrained(materialize_hf_folder("smollm2-135m"))
    model = make_tiny_llama(vocab_size=len(tokenizer), num_hidden_layers=4, seed=3, tie_word_embeddings=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def child(args) -> dict:
    """The driver under measurement: start Ray, run one extraction, report its memory."""
    import resource

    import psutil

    from pipelines.cluster import connect
    from pipelines.extract import ExtractConfig, run_extract

    connect(num_cpus=args.ray_cpus)
    me = psutil.Process()
    before = me.memory_info().rss
    peak, running = [before], True

    def sample():  # the RSS high-water mark while run_extract runs
        while running:
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    load_before = os.getloadavg()[0]  # the machine is shared: its load says how much of it the run had
    start = time.perf_counter()
    manifest = run_extract(ExtractConfig(
        corpus=args.corpus, output=args.output, target=args.target, regenerate=False, max_length=64,
        rows_per_shard=args.rows_per_shard, num_workers=args.num_workers, cpus_per_worker=1, gpus_per_worker=0,
        tokens_per_batch=8192, mlflow_experiment=None))
    seconds = time.perf_counter() - start
    running = False
    sampler.join()
    peak[0] = max(peak[0], me.memory_info().rss)
    return {"rows": manifest.rows, "shards": len(manifest.shards), "tokens": manifest.tokens,
            "seconds": round(seconds, 1), "rss_before_mib": round(before / MIB, 1),
            "rss_peak_mib": round(peak[0] / MIB, 1),
            "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB, 1),
            "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000], help="corpus sizes to measure")
    p.add_argument("--rows-per-shard", type=int, default=64, help="conversations per shard (ExtractConfig's default)")
    p.add_argument("--rows-per-file", type=int, default=50_000, help="conversations per corpus file")
    p.add_argument("--num-workers", type=int, default=2, help="extraction actors (1 CPU each)")
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the local Ray cluster")
    p.add_argument("--out", default=str(RESULTS / "extract-memory" / "extract-memory.json"), help="result JSON")
    p.add_argument("--note", default="", help="a line recorded with the result (what was not run, and why)")
    # the child's own arguments (one measurement)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_result(args, argv, runs: list[dict]) -> None:
    """The JSON (command, machine, date, every run) and its Markdown table."""
    smallest = runs[0]
    for run in runs:
        run["peak_over_smallest"] = round(run["rss_peak_mib"] / smallest["rss_peak_mib"], 3)
    result = {
        "what": "extraction driver's peak RSS against corpus size (tiny rows, regenerate=False, tiny random target)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "command": command("extract_memory", argv), "rows_per_shard": args.rows_per_shard,
        "num_workers": args.num_workers, "runs": runs, "note": args.note,
    }
    write_json(args.out, result, indent=1)
    lines = [f"# Extraction driver memory against corpus size ({result['date']})", "",
             f"`{result['command']}` on {result['machine']}; tiny random target (4 layers, hidden 64, SmolLM2's "
             f"tokenizer), `regenerate=False`, {args.rows_per_shard} rows per shard, {args.num_workers} actors. RSS "
             "of the driver process only (psutil, sampled every 20 ms during `run_extract`; `ru_maxrss` is the "
             "whole child's high-water mark).", "",
             "| corpus rows | shards | seconds | RSS before (MiB) | peak RSS in run_extract (MiB) | ru_maxrss (MiB) "
             "| peak / smallest | load (1 min) at start, end |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['corpus_rows']:,} | {r['shards']:,} | {r['seconds']} | {r['rss_before_mib']} | "
              f"{r['rss_peak_mib']} | {r['ru_maxrss_mib']} | {r['peak_over_smallest']} | "
              f"{', '.join(map(str, r.get('load_1min', [])))} |" for r in runs]
    if args.note:
        lines += ["", args.note]
    write_markdown(args.out, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        write_tiny_target(target)
        for n in args.rows:
            corpus, output = Path(tmp) / f"corpus-{n}", Path(tmp) / f"out-{n}"
            write_corpus(corpus, n, args.rows_per_file)
            cmd = [sys.executable, "-m", "bench.extract_memory", "--child", "--corpus", str(corpus), "--output",
                   str(output), "--target", str(target), "--rows-per-shard", str(args.rows_per_shard),
                   "--num-workers", str(args.num_workers), "--ray-cpus", str(args.ray_cpus)]
            env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
            env.pop("RAY_ADDRESS", None)  # a fresh local cluster per run: nothing left from the previous one
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
                return done.returncode
            run = {"corpus_rows": n, **json.loads(done.stdout.strip().splitlines()[-1])}
            print(json.dumps(run), flush=True)
            runs.append(run)
            write_result(args, argv, runs)  # after every run: a later run cut short loses none of the earlier ones
    return 0


if __name__ == "__main__":
    sys.exit(main())
