"""The cpu-adapter feature: megatron-core's GPTModel runs and trains on this CPU-only host.

Single-process checks (a 1-rank gloo group). Multi-process ones are in
test_cpu_adapter_distributed.py.
"""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
import wrapt

from mindspeed_like.testing import init_parallel, make_batches, tiny_gpt, train_steps

pytestmark = pytest.mark.usefixtures("adapter")  # tests/conftest.py


def fixed_data(vocab=256, batch=2, seq=32, seed=7):
    return make_batches(1, batch, seq, vocab, seed)[0]


def forward_backward(model, seed=3):
    tokens = fixed_data(seed=seed)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    loss = model(inputs, position_ids, None, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_gpt_forward_backward_fp32_and_bf16():
    model = tiny_gpt()
    loss, grads = forward_backward(model)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.5
    assert len(grads) == len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads.values())

    init_parallel()
    model16 = tiny_gpt(bf16=True)  # wrapped in megatron's Float16Module
    assert type(model16).__name__ == "Float16Module"
    loss16, grads16 = forward_backward(model16)
    assert math.isfinite(loss16.item())
    assert all(g.dtype == torch.bfloat16 for g in grads16.values())


@pytest.mark.parametrize(
    "bf16, distributed",
    [(False, False), (True, False), (True, True)],
    ids=["fp32-FP32Optimizer", "bf16-Float16Optimizer", "bf16-DistributedOptimizer"],
)
def test_training_steps_decrease_loss(bf16, distributed):
    model = tiny_gpt(bf16=bf16)
    losses = train_steps(model, 5, data=fixed_data(), lr=1e-2, use_distributed_optimizer=distributed)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, losses


def test_optimizer_classes_are_megatrons():
    """The optimizers built on CPU are megatron's own classes (not a stand-in)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    names = []
    for bf16, dist_opt in [(False, False), (True, False), (True, True)]:
        init_parallel()
        model = tiny_gpt(bf16=bf16)
        ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt), model
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, use_distributed_optimizer=dist_opt), [ddp]
        )
        names.append(type(getattr(opt, "chained_optimizers", [opt])[0]).__name__)
    assert names == ["FP32Optimizer", "Float16OptimizerWithFloat16Params", "DistributedOptimizer"]


RECOMPUTE = {
    "selective-core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


def test_recompute_matches_no_recompute_bitwise():
    """fp32, dropout 0: recompute re-runs the same ops on the same inputs, so losses and
    gradients are bitwise equal to the run that keeps activations."""
    init_parallel(seed=11)
    reference, ref_grads = forward_backward(tiny_gpt())
    for name, knobs in RECOMPUTE.items():
        init_parallel(seed=11)
        loss, grads = forward_backward(tiny_gpt(**knobs))
        assert torch.equal(loss, reference), name
        assert grads.keys() == ref_grads.keys()
        for key in grads:
            assert torch.equal(grads[key], ref_grads[key]), (name, key)


def test_layernorm_recompute_matches_within_rounding():
    """Selective ``layernorm`` recompute (megatron's CheckpointWithoutOutput) gives the same
    loss bitwise, but its gradients differ in the last bits (measured max 1.5e-8): the norm
    output is discarded and re-attached, which changes the order in which autograd sums the
    gradient contributions of the residual branch. Tolerance: 1e-6 absolute (100x that)."""
    init_parallel(seed=11)
    reference, ref_grads = forward_backward(tiny_gpt())
    init_parallel(seed=11)
    loss, grads = forward_backward(tiny_gpt(recompute_granularity="selective", recompute_modules=["layernorm"]))
    assert torch.equal(loss, reference)
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=0, atol=1e-6)


def test_recompute_with_dropout_replays_rng():
    """With dropout, full recompute must replay the same RNG states (megatron's tracker on
    the CPU generator): gradients equal the no-recompute run bitwise."""
    drop = dict(hidden_dropout=0.1, attention_dropout=0.1)
    init_parallel(seed=5)
    ref_loss, ref_grads = forward_backward(tiny_gpt(**drop))
    init_parallel(seed=5)
    loss, grads = forward_backward(
        tiny_gpt(**drop, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    )
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_trains(dispatcher):
    model = tiny_gpt(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    losses = train_steps(model, 4, data=fixed_data(), lr=1e-2)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses


def test_moe_recompute_trains():
    """Selective ``moe`` recompute. (``moe_act`` needs moe_grouped_gemm, i.e. GroupedMLP and the
    grouped_gemm CUDA package: megatron rejects it for SequentialMLP.)"""
    model = tiny_gpt(num_moe_experts=4, recompute_granularity="selective", recompute_modules=["moe"])
    losses = train_steps(model, 2, data=fixed_data(), lr=1e-2)
    assert all(math.isfinite(x) for x in losses)


def test_no_rng_warning_spam(caplog):
    """Dropout inside megatron's RNG fork used to log 'CPU RNG state changed within GPU RNG
    context' on every call; on CPU the two generators are one, so the check is void."""
    with caplog.at_level(logging.WARNING):
        model = tiny_gpt(hidden_dropout=0.1, attention_dropout=0.1)
        forward_backward(model)
    assert "CPU RNG state changed" not in caplog.text


def test_rng_tracker_fork_isolates_state():
    """fork() swaps the tracker's state in and out of the CPU generator (megatron semantics)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.manual_seed(0)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the tracked state advanced


class _Cached:
    calls = 0

    @functools.lru_cache(maxsize=4)  # noqa: B019 - the shape under test
    def where(self, n):  # megatron-core 0.13-0.15 RotaryEmbedding.forward has this shape
        type(self).calls += 1
        return torch.zeros(n, device=torch.cuda.current_device()).device.type


def test_host_twin_of_lru_cached_method_keeps_the_cache():
    """The host twin of an ``lru_cache``d method runs on the host and still caches (same
    maxsize/typed), as megatron's RotaryEmbedding.forward relies on in 0.13-0.15."""
    from mindspeed_like.adapters.cpu.host_view import run_on_host

    wrapped = wrapt.FunctionWrapper(_Cached.__dict__["where"], run_on_host)
    obj = _Cached()
    bound = wrapped.__get__(obj, _Cached)
    assert bound(3) == "cpu" and bound(3) == "cpu" and bound(5) == "cpu"
    assert _Cached.calls == 2  # (obj, 3) cached
