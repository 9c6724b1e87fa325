"""Train a draft in one process straight from a corpus (features computed on the fly, resumable).

    python -m jobs.distill --output work/distill/smollm2 --steps 1000     # rerun the same line to resume

See pipelines/distill.py for the recipe; `--help` lists every option with its default.
"""

from pipelines.cli import parse_dataclass
from pipelines.distill import DistillConfig, Distiller


def main(argv=None):
    cfg = parse_dataclass(DistillConfig, argv, description=__doc__)
    print(f"[distill] draft at {Distiller(cfg).run()}", flush=True)


if __name__ == "__main__":
    main()
