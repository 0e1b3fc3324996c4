"""The pieces every config section is written with: a field with its help text (the CLI flag's),
and the checks most fields need."""

from __future__ import annotations

import math
from dataclasses import field


def option(default, help: str, **kw):
    """A config field: `help` is its flag's help text; `choices` and `parse` go to the flag too
    (jaxserve/engine_args.py builds the CLI from the sections' fields)."""
    return field(default=default, metadata={"help": help, **kw})


def check_positive_int(config, *names: str, optional: bool = False) -> None:
    for name in names:
        v = getattr(config, name)
        if optional and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer" + (" or None" if optional else ""))


def check_positive_number(config, *names: str, optional: bool = False) -> None:
    for name in names:
        v = getattr(config, name)
        if optional and v is None:
            continue
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r} must be a finite number > 0" + (" or None" if optional else ""))


def check_choice(config, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(config, name) not in allowed:
        raise ValueError(f"{name}={getattr(config, name)!r} must be one of {allowed}")


def choices(config, name: str) -> tuple[str, ...]:
    """The choices a field declares."""
    return config.__dataclass_fields__[name].metadata["choices"]
