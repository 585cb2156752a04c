"""fused-linear-cross-entropy on a GPT with a multi-token prediction head (``mtp_num_layers=1``): the
main loss, the MTP head's loss (megatron's tracker) and every gradient equal megatron's within 1e-5
(fp32), and the ``[tokens, vocab]`` logits/softmax of the head are no longer held for backward.

Tolerance 1e-5 relative: the same per-token arithmetic; the weight gradient's sum over tokens is
split into chunks (fp32 summation order). Every run is ``strict``: a hand-back to megatron raises.
"""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import SavedBytesMeter, destroy_parallel, gpt_config, init_parallel
from mindspeed_like.testing.models import MODEL_DEFAULTS
from mindspeed_like.testing.parity import SEED

FP32_RTOL = 1e-5
CHUNK = 7  # tokens per chunk: not a divisor of the 64 tokens of a micro-batch


def mtp_gpt(vocab_size: int = 256, seq_length: int = 32, tied: bool = False, **config_overrides):
    """A tiny local-spec GPTModel with one MTP head: megatron's MTP block spec on the decoder layer's
    spec, as Megatron-LM's pretrain_gpt.py builds it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = gpt_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.3, **config_overrides)
    spec = get_gpt_layer_local_spec()
    model_args = {
        **MODEL_DEFAULTS,
        "vocab_size": vocab_size,
        "max_sequence_length": seq_length,
        "share_embeddings_and_output_weights": tied,
    }
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, mtp_block_spec=mtp, **model_args)


def _tracked_mtp_losses() -> torch.Tensor:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    return tracker.get("loss_values", tracker.get("values")).detach().clone()  # 0.19: loss_values


def run(fused: bool, tied: bool = False, **config_overrides) -> dict:
    """Main per-token loss, the MTP head's tracked loss and all gradients after one forward/backward."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    mindspeed_like.reset()
    try:
        mindspeed_like.configure(
            device="cpu", strict=True, use_fused_linear_cross_entropy=fused, linear_cross_entropy_chunk_tokens=CHUNK
        )
        init_parallel(seed=SEED)
        model = mtp_gpt(tied=tied, **config_overrides)
        model.train()
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, 256, (2, 33), generator=gen)
        tokens, labels = ids[:, :-1], ids[:, 1:]
        positions = torch.arange(32).unsqueeze(0).expand(2, 32)
        MTPLossLoggingHelper.tracker.clear()
        loss = model(tokens, positions, None, labels=labels)
        loss.float().mean().backward()  # the MTP head's loss joins the gradient through MTPLossAutoScaler
        return {
            "loss": loss.detach().clone(),
            "mtp": _tracked_mtp_losses(),
            # 0.19: the head's top-1 hits, counted from its logits (ours: on token chunks of them)
            "hits": [MTPLossLoggingHelper.tracker.get(k) for k in ("correct_values", "total_values")],
            "grads": {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
            "params": sum(1 for _ in model.parameters()),
        }
    finally:
        destroy_parallel()
        mindspeed_like.reset()


def _relative(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


MUP = dict(use_mup=True, mup_base_hidden_size=32, mup_output_mult=0.37)  # 0.17+: logits x 0.37, head and main


@pytest.mark.parametrize(
    "tied,mup", [(False, False), (True, False), (False, True)], ids=["untied", "tied", "untied-mup"]
)
def test_mtp_losses_and_gradients_equal_megatron_fp32(tied, mup):
    """With MuP, megatron scales each head's logits between its output layer and its loss
    (``process_mtp_loss(scale_logits_fn=...)``, 0.19): the deferred logits carry the factor."""
    overrides = {}
    if mup:
        from megatron.core.transformer.transformer_config import TransformerConfig

        if "use_mup" not in TransformerConfig.__dataclass_fields__:
            pytest.skip("this megatron-core has no MuP (use_mup is 0.17+)")
        overrides = MUP
    base, ours = run(False, tied, **overrides), run(True, tied, **overrides)
    assert base["mtp"].shape == (1,) and base["mtp"][0] > 0  # megatron computed the head's loss
    assert _relative(ours["loss"], base["loss"]) < FP32_RTOL
    assert _relative(ours["mtp"], base["mtp"]) < FP32_RTOL, (ours["mtp"], base["mtp"])
    for ours_hits, base_hits in zip(ours["hits"], base["hits"]):
        assert (ours_hits is None) == (base_hits is None)
        if base_hits is not None:
            assert torch.equal(ours_hits, base_hits), (ours["hits"], base["hits"])
    assert ours["grads"].keys() == base["grads"].keys()
    assert len(base["grads"]) == base["params"]  # every parameter, the MTP block's included, got a gradient
    for name, grad in base["grads"].items():
        error = _relative(ours["grads"][name], grad)
        assert error < FP32_RTOL, f"{name}: {error:.2e}"


def test_the_kernel_computes_the_head_and_the_main_loss(monkeypatch):
    """Two kernel calls per forward (head and main), no logits-sized output-layer call."""
    import mindspeed_like.features.fused_linear_cross_entropy.postprocess as post

    calls = []
    original = post.linear_cross_entropy
    monkeypatch.setattr(post, "linear_cross_entropy", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    run(True)
    assert calls == [(32, 2, 64), (32, 2, 64)], calls


def test_saved_for_backward_drops_by_both_softmaxes():
    """With MTP megatron keeps two fp32 ``[tokens, vocab]`` softmaxes (main and head) for backward;
    the feature keeps neither, and no op allocates a ``[tokens, vocab]`` tensor."""
    vocab, seq, mbs = 4096, 128, 2
    tokens = seq * mbs
    saved, largest = {}, {}
    for fused in (False, True):
        mindspeed_like.reset()
        mindspeed_like.configure(
            device="cpu", strict=True, use_fused_linear_cross_entropy=fused, linear_cross_entropy_chunk_tokens=16
        )
        init_parallel(seed=SEED)
        try:
            model = mtp_gpt(vocab_size=vocab, seq_length=seq)
            ids = torch.randint(0, vocab, (mbs, seq))
            positions = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
            with torch.profiler.profile(profile_memory=True) as prof, SavedBytesMeter() as meter:
                model(ids, positions, None, labels=ids).float().mean().backward()
            saved[fused] = meter.bytes
            largest[fused] = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
        finally:
            destroy_parallel()
            mindspeed_like.reset()
    softmax = tokens * vocab * 4
    # measured 0.16.1: 16.04 MiB -> 8.04 MiB, 2 x 4 MiB: the head's as well as the main one (the main
    # one alone, the feature before MTP heads were fused, is 1x)
    assert saved[False] - saved[True] > 1.5 * softmax, saved
    assert largest[True] < tokens * vocab * 2, largest
    assert largest[False] >= tokens * vocab * 4
