"""`mindspeed-like compare` as a user runs it: both arms train, the JSON has every field, the arms
share their data, fallbacks are reported, bad arguments are clear errors, a PNG is drawn."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from mindspeed_like.cli import main

TINY = ["--steps", "3", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"]
TINY += ["--seq-length", "16", "--micro-batch-size", "2", "--quiet", "--repeats", "1"]


def _compare(tmp_path, *args: str) -> dict:
    out = str(tmp_path / "out")
    assert main(["compare", *TINY, "--out", out, *args]) == 0
    with open(os.path.join(out, "compare.json")) as handle:
        return json.load(handle)["compare"]


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    """fp32 + activation-function recompute (bitwise by design), run once for the module."""
    import io
    from contextlib import redirect_stdout

    tmp_path = tmp_path_factory.mktemp("exact")
    printed = io.StringIO()
    with redirect_stdout(printed):
        result = _compare(tmp_path, "--fp32", "--recompute-activation-function")
    return result, printed.getvalue(), tmp_path / "out"


def test_exact_feature_same_data_same_losses_and_every_field(exact_run):
    """The two arms trained on the same batches from the same weights: every loss is equal,
    the first one included."""
    result, out, _ = exact_run
    for key in ("model", "parallel", "steps", "flags", "features", "megatron", "with_features", "ratios", "loss"):
        assert key in result
    for arm in (result["megatron"], result["with_features"]):
        assert len(arm["losses"]) == 3 and len(arm["step_times_s"]) == 3
        assert arm["tokens_per_s"] > 0 and arm["step_time"]["median_s"] > 0
        assert set(arm["memory_per_rank"]) == {
            "weights",
            "gradients",
            "optimizer",
            "model_state",
            "activations",
            "process_peak",
        }
        assert all(v > 0 for v in arm["memory_per_rank"].values())
    assert result["loss"]["first_step_equal"] is True
    assert result["loss"]["max_abs_diff"] == 0.0
    assert result["megatron"]["losses"] == result["with_features"]["losses"]
    # on by default, inert here (no MoE, no precision-aware optimizer config): never reached or idle
    assert "recompute-activation-function" in result["features"]["on"]
    assert (
        result["features"]["ran"] == ["recompute-activation-function"]
        or "flash-attention" not in (result["features"]["ran"])
    )
    assert "grouped-gemm" in result["features"]["idle"]
    assert "recompute-activation-function" not in result["megatron"]["features_on"]
    # the recompute frees the activation output: fewer bytes saved for backward, same state
    assert result["ratios"]["activations_bytes"] < 1.0
    assert result["ratios"]["model_state_bytes"] == 1.0
    assert "features / megatron" in out and "summary: llama:" in out


@pytest.mark.slow
def test_default_is_level_2_in_bf16(tmp_path):
    result = _compare(tmp_path)
    assert result["flags"] == {"optimization_level": 2}
    assert result["model"]["precision"] == "bf16"
    on = set(result["features"]["on"])
    assert {"flash-attention", "fused-rmsnorm", "reuse-fp32-param", "recompute-activation-function"} <= on
    assert "grouped-gemm" in result["features"]["idle"]  # no MoE in the llama preset
    assert result["loss"]["first_step_equal"] or result["loss"]["max_abs_diff"] < 0.05
    # reuse-fp32-param: no separate fp32 master copy next to the bf16 weights
    assert result["ratios"]["model_state_bytes"] < 1.0


@pytest.mark.slow
def test_feature_that_falls_back_is_reported_as_not_run(tmp_path):
    """Tiled TP overlap with fewer token rows per rank than tiles hands every call back."""
    result = _compare(
        tmp_path, "--fp32", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-tiled-tp-overlap"
    )
    assert "tp-overlap" in result["features"]["fell_back"]
    assert "tiles" in result["features"]["fell_back"]["tp-overlap"][0]
    assert "tp-overlap" not in result["features"]["ran"]
    assert result["megatron"]["processes"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["moe", "gpt"])
def test_other_presets_train(tmp_path, preset):
    # local spec: megatron's GroupedMLP is what grouped-gemm patches (TE's grouped linears use its kernel
    # inside the te-backend, without the feature's patch)
    result = _compare(tmp_path, "--preset", preset, "--transformer-impl", "local")
    assert result["model"]["preset"] == preset
    assert result["with_features"]["losses"][-1] < result["with_features"]["losses"][0] + 0.5
    if preset == "moe":
        assert "grouped-gemm" in result["features"]["ran"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hidden-size", "30", "--num-attention-heads", "4"], "must be divisible by --num-attention-heads"),
        (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (["--steps", "0"], "--steps must be positive"),
        (["--expert-model-parallel-size", "2"], "is for the MoE presets (deepseek, moe, qwen3-moe)"),
        (["--use-flash-atn"], "unrecognized arguments: --use-flash-atn"),
        (["--no-te-backend"], "--transformer-impl transformer_engine needs TransformerEngine or the te-backend"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path, capsys, args, message):
    try:
        code = main(["compare", "--out", str(tmp_path), *args])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "compare.json")


@pytest.mark.slow
def test_both_transformer_impls_train_the_same_function(tmp_path, exact_run):
    """``--transformer-impl`` (default: Megatron-LM's, transformer_engine): the TE-spec model gets the
    local-spec model's weights by checkpoint key, so megatron's arm trains the same function on
    either spec (fp32: within 1e-5, sums in other orders); the TE-spec model reaches the features."""
    te, _, _ = exact_run
    local = _compare(tmp_path, "--fp32", "--recompute-activation-function", "--transformer-impl", "local")
    assert te["model"]["transformer_impl"] == "transformer_engine" and local["model"]["transformer_impl"] == "local"
    for a, b in zip(te["megatron"]["losses"], local["megatron"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (te["megatron"]["losses"], local["megatron"]["losses"])
    assert "recompute-activation-function" in te["features"]["ran"]


def test_png_is_drawn_when_matplotlib_is_installed(exact_run):
    result, out, directory = exact_run
    if importlib.util.find_spec("matplotlib") is None:
        assert "pip install 'mindspeed_like[plot]'" in out
        pytest.skip("matplotlib is not installed (the optional [plot] extra); the hint was printed")
    assert os.path.getsize(directory / "compare.png") > 10_000
    assert str(directory / "compare.png") in out
