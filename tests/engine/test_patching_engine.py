"""The patch engine's promises, each checked on a throw-away package written to disk.

A stand-in package (not megatron) keeps these tests fast and lets them control exactly
which modules are imported when: that is what import-order independence is about.
"""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest
from packaging.version import Version

from mindspeed_like.engine import Kind, Patch, PatchEngine, PatchError, PatchTargetError, split_target

PKG = "fakemeg"

FILES = {
    "__init__.py": "",
    "core/__init__.py": "",
    "core/funcs.py": """
        def f(x):
            return x + 1

        def helper():
            return "helper"

        class C:
            def m(self):
                return "m"

            @staticmethod
            def s():
                return "s"

            @classmethod
            def cm(cls):
                return cls.__name__

        class Child(C):
            pass

        VALUE = 3
        FLAG = False

        try:
            from fakemeg_optional_dependency import Thing  # absent: Thing stays unbound
        except ImportError:
            pass
        NOTHING = None  # what a module binds when its optional dependency is absent
    """,
    "core/user.py": """
        from fakemeg.core.funcs import f
        from fakemeg.core.funcs import f as g
        import fakemeg.core.funcs as funcs_mod

        def call_f(x):
            return f(x)
    """,
    "core/later.py": """
        from fakemeg.core.funcs import f

        def call_f(x):
            return f(x)
    """,
}


@pytest.fixture
def fakemeg(tmp_path, monkeypatch):
    for relative, text in FILES.items():
        path = tmp_path / PKG / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [n for n in sys.modules if n == PKG or n.startswith(PKG + ".")]:
        del sys.modules[name]


@pytest.fixture
def engine():
    return PatchEngine(alias_scopes=(PKG,), version_of=lambda target: ("fakemeg", Version("1.2.3")))


def plus_100(x):
    return x + 100


def test_split_target_finds_module_without_importing(fakemeg):
    assert split_target(f"{PKG}.core.funcs.C.m") == (f"{PKG}.core.funcs", ["C", "m"])
    assert split_target(f"{PKG}.core.funcs.f") == (f"{PKG}.core.funcs", ["f"])
    assert f"{PKG}.core.funcs" not in sys.modules
    with pytest.raises(PatchTargetError, match="not a dotted path"):
        split_target("nodots")


def test_replace_updates_every_alias_and_remove_restores_identity(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    user = importlib.import_module(f"{PKG}.core.user")
    original = funcs.f
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, plus_100)])
    assert funcs.f is plus_100 and user.f is plus_100 and user.g is plus_100
    assert user.call_f(1) == 101
    (record,) = engine.report()
    assert (record.feature, record.target, record.kind, record.status) == (
        "feat",
        f"{PKG}.core.funcs.f",
        "replace",
        "applied",
    )
    assert set(record.aliases) == {f"{PKG}.core.user.f", f"{PKG}.core.user.g"}
    engine.remove("feat")
    assert funcs.f is original and user.f is original and user.g is original
    assert engine.report() == []


def test_modules_imported_later_get_the_replacement_and_lose_it_on_remove(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    original = funcs.f
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, plus_100)])
    later = importlib.import_module(f"{PKG}.core.later")
    assert later.f is plus_100
    engine.remove("feat")
    assert later.f is original


def test_patch_waits_for_import_of_its_module(fakemeg, engine):
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, plus_100)])
    assert f"{PKG}.core.funcs" not in sys.modules
    assert [r.status for r in engine.report()] == ["pending"]
    user = importlib.import_module(f"{PKG}.core.user")  # imports funcs first, then copies f
    assert user.f is plus_100 and user.g is plus_100
    assert [r.status for r in engine.report()] == ["applied"]


def test_import_order_gives_the_same_report(fakemeg, engine):
    patches = [
        Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, plus_100),
        Patch(f"{PKG}.core.funcs.C.m", Kind.REPLACE, lambda self: "new"),
    ]
    engine.apply("feat", patches)  # before the import
    importlib.import_module(f"{PKG}.core.user")
    before = [(r.target, r.kind, r.status, sorted(r.aliases)) for r in engine.report()]
    engine.remove("feat")
    engine.apply("feat", patches)  # after the import
    after = [(r.target, r.kind, r.status, sorted(r.aliases)) for r in engine.report()]
    assert before == after


def test_pending_patch_removed_before_import_never_applies(fakemeg, engine):
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, plus_100)])
    engine.remove("feat")
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    assert funcs.f(1) == 2


