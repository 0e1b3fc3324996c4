"""The flat spelling of EngineConfig: keywords (`LLM(max_num_seqs=8)`, `build_engine` callers) and
command-line flags (`--max-num-seqs 8`), as vLLM keeps EngineArgs beside its nested config.

Every field of a section (`EngineConfig.scheduler.max_num_seqs`) and every plain field of
EngineConfig (`speculative_config`) is one flat argument named as the field; the flags are
generated from the fields (their help, choices and parsers), so the spellings never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from dataclasses import dataclass
from functools import cache

from jaxserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class EngineArg:
    """One flat argument: the field it sets and the section holding it (None: EngineConfig's own)."""

    name: str
    section: str | None
    field: dataclasses.Field
    type: typing.Any          # the field's type without None
    # whether a second engine on the same compiled runner may set it anew (LLM.sharing_runner):
    # what only the scheduler and the engine's loop read, never the runner's shapes or weights
    per_engine: bool


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


@cache
def engine_args() -> dict[str, EngineArg]:
    """Every flat argument by name, in the order of the sections' fields."""
    out: dict[str, EngineArg] = {}
    hints = typing.get_type_hints(EngineConfig)
    for top in dataclasses.fields(EngineConfig):
        if top.metadata.get("section"):
            cls = hints[top.name]
            section_hints = typing.get_type_hints(cls)
            whole = top.metadata.get("per_engine", False)
            for f in dataclasses.fields(cls):
                out[f.name] = EngineArg(f.name, top.name, f, _base_type(section_hints[f.name]),
                                        per_engine=whole or f.metadata.get("per_engine", False))
        else:
            out[top.name] = EngineArg(top.name, None, top, _base_type(hints[top.name]),
                                      per_engine=top.metadata.get("per_engine", False))
    named = [f.name for top in dataclasses.fields(EngineConfig) if top.metadata.get("section")
             for f in dataclasses.fields(hints[top.name])] + [a.name for a in out.values() if a.section is None]
    assert len(named) == len(out), "a flat argument name is in two sections"
    return out


def engine_config(**kwargs) -> EngineConfig:
    """The EngineConfig of flat keyword arguments (unset ones keep their defaults); an unknown
    name is refused with the known ones."""
    known = engine_args()
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
    sections: dict[str, dict] = {}
    top: dict = {}
    for name, value in kwargs.items():
        arg = known[name]
        (sections.setdefault(arg.section, {}) if arg.section else top)[name] = value
    hints = typing.get_type_hints(EngineConfig)
    built = {name: hints[name](**values) for name, values in sections.items()}
    return EngineConfig(**built, **top)


def engine_kwargs(config: EngineConfig) -> dict:
    """The flat arguments of a config: engine_config(**engine_kwargs(c)) == c."""
    out = {}
    for name, arg in engine_args().items():
        holder = getattr(config, arg.section) if arg.section else config
        out[name] = getattr(holder, name)
    return out


def replace_args(config: EngineConfig, **kwargs) -> EngineConfig:
    """`config` with some flat arguments set anew (validated as a new config is)."""
    return engine_config(**{**engine_kwargs(config), **kwargs})


def default_arg(name: str):
    """The default of one flat argument (what the server runs with when it is not set)."""
    return engine_args()[name].field.default


def per_engine_args() -> frozenset[str]:
    """The arguments a second engine on the same compiled runner may set anew."""
    return frozenset(name for name, arg in engine_args().items() if arg.per_engine)


# ---- the command line ------------------------------------------------------------------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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
    for arg in engine_args().values():
        if arg.name in skip:
            continue
        f, tp = arg.field, arg.type
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
    """The flat arguments the user set on the command line (unset ones keep their defaults)."""
    out = {}
    for name in engine_args():
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    return out


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config(**engine_kwargs_from_args(args))
