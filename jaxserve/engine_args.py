"""EngineConfig <-> command-line flags, generated from the dataclass so they never drift apart:
every field `max_num_seqs` is the flag `--max-num-seqs`, with the field's help text."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from jaxserve.config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


_STATES_DEFAULT = re.compile(r"\(default\b|\bdefault:", re.IGNORECASE)   # "(default 1 GiB", "; default: x"


def help_states_default(help_text: str) -> bool:
    """Whether a flag's help already says what its default is."""
    return _STATES_DEFAULT.search(help_text) is not None


def _with_default(help_text: str, default) -> str:
    """The help with its default appended, unless the help already says what the default is or
    there is none to state (None: unset)."""
    if default is None or help_states_default(help_text):
        return help_text
    return f"{help_text} (default: {default})"


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        tp = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if tp is bool:
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None,
                               help=_with_default(help_text, f.default))
        elif typing.get_origin(tp) is tuple:
            group.add_argument(_flag(f.name), type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                               help=f"{help_text}; comma-separated")
        else:
            kw = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
            group.add_argument(_flag(f.name), type=f.metadata.get("parse", tp), default=None,
                               help=_with_default(help_text, f.default), **kw)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the user set on the command line (unset ones keep their defaults)."""
    out = {}
    for f in dataclasses.fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            out[f.name] = v
    return out


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
