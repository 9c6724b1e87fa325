"""The main job on the embedded defaults: ingest a sample of the default ShareGPT corpus and summarise it.

Usage: python jobs/demo.py [--corpus URL] [--limit N] [--address RAY_ADDRESS]
(Later stages — extract, train, serve — join this demo as they land.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelines.cluster import connect  # noqa: E402
from pipelines.data import DEFAULT_CORPUS, ingest  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=DEFAULT_CORPUS,
                        help="corpus URL (any fsspec URL: file, dir, glob, s3://...); 'sharegpt' = the embedded default")
    parser.add_argument("--limit", type=int, default=2000, help="read at most this many rows (default: 2000)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: the job's cluster, else a local one)")
    args = parser.parse_args(argv)

    connect(args.address)
    start = time.perf_counter()
    result = ingest(args.corpus, limit=args.limit)
    stats = result.stats
    print(f"[ingest] {stats.summary()} ({time.perf_counter() - start:.1f}s)")
    print("[ingest] counts:")
    for key in ("read", "kept", "quarantined", "deduped", "trimmed_rows"):
        print(f"  {key:>12}: {getattr(stats, key)}")
    for reason, count in sorted(stats.quarantined_by_reason.items(), key=lambda kv: -kv[1]):
        print(f"  {'quarantined':>12}: {count:6d}  {reason}")
    example = result.dataset.take(1)
    if example:
        first = example[0]
        print(f"[ingest] first kept conversation {first['id']!r}: {len(first['messages'])} turns, "
              f"first user turn: {first['messages'][0]['content'][:80]!r}")
    assert stats.kept + stats.quarantined + stats.deduped == stats.read
    return 0


if __name__ == "__main__":
    sys.exit(main())
