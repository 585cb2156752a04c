"""Runs for test_megatron_fsdp_hsdp_experts.py in spawned gloo processes (must be importable).

Megatron-FSDP's hybrid sharding (``num_distributed_optimizer_instances``) with expert parallelism: the
tiny MoE GPT of tests/fsdp trained under each case's wrapper on one parallel layout, recording each
step's loss and the grad norm megatron's optimizer computed (``optimizer.step()``'s second value)."""

from __future__ import annotations

import torch

STEPS = 3
MOE = dict(num_moe_experts=4, attention_dropout=0.1, hidden_dropout=0.1)


def _record_grad_norms(norms: list[float]):
    """``on_optimizer`` for ``train_steps``: every ``optimizer.step()``'s grad norm appended to ``norms``."""

    def install(model, optimizer):
        step = optimizer.step

        def recorded(*args, **kwargs):
            result = step(*args, **kwargs)
            norms.append(float(result[1]))
            return result

        optimizer.step = recorded

    return install


def train(layout: dict, cases: list[dict], model: dict | None = None, without: tuple[str, ...] = ()) -> dict:
    """``layout``: ``ep``, ``instances`` (``num_distributed_optimizer_instances`` of the parallel state);
    ``cases``: dicts of ``name``, ``data_parallel`` ('ddp' / 'megatron_fsdp'), ``ddp_options`` (their
    ``num_distributed_optimizer_instances`` defaults to the layout's) and ``use_distributed_optimizer``;
    ``without``: features removed first. Returns ``{name: {"losses": [...], "grad_norms": [...]}}``, the
    losses averaged over the data-parallel ranks."""
    from megatron.core import tensor_parallel

    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
    from mindspeed_like.testing.training import train_steps

    mindspeed_like.configure(device="cpu")
    for name in without:
        runtime.ENGINE.remove(name)
    instances = layout.get("instances", 1)
    init_parallel(ep=layout.get("ep", 1), seed=1234, num_distributed_optimizer_instances=instances)
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for case in cases:
            torch.manual_seed(1234)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            gpt = tiny_gpt(transformer_impl="transformer_engine", **{**MOE, **(model or {})})
            options = {"num_distributed_optimizer_instances": instances, **(case.get("ddp_options") or {})}
            norms: list[float] = []
            losses = train_steps(
                gpt,
                STEPS,
                lr=1e-2,
                data_parallel=case["data_parallel"],
                ddp_options=options,
                use_distributed_optimizer=case.get("use_distributed_optimizer", False),
                finalize_grads=True,
                on_optimizer=_record_grad_norms(norms),
            )
            out[case["name"]] = {"losses": losses, "grad_norms": norms}
    finally:
        destroy_parallel()
    return out
