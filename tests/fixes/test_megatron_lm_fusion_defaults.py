"""Megatron-LM's default fusions that need TransformerEngine or apex: switched, logged, where those are
absent, on every device (the H100 run of issue 36 needed --no-rope-fusion
--no-gradient-accumulation-fusion --no-persist-layer-norm by hand); left alone where they are there."""

from __future__ import annotations

import types

import pytest

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.fixes import megatron_lm_fusion_defaults as fix
from mindspeed_like.integrations.megatron_lm import hooks_of


def _megatron_lm_defaults(**overrides) -> types.SimpleNamespace:
    """The arguments the hook reads, at Megatron-LM core_v0.16.1's defaults."""
    values = dict(
        transformer_impl="transformer_engine",
        position_embedding_type="rope",
        apply_rope_fusion=True,
        gradient_accumulation_fusion=True,
        no_persist_layer_norm=False,
        rank=1,  # no log line
    )
    return types.SimpleNamespace(**{**values, **overrides})


def test_the_fusions_without_their_kernels_are_switched_with_the_reason(monkeypatch):
    monkeypatch.setattr(fix.transformer_engine, "megatron_fused_rope", lambda: None)  # te-backend off
    args = _megatron_lm_defaults()
    changes = fix.fusion_defaults(args)
    assert (args.apply_rope_fusion, args.gradient_accumulation_fusion, args.no_persist_layer_norm) == (
        False,
        False,
        True,
    )
    assert len(changes) == 3 and any("--use-fused-rotary-pos-emb" in line for line in changes), changes
    assert fix.fusion_defaults(args) == []  # nothing left to switch


def test_what_transformer_engine_provides_is_left_on(monkeypatch):
    monkeypatch.setattr(fix.transformer_engine, "installed", lambda: True)
    args = _megatron_lm_defaults()
    fix.fusion_defaults(args)
    assert args.apply_rope_fusion is True and args.gradient_accumulation_fusion is True  # TE's own kernels
    local = _megatron_lm_defaults(transformer_impl="local")
    fix.fusion_defaults(local)
    assert local.apply_rope_fusion is True and local.gradient_accumulation_fusion is False  # megatron's linears


@pytest.mark.parametrize(
    ("overrides", "switched"),
    [({}, False), ({"rotary_interleaved": True}, True), ({"multi_latent_attention": True}, True)],
)
def test_rope_fusion_stays_where_the_te_backend_serves_it(monkeypatch, overrides, switched):
    """The te-backend serves TE 2.1's fused RoPE (rotate-half) on our kernel: megatron's default stays
    on, except for what that does not cover (interleaved rotation, MLA's Triton kernel)."""
    monkeypatch.setattr(fix.transformer_engine, "megatron_fused_rope", lambda: "te-backend")
    args = _megatron_lm_defaults(**overrides)
    changes = fix.fusion_defaults(args)
    assert args.apply_rope_fusion is not switched
    assert any("apply_rope_fusion" in line for line in changes) is switched


def test_rope_fusion_is_not_touched_for_a_model_without_rope():
    args = _megatron_lm_defaults(position_embedding_type="learned_absolute")
    assert not any("apply_rope_fusion" in line for line in fix.fusion_defaults(args))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_hook_runs_around_validate_args_on_every_device(device):
    mindspeed_like.reset()
    try:
        ctx = runtime.context_for(runtime.resolve_config(code={"device": device}, argv=[]))
        assert (fix.NAME, fix.switch_absent_fusions) in hooks_of(ctx)
    finally:
        mindspeed_like.reset()
