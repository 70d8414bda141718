"""Turns :class:`Settings` into command-line flags, so a flag and its env var never drift apart."""

from __future__ import annotations

import argparse
import sys
from enum import Enum
from typing import Any, NoReturn

from pydantic import ValidationError

from dra_driver.settings import ENV_PREFIX, Settings


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
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=argparse.SUPPRESS,
            choices=choices,
            metavar=None if choices else name.split("_")[-1].upper(),
            help=f"{info.description} [env {env_name(name)}; default {default!s:.60}]",
        )


def settings_from(args: argparse.Namespace) -> Settings:
    """Build settings from parsed flags (over env vars, over defaults); exit 2 naming a bad one."""
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as err:
        _exit_invalid(err)


def _exit_invalid(err: ValidationError) -> NoReturn:
    for problem in err.errors():
        field = str(problem["loc"][0]) if problem["loc"] else "?"
        value = problem.get("input")
        print(
            f"error: invalid setting {flag_name(field)} / {env_name(field)} = {value!r}: {problem['msg']}",
            file=sys.stderr,
        )
    raise SystemExit(2)
