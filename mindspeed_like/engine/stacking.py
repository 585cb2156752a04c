"""The order of several features' patches on one target, from what each patch declares.

Wrappers on one target nest: the one applied last runs first and calls the one below it.
Which feature sits above which changes behaviour (a recompute around a fused activation is not
the same as the reverse), so it is declared by the patches themselves (``after`` / ``before``),
never taken from the order features happen to be applied in.
"""

from __future__ import annotations

from collections.abc import Sequence

from mindspeed_like.engine.patch import Patch, StackingError


def relation(upper: tuple[str, Patch], lower: tuple[str, Patch], target: str) -> bool | None:
    """True if ``upper`` is declared above ``lower``, False if below, None if not declared."""
    (a, pa), (b, pb) = upper, lower
    above = b in pa.after or a in pb.before
    below = b in pa.before or a in pb.after
    if above and below:
        raise StackingError(f"features '{a}' and '{b}' declare contradictory orders for target '{target}'")
    if above:
        return True
    if below:
        return False
    return None


def undeclared(first: tuple[str, Patch], second: tuple[str, Patch], target: str) -> StackingError:
    a, b = first[0], second[0]
    return StackingError(
        f"features '{a}' and '{b}' both patch '{target}' and neither declares which wraps the other: "
        f"declare it on one of the two patches (e.g. after=('{a}',) on '{b}''s patch: '{b}' then wraps "
        f"'{a}'), or switch one of the two features off"
    )


def ordered(entries: Sequence[tuple[str, Patch]], target: str) -> list[tuple[str, Patch]]:
    """``entries`` (feature, patch) of one target, bottom first; every pair must be declared."""
    above_count = {}
    for i, a in enumerate(entries):
        count = 0
        for j, b in enumerate(entries):
            if i == j:
                continue
            verdict = relation(a, b, target)
            if verdict is None:
                raise undeclared(*((a, b) if i < j else (b, a)), target)
            count += verdict
        above_count[a[0]] = count
    result = sorted(entries, key=lambda e: above_count[e[0]])
    if len(set(above_count.values())) != len(entries):
        cycle = ", ".join(e[0] for e in result)
        raise StackingError(f"the declared orders of {cycle} on target '{target}' form a cycle")
    return result
