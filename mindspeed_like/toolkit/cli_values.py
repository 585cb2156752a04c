"""Checked command-line values: ``type=`` functions for argparse, so a bad number or an output
path that cannot be written stops the command at argument parsing, before anything runs.

Why each exists (issue 37 item 6): ``mindspeed-like compare --out FILE`` with FILE an existing
file ran the whole comparison and then died in ``os.makedirs``, losing the result; ``--lr nan``
ended in torch's traceback from the optimizer; ``--record ../x`` wrote outside results/. The
demo, compare and every benchmark take their numbers and output paths through these.

argparse prints a type function's ``ArgumentTypeError`` as ``argument --lr: <message>`` and
exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable

_RECORD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _number(text: str, kind: type) -> float | int:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def at_least(minimum: float, kind: type = float) -> Callable[[str], float | int]:
    """A finite number >= ``minimum`` (``nan`` and ``inf`` are refused: no run can use them)."""

    def parse(text: str) -> float | int:
        value = _number(text, kind)
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum:g}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} >= {minimum:g}"
    return parse


def above(minimum: float, kind: type = float) -> Callable[[str], float | int]:
    """A finite number > ``minimum``."""

    def parse(text: str) -> float | int:
        value = _number(text, kind)
        if not math.isfinite(value) or value <= minimum:
            raise argparse.ArgumentTypeError(f"must be a finite number > {minimum:g}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} > {minimum:g}"
    return parse


positive_int = above(0, int)
non_negative_int = at_least(0, int)


def record_name(text: str) -> str:
    """A record's name: a plain file name under results/ (``NAME.json``), never a path out of it.
    The empty string stands for the default name."""
    if text == "":
        return text
    if text.endswith(".json"):
        raise argparse.ArgumentTypeError(f"give the record's name without .json (results/NAME.json), got {text!r}")
    if not _RECORD_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"a record name is a file name under results/ (letters, digits, '.', '_', '+', '-'; not starting with "
            f"'.' or '-'; no '/'), got {text!r}; use --json PATH (benchmarks) or --out DIR (compare) for another place"
        )
    return text


def output_directory(text: str) -> str:
    """A directory to write into: an existing directory, or one that can be created (its nearest
    existing parent is a writable directory)."""
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory; give a directory (it is created)")
    _check_writable_parent(text, path if os.path.isdir(path) else os.path.dirname(path))
    return text


def output_file(text: str) -> str:
    """A file to write: not an existing directory, in a directory that exists or can be created."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give the path of a file")
    _check_writable_parent(text, os.path.dirname(path))
    return text


def _check_writable_parent(text: str, directory: str) -> None:
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {existing!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {existing!r} is not writable")
