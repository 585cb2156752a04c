"""grouped-gemm on megatron-core 0.17+: ``moe_grouped_gemm=True`` builds SequentialMLP there (the
legacy GroupedMLP was deleted), and the feature runs its experts' linears as grouped GEMMs.

One model, the same weights: megatron's per-expert loop (feature off) against our grouped call
(feature on, the default without the CUDA grouped_gemm package). Tolerances as in
``test_grouped_gemm.py``: fp32 one step rtol 1e-5 / atol 1e-6 (the grouped kernel sums the same
products in another blocking order); 10 fp32 training steps 1e-5 relative.
"""

from __future__ import annotations

import logging

import pytest
import torch

import mindspeed_like
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import init_parallel, make_batches, tiny_gpt, train_steps
from mindspeed_like.testing.npu_emulator import emulated_torch_npu
from mindspeed_like.testing.parity import SEED, rel_close
from mindspeed_like.testing.training import unwrap
from mindspeed_like.toolkit.fallback import forget_logged

pytestmark = pytest.mark.skipif(
    megatron_core_version() is None or megatron_core_version().release < (0, 17),
    reason="megatron-core < 0.17 builds GroupedMLP: test_grouped_gemm.py",
)

EXPERTS = 4
STEPS = 10


def _model(**model):
    init_parallel(seed=SEED)
    return tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=True, **model)


def _forward_backward(model, tokens):
    gpt = unwrap(model)
    gpt.zero_grad(set_to_none=True)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, position_ids, None, labels=tokens)
    loss.float().mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}


def _wrapped() -> bool:
    from megatron.core.transformer.moe.experts import SequentialMLP

    return type(getattr(SequentialMLP.__dict__["forward"], "_self_wrapper", None)).__name__ == (
        "SequentialExpertsForward"
    )


def test_grouped_matches_megatrons_loop_and_off_restores_it(cpu_config):
    cpu_config(grouped_gemm="off")
    assert not _wrapped()
    model = _model()
    assert type(unwrap(model).decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    loss_loop, grads_loop = _forward_backward(model, tokens)
    mindspeed_like.configure(grouped_gemm="auto")  # the default: the CUDA package is absent here
    assert _wrapped()
    with emulated_torch_npu() as npu:
        from mindspeed_like.kernels.backend import force_backend

        with force_backend("npu"):
            loss_npu, _ = _forward_backward(model, tokens)
    # 2 layers x (fc1, fc2) forward; backward of each: dgrad + wgrad
    assert npu.calls["npu_grouped_matmul"] == 2 * 2 * 3
    loss, grads = _forward_backward(model, tokens)
    torch.testing.assert_close(loss, loss_loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_npu, loss_loop, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_loop.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_loop[name], rtol=1e-5, atol=1e-6, msg=name)
        if "local_experts" in name:
            assert torch.count_nonzero(grad) > 0, name
    mindspeed_like.configure(grouped_gemm="off")
    assert not _wrapped()


def test_trains_like_megatrons_loop(cpu_config):
    data = make_batches(1, 2, 32, 256, SEED)[0]
    cpu_config(grouped_gemm="off")
    base = train_steps(_model(), STEPS, seed=SEED, data=data)
    cpu_config()
    ours = train_steps(_model(), STEPS, seed=SEED, data=data)
    assert rel_close(ours, base, 1e-5), (ours, base)
    assert ours[-1] < ours[0]


def test_gradient_accumulation_fusion_is_a_logged_fallback(cpu_config, caplog):
    """SequentialMLP has one weight per expert: no one main_grad to fuse into; logged once, and
    an error under --strict (never silently ignored)."""
    from mindspeed_like.features import grouped_gemm as feature

    cpu_config(gemm_gradient_accumulation_fusion=True)
    forget_logged()
    model = _model()
    tokens = torch.randint(0, 256, (2, 32))
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        _forward_backward(model, tokens)
        _forward_backward(model, tokens)
    assert sum("gemm-gradient-accumulation-fusion" in r.getMessage() for r in caplog.records) == 1
    mindspeed_like.configure(strict=True)
    with pytest.raises(feature.GroupedGemmUnsupported, match="gemm-gradient-accumulation-fusion"):
        _forward_backward(model, tokens)
