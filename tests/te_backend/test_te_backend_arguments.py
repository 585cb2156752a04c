"""te-backend and Megatron-LM's arguments (fast; no Megatron-LM checkout needed).

* ``host_defaults`` keeps Megatron-LM's default ``--transformer-impl transformer_engine`` while the
  te-backend is on (megatron's TE classes are ours), and switches it to ``local`` with the logged
  reason only with ``--no-te-backend``; the other TE-dependent defaults are switched either way.
* ``--attention-backend``: what cannot be honoured on the TE-spec model is refused at validation;
  ``flash`` runs our flash kernel (even with flash-attention off), ``unfused`` megatron's math.
"""

from __future__ import annotations

import types

import pytest
import torch

import mindspeed_like
from mindspeed_like.adapters.cpu_training.arguments import host_defaults, te_layers_available
from mindspeed_like.te_backend import attention_backend as te_attention
from mindspeed_like.te_backend.refusals import TransformerEngineFeatureUnsupported
from mindspeed_like.testing import destroy_parallel, init_parallel
from mindspeed_like.toolkit.errors import LevelConflict


@pytest.fixture
def configured():
    def configure(**flags):
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu", **flags)

    yield configure
    mindspeed_like.reset()


def _megatron_lm_defaults(**overrides) -> types.SimpleNamespace:
    """The arguments host_defaults reads, at Megatron-LM's defaults."""
    values = dict(
        transformer_impl="transformer_engine",
        distributed_backend="gloo",
        apply_rope_fusion=True,
        gradient_accumulation_fusion=True,
        masked_softmax_fusion=True,
        no_persist_layer_norm=False,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        rank=1,  # no log line
    )
    return types.SimpleNamespace(**{**values, **overrides})


def test_transformer_engine_impl_kept_while_the_backend_is_on(configured):
    configured()
    assert te_layers_available()
    args = _megatron_lm_defaults()
    changes = host_defaults(args)
    assert args.transformer_impl == "transformer_engine"
    assert not any("transformer_impl" in line for line in changes)
    # TE's fused RoPE is served by the backend (TE 2.1's contract on our kernel): left on
    assert args.apply_rope_fusion is True
    assert not any("apply_rope_fusion" in line for line in changes)
    # the TE-spec linears are megatron's parallel linears: apex's wgrad fusion is still absent
    assert args.gradient_accumulation_fusion is False


@pytest.mark.parametrize(
    ("field", "reason"),
    [("rotary_interleaved", "needs TransformerEngine >= 2.3"), ("multi_latent_attention", "Triton kernel")],
)
def test_rope_fusion_switched_where_te_2_1_s_fused_rope_does_not_cover_it(configured, field, reason):
    configured()
    args = _megatron_lm_defaults(**{field: True})
    changes = host_defaults(args)
    assert args.apply_rope_fusion is False
    assert any("apply_rope_fusion" in line and reason in line for line in changes), changes


def test_switched_to_local_with_the_reason_when_the_backend_is_off(configured):
    configured(no_te_backend=True)
    assert not te_layers_available()
    args = _megatron_lm_defaults()
    changes = host_defaults(args)
    assert args.transformer_impl == "local"
    assert any("transformer_impl" in line and "--no-te-backend" in line for line in changes), changes
    assert args.apply_rope_fusion is False
    assert any("apply_rope_fusion" in line and "the te-backend is off" in line for line in changes), changes


def test_local_impl_given_by_name_is_left_alone(configured):
    configured()
    args = _megatron_lm_defaults(transformer_impl="local")
    host_defaults(args)
    assert args.transformer_impl == "local"


def _attention_args(backend: str, **overrides) -> types.SimpleNamespace:
    from megatron.core.transformer.enums import AttnBackend

    return types.SimpleNamespace(
        **{"transformer_impl": "transformer_engine", "attention_backend": AttnBackend[backend], **overrides}
    )


@pytest.mark.parametrize("backend", ["auto", "flash", "fused", "unfused"])
def test_attention_backends_accepted(configured, backend):
    configured()
    te_attention.check_attention_backend(_attention_args(backend))


def test_attention_backend_local_refused_with_the_te_impl(configured):
    configured()
    with pytest.raises(TransformerEngineFeatureUnsupported, match="--transformer-impl local"):
        te_attention.check_attention_backend(_attention_args("local"))
    te_attention.check_attention_backend(_attention_args("local", transformer_impl="local"))  # megatron's business


def test_unfused_with_flash_attention_is_a_conflict(configured):
    configured(use_flash_attn=True)
    assert te_attention.flash_attention_on()
    with pytest.raises(LevelConflict, match="drop one") as raised:
        te_attention.check_attention_backend(_attention_args("unfused"))
    assert raised.value.feature == "flash-attention"


def test_unfused_with_context_parallelism_refused(configured):
    configured()
    with pytest.raises(TransformerEngineFeatureUnsupported, match="context"):
        te_attention.check_attention_backend(_attention_args("unfused", context_parallel_size=2))


def _core_attention_output(backend: str, monkeypatch) -> tuple[torch.Tensor, int]:
    """TEDotProductAttention's output on one causal batch, and how many times the flash kernel ran."""
    from megatron.core.extensions import transformer_engine as extension
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    from mindspeed_like.kernels import flash_attention as kernel_module
    from mindspeed_like.testing import gpt_config

    calls = []
    kernel = kernel_module.flash_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "flash_attention", counted)
    init_parallel()
    try:
        config = gpt_config(attention_backend=AttnBackend[backend], attention_dropout=0.0)
        module = extension.TEDotProductAttention(config, 1, AttnMaskType.causal, "self")
        generator = torch.Generator().manual_seed(0)
        heads, dim = config.num_attention_heads, config.kv_channels
        q, k, v = (torch.randn(16, 2, heads, dim, generator=generator) for _ in range(3))
        out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    finally:
        destroy_parallel()
    return out, len(calls)


def test_flash_runs_our_flash_kernel_unfused_megatrons_math(configured, monkeypatch):
    configured()  # flash-attention off
    assert not te_attention.flash_attention_on()
    flash, flash_calls = _core_attention_output("flash", monkeypatch)
    unfused, unfused_calls = _core_attention_output("unfused", monkeypatch)
    auto, auto_calls = _core_attention_output("auto", monkeypatch)
    assert (flash_calls, unfused_calls, auto_calls) == (1, 0, 0)
    torch.testing.assert_close(flash, unfused, rtol=1e-5, atol=1e-6)  # same attention, fp32
    assert torch.equal(auto, unfused)
    configured(use_flash_attn=True)  # auto / fused: ours, i.e. flash-attention's when it is on
    _, auto_calls = _core_attention_output("auto", monkeypatch)
    _, flash_calls = _core_attention_output("flash", monkeypatch)
    assert (auto_calls, flash_calls) == (1, 1)
