"""moe-zero-memory outside the all-to-all pipeline (EP = 1 here): the experts module's whole call is
recomputed in backward, on the real megatron-core experts (SequentialMLP, GroupedMLP on the
grouped-gemm feature's kernel where megatron has it, TEGroupedMLP on the te-backend).

Every comparison with megatron's path is bitwise (``torch.equal``): the recompute runs the same
rows through the same ops. Saved-for-backward bytes: SavedBytesMeter, parameters excluded; the
experts then keep exactly their input rows and probs.
(The pipeline's per-chunk recompute at EP > 1: tests/features/moe_alltoall_overlap/.)
"""

from __future__ import annotations

import logging

import pytest
import torch

import mindspeed_like
from mindspeed_like.features.moe_zero_memory import experts as zm
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import SavedBytesMeter, init_parallel, tiny_gpt, train_steps

HAS_GROUPED_MLP = megatron_core_version() is not None and megatron_core_version().release < (0, 17)
SEQ, BATCH, HIDDEN, EXPERTS, TOPK = 32, 2, 64, 4, 2

SPECS = {
    "sequential": dict(moe_grouped_gemm=False),
    "te-grouped": dict(moe_grouped_gemm=True, transformer_impl="transformer_engine"),
}
if HAS_GROUPED_MLP:
    SPECS["grouped"] = dict(moe_grouped_gemm=True)


def _configure(on: bool, **flags) -> None:
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", moe_zero_memory="level0" if on else "disable", **flags)


class _ExpertsMeter:
    """Bytes saved for backward while an experts module's forward runs (outermost call only)."""

    def __init__(self) -> None:
        self.meters: list[SavedBytesMeter] = []

    def attach(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            experts, original = layer.experts, layer.experts.forward

            def forward(*args, _original=original, **kwargs):
                meter = SavedBytesMeter()
                self.meters.append(meter)
                with meter:
                    return _original(*args, **kwargs)

            experts.forward = forward


def _gpt_pass(on: bool, spec: str, flags: dict | None = None, **extra):
    """One fwd+bwd of a MoE GPT (no DDP): loss, every gradient, bytes held for backward (whole
    model and the experts' calls), and the rows each experts call received."""
    _configure(on, **(flags or {}))
    init_parallel(seed=1234)
    model = tiny_gpt(
        num_layers=2, hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, **SPECS[spec], **extra
    )
    experts_meter = _ExpertsMeter()
    experts_meter.attach(model)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with SavedBytesMeter() as saved:
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
    experts_held = [m.current_bytes(exclude=model.parameters()) for m in experts_meter.meters]
    # saved-tensor hooks stack: the experts' meters took their calls' tensors from the outer one
    held = saved.current_bytes(exclude=model.parameters()) + sum(experts_held)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, held, experts_held


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), f"loss {a[0].item()} != {b[0].item()}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        ga, gb = a[1][name], b[1][name]
        assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb)), f"grad of {name} differs"


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_experts_recomputed_bitwise_and_keep_only_rows_and_probs(spec, monkeypatch):
    """Loss and every gradient bitwise megatron's; each experts call keeps exactly its rows
    (fp32, hidden wide) and its probs (fp32): SEQ * BATCH * TOPK rows of (HIDDEN + 1) * 4 bytes;
    the recompute runs once per MoE layer in backward."""
    runs: list[int] = []
    original = zm.RecomputedExperts.backward
    monkeypatch.setattr(
        zm.RecomputedExperts, "backward", staticmethod(lambda ctx, g: runs.append(1) or original(ctx, g))
    )
    base = _gpt_pass(False, spec)
    ours = _gpt_pass(True, spec)
    _assert_same(base, ours)
    rows = SEQ * BATCH * TOPK
    assert ours[3] == [rows * (HIDDEN + 1) * 4] * 2
    assert all(b > o for b, o in zip(base[3], ours[3]))
    assert ours[2] < base[2]
    assert len(runs) == 2


def test_with_recompute_activation_and_the_level_2_set():
    """At --optimization-level 2 (recompute-activation-function on too, TE spec): bitwise, and the
    activation checkpoint steps aside inside the whole-experts recompute (the experts keep only
    their rows and probs, not fc1's output)."""
    base = _gpt_pass(False, "te-grouped")
    ours = _gpt_pass(True, "te-grouped", flags=dict(recompute_activation_function=True))
    _assert_same(base, ours)
    assert ours[3] == [SEQ * BATCH * TOPK * (HIDDEN + 1) * 4] * 2


@pytest.mark.parametrize("spec", ["sequential", "te-grouped"])
def test_training_bf16_ddp_bitwise(spec):
    """Three training steps in bf16 under megatron's DDP and optimizer (its gradient hooks fire on
    the node's parameter gradients): losses and trained weights bitwise megatron's."""
    runs = []
    for on in (False, True):
        _configure(on)
        init_parallel(seed=1234)
        model = tiny_gpt(
            num_layers=2, hidden_size=HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, bf16=True, **SPECS[spec]
        )
        losses = train_steps(model, 3, seed=1234)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses_off, weights_off), (losses_on, weights_on) = runs
    assert losses_off == losses_on
    assert all(torch.equal(a, b) for a, b in zip(weights_off, weights_on))


def test_expert_biases_fall_back_once(caplog):
    """Experts with biases keep megatron's path (an expert may return its bias to the caller) and
    the run says so once."""
    try:
        base = _gpt_pass(False, "sequential", add_bias_linear=True)
    except AssertionError as error:  # megatron-core 0.13: "Bias is not supported for MoE"
        pytest.skip(f"this megatron-core builds no MoE experts with biases: {error}")
    with caplog.at_level(logging.WARNING):
        ours = _gpt_pass(True, "sequential", add_bias_linear=True)
    _assert_same(base, ours)
    assert ours[3] == base[3]
    assert caplog.text.count("moe-zero-memory: keeping the experts' activations (expert biases") == 1


def test_acts_without_moe_alltoall_overlap():
    """The flag alone is a valid configuration now (it needed --moe-alltoall-overlap-comm before)."""
    _configure(True)
    assert "moe-zero-memory" in mindspeed_like.runtime.current_context().enabled_names
    assert "moe-alltoall-overlap" not in mindspeed_like.runtime.current_context().enabled_names
