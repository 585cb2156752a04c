"""Functions run in spawned gloo processes by the distributed tests (must be importable)."""

from __future__ import annotations

import torch

STEPS = 5


def _setup():
    import mindspeed_like

    mindspeed_like.configure(device="cpu")


def parallel_suite(seed: int = 1234) -> dict:
    """One 2-process run covering TP=2, TP=2+SP, DP=2 (DistributedOptimizer), EP=2 MoE."""
    from megatron.core import parallel_state

    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    _setup()
    out: dict = {}

    init_parallel(tp=2, seed=seed)
    out["tp2"] = train_steps(tiny_gpt(), STEPS, seed=seed)
    destroy_parallel()

    init_parallel(tp=2, seed=seed)
    out["tp2_sp"] = train_steps(tiny_gpt(sequence_parallel=True), STEPS, seed=seed)
    destroy_parallel()

    init_parallel(tp=1, seed=seed)  # world 2 -> DP=2
    out["dp2_distopt"] = train_steps(tiny_gpt(), STEPS, seed=seed, use_distributed_optimizer=True)
    out["dp2_distopt_bf16_overlap"] = train_steps(
        tiny_gpt(bf16=True), STEPS, seed=seed, use_distributed_optimizer=True, overlap_grad_reduce=True
    )
    destroy_parallel()

    init_parallel(ep=2, seed=seed)
    model = tiny_gpt(num_moe_experts=4, moe_token_dispatcher_type="alltoall")
    experts = model.decoder.layers[0].mlp.experts
    out["ep2_local_experts"] = len(experts.local_experts)
    out["ep2_rank"] = parallel_state.get_expert_model_parallel_rank()
    out["ep2_alltoall"] = train_steps(model, STEPS, seed=seed)
    init_parallel(ep=2, seed=seed)
    out["ep2_allgather"] = train_steps(
        tiny_gpt(num_moe_experts=4, moe_token_dispatcher_type="allgather"), STEPS, seed=seed
    )
    destroy_parallel()

    init_parallel(tp=2, seed=seed)
    out["tp2_sp_moe"] = train_steps(
        tiny_gpt(sequence_parallel=True, num_moe_experts=4, moe_token_dispatcher_type="alltoall"), STEPS, seed=seed
    )
    destroy_parallel()
    return out


def echo_rank(value):
    return (torch.distributed.get_rank(), torch.distributed.get_world_size(), value)


def fail_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise ValueError("rank one fails on purpose")
    return "ok"


def sleep_forever():
    import time

    while True:
        time.sleep(1)
