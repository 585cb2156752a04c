"""The engine's declared versions and declared stacking order, on a throw-away package."""

from __future__ import annotations

import importlib

import pytest
from packaging.version import Version

from mindspeed_like.engine import Kind, Patch, PatchEngine, PatchError, StackingError

PKG = "fakemeg"


@pytest.fixture
def fakemeg(tmp_path, monkeypatch):
    import sys
    import textwrap

    (tmp_path / PKG).mkdir()
    (tmp_path / PKG / "__init__.py").write_text("")
    (tmp_path / PKG / "funcs.py").write_text(
        textwrap.dedent(
            """
            def f(x):
                return x

            def old_name(x):
                return x
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield importlib.import_module(f"{PKG}.funcs")
    for name in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
        del sys.modules[name]


def engine_at(version: str | None) -> PatchEngine:
    return PatchEngine(alias_scopes=(PKG,), version_of=lambda t: ("fakemeg", Version(version) if version else None))


def appender(tag: str):
    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) + [tag]

    return wrapper


def test_a_patch_applies_only_to_its_declared_versions(fakemeg):
    patches = [
        Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("new"), versions=">=2.0"),
        Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("old"), versions="<2.0"),
        Patch(f"{PKG}.funcs.does_not_exist_in_1", Kind.REPLACE, None, versions=">=2.0"),
    ]
    old = engine_at("1.5")
    old.apply("feat", patches)
    assert fakemeg.f([]) == ["old"]
    assert [r.target for r in old.report()] == [f"{PKG}.funcs.f"]  # the 2.0-only target is not looked for
    old.remove("feat")
    assert fakemeg.f([]) == []


def test_unknown_version_means_the_newest_layout(fakemeg):
    engine = engine_at(None)
    engine.apply("feat", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("new"), versions=">=2.0")])
    assert fakemeg.f([]) == ["new"]
    engine.remove("feat")


def test_overlapping_versions_of_one_target_are_refused(fakemeg):
    engine = engine_at("2.0")
    both = [
        Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("a"), versions=">=1.0"),
        Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("b"), versions=">=2.0"),
    ]
    with pytest.raises(PatchError, match="two patches of 'fakemeg.funcs.f'"):
        engine.apply("feat", both)


def test_an_undeclared_second_patch_of_a_target_is_refused_naming_both(fakemeg):
    engine = engine_at("1.0")
    engine.apply("first", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("first"))])
    with pytest.raises(
        StackingError,
        match=r"'first' and 'second' both patch 'fakemeg\.funcs\.f'.*after=\('first',\) on 'second''s patch",
    ):
        engine.apply("second", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("second"))])
    assert fakemeg.f([]) == ["first"]  # nothing changed
    assert [r.feature for r in engine.report()] == ["first"]


@pytest.mark.parametrize("order", ["inner first", "outer first"])
def test_declared_order_holds_whatever_the_application_order(fakemeg, order):
    engine = engine_at("1.0")
    inner = ("inner", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("inner"))])
    outer = ("outer", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("outer"), after=("inner",))])
    for name, patches in (inner, outer) if order == "inner first" else (outer, inner):
        engine.apply(name, patches)
    assert fakemeg.f([]) == ["inner", "outer"]  # the outer wrapper runs last on the way out
    assert {r.stack for r in engine.report()} == {("inner", "outer")}
    engine.remove("inner")
    assert fakemeg.f([]) == ["outer"]
    engine.remove("outer")
    assert fakemeg.f([]) == []


def test_before_is_the_mirror_of_after(fakemeg):
    engine = engine_at("1.0")
    engine.apply("late", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("late"))])
    engine.apply("early", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("early"), before=("late",))])
    assert fakemeg.f([]) == ["early", "late"]


def test_contradictory_orders_are_refused(fakemeg):
    engine = engine_at("1.0")
    engine.apply("a", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("a"), after=("b",))])
    with pytest.raises(StackingError, match="contradictory"):
        engine.apply("b", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("b"), after=("a",))])


def test_a_cycle_of_three_is_refused(fakemeg):
    engine = engine_at("1.0")
    plan = {
        "a": [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("a"), after=("b",))],
        "b": [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("b"), after=("c",))],
        "c": [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("c"), after=("a",))],
    }
    with pytest.raises(StackingError, match="cycle"):
        engine.check(plan)


def test_stacking_is_checked_before_the_module_is_imported(tmp_path, monkeypatch, fakemeg):
    """A pending patch counts: the refusal comes at apply time, not inside a later import."""
    import sys

    del sys.modules[f"{PKG}.funcs"]
    engine = engine_at("1.0")
    engine.apply("first", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("first"))])
    assert [r.status for r in engine.report()] == ["pending"]
    with pytest.raises(StackingError):
        engine.apply("second", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("second"))])
    engine.apply("second", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("second"), after=("first",))])
    funcs = importlib.import_module(f"{PKG}.funcs")
    assert funcs.f([]) == ["first", "second"]


def test_apply_makes_the_feature_patches_exactly_the_given_ones(fakemeg):
    engine = engine_at("1.0")
    engine.apply("feat", [Patch(f"{PKG}.funcs.f", Kind.WRAP, appender("f"))])
    engine.apply("feat", [Patch(f"{PKG}.funcs.old_name", Kind.WRAP, appender("g"))])
    assert fakemeg.f([]) == [] and fakemeg.old_name([]) == ["g"]
    assert [r.target for r in engine.report()] == [f"{PKG}.funcs.old_name"]


def test_patch_declarations_are_checked():
    with pytest.raises(TypeError, match="tuple of feature names"):
        Patch("a.b", Kind.WRAP, None, after="cpu-adapter")
    with pytest.raises(ValueError, match="not a specifier"):
        Patch("a.b", Kind.WRAP, None, versions="0.16")
