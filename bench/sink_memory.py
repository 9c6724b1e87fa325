"""Benchmark: the traffic sink's memory behind a stalled store (issue 54, item 7).

    python -m bench.sink_memory --requests 1000 --hidden 256 --tokens 512 --bound-mib 64

One child process per setting (a fresh interpreter, so its RSS is the sink's and nothing earlier's): a sink for a
fake target of hidden size --hidden whose store never answers (every write blocks until the end of the run), fed
--requests records of --tokens tokens each, with features as serving captures them (aux [n, 3H] and last [n, H],
bf16; on the GPU where there is one, as the decoding thread hands them over). Recorded: the child's RSS before the
sink and after the records (psutil), the CUDA memory still allocated (where there is a GPU), the bytes the sink
says it holds, how many records it kept and dropped, and the slowest `record` call. Two settings: the byte bound
(`max_pending_bytes` = --bound-mib) and no byte bound (the count bound alone, 1 024 records, as before issue 54).
Results: bench/results/sink-memory/<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone

from bench.common import RESULTS, command, write_json, write_markdown

MIB = 1 << 20


def cpu_line() -> str:
    """The CPU's model and the instruction-set flags that decide torch's kernels, from /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} CPU cores, flags: {' '.join(shown) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}"


def child(args) -> dict:
    import threading
    import uuid
    from types import SimpleNamespace

    import fsspec
    import psutil
    import torch
    from fsspec.implementations.memory import MemoryFileSystem

    from eagle_core.capture import RowFeatures
    from pipelines.traffic import TrafficSink
    from pipelines.traffic_config import TrafficConfig

    release = threading.Event()

    class Stalled(MemoryFileSystem):
        protocol = "benchstalled"

        def pipe_file(self, path, value, **kwargs):
            release.wait()
            return super().pipe_file(path, value, **kwargs)

    fsspec.register_implementation("benchstalled", Stalled, clobber=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h, n = args.hidden, args.tokens
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    cuda_before = torch.cuda.memory_allocated() if device == "cuda" else 0
    fingerprint = {"target_weights_hash": "w", "tokenizer_hash": "t", "max_length": n + 8, "dtype": "bfloat16",
                   "aux_layer_ids": [1, 2, 3], "regeneration": {"with": "serve"}, "corpus": "traffic"}
    bound = args.bound_mib * MIB if args.bound_mib else 1 << 62
    sink = TrafficSink(TrafficConfig(url=f"benchstalled://{uuid.uuid4().hex}/traffic", target="fake",
                                     max_length=n + 8, max_pending_bytes=bound),
                       target_config=SimpleNamespace(hidden_size=h, vocab_size=1000, num_hidden_layers=4),
                       fingerprint=fingerprint, dtype=torch.bfloat16)
    worst = 0.0
    prompt, answer = list(range(1, n // 2 + 1)), list(range(100, 100 + n - n // 2))
    for _ in range(args.requests):
        features = RowFeatures(torch.randn(n - 1, 3 * h, device=device, dtype=torch.bfloat16),
                               torch.randn(n - 1, h, device=device, dtype=torch.bfloat16))
        started = time.perf_counter()
        sink.record(prompt, answer, features=features)
        worst = max(worst, time.perf_counter() - started)
        del features
    time.sleep(1.0)  # the writer takes what it will take
    if device == "cuda":
        torch.cuda.synchronize()
    stats = sink.stats()
    out = {"bound_bytes": args.bound_mib * MIB if args.bound_mib else None, "device": device,
           "record_bytes": 8 * n + (n - 1) * 4 * h * 2, "rss_before_mib": rss_before / MIB,
           "rss_after_mib": proc.memory_info().rss / MIB, "rss_growth_mib": (proc.memory_info().rss - rss_before) / MIB,
           "cuda_allocated_mib": ((torch.cuda.memory_allocated() - cuda_before) / MIB) if device == "cuda" else None,
           "sink_pending_mib": stats["pending_bytes"] / MIB, "dropped": stats["dropped"],
           "kept": args.requests - sum(stats["dropped"].values()), "worst_record_ms": worst * 1e3}
    release.set()
    sink.close(timeout=60)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000, help="records handed to the sink behind the stalled store")
    p.add_argument("--hidden", type=int, default=256, help="the fake target's hidden size H")
    p.add_argument("--tokens", type=int, default=512, help="tokens per conversation")
    p.add_argument("--bound-mib", type=int, default=64, help="max_pending_bytes of the bounded setting, MiB")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="result JSON file (default: bench/results/sink-memory/<date>.json)")
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    runs = []
    for bound in (args.bound_mib, 0):
        argv_child = [sys.executable, "-m", "bench.sink_memory", "--child", "--requests", str(args.requests),
                      "--hidden", str(args.hidden), "--tokens", str(args.tokens), "--bound-mib", str(bound)]
        done = subprocess.run(argv_child, capture_output=True, text=True, timeout=600)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"the child failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(line[len("RESULT "):]))
    now = datetime.now(timezone.utc)
    data = {"command": command("sink_memory", argv), "date": now.strftime("%Y-%m-%d %H:%M UTC"), "machine": cpu_line(),
            "gpu": None, "requests": args.requests, "hidden": args.hidden, "tokens": args.tokens, "runs": runs}
    import torch

    if torch.cuda.is_available():
        data["gpu"] = torch.cuda.get_device_name(0)
    out = args.out or str(RESULTS / "sink-memory" / f"{now.strftime('%Y-%m-%d-%H%M')}.json")
    write_json(out, data)
    rows = "\n".join(
        f"| {'%d MiB' % (r['bound_bytes'] // MIB) if r['bound_bytes'] else 'none (count bound 1 024)'} | "
        f"{r['kept']} | {sum(r['dropped'].values())} | {r['sink_pending_mib']:.1f} | {r['rss_growth_mib']:.1f} | "
        f"{'-' if r['cuda_allocated_mib'] is None else '%.1f' % r['cuda_allocated_mib']} | {r['worst_record_ms']:.2f} |"
        for r in runs)
    write_markdown(out, f"""# Traffic sink memory behind a stalled store ({data['date']})

`{data['command']}` on {data['machine']}{', GPU ' + data['gpu'] if data['gpu'] else ', no GPU'}.
{args.requests} records of {args.tokens} tokens with features of a hidden size {args.hidden} in bf16
({runs[0]['record_bytes'] / MIB:.2f} MiB each, on {runs[0]['device']}); the store never answers during the run. One
fresh process per row; RSS growth is the process's resident memory after the records minus before the sink.

| byte bound | records kept | dropped | sink holds (MiB) | RSS growth (MiB) | CUDA allocated (MiB) | slowest record (ms) |
|---|---:|---:|---:|---:|---:|---:|
{rows}
""")


if __name__ == "__main__":
    main()
