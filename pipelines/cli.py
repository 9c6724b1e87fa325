"""Command lines derived from config dataclasses: one flag per field, its default and help from the field."""

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
        text = (help or {}).get(f.name, f.metadata.get("help", ""))
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
