"""Turns :class:`Settings` into command-line flags, so a flag and its env var never drift apart."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from pydantic import ValidationError

from dra_driver.errors import EXIT_USAGE, StartupError
from dra_driver.settings import ENV_PREFIX, LogFormat, Settings


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def add_settings_flags(parser: argparse.ArgumentParser, fields: list[str] | None = None) -> None:
    """Add one flag per setting; unset flags stay absent so the environment can supply them."""
    for name, info in Settings.model_fields.items():
        if fields is not None and name not in fields:
            continue
        annotation: Any = info.annotation
        choices = (
            [member.value for member in annotation]
            if isinstance(annotation, type) and issubclass(annotation, Enum)
            else None
        )
        default = info.default.value if isinstance(info.default, Enum) else info.default
        # A switch may stand alone: `--consumable-capacity` is `--consumable-capacity true`.
        switch: dict[str, Any] = {"nargs": "?", "const": "true"} if annotation is bool else {}
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=argparse.SUPPRESS,
            choices=choices,
            **switch,
            metavar=None if choices else name.split("_")[-1].upper(),
            help=f"{info.description} [env {env_name(name)}; default {default!s:.60}]",
        )


def settings_from(args: argparse.Namespace) -> Settings:
    """Build settings from parsed flags (over env vars, over defaults).

    Raises :class:`StartupError` (exit 2) naming every bad setting by flag and env var, in one line.
    """
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as err:
        raise StartupError("; ".join(map(_describe, err.errors())), exit_code=EXIT_USAGE) from None


def _describe(problem: Any) -> str:
    field = str(problem["loc"][0]) if problem["loc"] else "?"
    message = str(problem["msg"]).removeprefix("Value error, ")  # pydantic's prefix for a ValueError
    return f"invalid setting {flag_name(field)} / {env_name(field)} = {problem.get('input')!r}: {message}"


def unknown_env_settings(environ: Mapping[str, str] = os.environ) -> list[str]:
    """``DRA_*`` variables that name no setting: a typo such as DRA_MIG_PARTITION is otherwise ignored."""
    known = {env_name(name) for name in Settings.model_fields}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def requested_log_format(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> LogFormat:
    """The log format asked for, read leniently: errors must be reported before settings are valid.

    ``--log-format X`` or ``--log-format=X`` wins over ``DRA_LOG_FORMAT``; anything unknown is auto.
    """
    flag, value = flag_name("log_format"), environ.get(env_name("log_format"), "")
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    try:
        return LogFormat(value)
    except ValueError:
        return LogFormat.AUTO
