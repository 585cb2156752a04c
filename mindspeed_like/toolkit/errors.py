"""The errors users see: a bad configuration, or a call a feature cannot run under --strict."""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag value, name or combination is wrong; the message says how to fix it."""


class FeatureUnsupported(RuntimeError):
    """``--strict`` is on and a feature cannot run a call as asked (it would have fallen back).

    Each feature raises its own subclass (e.g. ``FlashAttentionUnsupported``), so a user can
    catch one feature's refusals or all of them with this base.
    """
