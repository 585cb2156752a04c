"""Plain megatron-core driven the way users' scripts drive it, on this CPU-only host.

The model, the schedules, DDP, the optimizer and checkpointing are megatron's own, used through
its public entry points (see ``user_script_workers``); ours is only ``mindspeed_like.configure``.
Each check compares with megatron's own behaviour: the explicit causal mask against the one
megatron builds, PP=2 against PP=1 from the same weights, a resumed run against a straight one.
"""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_like.adapters.cpu.host_view import host_function
from mindspeed_like.testing import init_parallel, run_distributed


def test_twin_reads_tensor_cuda_method_as_cpu():
    def move(t):
        return t.cuda(), torch.cuda.current_device()

    moved, device = host_function(move)(torch.ones(2))
    assert moved.device.type == "cpu" and device == torch.device("cpu")
    with pytest.raises((AssertionError, RuntimeError)):
        move(torch.ones(2))  # the original still means CUDA


@pytest.mark.slow
def test_default_config_builds_weights_and_causal_mask_on_host(adapter):
    """TransformerConfig defaults (no use_cpu_initialization, default dropout), attention_mask=None
    (megatron builds the causal mask) equals an explicit causal mask, through megatron's
    no-pipelining schedule, DDP and optimizer; then bf16 under Float16Module."""
    from user_script_workers import SEQ, build, train

    model, optimizer = build(dropout=0.0, masked_softmax_fusion=True)
    assert all(p.device.type == "cpu" for p in model.parameters())
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        built = model(tokens, position_ids, None, labels=tokens)
        explicit = model(tokens, position_ids, causal, labels=tokens)
    assert torch.equal(built, explicit)

    fp32 = train(model, optimizer, 0, 3)
    assert all(math.isfinite(x) for x in fp32) and fp32[-1] < fp32[0]

    init_parallel()
    model16, optimizer16 = build(bf16=True, dropout=0.0)
    assert type(model16.module).__name__ == "Float16Module"
    bf16 = train(model16, optimizer16, 0, 3)
    assert all(math.isclose(a, b, rel_tol=2e-2) for a, b in zip(bf16, fp32, strict=True)), (bf16, fp32)

    init_parallel()
    with_dropout = train(*build(), 0, 2)  # megatron's default dropout 0.1 draws from the host RNG tracker
    assert all(math.isfinite(x) for x in with_dropout)


@pytest.mark.slow
def test_megatron_fusion_flags_bf16(adapter):
    """bias_activation_fusion and bias_dropout_fusion (megatron's jit_fuser = torch.compile)."""
    from user_script_workers import build, train

    losses = train(*build(bf16=True, dropout=0.1, bias_activation_fusion=True, bias_dropout_fusion=True), 0, 2)
    assert all(math.isfinite(x) for x in losses)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from user_script_workers import pipeline_suite

    return run_distributed(pipeline_suite, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.mark.slow
def test_pp2_schedule_equals_pp1(pipeline):
    """forward_backward_pipelining_without_interleaving (p2p over gloo) from the PP=1 weights
    (resharded over the stages by dist_checkpointing) equals PP=1 x DP=2 on the same global batch."""
    first, last = sorted(pipeline, key=lambda r: r["pp_rank"])
    assert first["pp2"] == [None] * len(first["pp2"])  # losses live on the last stage
    assert all(math.isclose(a, b, rel_tol=2e-5) for a, b in zip(last["pp2"], last["pp1_dp2"], strict=True))
    assert last["pp2"][-1] < last["pp2"][0]


@pytest.mark.slow
def test_checkpoint_round_trip_is_bitwise(pipeline):
    """Train N steps, dist_checkpointing.save (model + optimizer), load into a fresh model and
    optimizer, train M more: the same losses, bitwise (fp32), as training N+M straight."""
    last = max(pipeline, key=lambda r: r["pp_rank"])
    assert last["pp2_resumed"] == last["pp2_straight"]
    assert all(math.isfinite(x) for x in last["pp2_resumed"])
