"""The demo's per-device size and its closing compare line (fast; the runs themselves: test_cli.py on
this CPU, tests/integration/test_cuda_placement.py on device cuda under the placement check)."""

from __future__ import annotations

import argparse

import pytest

from mindspeed_like import demo


def _args(*flags: str, **given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)
    argv = [*flags, *(f"--{k.replace('_', '-')}={v}" for k, v in given.items())]
    return parser.parse_args(argv)


def test_each_device_has_its_size_and_given_arguments_win():
    assert demo.demo_size(_args(), "cpu") == demo.SIZES["cpu"]
    cuda = demo.demo_size(_args(), "cuda")
    assert (cuda.num_layers, cuda.hidden_size, cuda.seq_length, cuda.micro_batch_size, cuda.bf16) == (
        8,
        2048,
        4096,
        1,
        True,
    )
    mine = demo.demo_size(_args(seq_length=64, steps=3), "cuda")
    assert (mine.seq_length, mine.steps, mine.hidden_size) == (64, 3, 2048)
    with pytest.raises(SystemExit, match="--num-layers must be positive"):
        demo.demo_size(_args(num_layers=0), "cpu")
    with pytest.raises(SystemExit, match="divisible"):
        demo.demo_size(_args(hidden_size=100, num_attention_heads=8), "cpu")


def test_the_compare_line_runs_at_the_demos_size():
    args = _args(compare_steps=6)
    command = demo.compare_command(args, demo.SIZES["cuda"], "cuda")
    pairs = dict(zip(command[::2], command[1::2]))
    assert pairs["--seq-length"] == "4096" and pairs["--num-layers"] == "8" and pairs["--steps"] == "6"
    assert "--fp32" not in command  # compare's bf16 unless --no-bf16 was given
    assert "--fp32" in demo.compare_command(_args("--no-bf16"), demo.SIZES["cpu"], "cpu")


def _result(ratio: float, ran: list[str]) -> dict:
    return {"ratios": {"tokens_per_s": ratio, "activations_bytes": 0.26}, "features": {"ran": ran}}


def test_a_ratio_below_one_is_explained_in_one_sentence():
    assert demo.why_below_one(_result(1.3, ["flash-attention"])) == ""
    level2 = demo.why_below_one(_result(0.8, ["flash-attention", "recompute-activation-function"]))
    assert "recompute-activation-function trade time for memory" in level2 and "0.26x" in level2
    assert "flash-attention" not in level2 and "--optimization-level 1" in level2
    assert demo.why_below_one(_result(0.9, ["flash-attention"])).startswith("below 1x")
    busy = demo.why_below_one(_result(0.9, ["recompute-activation-function"]), busy=True, load=9.5)
    assert "busy (load average 9.5" in busy and "trade time" not in busy
