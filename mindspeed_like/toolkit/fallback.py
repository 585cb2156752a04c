"""A feature that cannot run a call hands it back to megatron visibly (design principle 8).

Each reason is logged once per process (until ``forget_logged()``, which ``mindspeed_like.reset()``
calls); under ``--strict`` it is an error instead, so a user who asked for a feature learns that
a call did not get it. A :class:`Fallback` is built from the resolved config when a feature's
patches are built (``Context.fallback``): it knows ``strict`` and never reads global config.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from mindspeed_like.toolkit.errors import FeatureUnsupported

_logged: dict[str, set[str]] = {}
_fell_back: dict[str, list[str]] = {}  # feature -> reasons it handed a call back, in order
_served: dict[str, str] = {}  # feature -> what computed its calls instead (another feature's kernel)
_lock = threading.Lock()


def forget_logged() -> None:
    """Every reason may be logged once more (a fresh start, e.g. after ``mindspeed_like.reset()``)."""
    with _lock:
        _logged.clear()
        _fell_back.clear()
        _served.clear()


def fell_back() -> dict[str, list[str]]:
    """The features that handed at least one call back to megatron in this process (since the
    last ``forget_logged()``), each with its distinct reasons: what `mindspeed-like compare`
    reports as "did not run"."""
    with _lock:
        return {feature: list(reasons) for feature, reasons in _fell_back.items()}


def served() -> dict[str, str]:
    """The features whose calls another feature's kernel computed in this process (since the last
    ``forget_logged()``), each with what did: e.g. flash-attention at context_parallel_size > 1,
    where the context-parallel kernel computes attention (flash-style). Not a fallback to megatron."""
    with _lock:
        return dict(_served)


@dataclass(frozen=True)
class Fallback:
    """``fallback(reason)``: raise ``error`` under strict, else log ``reason`` the first time.

    Frozen and compared by value, so patches built with an equal Fallback are equal and a
    re-applied configuration leaves them in place.
    """

    feature: str
    strict: bool
    error: type[Exception] = FeatureUnsupported
    instead: str = "using megatron's path"
    logger: str = "mindspeed_like"

    def __call__(self, reason: str) -> None:
        if self.strict:
            raise self.error(f"{self.feature} cannot run this call ({reason}) and strict is on")
        with _lock:
            reasons = _fell_back.setdefault(self.feature, [])
            if reason not in reasons:
                reasons.append(reason)
        self.once(reason, f"{self.feature}: {self.instead} ({reason})")

    def served_by(self, by: str, message: str, say: bool = True) -> None:
        """This feature's call is computed by ``by`` (another feature's kernel that does the same job
        there): recorded for reports, ``message`` logged once (``say=False``: marked as said, e.g. on
        ranks other than 0). Never an error, also under strict: the call does get the kind of kernel
        the user asked for."""
        with _lock:
            _served.setdefault(self.feature, by)
            if not say:
                _logged.setdefault(self.feature, set()).add(f"served by {by}")
        self.once(f"served by {by}", message)

    def once(self, key: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time ``key`` is seen for this feature (never an error)."""
        with _lock:
            seen = _logged.setdefault(self.feature, set())
            if key in seen:
                return
            seen.add(key)
        logging.getLogger(self.logger).log(level, "%s", message)