def test_missing_target_is_a_clear_error_and_nothing_is_created(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    with pytest.raises(PatchTargetError) as info:
        engine.apply("my-feature", [Patch(f"{PKG}.core.funcs.does_not_exist", Kind.REPLACE, plus_100)])
    message = str(info.value)
    assert "my-feature" in message and f"{PKG}.core.funcs.does_not_exist" in message and "fakemeg 1.2.3" in message
    assert not hasattr(funcs, "does_not_exist")
    with pytest.raises(PatchTargetError):
        engine.apply("my-feature", [Patch(f"{PKG}.core.funcs.C.nope", Kind.REPLACE, plus_100)])
    assert not hasattr(funcs.C, "nope")
    assert engine.report() == []


def test_missing_target_in_a_module_imported_later_fails_at_that_import(fakemeg, engine):
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.gone", Kind.REPLACE, plus_100)])
    with pytest.raises(PatchTargetError, match="gone"):
        importlib.import_module(f"{PKG}.core.funcs")


def test_optional_missing_target_is_a_logged_skip(fakemeg, engine, caplog):
    importlib.import_module(f"{PKG}.core.funcs")
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        engine.apply("feat", [Patch(f"{PKG}.core.funcs.gone", Kind.REPLACE, plus_100, optional=True)])
    assert [r.status for r in engine.report()] == ["skipped"]
    assert "gone" in caplog.text and "skipped" in caplog.text


def test_optional_missing_target_with_on_missing_is_the_features_fallback(fakemeg, engine, caplog, tmp_path):
    """An optional target whose absence changes behaviour: the skip goes to the feature's
    Fallback (a warning, not the info-level skip line); under strict it raises where the target
    was looked for: at apply for an imported module, at the import of a module imported later."""
    from mindspeed_like.toolkit.fallback import Fallback, forget_logged

    forget_logged()
    importlib.import_module(f"{PKG}.core.funcs")
    lenient = Fallback("feat", strict=False, instead="left unadapted")
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        engine.apply(
            "feat", [Patch(f"{PKG}.core.funcs.gone", Kind.REPLACE, plus_100, optional=True, on_missing=lenient)]
        )
    assert [r.status for r in engine.report()] == ["skipped"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "gone" in warnings[0].getMessage() and "left unadapted" in warnings[0].getMessage()
    engine.remove("feat")

    strict = Fallback("feat", strict=True)
    with pytest.raises(Exception, match="gone.*strict is on"):
        engine.apply(
            "feat", [Patch(f"{PKG}.core.funcs.gone", Kind.REPLACE, plus_100, optional=True, on_missing=strict)]
        )
    engine.remove("feat")
    module = f"{PKG}.training.args"
    engine.apply(
        "feat", [Patch(f"{module}.gone", Kind.REPLACE, plus_100, optional=True, module=module, on_missing=strict)]
    )
    (tmp_path / PKG / "training").mkdir()
    (tmp_path / PKG / "training" / "__init__.py").write_text("")
    (tmp_path / PKG / "training" / "args.py").write_text("def parse():\n    return 1\n")
    importlib.invalidate_caches()
    with pytest.raises(Exception, match="gone.*strict is on"):
        importlib.import_module(module)
    with pytest.raises(ValueError, match="on_missing is for optional targets"):
        Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, plus_100, on_missing=strict)


def test_wrap_calls_through_and_keeps_wrapped(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    user = importlib.import_module(f"{PKG}.core.user")
    original = funcs.f

    def double_result(wrapped, instance, args, kwargs):
        return 2 * wrapped(*args, **kwargs)

    engine.apply("feat", [Patch(f"{PKG}.core.funcs.f", Kind.WRAP, double_result)])
    assert user.call_f(1) == 4
    assert funcs.f.__wrapped__ is original
    engine.remove("feat")
    assert funcs.f is original and user.f is original


def test_calls_count_as_reached_unless_the_patch_says_it_is_a_hook_for_every_model(fakemeg, engine):
    """compare's "features reached" list: a config hook that runs for every model (moe-permute's
    TransformerConfig check) must not make a dense model list the feature as reached."""
    import collections

    funcs = importlib.import_module(f"{PKG}.core.funcs")

    def through(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    engine.calls = collections.Counter()
    engine.apply("worker", [Patch(f"{PKG}.core.funcs.f", Kind.WRAP, through)])
    engine.apply("hook", [Patch(f"{PKG}.core.funcs.helper", Kind.WRAP, through, counts_as_reached=False)])
    assert funcs.f(1) == 2 and funcs.helper() == "helper"
    assert engine.calls == collections.Counter({"worker": 1})


def test_wrap_methods_static_and_class_methods(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    raw = {name: vars(funcs.C)[name] for name in ("m", "s", "cm")}

    def shout(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs).upper()

    engine.apply("feat", [Patch(f"{PKG}.core.funcs.C.{n}", Kind.WRAP, shout) for n in raw])
    assert (funcs.C().m(), funcs.C.s(), funcs.C.cm(), funcs.Child.cm()) == ("M", "S", "C", "CHILD")
    engine.remove("feat")
    assert all(vars(funcs.C)[name] is obj for name, obj in raw.items())


def test_replacing_an_inherited_method_is_undone_by_deletion(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.Child.m", Kind.REPLACE, lambda self: "child")])
    assert funcs.Child().m() == "child" and funcs.C().m() == "m"
    engine.remove("feat")
    assert "m" not in vars(funcs.Child) and funcs.Child().m() == "m"


def test_wrap_needs_a_callable(fakemeg, engine):
    importlib.import_module(f"{PKG}.core.funcs")
    with pytest.raises(PatchTargetError, match="callable"):
        engine.apply("feat", [Patch(f"{PKG}.core.funcs.VALUE", Kind.WRAP, lambda *a: None)])


def test_provide_binds_what_a_missing_optional_dependency_left_unbound(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    user = importlib.import_module(f"{PKG}.core.user")

    class Ours:
        pass

    engine.apply(
        "feat",
        [Patch(f"{PKG}.core.funcs.Thing", Kind.PROVIDE, Ours), Patch(f"{PKG}.core.funcs.NOTHING", Kind.PROVIDE, Ours)],
    )
    assert funcs.Thing is Ours and funcs.NOTHING is Ours
    assert not hasattr(user, "Thing")  # nothing else is touched: no aliases of a name nobody held
    assert [r.kind for r in engine.report()] == ["provide", "provide"]
    engine.remove("feat")
    assert "Thing" not in vars(funcs) and funcs.NOTHING is None


def test_deferred_new_is_imported_when_its_target_module_is(fakemeg, engine):
    """A replacement defined in terms of the patched package waits, like the patch, for its import."""
    from mindspeed_like.engine import Deferred

    patch = Patch(f"{PKG}.core.funcs.NOTHING", Kind.PROVIDE, Deferred(f"{PKG}.core.later", "call_f"))
    engine.apply("feat", [patch])
    assert f"{PKG}.core.later" not in sys.modules and engine.report()[0].status == "pending"
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    assert funcs.NOTHING is sys.modules[f"{PKG}.core.later"].call_f
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.NOTHING", Kind.PROVIDE, Deferred(f"{PKG}.core.later", "call_f"))])
    assert funcs.NOTHING.__name__ == "call_f"  # equal by value: left in place
    engine.remove("feat")
    assert funcs.NOTHING is None


def test_provide_replaces_a_placeholder_everywhere_it_was_copied(fakemeg, engine):
    """megatron binds MagicMock stand-ins where TE is absent, and other modules import them by name."""
    from unittest import mock

    funcs = importlib.import_module(f"{PKG}.core.funcs")
    stand_in = funcs.NOTHING = mock.MagicMock()
    user = importlib.import_module(f"{PKG}.core.user")
    user.NOTHING = stand_in  # a copy taken by `from funcs import NOTHING`

    class Ours:
        pass

    def is_mock(value):
        return isinstance(value, mock.NonCallableMock)

    patches = [
        Patch(f"{PKG}.core.funcs.NOTHING", Kind.PROVIDE, Ours, placeholder=is_mock),
        Patch(f"{PKG}.core.user.NOTHING", Kind.PROVIDE, Ours, placeholder=is_mock),  # found swapped already
    ]
    engine.apply("feat", patches)
    assert funcs.NOTHING is Ours and user.NOTHING is Ours
    with pytest.raises(PatchTargetError, match="already bound"):
        engine.apply("other", [Patch(f"{PKG}.core.funcs.f", Kind.PROVIDE, Ours)])  # no placeholder: refused
    engine.remove("feat")
    assert funcs.NOTHING is stand_in and user.NOTHING is stand_in
    with pytest.raises(ValueError, match="placeholder is for PROVIDE"):
        Patch(f"{PKG}.core.funcs.f", Kind.REPLACE, Ours, placeholder=is_mock)


def test_provide_refuses_a_bound_name(fakemeg, engine):
    importlib.import_module(f"{PKG}.core.funcs")
    with pytest.raises(PatchTargetError, match="already bound"):
        engine.apply("feat", [Patch(f"{PKG}.core.funcs.VALUE", Kind.PROVIDE, object())])
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.VALUE", Kind.PROVIDE, object(), optional=True)])
    assert importlib.import_module(f"{PKG}.core.funcs").VALUE == 3
    assert [r.status for r in engine.report()] == ["skipped"]


def test_replacing_a_plain_value_needs_update_aliases_off(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    with pytest.raises(PatchError, match="update_aliases=False"):
        engine.apply("feat", [Patch(f"{PKG}.core.funcs.FLAG", Kind.REPLACE, True)])
    assert funcs.FLAG is False and funcs.NOTHING is None  # nothing else holding False was swapped
    assert engine.report() == []
    engine.apply("feat", [Patch(f"{PKG}.core.funcs.FLAG", Kind.REPLACE, True, update_aliases=False)])
    assert funcs.FLAG is True and funcs.NOTHING is None
    engine.remove("feat")
    assert funcs.FLAG is False


def test_applying_twice_equals_once(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    original = funcs.f

    def add_one(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) + 1

    patch = Patch(f"{PKG}.core.funcs.f", Kind.WRAP, add_one)
    engine.apply("feat", [patch])
    engine.apply("feat", [patch])
    assert funcs.f(0) == 2  # wrapped once, not twice
    assert len(engine.report()) == 1
    engine.remove("feat")
    engine.remove("feat")
    assert funcs.f is original


def test_stacked_features_remove_in_any_order(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    user = importlib.import_module(f"{PKG}.core.user")
    original = funcs.f

    def times(k):
        def wrapper(wrapped, instance, args, kwargs):
            return k * wrapped(*args, **kwargs)

        return wrapper

    engine.apply("a", [Patch(f"{PKG}.core.funcs.f", Kind.WRAP, times(2))])
    engine.apply("b", [Patch(f"{PKG}.core.funcs.f", Kind.WRAP, times(3), after=("a",))])
    assert user.call_f(0) == 6
    engine.remove("a")  # the bottom one: b is peeled off and put back on the original
    assert user.call_f(0) == 3
    engine.remove("b")
    assert funcs.f is original and user.f is original


def test_targets_outside_the_scopes_must_be_declared_global(fakemeg, engine):
    with pytest.raises(PatchError, match="global_change"):
        engine.apply("feat", [Patch("json.dumps", Kind.REPLACE, plus_100)])
    import json

    original = json.dumps
    engine.apply("feat", [Patch("json.dumps", Kind.REPLACE, plus_100, global_change=True, why="test")])
    assert json.dumps is plus_100
    assert engine.report()[0].global_change
    engine.remove("feat")
    assert json.dumps is original


def test_explicit_module_waits_for_a_module_that_does_not_exist_yet(fakemeg, engine, tmp_path):
    engine.apply(
        "feat",
        [Patch(f"{PKG}.training.args.parse", Kind.REPLACE, plus_100, optional=True, module=f"{PKG}.training.args")],
    )
    assert [r.status for r in engine.report()] == ["pending"]
    (tmp_path / PKG / "training").mkdir()
    (tmp_path / PKG / "training" / "__init__.py").write_text("")
    (tmp_path / PKG / "training" / "args.py").write_text("def parse():\n    return 1\n")
    importlib.invalidate_caches()
    module = importlib.import_module(f"{PKG}.training.args")
    assert module.parse is plus_100


def test_module_local_replacement_leaves_other_modules_alone(fakemeg, engine):
    funcs = importlib.import_module(f"{PKG}.core.funcs")
    user = importlib.import_module(f"{PKG}.core.user")
    original = funcs.f
    engine.apply("feat", [Patch(f"{PKG}.core.user.f", Kind.REPLACE, plus_100, update_aliases=False)])
    assert user.f is plus_100 and funcs.f is original and user.g is original
    assert engine.report()[0].aliases == ()
    engine.remove("feat")
    assert user.f is original
