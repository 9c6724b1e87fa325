"""Config dataclasses in use: command lines derived from them (one flag per field, its default and help from the
field), and a flat job config's fields handed on to the component config that owns them."""

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


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, help: dict | None = None) -> None:
    """`--field-name` for every field of `cls` (bools as --x/--no-x), defaulting to the field's default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        # argparse prints nothing, not even the default, for an option with empty help
        text = (help or {}).get(f.name, f.metadata.get("help", "")) or "default: %(default)s"
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
