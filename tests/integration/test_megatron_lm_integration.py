"""Megatron-LM's own pretrain_gpt.py trains on CPU with the one import line (opt-in).

Runs only when MEGATRON_LM_PATH points at a Megatron-LM checkout (tag core_v0.16.1 matches
megatron-core 0.16.1); `make megatron-lm-smoke MEGATRON_LM_PATH=...` installs what
megatron.training imports and runs this file. Nothing of Megatron-LM is in this repository:
the tests launch the checkout's script through torchrun, as a user would.
"""

from __future__ import annotations

import os

import pytest

from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)
PRETRAIN_GPT, MEGATRON_LM = megatron_lm.PRETRAIN_GPT, megatron_lm.MEGATRON_LM
_torchrun, _losses, _launcher = megatron_lm.torchrun, megatron_lm.losses, megatron_lm.launcher


def test_single_process_trains_and_loss_decreases():
    losses = _losses(_torchrun(1, _launcher(), []))
    assert losses[-1] < losses[0]


FUSED = ["--use-fused-rmsnorm", "--use-fused-rotary-pos-emb", "--use-fused-swiglu"]


def test_fused_kernel_flags_on_megatrons_command_line_match_megatrons_path():
    """Our fused-kernel flags given to Megatron-LM's own parser: applied (Megatron's start-up log
    says so) and fp32 losses equal to megatron's path within 1e-5 relative."""
    lines = _torchrun(1, _launcher(), FUSED)
    assert all(name in lines[0] for name in ("fused-rmsnorm", "fused-rotary-pos-emb", "fused-swiglu"))
    baseline = _torchrun(1, _launcher(), [])
    assert "fused-" not in baseline[0]
    assert _losses(lines) == pytest.approx(_losses(baseline), rel=1e-5)


def test_import_line_added_to_a_copy_of_pretrain_gpt(tmp_path):
    """Literally the user's edit: the import line first in pretrain_gpt.py (a copy beside the test)."""
    with open(PRETRAIN_GPT, encoding="utf-8") as handle:
        source = handle.read()
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("import mindspeed_like.megatron_adaptor\n" + source)
    env = {"PYTHONPATH": MEGATRON_LM + os.pathsep + os.environ.get("PYTHONPATH", "")}
    losses = _losses(_torchrun(1, [str(script)], ["--bf16"], env))
    assert losses[-1] < losses[0]


def test_tensor_parallel_2_with_sequence_parallel_matches_single_process():
    # --use-cpu-initialization draws the full weights from one generator and slices them, so
    # TP=1 and TP=2 start equal (megatron's per-rank GPU-style init would not, on a GPU either);
    # vocab 255 pads to 256 at both TP sizes, so the softmax sees the same logits.
    same_start = ["--use-cpu-initialization"]
    reference = _losses(_torchrun(1, _launcher(), same_start))
    tp2 = _losses(_torchrun(2, _launcher(), [*same_start, "--tensor-model-parallel-size", "2", "--sequence-parallel"]))
    # Same math with the reductions split over two ranks: equal to print precision (7 digits)
    # or within float32 rounding of a different summation order.
    assert tp2 == pytest.approx(reference, rel=1e-5)


def test_data_parallel_2_with_distributed_optimizer_bf16_and_our_flags():
    lines = _torchrun(
        2,
        _launcher(),
        ["--use-distributed-optimizer", "--bf16", "--device", "cpu"],  # --device: ours, on Megatron's command line
        {"MINDSPEED_LIKE_ARGS": "--strict"},
    )
    losses = _losses(lines)
    assert losses[-1] < losses[0]
