"""configure()/env/argv drive the real patches on megatron-core; relations and versions are checked."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

import mindspeed_like
from mindspeed_like import Feature, Flag, Kind, Patch, runtime
from mindspeed_like.toolkit.errors import ConfigError


def _count_calls(wrapped, instance, args, kwargs):
    _count_calls.calls += 1
    return wrapped(*args, **kwargs)


_count_calls.calls = 0
DIVIDE = Patch("megatron.core.utils.divide", Kind.WRAP, _count_calls, why="test")

COUNTER = Feature(
    name="divide-counter",
    summary="counts megatron.core.utils.divide calls",
    flags=(Flag("use_divide_counter", bool, False, "count", aliases=("--count-divides",)),),
    patches=lambda config: [DIVIDE],
)
NEEDS_COUNTER = Feature(
    name="needs-counter",
    summary="requires divide-counter",
    flags=(Flag("use_needy", bool, False, "needy"),),
    patches=lambda config: [],
    requires=("divide-counter",),
)
HATES_COUNTER = Feature(
    name="hates-counter",
    summary="conflicts with divide-counter",
    flags=(Flag("use_hater", bool, False, "hater"),),
    patches=lambda config: [],
    conflicts=("divide-counter",),
)
FROM_THE_FUTURE = Feature(
    name="future-only",
    summary="needs a newer megatron",
    flags=(Flag("use_future", bool, False, "future"),),
    patches=lambda config: [],
    megatron_versions=">=99.0",
)


TEST_FEATURES = (COUNTER, NEEDS_COUNTER, HATES_COUNTER, FROM_THE_FUTURE)


@pytest.fixture
def features(monkeypatch):
    """Test features registered through the plugin API, like a user's own."""
    for feature in TEST_FEATURES:
        mindspeed_like.register_feature(feature)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
    mindspeed_like.reset()
    yield
    mindspeed_like.reset()
    for feature in TEST_FEATURES:
        mindspeed_like.unregister_feature(feature.name)


def test_configure_applies_and_switching_off_restores_the_original(features):
    import megatron.core.utils as mutils

    original = mutils.divide
    config = mindspeed_like.configure(use_divide_counter=True)
    assert config.use_divide_counter is True and config.sources["use_divide_counter"] == "configure"
    assert mutils.divide is not original and mutils.divide.__wrapped__ is original
    _count_calls.calls = 0
    assert mutils.divide(8, 2) == 4 and _count_calls.calls == 1
    assert any(r.feature == "divide-counter" and r.status == "applied" for r in mindspeed_like.report())
    mindspeed_like.configure(use_divide_counter=False)
    assert mutils.divide is original
    assert not any(r.feature == "divide-counter" for r in mindspeed_like.report())


def test_env_and_argv_switch_features_on(features, monkeypatch):
    import megatron.core.utils as mutils

    original = mutils.divide
    monkeypatch.setenv("MINDSPEED_LIKE_ARGS", "--count-divides")
    assert runtime.apply().use_divide_counter is True
    assert mutils.divide.__wrapped__ is original
    mindspeed_like.reset()
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS")
    monkeypatch.setattr(sys, "argv", ["train.py", "--num-layers", "2", "--use-divide-counter"])
    assert runtime.apply().sources["use_divide_counter"] == "argv"
    assert mutils.divide.__wrapped__ is original


def test_missing_requirement_names_both_features(features):
    with pytest.raises(ConfigError, match=r"'needs-counter' requires feature 'divide-counter'.*--use-divide-counter"):
        mindspeed_like.configure(use_needy=True)
    mindspeed_like.configure(use_needy=True, use_divide_counter=True)


def test_conflict_names_both_features_and_changes_nothing(features):
    import megatron.core.utils as mutils

    original = mutils.divide
    with pytest.raises(ConfigError, match="'hates-counter' and 'divide-counter' cannot be used together"):
        mindspeed_like.configure(use_hater=True, use_divide_counter=True)
    assert mutils.divide is original
    assert mindspeed_like.current_config().use_hater is False  # a failed configure() does not stick


def test_unsupported_megatron_version_is_an_error(features):
    with pytest.raises(ConfigError, match=r"'future-only' supports megatron-core >=99.0; megatron-core 0\.\d+"):
        mindspeed_like.configure(use_future=True)


def test_unknown_configure_name_suggests(features):
    with pytest.raises(ConfigError, match="Did you mean 'use_divide_counter'"):
        mindspeed_like.configure(use_divide_countr=True)


STAND_IN = '''
"""A stand-in for Megatron-LM's megatron/training/arguments.py: the same parse_args signature
and the same flow (build parser, extra_args_provider, parse sys.argv). It defines one of the
options we also know (--use-flash-attn) the way Megatron-LM does."""
import argparse


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="training")
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--use-flash-attn", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args
'''


