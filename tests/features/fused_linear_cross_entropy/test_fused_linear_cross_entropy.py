"""fused-linear-cross-entropy on megatron-core's GPTModel: 10 steps with vs without the flag,
tied and untied output weights, TP=2+SP, bf16; the memory it saves; what it hands back.

Tolerances: fp32 losses within 1e-5 relative per step (the same arithmetic per token; only the
weight gradient's sum over tokens is split into chunks); bf16 within 1e-2 relative (the weight
gradient is summed in fp32 over chunks where megatron sums one bf16 matmul, and 10 Adam steps
amplify the rounding difference).
"""

from __future__ import annotations

import logging

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import (
    SavedBytesMeter,
    destroy_parallel,
    init_parallel,
    run_distributed,
    tiny_gpt,
    train_steps,
)
from mindspeed_like.testing.parity import SEED, assert_losses_close

STEPS = 10
CHUNK = 7  # tokens per chunk: 64 tokens per micro-batch are not a multiple of it


def _losses(cpu_config, fused: bool, steps: int = STEPS, **model) -> list[float]:
    cpu_config(use_fused_linear_cross_entropy=fused, linear_cross_entropy_chunk_tokens=CHUNK)
    init_parallel(seed=SEED)
    return train_steps(tiny_gpt(**model), steps, seed=SEED)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gpt_parity_fp32(cpu_config, tied):
    base = _losses(cpu_config, False, share_embeddings_and_output_weights=tied)
    ours = _losses(cpu_config, True, share_embeddings_and_output_weights=tied)
    assert_losses_close(ours, base, 1e-5, f"fused-linear-cross-entropy fp32 GPT ({'tied' if tied else 'untied'})")


def test_gpt_parity_bf16(cpu_config):
    base = _losses(cpu_config, False, bf16=True)
    ours = _losses(cpu_config, True, bf16=True)
    assert_losses_close(ours, base, 1e-2, "fused-linear-cross-entropy bf16 GPT")


def test_the_kernel_runs_and_logits_calls_are_untouched(cpu_config, monkeypatch):
    import mindspeed_like.features.fused_linear_cross_entropy.postprocess as post

    calls = []
    original = post.linear_cross_entropy
    monkeypatch.setattr(post, "linear_cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k))
    cpu_config(use_fused_linear_cross_entropy=True)
    init_parallel(seed=SEED)
    model = tiny_gpt(wrap_float16=False)
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).unsqueeze(0).expand(2, 32)
    loss = model(tokens, positions, None, labels=tokens)
    assert calls == [1] and loss.shape == (2, 32)
    logits = model(tokens, positions, None)  # no labels: megatron's own logits
    assert calls == [1] and logits.shape == (2, 32, 256)


def test_saved_for_backward_drops_by_the_softmax_and_no_logits_sized_tensor(cpu_config):
    """Saved-for-backward bytes of a forward: megatron's fp32 softmax [tokens, vocab] less with the
    feature (less the per-token difference: megatron also keeps an int64 target and a bool mask,
    9 bytes a token; the kernel an int32 target and the fp32 max and sum(exp), 12 bytes a token);
    and no tensor with tokens x vocab elements is ever allocated (profiler memory events: no op
    allocates tokens x vocab x 2 bytes or more itself)."""
    vocab, seq, mbs = 4096, 128, 2
    tokens = seq * mbs
    meters = {}
    largest = {}
    for fused in (False, True):
        cpu_config(use_fused_linear_cross_entropy=fused, linear_cross_entropy_chunk_tokens=16)
        init_parallel(seed=SEED)
        model = tiny_gpt(wrap_float16=False, vocab_size=vocab, seq_length=seq)
        ids = torch.randint(0, vocab, (mbs, seq))
        positions = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
        with torch.profiler.profile(profile_memory=True) as prof, SavedBytesMeter() as meter:
            loss = model(ids, positions, None, labels=ids).float().mean()
            loss.backward()
        meters[fused] = meter.bytes
        # each op's own allocations (children excluded): the logits are one op's output
        largest[fused] = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
        destroy_parallel()
    softmax = tokens * vocab * 4
    assert meters[False] - meters[True] >= softmax - (12 - 9) * tokens, meters
    assert largest[True] < tokens * vocab * 2, (largest, tokens * vocab * 2)  # not even bf16 logits
    assert largest[False] >= tokens * vocab * 4  # megatron's path does allocate them


