"""The te-backend's grouped linears through megatron's distributed checkpoint and back into a model.

Their sharded state dict writes one ``_extra_state`` per expert (``_extra_state``, ``_extra_state1``,
..., megatron's TEGroupedLinear layout); the loaded dict then holds all of them, and the module, which
has one ``_extra_state``, must take them on a strict ``load_state_dict`` as megatron's does (its
load pre-hook merges them). Found by megatron's own
dist_checkpointing/models/test_moe_experts.py::TestExpertLayerReconfiguration (te_grouped): "Unexpected
key(s) in state_dict for TEGroupedMLP: linear_fc1._extra_state1, ..."."""

from __future__ import annotations

import torch

from mindspeed_like.testing import init_parallel, tiny_gpt

MODEL = dict(transformer_impl="transformer_engine", num_moe_experts=4, moe_grouped_gemm=True)


def test_grouped_experts_load_their_own_distributed_checkpoint_strictly(cpu_config, tmp_path):
    from megatron.core import dist_checkpointing

    cpu_config()
    init_parallel(seed=1)
    model = tiny_gpt(**MODEL)
    sharded = model.sharded_state_dict()
    assert any(key.endswith("linear_fc1._extra_state1") for key in sharded), "not the per-expert layout"
    dist_checkpointing.save(sharded, str(tmp_path))

    init_parallel(seed=2)
    fresh = tiny_gpt(**MODEL)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path))
    assert any(key.endswith("linear_fc1._extra_state1") for key in loaded)
    # strict, as megatron's dist_checkpointing tests load: megatron's TEDotProductAttention leaves its
    # _extra_state out of the sharded state dict, and TE's DotProductAttention's load post-hook drops it from
    # the missing keys (ours too: "Missing key(s) ... core_attention._extra_state" before, found by megatron's
    # dist_checkpointing/models/test_gpt_model.py::TestGPTModelReconfiguration at 4 ranks)
    result = fresh.load_state_dict(loaded)
    assert not result.unexpected_keys and not result.missing_keys, result
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        if isinstance(want, torch.Tensor) and want.is_floating_point():
            assert torch.equal(want, got), name


def test_a_non_empty_expert_extra_state_reaches_set_extra_state(cpu_config):
    """TE fp8 scaling state under ``_extra_state3`` only is handed on (and dropped, said once), not lost
    silently as an unexpected key."""
    cpu_config()
    init_parallel(seed=1)
    model = tiny_gpt(**MODEL)
    fc1 = next(m for name, m in model.named_modules() if name.endswith("experts.linear_fc1"))
    seen = []
    fc1.set_extra_state = seen.append
    state = {f"{k}": v for k, v in fc1.state_dict().items()}
    state["_extra_state3"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    fc1.load_state_dict(state, strict=True)
    assert len(seen) == 1 and torch.equal(seen[0], torch.tensor([1, 2, 3], dtype=torch.uint8))
