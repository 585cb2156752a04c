"""Issue 37 item 2: ``--optimization-level 2`` trains at every precision megatron has. A feature the
level switched on that cannot act in the run's precision steps aside with one line saying why;
asked for by name it is a clear error. Every level member is checked against every precision, the
list read from the registry (``Feature.precisions``), on Megatron-LM's command line (a stand-in of
its arguments module) and where megatron-core code builds its optimizer (``get_megatron_optimizer``).
The run through Megatron-LM's pretrain_gpt.py: tests/reliability/test_megatron_lm_level_precisions.py.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import mindspeed_like
from mindspeed_like import levels, registry, runtime
from mindspeed_like.integrations import megatron_lm as megatron_lm_integration
from mindspeed_like.integrations import precision as precision_check
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps
from mindspeed_like.toolkit.declaration import Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.precision import PRECISIONS

FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}
SPELLED = {"fp32": "fp32 (neither --bf16 nor --fp16)", "fp16": "fp16 (--fp16)", "bf16": "bf16 (--bf16)"}


def _members() -> list[Feature]:
    return levels.members(2, registry.all_features())


def _cannot_act(precision: str) -> list[Feature]:
    return [f for f in _members() if f.precisions and precision not in f.precisions]


def _line(feature: Feature, precision: str) -> str:
    return (
        f"{feature.name} (from --optimization-level 2) stepped aside: it acts only in "
        f"{' or '.join(feature.precisions)} training; this run trains in {SPELLED[precision]}"
    )


def test_the_registry_has_a_precision_limited_level_member():
    """The cases below are not empty: reuse-fp32-param acts in bf16 only."""
    assert _cannot_act("fp32") and _cannot_act("fp16") and not _cannot_act("bf16")
    assert all(set(f.precisions) <= set(PRECISIONS) for f in registry.all_features())


def test_an_unknown_precision_is_a_declaration_error():
    with pytest.raises(ValueError, match="precisions \\['fp8'\\] are not of"):
        Feature(name="x", summary="x", precisions=("fp8",))


STAND_IN = '''
"""Megatron-LM's arguments module, reduced: its precision options and the two entry points."""
import argparse


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--use-flash-attn", action="store_true")
    group.add_argument("--use-precision-aware-optimizer", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args()
    args.rank = 0
    return args


def validate_args(args, defaults={}):
    args.validated = True
    return args
'''


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
    mindspeed_like.reset()
    yield
    mindspeed_like.reset()


@pytest.fixture
def megatron_lm(tmp_path, monkeypatch, clean):
    package = tmp_path / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "arguments.py").write_text(textwrap.dedent(STAND_IN))
    import megatron  # the wheel's namespace package: a checkout on sys.path joins it

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(megatron_lm_integration, "_announced", [])  # each case prints its own features line
    importlib.invalidate_caches()

    def run(*argv: str):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--device", "cpu", *argv])
        runtime.apply()  # the import line, before megatron.training exists
        from megatron.training.arguments import parse_args, validate_args

        return validate_args(parse_args())

    assert any(str(tmp_path) in p for p in megatron.__path__)
    yield run
    for name in ("megatron.training.arguments", "megatron.training"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_level_2_on_megatron_lms_command_line_starts_at_every_precision(megatron_lm, caplog, capsys, precision):
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        args = megatron_lm("--optimization-level", "2", *FLAGS[precision])
    assert args.validated
    aside = _cannot_act(precision)
    said = [r.getMessage() for r in caplog.records if "stepped aside" in r.getMessage()]
    assert said == [_line(f, precision) for f in aside], "each member that cannot act is said once, with why"
    on = set(runtime.current_context().enabled_names)
    assert on >= {f.name for f in _members()} - {f.name for f in aside} - {"moe-alltoall-overlap"}
    assert not on & {f.name for f in aside}
    features = [line for line in capsys.readouterr().out.splitlines() if "features on:" in line]
    assert len(features) == 1 and all(f.name not in features[0].split(": ", 1)[1].split(", ") for f in aside)


@pytest.mark.parametrize(
    ("feature", "precision"),
    [(f.name, p) for f in registry.all_features() if f.precisions for p in PRECISIONS if p not in f.precisions],
)
def test_asked_for_by_name_in_a_precision_it_cannot_act_in_is_the_error(megatron_lm, feature, precision):
    option = next(flag.option for flag in registry.feature_by_name(feature).flags if flag.type is bool)
    with pytest.raises(ConfigError, match=f"{option} acts only in .* training, but this run trains in {precision}"):
        megatron_lm(option, *FLAGS[precision])


def _get_megatron_optimizer(config, model_chunks, config_overrides=None):
    """megatron-core's signature (the wrapper reads ``config`` by name)."""
    return "built"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_megatron_core_optimizer_built_from_code_at_level_2(clean, caplog, precision):
    """verl / Megatron-Bridge build OptimizerConfig in code: the check runs when megatron-core
    builds the optimizer, before its features' optimizer patches could refuse."""
    mindspeed_like.configure(device="cpu", optimization_level=2)
    patches = precision_check.patches(runtime.current_context())
    assert [p.target for p in patches] == [precision_check.TARGET]
    config = SimpleNamespace(bf16=precision == "bf16", fp16=precision == "fp16")
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        assert patches[0].new(_get_megatron_optimizer, None, (config, []), {}) == "built"
    spelled = {"fp32": "fp32 (neither bf16 nor fp16)", "fp16": "fp16 (fp16=True)", "bf16": "bf16 (bf16=True)"}
    aside = _cannot_act(precision)
    said = [r.getMessage() for r in caplog.records if "stepped aside" in r.getMessage()]
    assert said == [_line(f, precision).replace(SPELLED[precision], spelled[precision]) for f in aside]
    assert not set(runtime.current_context().enabled_names) & {f.name for f in aside}


def test_megatron_core_optimizer_leaves_a_feature_asked_for_by_name_to_its_own_refusal(clean):
    """reuse-fp32-param's own optimizer wrappers refuse fp16/fp32 naming the optimizer megatron built
    (tests/features/reuse_fp32_param); nothing steps aside."""
    mindspeed_like.configure(device="cpu", reuse_fp32_param=True)
    assert precision_check.patches(runtime.current_context()) == []


def test_no_patch_without_a_precision_limited_feature(clean):
    mindspeed_like.configure(device="cpu", optimization_level=1)
    assert precision_check.patches(runtime.current_context()) == []


def test_a_users_feature_declares_its_precisions_the_same_way(clean, caplog):
    mine = Feature(
        name="my-fp16-only",
        summary="acts in fp16 only",
        flags=(Flag("use_my_fp16_only", bool, False, "x"),),
        switch_on={"use_my_fp16_only": True},
        optimization_level=1,
        precisions=("fp16",),
    )
    mindspeed_like.register_feature(mine)
    try:
        mindspeed_like.configure(device="cpu", optimization_level=1)
        (patch,) = precision_check.patches(runtime.current_context())
        with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
            patch.new(_get_megatron_optimizer, None, (SimpleNamespace(bf16=True, fp16=False), []), {})
        assert "my-fp16-only (from --optimization-level 1) stepped aside: it acts only in fp16 training" in caplog.text
    finally:
        mindspeed_like.reset()
        mindspeed_like.unregister_feature(mine.name)


MODEL_PRECISION = {
    "fp32": ({}, {}),
    "fp16": ({"fp16": True, "params_dtype": torch.float16}, {"bf16": False, "optimizer": {"fp16": True}}),
    "bf16": ({"bf16": True, "params_dtype": torch.bfloat16}, {}),
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_level_2_trains_megatron_cores_gpt_at_every_precision(clean, caplog, precision):
    """megatron-core's GPTModel and get_megatron_optimizer at level 2: two finite steps at each
    precision (before: fp16 stopped in reuse-fp32-param's optimizer wrapper with a ConfigError)."""
    model_args, train_args = MODEL_PRECISION[precision]
    mindspeed_like.configure(device="cpu", optimization_level=2)
    init_parallel(seed=1234)
    try:
        with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
            losses = train_steps(tiny_gpt(**model_args), 2, **train_args)
    finally:
        destroy_parallel()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    aside = {f.name for f in _cannot_act(precision)}
    said = {r.getMessage().split(" ", 1)[0] for r in caplog.records if "stepped aside" in r.getMessage()}
    assert said == aside
