"""A configuration error that ends the process is printed as its message, not as a traceback.

A bad ``MINDSPEED_LIKE_ARGS`` value, a flag the host refuses, or two features that conflict
stop the run with a :class:`ConfigError` whose message says what to change. Raised from
``import mindspeed_like.megatron_adaptor`` (or from Megatron-LM's argument hooks) it reached the
user as a traceback through importlib and the runtime, 20 to 45 lines with the message last
(issue 37 item 6). :func:`message_only` marks such an error where it leaves the library; if
nothing catches it, the process prints::

    mindspeed_like: ConfigError: MINDSPEED_LIKE_ARGS: unknown flag '--use-flash-atn'. Did you mean ...?
      (raised at train.py:1; MINDSPEED_LIKE_TRACEBACK=1 prints the traceback)

and exits with status 1, as it did. The error itself is unchanged: a caller that catches
``ConfigError`` (a framework, a test) sees the same exception. Only marked errors are shortened:
the hook that prints them (``sys.excepthook``, installed the first time an error is marked, i.e.
only in a process that is about to fail on one) hands every other exception to the hook it
found. ``MINDSPEED_LIKE_TRACEBACK=1`` (any value but empty or 0) restores the full traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

TRACEBACK_ENV = "MINDSPEED_LIKE_TRACEBACK"
_MARK = "_mindspeed_like_message_only"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# frames that are machinery between the user's line and ours: the import system, runpy
_MACHINERY = ("<frozen ", os.sep + "runpy.py", os.sep + "importlib" + os.sep)


def message_only(error: BaseException) -> BaseException:
    """Mark ``error`` to be printed as its message should it end the process; returns it (``raise
    message_only(error)``)."""
    setattr(error, _MARK, True)
    _install()
    return error


def traceback_wanted() -> bool:
    return os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0")


def short_report(error: BaseException, tb: TracebackType | None) -> str:
    """The lines printed for a marked error: its type and message, where the user's code raised it,
    and how to see the traceback."""
    where = _users_line(tb)
    hint = f"{TRACEBACK_ENV}=1 prints the traceback"
    return f"mindspeed_like: {type(error).__name__}: {error}\n  ({f'raised at {where}; ' if where else ''}{hint})\n"


def _users_line(tb: TracebackType | None) -> str:
    """``file:line`` of the outermost frame outside this package and the import machinery: the
    user's ``import mindspeed_like.megatron_adaptor`` or the script line that called Megatron-LM."""
    for frame in traceback.extract_tb(tb):
        filename = frame.filename
        if filename.startswith("<string>") or filename == "<stdin>":
            return filename
        if filename.startswith(_PACKAGE_DIR + os.sep) or any(part in filename for part in _MACHINERY):
            continue
        relative = os.path.relpath(filename)
        return f"{filename if relative.startswith('..') else relative}:{frame.lineno}"
    return ""


def _hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    if getattr(error, _MARK, False) and not traceback_wanted():
        sys.stderr.write(short_report(error, tb))
        sys.stderr.flush()
        return
    _hook.previous(kind, error, tb)  # type: ignore[attr-defined]


def _install() -> None:
    if sys.excepthook is _hook:
        return
    _hook.previous = sys.excepthook  # type: ignore[attr-defined]
    sys.excepthook = _hook
