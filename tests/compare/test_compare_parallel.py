"""`mindspeed-like compare` over every parallelism (CP, PP with virtual stages, EP with DP and the
distributed optimizer), its refusals before any process starts, the alternating repeats and the
measurement record, and the feature summary the demo and compare print."""

from __future__ import annotations

import json
import os

import pytest

from mindspeed_like.cli import main

TINY = ["--steps", "3", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
TINY += ["--seq-length", "16", "--micro-batch-size", "2", "--quiet"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Megatron-LM's validate_args, quoted
        (
            ["--pipeline-model-parallel-size", "3"],
            "'Number of layers should be divisible by the pipeline-model-parallel",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            "'number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage'",
        ),
        (["--num-layers-per-virtual-pipeline-stage", "1"], "pipeline-model-parallel size should be greater than 1"),
        # megatron's TransformerConfig.__post_init__, built in the parent
        (
            ["--tensor-model-parallel-size", "3"],
            "TransformerConfig refuses this combination: num_attention_heads (8) must be a multiple of "
            "tensor_model_parallel_size (3)",
        ),
        # initialize_model_parallel's world decomposition
        (
            ["--preset", "moe", "--expert-model-parallel-size", "2"],
            "is not divisible by expert tensor parallel size (1) x expert model parallel size (2)",
        ),
        (["--preset", "moe", "--expert-model-parallel-size", "3", "--data-parallel-size", "3"], "must divide the 8"),
        # the CP batch split and attention
        (["--context-parallel-size", "2", "--seq-length", "30"], "divisible by 2 x --context-parallel-size (4)"),
        (
            [
                "--context-parallel-size",
                "2",
                "--context-parallel-algo",
                "ulysses_cp_algo",
                "--num-attention-heads",
                "2",
            ],
            "the 1 key/value groups per TP rank (1 at TP 1) must be divisible by 2",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--context-parallel-algo",
                "hybrid_cp_algo",
                "--ulysses-degree-in-cp",
                "3",
            ],
            "--ulysses-degree-in-cp 3 does not divide --context-parallel-size 4",
        ),
        (["--context-parallel-algo", "ulysses_cp_algo"], "act at --context-parallel-size > 1"),
        (["--preset", "deepseek", "--pipeline-model-parallel-size", "2"], "not supported by compare"),
        (["--repeats", "0"], "--repeats must be positive"),
    ],
)
def test_bad_combinations_are_refused_before_any_process_starts(tmp_path, capsys, no_process, args, message):
    code = main(["compare", "--out", str(tmp_path), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "compare.json")


def _fake_rank(spec: dict, rank: int, world: int) -> dict:
    """What run_arm returns, with step times chosen per arm and repeat: megatron 100 ms, features
    50/80/40 ms over the repeats (ratios of tokens/s 2.0, 1.25, 2.5); a feature arm whose losses move
    in repeat 2 when ``spec['flaky']``."""
    features = spec["arm"] == "features"
    step = (0.05, 0.08, 0.04)[spec["repeat"]] if features else 0.1
    losses = [5.5, 5.0, 4.5]
    if features and spec.get("flaky") and spec["repeat"] == 1:
        losses = [5.5, 5.0, 4.4]
    memory = {"weights": 1000 + rank, "gradients": 1000, "optimizer": 2000, "activations": 500 if features else 800}
    return {
        "arm": spec["arm"],
        "rank": rank,
        "place": {"dp": rank} if world > 1 else {},
        "device": "cpu",
        "features_on": ["cpu-adapter", "fix-distopt-padding-flag", "model-construction-tracker"]
        + (["fused-rmsnorm"] if features else []),
        "fell_back": {},
        "served": {},
        "calls": {"fused-rmsnorm": 4} if features else {},
        "losses": losses,
        "step_times_s": [0.5, step, step],
        "step_time": {"median_s": step, "min_s": step, "max_s": step, "first_s": 0.5, "steps_timed": 2},
        "tokens_per_step": 64,
        "memory": {**memory, "process_peak": 10_000},
    }


@pytest.fixture
def fake_arms(monkeypatch):
    """run_distributed replaced by ranks from ``_fake_rank``; the order of the arms is kept."""
    import mindspeed_like.workloads as workloads

    calls: list[tuple[str, int]] = []
    flaky = {"on": False}

    def run_distributed(fn, world, spec, **kwargs):
        calls.append((spec["arm"], spec["repeat"]))
        return [_fake_rank(dict(spec, flaky=flaky["on"]), rank, world) for rank in range(world)]

    monkeypatch.setattr(workloads, "run_distributed", run_distributed)
    return calls, flaky


def test_repeats_alternate_arms_and_report_the_median_ratio_with_its_spread(tmp_path, monkeypatch, capsys, fake_arms):
    calls, _ = fake_arms
    monkeypatch.setenv("MINDSPEED_LIKE_RESULTS", str(tmp_path / "results"))
    out = tmp_path / "out"
    args = ["compare", *TINY, "--data-parallel-size", "2", "--out", str(out), "--record", "--use-fused-rmsnorm"]
    assert main(args) == 0
    assert calls == [("megatron", 0), ("features", 0), ("megatron", 1), ("features", 1), ("megatron", 2)] + [
        ("features", 2)
    ]
    printed = capsys.readouterr().out
    assert "2.00x (1.25-2.50)" in printed  # tokens/s: per-repeat ratios 2.0, 1.25, 2.5
    assert "median, min-max of 3" in printed and "per rank MiB" in printed
    with open(out / "compare.json") as handle:
        record = json.load(handle)
    rows = {row["metric"]: row for row in record["rows"]}
    assert (rows["tokens_per_s"]["ratio"], rows["tokens_per_s"]["ratio_min"], rows["tokens_per_s"]["ratio_max"]) == (
        2.0,
        1.25,
        2.5,
    )
    assert rows["step_time_s"]["ratio"] == pytest.approx(0.5) and rows["step_time_s"]["ratio_max"] == pytest.approx(0.8)
    assert rows["weights_bytes"]["megatron_per_rank"] == [1000, 1001] and rows["weights_bytes"]["megatron"] == 1001
    assert rows["activations_bytes"]["ratio"] == pytest.approx(500 / 800)
    assert rows["losses_identical_across_repeats"]["features"] is True
    assert record["samples"]["features/repeat2/step_times_s"] == [0.5, 0.08, 0.08]
    assert record["samples"]["megatron/repeat3/losses"] == [5.5, 5.0, 4.5]
    assert record["name"] == "compare-llama-dp2-layers2-hidden32-heads4-seq16-mbs2-steps3-use-fused-rmsnorm"
    assert record["command"][:4] == ["mindspeed-like", "compare", "--preset", "llama"]
    assert "--data-parallel-size" in record["command"] and "--use-fused-rmsnorm" in record["command"]
    assert record["host"]["load_average_at_start"] is not None and record["options"]["repeats"] == 3
    # compare's features: the accelerations only (adapters, fixes, trackers are in both arms)
    assert record["compare"]["features"]["on"] == ["fused-rmsnorm"]
    with open(tmp_path / "results" / f"{record['name']}.json") as handle:
        assert json.load(handle)["rows"] == record["rows"]


def test_losses_that_differ_between_repeats_are_flagged(tmp_path, capsys, fake_arms):
    _, flaky = fake_arms
    flaky["on"] = True
    out = tmp_path / "out"
    assert main(["compare", *TINY, "--out", str(out), "--repeats", "2", "--use-fused-rmsnorm"]) == 0
    assert "WARNING: the features arm's losses differ between repeats" in capsys.readouterr().out
    with open(out / "compare.json") as handle:
        rows = {row["metric"]: row for row in json.load(handle)["rows"]}
    assert rows["losses_identical_across_repeats"] == {
        "metric": "losses_identical_across_repeats",
        "unit": "bool",
        "megatron": True,
        "features": False,
    }


def test_record_names_tag_the_options_not_at_their_default():
    import argparse

    from mindspeed_like.compare import add_compare_arguments
    from mindspeed_like.compare.report import record_name

    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    name = record_name(
        parser.parse_args(["--context-parallel-size", "2"]), {"context_parallel_algo": "ulysses_cp_algo"}
    )
    assert name == "compare-llama-cp2-ulysses"
    args = parser.parse_args(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"])
    assert record_name(args, {}) == "compare-llama-pp2-vpp1"
    args = parser.parse_args(
        "--preset moe --data-parallel-size 2 --expert-model-parallel-size 2 --use-distributed-optimizer "
        "--transformer-impl local".split()
    )
    assert record_name(args, {"optimization_level": 1}) == "compare-moe-dp2-ep2-distopt-local-level1"


def test_feature_summary_names_accelerations_and_counts_adapters_and_fixes():
    from mindspeed_like.compare.report import describe_features

    names = ["cpu-adapter", "te-backend", "fix-distopt-padding-flag", "fix-mla-have-te", "megatron-lm-arguments"]
    names += ["model-construction-tracker", "flash-attention", "fused-rmsnorm"]
    assert describe_features(names) == "flash-attention, fused-rmsnorm (+ cpu adapter, 1 more adapter, 2 fixes)"
    assert describe_features(["model-construction-tracker"]) == "none"


def _compare(tmp_path, *args: str) -> dict:
    out = str(tmp_path / "out")
    assert main(["compare", *TINY, "--repeats", "1", "--out", out, *args]) == 0
    with open(os.path.join(out, "compare.json")) as handle:
        return json.load(handle)["compare"]


@pytest.mark.slow
def test_context_parallel_2_trains_in_both_arms_with_per_rank_memory(tmp_path):
    """CP=2 (ring, both arms: megatron has no other CP attention here), fp32 with an exact feature:
    the losses are equal step for step; each CP rank holds half of every sequence."""
    result = _compare(tmp_path, "--context-parallel-size", "2", "--fp32", "--recompute-activation-function")
    assert result["parallel"]["world_size"] == 2 and result["megatron"]["places"] == [{"cp": 0}, {"cp": 1}]
    assert result["megatron"]["losses"] == result["with_features"]["losses"]
    assert len(result["megatron"]["memory_by_rank"]["activations"]) == 2
    assert "recompute-activation-function" in result["features"]["ran"]


@pytest.mark.slow
def test_context_parallel_ulysses_level_2(tmp_path):
    result = _compare(tmp_path, "--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo")
    assert result["parallel"]["context_parallel_algo"] == "ulysses_cp_algo"
    assert result["loss"]["max_abs_diff"] < 5e-3  # bf16 noise of the level-2 features


@pytest.mark.slow
def test_pipeline_2_with_virtual_stages_runs_the_interleaved_schedule(tmp_path):
    """PP=2 with one layer per virtual stage (two chunks per rank: megatron's interleaved schedule),
    fp32 with an exact feature: equal losses; the stages hold different weights (the embedding on
    the first, the output layer on the last)."""
    result = _compare(
        tmp_path,
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--fp32",
        "--recompute-activation-function",
    )
    assert result["megatron"]["places"] == [{"pp": 0}, {"pp": 1}]
    assert result["megatron"]["losses"] == result["with_features"]["losses"]
    assert result["with_features"]["losses"][-1] < result["with_features"]["losses"][0]
    assert "recompute-activation-function" in result["features"]["ran"]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_moe_expert_parallel_2_with_distributed_optimizer(tmp_path, impl):
    result = _compare(
        tmp_path,
        "--preset",
        "moe",
        "--data-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--transformer-impl",
        impl,
    )
    assert result["megatron"]["places"] == [{"dp": 0}, {"dp": 1}]
    assert result["loss"]["max_abs_diff"] < 5e-3
    assert "moe-permute" in result["features"]["ran"]