@pytest.fixture
def megatron_training_stand_in(tmp_path, monkeypatch, features):
    package = tmp_path / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "arguments.py").write_text(textwrap.dedent(STAND_IN))
    import megatron  # the wheel's namespace package: a checkout on sys.path joins it

    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert any(str(tmp_path) in p for p in megatron.__path__)
    yield
    for name in ("megatron.training.arguments", "megatron.training"):
        sys.modules.pop(name, None)


def test_megatron_lm_parser_accepts_our_flags(megatron_training_stand_in, monkeypatch):
    """Tested against a stand-in module with Megatron-LM's parse_args signature (not Megatron-LM itself)."""
    runtime.apply()  # as `import mindspeed_like.megatron_adaptor` does, before megatron.training exists
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2", "--count-divides", "--use-flash-attn"])
    args = parse_args()
    assert args.num_layers == 2
    assert args.use_divide_counter is True  # our flag, added to Megatron's parser
    assert mindspeed_like.current_config().sources["use_divide_counter"] == "megatron-args"
    import megatron.core.utils as mutils

    assert hasattr(mutils.divide, "__wrapped__")  # the feature was applied from Megatron's args


def test_megatron_lm_parser_still_rejects_unknown_flags(megatron_training_stand_in, monkeypatch):
    runtime.apply()
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--no-such-flag"])
    with pytest.raises(SystemExit):
        parse_args()


def test_megatron_lm_parser_keeps_the_users_extra_args_provider(megatron_training_stand_in, monkeypatch):
    runtime.apply()
    from megatron.training.arguments import parse_args

    def provider(parser):
        parser.add_argument("--my-own", type=int, default=7)
        return parser

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--my-own", "3"])
    args = parse_args(provider)
    assert args.my_own == 3 and args.use_divide_counter is False


def test_unsupported_megatron_warns_once_and_still_applies(features, monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(runtime, "megatron_core_version", lambda: Version("0.99.0"))
    monkeypatch.setattr(runtime, "_warned_version", False)
    with pytest.warns(UserWarning, match=r"supports megatron-core .*<0\.\d+.*0\.99\.0 is installed"):
        runtime.apply()
    assert any(r.feature == "fix-checkpoint-without-output-fp8" for r in mindspeed_like.report())


def test_dependency_bound_is_the_supported_range():
    """pyproject's megatron-core requirement is exactly the range we say we support, it has an
    upper bound, and the installed release lies inside it (never an unbounded dependency on a
    library we patch)."""
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from packaging.requirements import Requirement

    from mindspeed_like.megatron_version import SUPPORTED, TESTED_VERSIONS, megatron_core_version

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    (requirement,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("megatron-core")]
    assert requirement.specifier == SUPPORTED
    assert any(spec.operator == "<" for spec in SUPPORTED)
    assert all(version in SUPPORTED for version in TESTED_VERSIONS)
    assert megatron_core_version() in SUPPORTED


def test_release_in_counts_a_pre_release_as_its_release():
    """Every range check on the installed megatron-core goes through one function, so an rc wheel's
    ``0.17.0rc1`` is read as 0.17 by all of them (PEP 440 orders it before 0.17), and an absent megatron-core
    is in no range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from mindspeed_like.megatron_version import release_in

    assert not SpecifierSet(">=0.17").contains(Version("0.17.0rc1"), prereleases=True)  # why the function exists
    assert release_in(">=0.17,<0.18", Version("0.17.0rc1"))
    assert release_in(">=0.16,<0.19", Version("0.18.2"))
    assert not release_in(">=0.16", Version("0.15.3"))
    assert not release_in(">=0.16", None)


def test_every_fsdp_release_check_reads_a_pre_release_as_its_release(monkeypatch):
    """The Megatron-FSDP refusals and layouts ask ``release_in``: with a 0.17 pre-release installed the
    lean-state layout is 0.17's and the virtual-stage save refusal (for releases before 0.16) stays off."""
    from packaging.version import Version

    from mindspeed_like.features import megatron_fsdp_lean_state
    from mindspeed_like.fixes import megatron_fsdp_pipeline

    pre = Version("0.17.0rc1")
    assert megatron_fsdp_lean_state.layout_of(pre) is megatron_fsdp_lean_state.layout_of(Version("0.17.1"))
    assert megatron_fsdp_lean_state.layout_of(pre) is not None
    monkeypatch.setattr("mindspeed_like.megatron_version.megatron_core_version", lambda: pre)
    args = type("Args", (), {"use_megatron_fsdp": True, "save": "/tmp/x", "num_layers_per_virtual_pipeline_stage": 1})
    megatron_fsdp_pipeline.refuse_saving_virtual_stages(args)  # no ConfigError: 0.17 names the chunks apart
