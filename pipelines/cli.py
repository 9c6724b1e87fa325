"""Config dataclasses in use: command lines derived from them (one flag per field, its default and help from the
field's metadata, see `option`), a flat job config's fields handed on to the component config that owns them, and
the `--recipe` option every job shares (values a flag leaves unset come from the recipe in force)."""

from __future__ import annotations

import argparse
import dataclasses
import typing


def _parser_type(field: dataclasses.Field, hints: dict):
    hint = hints.get(field.name, str)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if base is bool:
        return None  # --flag / --no-flag
    return base if base in (int, float, str) else str


def option(default=dataclasses.MISSING, help: str = "", *, default_factory=dataclasses.MISSING):
    """A dataclass field that carries its command-line help: `lr: float = option(1e-4, "peak learning rate")`."""
    if not help:
        raise ValueError("option() needs its help text")
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, help: dict | None = None) -> None:
    """`--field-name` for every field of `cls` (bools as --x/--no-x), defaulting to the field's default; its help
    from `help[name]`, else the field's metadata (`option`). A field without help is refused: a user's --help
    would show nothing for it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        text = (help or {}).get(f.name, f.metadata.get("help", ""))
        if not text:
            raise ValueError(f"{cls.__name__}.{f.name} has no help text: declare it with pipelines.cli.option(...) "
                             "or pass help=")
        kind = _parser_type(f, hints)
        if kind is None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)


def dataclass_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def parse_dataclass(cls, argv=None, description: str | None = None):
    """Parse a command line into an instance of `cls` (defaults shown in --help)."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_arguments(parser, cls)
    return dataclass_from_args(cls, parser.parse_args(argv))


def config_from_fields(cls, source, **given):
    """An instance of the dataclass `cls` from the same-named fields of the dataclass `source`, then `given`.

    A job config keeps flat fields (its CLI flags, JSON overrides and MLflow params) whose defaults are read from
    the component's own config (`lr: float = TrainConfig.lr`); this hands them back without a field-by-field copy.
    """
    shared = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(source)}
    return cls(**{**{name: getattr(source, name) for name in shared}, **given})


def comma_separated(kind, what: str, check=None):
    """An argparse type: comma-separated values of `kind` (e.g. "2,15,27"); `check(values)` returns an error
    message or None."""
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from err
        problem = check(values) if check else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return values
    return parse


# --------------------------------------------------------------------------------------------------
# Recipes (eagle_core.recipe): `--recipe`, and the options whose unset values come from it
# --------------------------------------------------------------------------------------------------

RECIPE_HELP = ("training recipe: a shipped name (docs/recipes.md) or a .toml file (default: the shipped recipe naming "
               "the target, else one derived from the target's size and vocabulary; printed at start)")


def add_recipe_option(parser) -> None:
    """--recipe; absent from the parsed namespace unless given (its help states its default itself)."""
    parser.add_argument("--recipe", default=argparse.SUPPRESS, metavar="NAME|FILE", help=RECIPE_HELP)


class _FromRecipe:
    """The default of an option whose value comes from the recipe in force (--help shows "the recipe's")."""

    def __repr__(self) -> str:
        return "the recipe's"


FROM_RECIPE = _FromRecipe()


def defer_to_recipe(parser: argparse.ArgumentParser, names) -> None:
    """Make the options `names` (dest names) default to the recipe's value, and say so in their help."""
    unknown = set(names) - {a.dest for a in parser._actions}
    if unknown:
        raise ValueError(f"no such options to take from the recipe: {sorted(unknown)}")
    for action in parser._actions:
        if action.dest in names:
            action.default = FROM_RECIPE
            if "%(default)" not in (action.help or ""):
                action.help = f"{action.help or ''} (default: %(default)s)".strip()


def from_recipe(value) -> bool:
    return value is FROM_RECIPE


def fill_from_recipe(values: dict, recipe, names: dict) -> dict:
    """`values` with every option among `names` (option -> recipe value name) that no flag set taken from
    `recipe.training_values()`; values a flag gave stay."""
    given = recipe.training_values()
    for option_name, recipe_name in names.items():
        if from_recipe(values.get(option_name, FROM_RECIPE)):
            values[option_name] = given[recipe_name]
    return values
