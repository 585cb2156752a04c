"""Flags: typed, four sources in priority order, clear errors with suggestions."""

from __future__ import annotations

import pytest

from mindspeed_like.config import normalize_names, parse_argv, parse_env, resolve
from mindspeed_like.toolkit.declaration import Flag
from mindspeed_like.toolkit.errors import ConfigError

FLAGS = [
    Flag("use_flash_attn", bool, False, "flash attention", megatron_defines=True),
    Flag("use_tp_overlap", bool, False, "tiled TP overlap", aliases=("--use-ascend-coc",)),
    Flag("tp_overlap_chunks", int, 1, "chunks", aliases=("--coc-parallel-num",), choices=(1, 2, 4, 8)),
    Flag("dropout_scale", float, 1.0, "a float"),
    Flag("backend", str, "auto", "a string", choices=("auto", "npu", "portable")),
]


def test_defaults_when_no_source_sets_anything():
    config = resolve(FLAGS)
    assert dict(config) == {
        "use_flash_attn": False,
        "use_tp_overlap": False,
        "tp_overlap_chunks": 1,
        "dropout_scale": 1.0,
        "backend": "auto",
    }
    assert set(config.sources.values()) == {"default"}


def test_later_sources_win_in_order():
    config = resolve(
        FLAGS,
        env="--tp-overlap-chunks 2 --dropout-scale 0.5 --backend npu",
        argv=["--tp-overlap-chunks", "4", "--dropout-scale", "0.25"],
        code={"tp_overlap_chunks": 8},
    )
    assert config.tp_overlap_chunks == 8 and config.sources["tp_overlap_chunks"] == "configure"
    assert config.dropout_scale == 0.25 and config.sources["dropout_scale"] == "argv"
    assert config.backend == "npu" and config.sources["backend"] == "env"
    assert config.use_flash_attn is False and config.sources["use_flash_attn"] == "default"


def test_values_are_typed():
    values = parse_argv(FLAGS, ["--coc-parallel-num", "4", "--dropout-scale", "2", "--use-ascend-coc"])
    assert values == {"tp_overlap_chunks": 4, "dropout_scale": 2.0, "use_tp_overlap": True}
    assert type(values["tp_overlap_chunks"]) is int and type(values["dropout_scale"]) is float


def test_megatron_flags_pass_through_the_command_line():
    argv = ["--num-layers", "2", "--use-flash-attn", "--seq-length", "4", "--bf16"]
    assert parse_argv(FLAGS, argv) == {"use_flash_attn": True}


def test_no_prefix_matching_of_long_options():
    # argparse would otherwise read Megatron's hypothetical --use-flash as our --use-flash-attn
    assert parse_argv(FLAGS, ["--use-flash"]) == {}


def test_bad_value_on_command_line_is_dropped_with_a_warning_never_exits():
    """The command line is the script's: a value our parser rejects is not an import-time error."""
    with pytest.warns(UserWarning, match="ignoring --.*invalid choice: 3"):
        assert parse_argv(FLAGS, ["--coc-parallel-num", "3", "--use-ascend-coc"]) == {"use_tp_overlap": True}
    with pytest.warns(UserWarning, match="invalid int value"):
        assert parse_argv(FLAGS, ["--coc-parallel-num", "four"]) == {}
    with pytest.raises(ConfigError, match="not one of"):  # the same value from code is an error
        normalize_names(FLAGS, {"coc_parallel_num": 3}, "configure()")


def test_unknown_env_flag_has_a_suggestion():
    with pytest.raises(ConfigError, match=r"MINDSPEED_LIKE_ARGS: unknown flag '--use-flash-atn'.*'--use-flash-attn'"):
        parse_env(FLAGS, "--use-flash-atn")
    with pytest.raises(ConfigError, match="unexpected value"):
        parse_env(FLAGS, "--use-flash-attn yes")


def test_env_accepts_equals_and_mindspeed_spellings():
    assert parse_env(FLAGS, "--coc-parallel-num=2 --use-ascend-coc") == {"tp_overlap_chunks": 2, "use_tp_overlap": True}


def test_configure_names_values_and_suggestions():
    assert normalize_names(FLAGS, {"coc_parallel_num": 4, "use-ascend-coc": True}, "configure()") == {
        "tp_overlap_chunks": 4,
        "use_tp_overlap": True,
    }
    with pytest.raises(ConfigError, match=r"unknown flag 'use_flash_atn'.*Did you mean 'use_flash_attn'"):
        normalize_names(FLAGS, {"use_flash_atn": True}, "configure()")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("tp_overlap_chunks", "4", "has type str, expected int"),
        ("tp_overlap_chunks", True, "has type bool, expected int"),
        ("tp_overlap_chunks", 3, r"not one of \[1, 2, 4, 8\]"),
        ("use_flash_attn", 1, "has type int, expected bool"),
        ("use_flash_attn", "true", "has type str, expected bool"),
        ("backend", "cuda", "not one of"),
    ],
)
def test_configure_rejects_wrong_types_and_choices(name, value, message):
    with pytest.raises(ConfigError, match=message):
        normalize_names(FLAGS, {name: value}, "configure()")


def test_configure_int_for_float_is_accepted_as_float():
    assert normalize_names(FLAGS, {"dropout_scale": 2}, "configure()") == {"dropout_scale": 2.0}
