"""The persistent async-save worker on a CPU host (``adapters/cpu/ckpt_worker.py``).

megatron-core's ``AsyncCallsQueue(persistent=True)`` (Megatron-LM's ``--async-save
--use-persistent-ckpt-worker``) spawns one checkpoint writer per rank. Before the adapter, on a
host, the worker died at its first line (``torch.cuda.set_device(rank % 0)``) and the trainer waited
on its queue forever. Here, 2 gloo ranks with the import line, the shape of Megatron-LM's
``tests/unit_tests/dist_checkpointing/test_async_save.py::test_async_is_equivalent_to_sync``: an
async save through the persistent worker loads equal to a synchronous save of the same values,
although the trainer changed its tensors in place right after scheduling it (the worker writes a
copy, not the trainer's live tensors); the worker ends at ``close()``. Then a worker that cannot
start (an unknown flag in its ``MINDSPEED_LIKE_ARGS``) raises ``WorkerDied`` in the trainer.

Without the adapter each rank stalls in ``schedule_async_request`` (megatron's
``preload_q.join()``): the rank function's own guard turns that into a ``TimeoutError`` after
``STALL_S``, so the test fails and never hangs. One spawn of 2 ranks for both tests.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import run_distributed

pytestmark = pytest.mark.skipif(
    megatron_core_version() >= Version("0.17"),
    reason="adapted on megatron-core < 0.17 (0.19 keeps one worker per class); refused there (test_cuda_sites)",
)

STALL_S = 240  # after the imports: a rank waits on its worker no longer (a loaded 2-core host: ~30-90 s)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from persistent_ckpt_workers import async_equals_sync_and_a_dead_worker_raises

    directory = str(tmp_path_factory.mktemp("persistent_ckpt"))
    return run_distributed(async_equals_sync_and_a_dead_worker_raises, 2, directory, STALL_S, timeout=900)


def test_async_save_through_the_persistent_worker_equals_a_sync_save(ranks):
    for rank, out in enumerate(ranks):
        assert out["diffs"] == [False, False, False], (rank, out)
        assert out["async_a"] == out["original_a"], "the worker wrote the values at scheduling time"
        assert out["worker_exitcode"] == 0, "close() ends the worker"


def test_a_worker_that_cannot_start_raises_in_the_trainer(ranks):
    for rank, out in enumerate(ranks):
        assert out["died"] is not None, f"rank {rank}: the worker could not start and nothing was raised"
        assert f"rank {rank}: megatron's persistent checkpoint worker" in out["died"]
        assert "exited with code 1 before it had staged the checkpoint request" in out["died"]
