"""User hooks named in configuration as "package.module:function" (the traffic sink's redaction hook, the drift
hook): imported when the component is built, so a typo stops it at once instead of at the first call."""

from __future__ import annotations

import importlib
from typing import Callable


def import_callable(spec: str, what: str) -> Callable:
    """"package.module:function" -> that function; `what` names the setting in the errors."""
    module, _, name = str(spec).partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: expected 'module:function'")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable")
    return fn
