"""EngineArgs: every engine option once, as vLLM's ``EngineArgs`` (a dataclass + CLI flags).

The options, their defaults and help texts are :class:`~workbench.config.EngineConfig`'s
fields; EngineArgs adds the argparse round trip, so ``workbench serve``, ``workbench
generate`` and notebook magics share one set of flags::

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(argv)))
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection

from workbench.config import EngineConfig

_SCALARS = (int, float, str)


def _flag_type(hint: object) -> type:
    """int / float / str for a field annotated ``T`` or ``T | None``; str otherwise (Any)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if len(args) == 1 and args[0] in _SCALARS else str


@dataclasses.dataclass
class EngineArgs(EngineConfig):
    """The engine's options (see EngineConfig for each one's meaning and default)."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, exclude: Collection[str] = (),
                     keep_defaults: bool = True) -> argparse.ArgumentParser:
        """Add one ``--flag-name`` per option (booleans also get ``--no-flag-name``).

        ``exclude`` leaves options out (a caller that takes the model as a positional);
        ``keep_defaults=False`` parses an absent flag as None, so only the flags given
        override another base config (``%llm load`` over the teaching engine).
        """
        group = parser.add_argument_group("engine options")
        hints = typing.get_type_hints(EngineConfig)
        for f in dataclasses.fields(EngineConfig):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help", "")
            default = f.default if keep_defaults else None
            if default is not None:
                help_text += " (default: %(default)s)"
            if hints[f.name] is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=default, help=help_text)
            else:
                group.add_argument(flag, type=_flag_type(hints[f.name]), default=default,
                                   help=help_text, **meta)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed with :meth:`add_cli_args` (other keys ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                      if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(**self.to_kwargs())

    def to_kwargs(self) -> dict:
        """The options as keyword arguments (for ``LLM(**args.to_kwargs())``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
