"""Train a draft in one process straight from a corpus (features computed on the fly, resumable).

    python -m jobs.distill --output work/distill/smollm2 --steps 1000     # rerun the same line to resume

See pipelines/distill.py for the method; `--help` lists every option with its default. The recipe in force
(--recipe, else the target's: eagle_core/recipes/) sets lr, TTT steps, draft vocabulary, max length and tokens
per step unless those flags are given.
"""

import argparse
import sys

from pipelines.cli import (add_dataclass_arguments, add_recipe_option, dataclass_from_args, defer_to_recipe,
                           fill_from_recipe)
from pipelines.distill import DistillConfig, Distiller

# DistillConfig fields that default to the recipe's values (field -> recipe value).
RECIPE_OPTIONS = {"lr": "lr", "ttt_steps": "ttt_steps", "draft_vocab_size": "draft_vocab_size",
                  "max_length": "max_length", "tokens_per_batch": "tokens_per_batch"}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, every option with its default."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.distill", description=__doc__, formatter_class=_Formatter)
    add_dataclass_arguments(p, DistillConfig)
    add_recipe_option(p)
    defer_to_recipe(p, RECIPE_OPTIONS)
    return p


def config_from_argv(argv=None) -> DistillConfig:
    from eagle_core.recipe import RecipeError, resolve_recipe

    args = build_parser().parse_args(argv)
    try:
        recipe = resolve_recipe(getattr(args, "recipe", None), args.target)
    except (RecipeError, FileNotFoundError) as err:
        raise SystemExit(f"distill: {err}") from err
    print(f"[distill] recipe {recipe.summary()} ({recipe.why})", flush=True)
    values = fill_from_recipe(vars(args), recipe, RECIPE_OPTIONS)
    return dataclass_from_args(DistillConfig, argparse.Namespace(**values))


def main(argv=None):
    cfg = config_from_argv(argv)
    print(f"[distill] draft at {Distiller(cfg).run()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