def test_unsupported_call_is_handed_back_with_a_reason(cpu_config, caplog):
    """Gathered logits asked for with labels: megatron's own path, said once."""
    cpu_config(use_fused_linear_cross_entropy=True)
    init_parallel(seed=SEED)
    model = tiny_gpt(wrap_float16=False)
    ids = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).unsqueeze(0).expand(2, 32)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        ours = model(ids, positions, None, labels=ids, runtime_gather_output=True)
    mindspeed_like.configure(use_fused_linear_cross_entropy=False)
    base = model(ids, positions, None, labels=ids, runtime_gather_output=True)
    assert torch.equal(ours, base)
    assert "fused-linear-cross-entropy: using megatron's output layer and loss (gathered logits requested" in (
        caplog.text
    )


def _needs_mup() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "use_mup" not in TransformerConfig.__dataclass_fields__:
        pytest.skip("this megatron-core has no MuP (use_mup is 0.17+)")


@pytest.mark.parametrize("mult", [None, 0.37], ids=["auto-mult", "mult-0.37"])
def test_gpt_parity_fp32_with_mup_logit_scaling(cpu_config, mult):
    """MuP multiplies the logits by mup_output_mult before the loss (auto: 1 / width multiplier, here
    0.5); the fused path scales the hidden states fed to the same matmul. Without that scaling the
    losses differ from the first step (checked: the scale is not 1 in either case)."""
    _needs_mup()
    model = dict(use_mup=True, mup_base_hidden_size=32)  # hidden 64: width multiplier 2
    if mult is not None:
        model["mup_output_mult"] = mult
    base = _losses(cpu_config, False, **model)
    ours = _losses(cpu_config, True, **model)
    assert_losses_close(ours, base, 1e-5, f"fused-linear-cross-entropy fp32 GPT with MuP ({mult or 'auto'})")


def test_mup_logit_scale_reads_megatrons_multiplier():
    from types import SimpleNamespace

    from mindspeed_like.features.fused_linear_cross_entropy.postprocess import mup_logit_scale

    assert mup_logit_scale(SimpleNamespace(use_mup=True, mup_output_mult=0.25)) == 0.25
    assert mup_logit_scale(SimpleNamespace(use_mup=False, mup_output_mult=0.25)) == 1.0
    assert mup_logit_scale(SimpleNamespace()) == 1.0  # before 0.17: no MuP fields at all


def test_negative_chunk_is_a_config_error():
    from mindspeed_like.toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="--linear-cross-entropy-chunk-tokens must be >= 0"):
        mindspeed_like.configure(use_fused_linear_cross_entropy=True, linear_cross_entropy_chunk_tokens=-4)
    mindspeed_like.reset()


def tp2_worker(sequence_parallel: bool, tied: bool, seed: int = SEED) -> dict:
    out = {}
    for fused in (False, True):
        mindspeed_like.reset()
        mindspeed_like.configure(
            device="cpu", use_fused_linear_cross_entropy=fused, linear_cross_entropy_chunk_tokens=CHUNK
        )
        init_parallel(tp=2, seed=seed)
        model = tiny_gpt(sequence_parallel=sequence_parallel, share_embeddings_and_output_weights=tied)
        out[fused] = train_steps(model, STEPS, seed=seed)
        destroy_parallel()
    mindspeed_like.reset()
    return out


@pytest.mark.parametrize(
    "sequence_parallel, tied",
    [
        (True, False),
        pytest.param(True, True, marks=pytest.mark.slow),
        pytest.param(False, False, marks=pytest.mark.slow),
    ],
    ids=["sp-untied", "sp-tied", "no-sp"],
)
def test_tp2_parity(sequence_parallel, tied):
    for rank in run_distributed(tp2_worker, 2, sequence_parallel, tied, timeout=300):
        assert_losses_close(rank[True], rank[False], 1e-5, "fused-linear-cross-entropy TP=2")
