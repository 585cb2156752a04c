"""The errors users see: a bad configuration, or a call a feature cannot run under --strict."""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag value, name or combination is wrong; the message says how to fix it."""


class LevelConflict(ConfigError):
    """``feature`` cannot run together with ``given`` (a flag or feature set explicitly).

    Raised where the conflict is found (a feature's validate, a validate_args hook, a wrapper);
    the runtime decides what it means: a feature that only ``--optimization-level`` switched on
    steps aside (one log line), an explicit flag wins over a level; a feature the user asked for
    by name makes this the error, with its message. ``reason``: what the step-aside line says
    instead of "``given`` was given" (e.g. why a precision leaves the feature nothing to do).
    """

    def __init__(self, feature: str, given: str, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.feature = feature
        self.given = given
        self.reason = reason or f"{given} was given"


class FeatureUnsupported(RuntimeError):
    """``--strict`` is on and a feature cannot run a call as asked (it would have fallen back).

    Each feature raises its own subclass (e.g. ``FlashAttentionUnsupported``), so a user can
    catch one feature's refusals or all of them with this base.
    """
