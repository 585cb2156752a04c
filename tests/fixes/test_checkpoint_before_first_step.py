"""fix-checkpoint-before-first-step (issue 49 item 5): a checkpoint saved before the optimizer's first
step loads.

fp16 with megatron's default ``--initial-loss-scale`` (2**32) skips the first steps, so an early
``--save`` held no Adam moments and the load, which initialises them first and asks the checkpoint
for them, stopped with ``KeyError: "optimizer.state.exp_avg... from model not in state dict"``
(Float16 optimizer) or ``"...bucket_idx_0.exp_avg from model not in state dict"``
(DistributedOptimizer). Here megatron-core's own save and load (``dist_checkpointing``, as
Megatron-LM's ``--ckpt-format torch_dist`` calls them) of a model whose optimizer has not stepped,
into a freshly built one; the run through Megatron-LM's pretrain_gpt.py is
tests/reliability/test_megatron_lm_host_flags.py (opt-in).
"""

from __future__ import annotations

import pytest
from optimizer_checkpoints import OLD_DISTOPT_NEEDS_NUMPY_1, build_gpt_and_optimizer, checkpoint_state, inner_states


@pytest.mark.parametrize(
    ("fp16", "distributed_optimizer"),
    [
        pytest.param(True, False, id="float16-optimizer"),
        pytest.param(False, False, id="fp32-optimizer"),
        pytest.param(True, True, id="distributed-optimizer", marks=OLD_DISTOPT_NEEDS_NUMPY_1),
    ],
)
def test_a_checkpoint_saved_before_the_first_step_loads(adaptor, tmp_path, fp16, distributed_optimizer):
    from megatron.core import dist_checkpointing

    from mindspeed_like.testing import init_parallel

    init_parallel()
    model, optimizer = build_gpt_and_optimizer(fp16, distributed_optimizer)
    assert all(len(s) == 0 for s in inner_states(optimizer)), "the optimizer has stepped: not the case under test"
    dist_checkpointing.save(checkpoint_state(model, optimizer, loading=False), str(tmp_path))
    # the saving run's optimizer is left as it was: its first step initialises its state as before
    assert all(len(s) == 0 for s in inner_states(optimizer))

    fresh_model, fresh = build_gpt_and_optimizer(fp16, distributed_optimizer)
    loaded = dist_checkpointing.load(checkpoint_state(fresh_model, fresh, loading=True), str(tmp_path))
    fresh_model.module.load_state_dict(loaded["model"])
    fresh.load_state_dict(loaded["optimizer"])
    # the loaded state is the one torch's Adam makes at the first step: zero moments, step 0
    states = inner_states(fresh)
    assert states and all(set(s) >= {"exp_avg", "exp_avg_sq", "step"} for s in states), [sorted(s) for s in states]
    for s in states:
        assert not s["exp_avg"].any() and not s["exp_avg_sq"].any() and float(s["step"]) == 0.0
