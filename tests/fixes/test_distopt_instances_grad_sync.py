"""fix-distopt-instances-grad-sync: several distributed-optimizer instances reduce a later pipeline
stage's gradients once per step, as one instance does.

The worker drives megatron's DDP the way megatron's 1F1B schedule drives a stage after the first
under ``align_grad_reduce``: every backward inside ``no_sync``, then ``config.grad_sync_func``
(``model.start_grad_sync``), then ``finalize_model_grads`` (``finish_grad_sync``). DP 4 (two
instances of 2 ranks): with one instance per rank pair the reduction is not idempotent, so a second
one changes the gradients."""

from __future__ import annotations

import pytest
from packaging.version import Version

from mindspeed_like.fixes import distopt_instances_grad_sync as fix
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import run_distributed

STEPS = 3

pytestmark = pytest.mark.skipif(
    megatron_core_version() < Version("0.16"), reason="megatron-core < 0.16 has no first-batch start to repeat"
)


def later_stage_worker(instance_counts: list[int], without: tuple[str, ...]) -> list[list[tuple[float, float]]]:
    """For each count of distributed-optimizer instances: (loss, grad norm) of each step, DP 4."""

    import mindspeed_like
    from mindspeed_like import runtime

    mindspeed_like.configure(device="cpu")
    for name in without:
        runtime.ENGINE.remove(name)
    return [_train_later_stage(instances) for instances in instance_counts]


def _train_later_stage(instances: int) -> list[tuple[float, float]]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
    from mindspeed_like.workloads.training import make_batches

    init_parallel(seed=1234, num_distributed_optimizer_instances=instances)
    try:
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        gpt = tiny_gpt()
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
            num_distributed_optimizer_instances=instances,
        )
        model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0), [model]
        )
        dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        inner = gpt.module if hasattr(gpt, "module") else gpt
        data = make_batches(STEPS, 2 * dp_size, inner.max_sequence_length, inner.vocab_size, 1234)
        steps = []
        for step in range(STEPS):
            batch = data[step][2 * dp_rank : 2 * dp_rank + 2]
            tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            with model.no_sync():  # a later stage's last backward runs with grad sync disabled
                loss = model(tokens, positions, None, labels=labels).float().mean()
                loss.backward()
            model.start_grad_sync()  # the schedule's grad_sync_func (align_grad_reduce)
            model.finish_grad_sync()  # finalize_model_grads
            _, grad_norm, _ = optimizer.step()
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            steps.append((reported.item() / dist.get_world_size(), float(grad_norm)))
        return steps
    finally:
        destroy_parallel()


def _run(instance_counts: list[int], without: tuple[str, ...] = ()) -> list[list[tuple[float, float]]]:
    return run_distributed(later_stage_worker, 4, instance_counts, without, timeout=600)[0]


def test_two_instances_reduce_a_later_stage_once_as_one_instance_does():
    one, two = _run([1, 2])
    assert [norm for _, norm in two] == pytest.approx([norm for _, norm in one], rel=1e-5)
    assert [loss for loss, _ in two] == pytest.approx([loss for loss, _ in one], rel=1e-6)
    assert one[-1][0] != one[0][0]


@pytest.mark.slow
def test_without_the_fix_two_instances_reduce_twice():
    """The test above fails without the fix: megatron's own path, reduced twice, trains on other gradients."""
    one, two = _run([1, 2], without=(fix.NAME,))
    assert two[0][1] != pytest.approx(one[0][1], rel=1e-3)
