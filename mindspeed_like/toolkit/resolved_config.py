"""``Config``: the resolved flag values of a run (read-only) and the source each came from.

It sits below both of its users: ``config.py`` resolves one from the flag sources (and imports
``Flag``/``Feature`` from ``toolkit/declaration.py`` to do so), and ``declaration.py``'s
``Context`` carries one to every feature. Defined in either of them, the other would import it
back: an import cycle (tests/engine/test_import_cycles.py counts type-only imports too).
``mindspeed_like.config.Config`` is this class.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class Config(Mapping[str, Any]):
    """Resolved flag values (read-only) and where each came from."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str]) -> None:
        self._values = dict(values)
        self.sources = dict(sources)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if self.sources.get(k) != "default"}
        return f"Config({changed})"
