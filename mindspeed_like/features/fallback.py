"""A feature that cannot run a call hands it back to megatron visibly (design principle 8).

Each reason is logged once per process; under ``--strict`` it is an error instead, so a user
who asked for a feature learns that a call did not get it.
"""

from __future__ import annotations

import logging


class Fallback:
    """``fall_back(reason)``: raise ``error`` under strict, else log ``reason`` the first time.

    ``logged`` is the set of reasons already logged (tests clear it to see a line again).
    """

    def __init__(self, feature: str, error: type[Exception], instead: str, logger: logging.Logger) -> None:
        self.feature = feature
        self.error = error
        self.instead = instead
        self.logger = logger
        self.logged: set[str] = set()

    def __call__(self, reason: str) -> None:
        import mindspeed_like

        if mindspeed_like.current_config()["strict"]:
            raise self.error(f"{self.feature} cannot run this call ({reason}) and strict is on")
        self.once(reason, f"{self.feature}: {self.instead} ({reason})")

    def once(self, key: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time ``key`` is seen (a note that is never an error)."""
        if key not in self.logged:
            self.logged.add(key)
            self.logger.log(level, "%s", message)
