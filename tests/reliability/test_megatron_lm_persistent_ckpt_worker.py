"""``--async-save --use-persistent-ckpt-worker`` through Megatron-LM's own pretrain_gpt.py (opt-in).

The pair was refused at start-up on a host until ``adapters/cpu/ckpt_worker.py``: the flag
sweep's run never ended (megatron's worker died at ``torch.cuda.set_device(rank % 0)`` in its new
process and each rank waited on its queue forever). Without ``--use-persistent-ckpt-worker``
Megatron-LM 0.16 turns ``--async-save`` off for torch_dist checkpoints ("not supported"), so this is
the one way to an asynchronous save there.

2 processes, DP=2, the import line (``python -m mindspeed_like.run``), ``--ckpt-format
torch_dist``: a straight run of 6 iterations; a run that saves asynchronously every 2 iterations
and exits at 4, its iterations 1-4 the straight run's; a new launch that loads the checkpoint of
iteration 2 (the tracker file pointed at it: that save was written by the worker while iterations
3 and 4 trained on the same tensors) and trains 3-6, printing the straight run's ``lm loss`` and
``grad norm`` digit for digit. Three launches, a few minutes on a 2-core CPU: slow.
"""

from __future__ import annotations

import os

import pytest

from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)

ITERS, EXIT_AT, LOAD_FROM = 6, 4, 2
PERSISTENT_ASYNC = ["--async-save", "--use-persistent-ckpt-worker", "--ckpt-format", "torch_dist"]
LAUNCH_TIMEOUT_S = 600  # a launch that hangs on its worker fails here instead of the default 900 s


def _launch(extra: list[str]) -> str:
    return megatron_lm.torchrun_output(
        2, megatron_lm.launcher(), [*PERSISTENT_ASYNC, "--train-iters", str(ITERS), *extra], timeout=LAUNCH_TIMEOUT_S
    )


@pytest.mark.slow
def test_a_persistent_worker_save_resumes_the_straight_run(tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    straight = megatron_lm.printed(megatron_lm.lines_of(_launch([])))
    assert sorted(straight) == list(range(1, ITERS + 1))

    output = _launch(["--save", checkpoint, "--save-interval", "2", "--exit-interval", str(EXIT_AT)])
    saving = megatron_lm.printed(megatron_lm.lines_of(output))
    assert saving == {i: straight[i] for i in range(1, EXIT_AT + 1)}, "saving changes nothing of the run"
    for iteration in (2, 4):
        assert f"scheduled an async checkpoint save at iteration {iteration:7d}" in output, output[-3000:]
        assert os.path.isfile(os.path.join(checkpoint, f"iter_{iteration:07d}", ".metadata")), "the worker wrote it"

    with open(os.path.join(checkpoint, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write(str(LOAD_FROM))  # the save that was in flight while iterations 3 and 4 trained
    resumed = megatron_lm.printed(megatron_lm.lines_of(_launch(["--load", checkpoint])))
    assert sorted(resumed) == list(range(LOAD_FROM + 1, ITERS + 1)), "the new processes start after iteration 2"
    for iteration in resumed:  # one message per iteration: which value, straight vs resumed
        assert resumed[iteration] == straight[iteration], (
            f"iteration {iteration} straight {straight[iteration]} resumed {resumed[iteration]}"
        )
