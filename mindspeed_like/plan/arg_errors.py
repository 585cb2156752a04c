"""One-line argument errors for ``mindspeed-like plan``: argparse prints its whole usage (68 lines
for Megatron-LM's options, under the interpreter's program name) before the one line that says
what was wrong; plan's other refusals are that one line, ``mindspeed-like plan: ...``, exit 2."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Iterator, Sequence

from mindspeed_like.toolkit.errors import ConfigError

# plan's own options that take a value which may start with '-' (argparse would read '-80GiB' as an option)
VALUE_OPTIONS = ("--device-memory", "--world-size", "--headroom")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a ConfigError (``plan: argument --x: ...``), not usage + exit."""

    def error(self, message: str) -> None:  # argparse would print the usage and sys.exit(2)
        raise ConfigError(f"plan: {message}")


def values_attached(argv: Sequence[str], options: Sequence[str] = VALUE_OPTIONS) -> list[str]:
    """``--device-memory -80GiB`` as ``--device-memory=-80GiB``, so the value reaches its checks
    (which say what is wrong with it) instead of argparse's 'expected one argument'."""
    out: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        value = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tokens[i] in options and value.startswith("-") and not value.startswith("--"):
            out.append(f"{tokens[i]}={value}")
            i += 2
            continue
        out.append(tokens[i])
        i += 1
    return out


@contextlib.contextmanager
def megatron_lm_usage_errors() -> Iterator[None]:
    """Megatron-LM's ``parse_args`` builds its own parser: its usage error (SystemExit 2, the usage on
    stderr) becomes the last line's message as a ConfigError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as stop:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exited with {stop.code}"
        message = re.sub(r"^\S+: error: ", "", last)
        raise ConfigError(f"plan: Megatron-LM's parser: {message}") from None
    finally:
        leftover = err.getvalue()
        if leftover and "error:" not in leftover:
            sys.stderr.write(leftover)
