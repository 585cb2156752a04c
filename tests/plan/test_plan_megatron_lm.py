"""Opt-in (``MEGATRON_LM_PATH``): plan's built-in parser against Megatron-LM's own, option by option
(names, defaults) and run by run (the same prediction from the same command line), and Megatron-LM's
``report_theoretical_memory`` read from its own file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mindspeed_like.testing.megatron_lm import MEGATRON_LM, SKIP_REASON, available

pytestmark = pytest.mark.skipif(not available(), reason=SKIP_REASON)

COMMANDS = {
    "llama tp1": "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights "
    "--disable-bias-linear --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000 --bf16 "
    "--micro-batch-size 2 --global-batch-size 16",
    "gpt pp2 vpp distopt": "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
    "--max-position-embeddings 512 --vocab-size 50257 --bf16 --pipeline-model-parallel-size 2 "
    "--num-layers-per-virtual-pipeline-stage 2 --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 8",
    "moe dense-first": "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --seq-length 256 --max-position-embeddings 256 "
    "--vocab-size 1000 --bf16 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 "
    "--moe-layer-freq ([0]+[1]*3) --moe-shared-expert-intermediate-size 128 --expert-model-parallel-size 2 "
    "--micro-batch-size 1 --global-batch-size 16",
    "llama tp2 sp cp2": "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope --seq-length 1024 "
    "--max-position-embeddings 1024 --vocab-size 1000 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
    "--context-parallel-size 2 --micro-batch-size 1 --global-batch-size 4",
}


def _plan_json(command: str, parser: str, world: int) -> dict:
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, os.environ.get("PYTHONPATH", "")]))
    args = [*command.split(), "--world-size", str(world), "--parser", parser, "--json", "--target-device", "cuda"]
    done = subprocess.run([sys.executable, "-m", "mindspeed_like.plan", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_builtin_parser_predicts_what_megatron_lms_parser_does(name: str) -> None:
    ours = _plan_json(COMMANDS[name], "builtin", 8)
    theirs = _plan_json(COMMANDS[name], "megatron-lm", 8)
    # validate_args ran whole on this host without a GPU (its device queries answered as Hopper's)
    assert theirs["run"]["source"] == "megatron-lm" and ours["run"]["source"] == "builtin"
    assert ours["run"]["description"] == theirs["run"]["description"]
    assert ours["per_rank"] == theirs["per_rank"]


def test_builtin_defaults_are_megatron_lms() -> None:
    sys.path.insert(0, MEGATRON_LM)
    try:
        import argparse

        from megatron.training.arguments import add_megatron_arguments

        from mindspeed_like.plan.megatron_args import NEWER_OPTIONS, build_parser

        theirs = {a.dest: a for a in add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))._actions}
        checked = 0
        for action in build_parser()._actions:
            if not action.option_strings:
                continue
            if action.option_strings[0] in NEWER_OPTIONS and action.dest not in theirs:
                continue  # a later Megatron-LM's option (checked where that Megatron-LM is the one at hand)
            assert action.dest in theirs, f"{action.option_strings[0]} is not Megatron-LM's"
            default = theirs[action.dest].default
            assert action.default == default, f"{action.option_strings[0]}: ours {action.default!r}, theirs {default!r}"
            if action.option_strings[0] in NEWER_OPTIONS:
                assert set(action.choices) == set(theirs[action.dest].choices), action.option_strings[0]
            checked += 1
        assert checked > 60
    finally:
        sys.path.remove(MEGATRON_LM)


def test_report_theoretical_memory_is_read_from_megatron_lm() -> None:
    import argparse
    import json

    from mindspeed_like.plan import theory
    from mindspeed_like.plan.compare_args import run_from_compare
    from mindspeed_like.toolkit import records

    rec = json.loads((records.results_dir() / "compare-llama-level2.json").read_text())
    run = run_from_compare(argparse.Namespace(**rec["options"]), {}, "cpu")
    figures = theory.report(run)
    # 18 bytes a parameter (fp32 grads, masters and moments + bf16 weights) for the 11.54M parameters
    assert figures is not None and figures["model_state_bytes"] == pytest.approx(18 * 11538944, rel=1e-6)


def test_a_bare_assert_in_validate_args_is_quoted() -> None:
    """Megatron-LM asserts many arguments without a message: the refusal names the asserting line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, os.environ.get("PYTHONPATH", "")]))
    command = COMMANDS[sorted(COMMANDS)[0]].split()
    args = [*command, "--hidden-size", "250", "--parser", "megatron-lm"]
    done = subprocess.run([sys.executable, "-m", "mindspeed_like.plan", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert "assert args.hidden_size % args.num_attention_heads == 0 (megatron/training/arguments.py:" in done.stderr


def test_validate_args_refusals_after_its_device_query_are_kept() -> None:
    """At TP 2 validate_args asks CUDA for the GPU's architecture before its later checks; a host
    without a GPU answers as Hopper, so a refusal after that point (Muon with the distributed
    optimizer) is still Megatron-LM's, not lost to a fallback."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, os.environ.get("PYTHONPATH", "")]))
    command = COMMANDS["llama tp1"].split()
    args = [*command, "--tensor-model-parallel-size", "2", "--optimizer", "muon", "--use-distributed-optimizer"]
    args += ["--world-size", "2", "--parser", "megatron-lm"]
    done = subprocess.run([sys.executable, "-m", "mindspeed_like.plan", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stdout[-2000:]
    assert "Muon optimizer does not support distributed optimizer" in done.stderr
