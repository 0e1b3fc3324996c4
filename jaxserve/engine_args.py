"""EngineConfig <-> command-line flags, generated from the dataclass so they never drift apart:
every field `max_num_seqs` is the flag `--max-num-seqs`, with the field's help text."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from jaxserve.config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


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
                               help=f"{help_text} (default: {f.default})")
        elif typing.get_origin(tp) is tuple:
            group.add_argument(_flag(f.name), type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                               help=f"{help_text}; comma-separated")
        else:
            kw = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
            group.add_argument(_flag(f.name), type=tp, default=None, help=f"{help_text} (default: {f.default})",
                               **kw)


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
