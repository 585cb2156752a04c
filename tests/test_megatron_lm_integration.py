"""Megatron-LM's own pretrain_gpt.py trains on CPU with the one import line (opt-in).

Runs only when MEGATRON_LM_PATH points at a Megatron-LM checkout (tag core_v0.16.1 matches
megatron-core 0.16.1); `make megatron-lm-smoke MEGATRON_LM_PATH=...` installs what
megatron.training imports and runs this file. Nothing of Megatron-LM is in this repository:
the tests launch the checkout's script through torchrun, as a user would.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from mindspeed_like.testing.parallel import free_port

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH", "")
PRETRAIN_GPT = os.path.join(MEGATRON_LM, "pretrain_gpt.py")

pytestmark = pytest.mark.skipif(
    not os.path.isfile(PRETRAIN_GPT),
    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1) to run; see docs/megatron-lm.md",
)

# Only what a CPU user chooses: data, tokenizer, model size, schedule. No CPU-specific flags:
# the adaptor switches TE/NCCL/apex defaults itself and logs it.
TINY = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-3 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--attention-dropout 0 --hidden-dropout 0 --seed 1234"
).split()
ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.E+-]+)"
)


def _torchrun(nproc: int, script_args: list[str], extra: list[str], env_extra: dict | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    bin_dir = os.path.dirname(sys.executable)  # megatron compiles helpers with the python3 on PATH
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS=str(max(1, 2 // nproc)))
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.update(env_extra or {})
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        *script_args, *TINY, *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    features = [line for line in output.splitlines() if "> mindspeed_like features on:" in line]
    assert len(features) == 1, "rank 0 prints the features once"
    return [features[0], *[line for line in output.splitlines() if ITERATION.search(line)]]


def _losses(lines: list[str]) -> list[float]:
    losses = [float(ITERATION.search(line).group(4)) for line in lines[1:]]
    assert len(losses) == 10, lines
    assert all(math.isfinite(x) for x in losses)
    return losses


def _launcher() -> list[str]:
    return ["-m", "mindspeed_like.run", PRETRAIN_GPT]


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
