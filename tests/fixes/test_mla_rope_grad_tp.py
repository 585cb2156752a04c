"""Local-spec multi-latent attention at TP=2 (with and without SP) has TP=1's gradients with our fix,
and megatron's own path does not (mindspeed_like/fixes/mla_rope_grad_tp.py).

The TP=1 and TP=2 models are the same function (tiny_gpt: CPU initialization scatters one master
weight), so after one forward/backward on one batch every parameter's gradient, gathered back to its
TP=1 shape, must equal TP=1's up to float32 summation order.
"""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.fixes import mla_rope_grad_tp as fix
from mindspeed_like.testing import destroy_parallel, init_parallel, run_distributed, tiny_gpt
from mindspeed_like.testing.parity import SEED
from mindspeed_like.testing.training import make_batches

FP32_RTOL = 1e-5  # same math in another summation order (TP=2 sums head groups then ranks)
MLA = dict(multi_latent_attention=True)


def _full(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A TP-sharded parameter's gradient in its TP=1 shape (megatron's ``partition_dim`` and
    ``partition_stride``: stride 2 is the gated fc1's [gate_r; up_r] rows per rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return grad
    group = parallel_state.get_tensor_model_parallel_group()
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    shards = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, grad.contiguous(), group=group)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def gradients_worker(tp: int, sequence_parallel: bool, fixed: bool = True) -> dict:
    """Every parameter's gradient (TP=1 shapes, as numpy arrays: tensors would travel back through
    shared memory the exiting child frees) after one forward/backward of a tiny local-spec MLA GPT;
    SP-marked gradients summed over TP as megatron's ``finalize_model_grads`` does."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    if not fixed:
        runtime.ENGINE.remove(fix.FEATURE.name)  # megatron's own path
    init_parallel(tp=tp, seed=SEED)
    try:
        model = tiny_gpt(**MLA, sequence_parallel=sequence_parallel)
        batch = make_batches(1, 2, model.max_sequence_length, model.vocab_size, SEED)[0]
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        model(tokens, position_ids, None, labels=labels).float().mean().backward()
        group = parallel_state.get_tensor_model_parallel_group()
        out = {}
        for name, param in model.named_parameters():
            grad = param.grad.detach().clone()
            if tp > 1 and getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            out[name] = _full(param, grad).numpy()
        return out
    finally:
        destroy_parallel()
        mindspeed_like.reset()


def _relative_errors(actual: dict, reference: dict) -> dict[str, float]:
    assert actual.keys() == reference.keys()
    return {name: float(abs(actual[name] - ref).max() / max(abs(ref).max(), 1e-30)) for name, ref in reference.items()}


@pytest.fixture(scope="module")
def tp1_gradients() -> dict:
    return run_distributed(gradients_worker, 1, 1, False, timeout=300)[0]


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["tp2sp", "tp2"])
def test_local_mla_tp2_gradients_equal_tp1(tp1_gradients, sequence_parallel):
    results = run_distributed(gradients_worker, 2, 2, sequence_parallel, timeout=300)
    for grads in results:
        errors = _relative_errors(grads, tp1_gradients)
        worst = max(errors, key=errors.get)
        assert errors[worst] < FP32_RTOL, f"{worst}: {errors[worst]:.2e} from TP=1"


@pytest.mark.slow
def test_megatron_local_mla_tp2sp_gradients_differ_without_the_fix(tp1_gradients):
    """The bug this fixes: megatron's path keeps one rank's part of k_pos_emb's gradient."""
    grads = run_distributed(gradients_worker, 2, 2, True, False, timeout=300)[0]
    errors = _relative_errors(grads, tp1_gradients)
    for layer in (0, 1):
        assert errors[f"decoder.layers.{layer}.self_attention.linear_kv_down_proj.weight"] > 1e-4
        assert errors[f"decoder.layers.{layer}.input_layernorm.weight"] > 1e-4


def rope_grad_worker(width: int) -> tuple:
    """Each rank's gradient through :func:`fix.sum_shared_rope_grad` of a rank-dependent upstream gradient."""
    import torch.distributed as dist

    rank = dist.get_rank()
    combined = torch.zeros(3, 2, 10, requires_grad=True)
    out = fix.sum_shared_rope_grad(combined, width, None)
    upstream = torch.arange(60, dtype=torch.float32).reshape(3, 2, 10) * (rank + 1)
    out.backward(upstream)
    return out.detach().numpy(), combined.grad.numpy()


@pytest.mark.slow
def test_rope_columns_gradient_summed_over_the_group_others_untouched():
    """The mechanism, in two processes: only the trailing ``width`` columns' gradient is all-reduced."""
    upstream = torch.arange(60, dtype=torch.float32).reshape(3, 2, 10)
    for rank, (out, grad) in enumerate(run_distributed(rope_grad_worker, 2, 4, timeout=300)):
        out, grad = torch.from_numpy(out), torch.from_numpy(grad)
        assert torch.equal(out, torch.zeros(3, 2, 10))  # forward: the identity
        assert torch.equal(grad[..., :6], upstream[..., :6] * (rank + 1))  # kv_compressed: as megatron's
        assert torch.equal(grad[..., 6:], upstream[..., 6:] * 3)  # k_pos_emb: rank 0's + rank 1's


def test_patches_installed_and_tp1_output_not_marked():
    """At TP=1 megatron gathers nothing (the linear's output is whole): nothing is marked or changed."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel(tp=1, seed=SEED)
    try:
        from megatron.core.transformer import multi_latent_attention as mla

        assert hasattr(mla.gather_from_tensor_model_parallel_region, "__wrapped__")
        model = tiny_gpt(**MLA)
        attention = model.decoder.layers[0].self_attention
        assert not fix.returns_sharded_columns(attention.linear_kv_down_proj, model.config)
        hidden = torch.randn(4, 1, model.config.hidden_size)
        output, _ = attention.linear_kv_down_proj(hidden)
        assert not hasattr(output, fix.ROPE_WIDTH)
    finally:
        destroy_parallel()
        mindspeed_like.reset()
