"""What every command shares: argument types, the artifact directory rule,
JSON output and the one-line error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.devices import device_name, parse_device
from ..core.env import ARTIFACTS as ENV_ARTIFACTS
from ..runtime.paths import default_artifact_dir

# Exceptions whose message says all there is to say: no type name needed.
PLAIN_ERRORS = (ValueError, TypeError, OSError, RuntimeError, ImportError)


class CliError(Exception):
    """A command's invalid input or unusable state: printed as one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse would print the usage block first; one line is enough
        # (--help has the rest).
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def device_arg(text: str) -> str:
    """An argparse type: a device name (core/devices.py), canonical."""
    try:
        return device_name(*parse_device(text, "the device"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_list(minimum: int):
    """An argparse type: a comma list of integers >= minimum."""

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
        return [_int_at_least(t, minimum) for t in items]

    return parse


def artifact_dir(args, may_be_missing: bool = False) -> Path:
    """The directory --artifacts names, else the default one. It must exist
    (a mistyped path would otherwise read as an empty directory), except
    the default one where may_be_missing (nothing built yet)."""
    given = args.artifacts is not None
    d = Path(args.artifacts) if given else default_artifact_dir()
    if d.is_dir() or (may_be_missing and not given):
        return d
    what = "--artifacts" if given else f"the default artifact directory (${ENV_ARTIFACTS}, else the user cache)"
    state = "is not a directory" if d.exists() else "does not exist"
    raise CliError(f"{what}: {d} {state}; build into it with `turbine-fmha build --artifacts {d}`")


def emit_json(value) -> None:
    print(json.dumps(value, indent=1))
