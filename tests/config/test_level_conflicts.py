"""An explicit flag wins over --optimization-level (issue 28 item 3): a level's member in conflict
with a flag given by name steps aside with one log line; two explicit flags in conflict stay an
error; ``--no-<flag>`` keeps a level and switches one of its features off, on every command line."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest

import mindspeed_like
from mindspeed_like import Feature, Flag, config, runtime
from mindspeed_like.toolkit.errors import ConfigError, LevelConflict
from mindspeed_like.toolkit.megatron_lm_options import MEGATRON_LM_OPTIONS

LEVELED = Feature(
    name="level-member",
    summary="a level-1 member",
    flags=(Flag("use_level_member", bool, False, "x"),),
    switch_on={"use_level_member": True},
    optimization_level=1,
)
ASKED = Feature(
    name="asked-for",
    summary="conflicts with the level's member",
    flags=(Flag("use_asked_for", bool, False, "y"),),
    conflicts=("level-member",),
)


def _validate_member(ctx) -> None:
    if ctx["use_asked_for"]:
        raise LevelConflict("checked-member", "--use-asked-for", "checked-member cannot run with --use-asked-for")


CHECKED = Feature(
    name="checked-member",
    summary="a level-1 member whose own check finds the conflict",
    flags=(Flag("use_checked_member", bool, False, "z"),),
    switch_on={"use_checked_member": True},
    optimization_level=1,
    validate=_validate_member,
)
TEST_FEATURES = (LEVELED, ASKED, CHECKED)


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
    mindspeed_like.reset()
    yield
    mindspeed_like.reset()


@pytest.fixture
def features(clean):
    for feature in TEST_FEATURES:
        mindspeed_like.register_feature(feature)
    yield
    mindspeed_like.reset()
    for feature in TEST_FEATURES:
        mindspeed_like.unregister_feature(feature.name)


STEPPED = "{} (from --optimization-level {}) stepped aside: {} was given"


def test_a_level_member_in_a_declared_conflict_steps_aside(features, caplog):
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        mindspeed_like.configure(device="cpu", optimization_level=1, use_asked_for=True)
    on = runtime.current_context().enabled_names
    assert "asked-for" in on and "level-member" not in on
    assert "checked-member" not in on  # its own check raised the LevelConflict: it steps aside too
    lines = [r.getMessage() for r in caplog.records if "stepped aside" in r.getMessage()]
    assert lines == [
        STEPPED.format("level-member", 1, "--use-asked-for"),
        STEPPED.format("checked-member", 1, "--use-asked-for"),
    ]
    assert runtime.current_context().config["use_level_member"] is False
    # a later configure() keeps it aside without saying it again
    caplog.clear()
    mindspeed_like.configure(use_fused_rmsnorm=True)
    assert "level-member" not in runtime.current_context().enabled_names
    assert not [r for r in caplog.records if "stepped aside" in r.getMessage()]


def test_only_rank_0_says_it_every_rank_steps_aside(features, caplog, monkeypatch):
    """A torchrun job prints the line once (Megatron-LM validates before torch.distributed exists:
    the launcher's RANK decides)."""
    monkeypatch.setattr(runtime, "_process_rank", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        mindspeed_like.configure(device="cpu", optimization_level=1, use_asked_for=True)
    assert "level-member" not in runtime.current_context().enabled_names
    assert not [r for r in caplog.records if "stepped aside" in r.getMessage()]


def test_process_rank_before_torch_distributed_is_the_launchers(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "3")
    assert runtime._process_rank() == 3
    monkeypatch.delenv("RANK")
    assert runtime._process_rank() == 0


def test_two_explicit_flags_in_conflict_stay_an_error(features):
    with pytest.raises(ConfigError, match="'asked-for' and 'level-member' cannot be used together"):
        mindspeed_like.configure(device="cpu", optimization_level=1, use_asked_for=True, use_level_member=True)
    with pytest.raises(ConfigError, match="checked-member cannot run with --use-asked-for"):
        mindspeed_like.configure(device="cpu", use_asked_for=True, use_checked_member=True)


def test_without_a_conflict_the_level_keeps_its_members(features):
    mindspeed_like.configure(device="cpu", optimization_level=1)
    assert {"level-member", "checked-member"} <= set(runtime.current_context().enabled_names)


# ---------------------------------------------------------------- --no-<flag>


def test_every_bool_flag_a_level_sets_has_a_no_spelling_clashing_with_nothing():
    from mindspeed_like import registry

    flags = runtime.flags()
    negatable = {f.name for f in config.negatable(flags)}
    level_set = {
        name
        for feature in registry.all_features()
        if feature.optimization_level is not None
        for name, value in feature.switch_on.items()
        if value is True
    }
    assert level_set and level_set <= negatable
    options = {config.negation_option(f) for f in config.negatable(flags)}
    assert "--no-reuse-fp32-param" in options and "--no-use-flash-attn" in options
    assert not options & MEGATRON_LM_OPTIONS, "a --no- option of ours would shadow Megatron-LM's"
    assert not options & {o for f in flags for o in f.option_strings}


@pytest.mark.parametrize("source", ["argv", "env"])
def test_no_flag_keeps_the_level_and_switches_one_feature_off(clean, monkeypatch, source):
    tokens = ["--optimization-level", "2", "--no-reuse-fp32-param", "--no-use-flash-attn"]
    if source == "env":
        monkeypatch.setenv("MINDSPEED_LIKE_ARGS", " ".join(tokens))
        tokens = []
    resolved = runtime.resolve_config(argv=tokens, code={"device": "cpu"})
    assert resolved["reuse_fp32_param"] is False and resolved.sources["reuse_fp32_param"] == source
    assert resolved["use_flash_attn"] is False
    assert resolved["use_fused_rmsnorm"] is True and resolved["recompute_activation_function"] is True
    on = runtime.enabled_feature_names(resolved)
    assert "reuse-fp32-param" not in on and "flash-attention" not in on and "fused-rmsnorm" in on


def test_the_later_of_flag_and_no_flag_wins():
    assert runtime.resolve_config(argv=["--use-fused-swiglu", "--no-use-fused-swiglu"])["use_fused_swiglu"] is False
    assert runtime.resolve_config(argv=["--no-use-fused-swiglu", "--use-fused-swiglu"])["use_fused_swiglu"] is True


def test_configure_says_how_to_switch_off_in_code(clean):
    with pytest.raises(ConfigError, match="in code pass reuse_fp32_param=False"):
        mindspeed_like.configure(no_reuse_fp32_param=True)


def test_cli_takes_the_no_spelling(capsys):
    from mindspeed_like import cli

    assert cli.main(["features", "--device", "cpu", "--optimization-level", "2", "--no-reuse-fp32-param"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("reuse-fp32-param "))
    assert row.split()[2] == "off"


# ---------------------------------------------------------------- Megatron-LM's parser and validate_args

STAND_IN = '''
"""A stand-in for Megatron-LM's megatron/training/arguments.py: parse_args and validate_args with
Megatron-LM's signatures and flow, defining the options of ours it also has the way it does."""
import argparse


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="training")
    group.add_argument("--use-flash-attn", action="store_true")
    group.add_argument("--use-precision-aware-optimizer", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--num-experts", type=int, default=None)
    group.add_argument("--moe-token-dispatcher-type", default="allgather")
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
def megatron_lm(tmp_path, monkeypatch, clean):
    package = tmp_path / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "arguments.py").write_text(textwrap.dedent(STAND_IN))
    import megatron  # the wheel's namespace package: a checkout on sys.path joins it

    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    def run(*argv: str):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        runtime.apply()  # the import line, before megatron.training exists
        from megatron.training.arguments import parse_args, validate_args

        return validate_args(parse_args())

    assert any(str(tmp_path) in p for p in megatron.__path__)
    yield run
    for name in ("megatron.training.arguments", "megatron.training"):
        sys.modules.pop(name, None)


def test_level_2_with_megatrons_precision_aware_optimizer_steps_aside(megatron_lm, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        args = megatron_lm("--optimization-level", "2", "--use-precision-aware-optimizer", "--bf16")
    assert args.validated and args.reuse_fp32_param is False and args.recompute_activation_function is True
    assert STEPPED.format("reuse-fp32-param", 2, "--use-precision-aware-optimizer") in caplog.text
    assert "reuse-fp32-param" not in runtime.current_context().enabled_names
    features = [line for line in capsys.readouterr().out.splitlines() if "features on:" in line]
    assert len(features) == 1 and "reuse-fp32-param" not in features[0] and "fused-rmsnorm" in features[0]


def test_level_1_moe_with_the_default_allgather_dispatcher_steps_aside(megatron_lm, caplog):
    """moe-alltoall-overlap (level 1) can only act on the alltoall dispatcher; Megatron-LM's default
    is allgather. The level's member steps aside; asked for by name it is the error."""
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        args = megatron_lm("--optimization-level", "1", "--num-experts", "4")
    assert args.validated and args.moe_alltoall_overlap_comm is False
    # the user never typed --moe-token-dispatcher-type: the line says it is megatron's default (issue 48)
    assert (
        "moe-alltoall-overlap (from --optimization-level 1) stepped aside: this MoE run uses megatron's default "
        "token dispatcher, allgather, which has no all-to-alls to overlap" in caplog.text
    )
    assert "was given" not in caplog.text
    assert "moe-alltoall-overlap" not in runtime.current_context().enabled_names
    assert "moe-permute" in runtime.current_context().enabled_names  # the rest of the level stays


def test_an_explicit_dispatcher_other_than_megatrons_default_is_said_given(megatron_lm, caplog):
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        megatron_lm("--optimization-level", "1", "--num-experts", "4", "--moe-token-dispatcher-type", "flex")
    assert STEPPED.format("moe-alltoall-overlap", 1, "--moe-token-dispatcher-type flex") in caplog.text


def test_a_member_that_stepped_aside_steps_aside_again_on_the_next_validation(megatron_lm, caplog, monkeypatch):
    """Issue 48: megatron's unit tests (test_multi_token_prediction.py) import ``parse_args`` and
    ``validate_args`` by name once and validate a new MoE model's arguments in every test. The
    name they hold is the wrapper of the first validation's moment, whose hooks still include the
    member that stepped aside: its check raises again, and that must not be the error."""
    megatron_lm("--optimization-level", "1")  # installs the wrappers; the test module then imports them
    from megatron.training.arguments import parse_args, validate_args

    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        for _ in range(3):
            monkeypatch.setattr(sys, "argv", ["test_mtp.py", "--optimization-level", "1", "--num-experts", "8"])
            args = validate_args(parse_args())
            assert args.validated and args.moe_alltoall_overlap_comm is False
    said = [r.getMessage() for r in caplog.records if "stepped aside" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("moe-alltoall-overlap (from --optimization-level 1)")
    assert "moe-alltoall-overlap" not in runtime.current_context().enabled_names


def test_a_held_check_of_a_member_switched_off_since_is_moot(megatron_lm, monkeypatch):
    """The level went away between two validations (megatron's tests set ``sys.argv`` themselves):
    the held wrapper's check of a member that is off now raises nothing the user has to answer."""
    megatron_lm("--optimization-level", "1")
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["test_mtp.py", "--num-experts", "8"])
    args = validate_args(parse_args())
    assert args.validated and "moe-alltoall-overlap" not in runtime.current_context().enabled_names


def test_moe_alltoall_overlap_by_name_with_the_allgather_dispatcher_is_the_error(megatron_lm):
    with pytest.raises(ConfigError, match="pass --moe-token-dispatcher-type alltoall") as raised:
        megatron_lm("--moe-alltoall-overlap-comm", "--num-experts", "4")
    assert "megatron's default MoE token dispatcher, allgather" in str(raised.value)


def test_both_asked_for_on_megatrons_command_line_is_the_error(megatron_lm):
    with pytest.raises(ConfigError, match="Drop --reuse-fp32-param"):
        megatron_lm("--reuse-fp32-param", "--use-precision-aware-optimizer", "--bf16")


@pytest.mark.parametrize(
    ("argv", "flash"),
    [
        (("--optimization-level", "1", "--no-use-flash-attn"), False),
        (("--optimization-level", "1", "--use-flash-attn", "--no-use-flash-attn"), False),
        (("--no-use-flash-attn", "--use-flash-attn"), True),
    ],
)
def test_no_flag_on_megatrons_parser_for_its_own_option_too(megatron_lm, argv, flash):
    args = megatron_lm(*argv, "--no-reuse-fp32-param", "--bf16")
    assert runtime.current_config()["use_flash_attn"] is flash and args.use_flash_attn is flash
    assert runtime.current_config().sources["use_flash_attn"] == "megatron-args"
    assert not hasattr(args, "_mindspeed_like_no_use_flash_attn")
    assert args.reuse_fp32_param is False
    assert runtime.current_config()["use_fused_swiglu"] is (argv[0] == "--optimization-level")
    assert ("flash-attention" in runtime.current_context().enabled_names) is flash


def test_level_2_precision_aware_optimizer_on_megatron_core_steps_aside_before_the_build(clean, caplog):
    """megatron-core without Megatron-LM: the conflict is found when megatron builds the optimizer
    (OptimizerConfig(use_precision_aware_optimizer=True)); reuse-fp32-param is switched off before
    the optimizer exists and the run trains."""
    import torch

    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.configure(device="cpu", optimization_level=2)
    assert "reuse-fp32-param" in runtime.current_context().enabled_names
    init_parallel()
    try:
        model = tiny_gpt(bf16=True)
        fields = dict(
            optimizer="adam",
            use_precision_aware_optimizer=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
            main_grads_dtype=torch.bfloat16,
        )
        with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
            losses = train_steps(model, 2, optimizer=fields, use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    finally:
        destroy_parallel()
    assert len(losses) == 2 and all(map(lambda x: x == x, losses))
    assert STEPPED.format("reuse-fp32-param", 2, "--use-precision-aware-optimizer") in caplog.text
    assert "reuse-fp32-param" not in runtime.current_context().enabled_names


def test_reuse_asked_for_by_name_with_the_precision_aware_optimizer_is_the_error(clean):
    import torch

    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.configure(device="cpu", reuse_fp32_param=True)
    init_parallel()
    try:
        model = tiny_gpt(bf16=True)
        fields = dict(optimizer="adam", use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16)
        with pytest.raises(ConfigError, match="Drop --reuse-fp32-param"):
            train_steps(model, 1, optimizer=fields, use_distributed_optimizer=True)
    finally:
        destroy_parallel()
