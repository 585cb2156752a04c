"""megatron's MoE router without TransformerEngine: ``te_general_gemm`` is unbound (NameError) in
megatron-core 0.13-0.16; the fix runs the router's non-TE branch on every device (this CPU here; a
GPU in tests/integration/test_cuda_placement.py), and leaves megatron's TE branch alone where TE
binds it. From 0.17 megatron binds the name to None itself and the fix declares nothing."""

from __future__ import annotations

import importlib

import pytest
import torch
from packaging.version import Version

from mindspeed_like import runtime
from mindspeed_like.fixes import router_gating_without_te
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
from mindspeed_like.testing.declarations import declared_patches

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
FIXED_UPSTREAM = megatron_core_version() >= Version("0.17")  # megatron binds te_general_gemm = None


def _moe_loss() -> torch.Tensor:
    init_parallel(seed=3)
    try:
        model = tiny_gpt(num_moe_experts=4, moe_router_topk=2, moe_router_dtype="fp32")
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(32).unsqueeze(0).expand(2, 32)
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        return loss.detach()
    finally:
        destroy_parallel()


def test_the_router_runs_without_te_and_fails_without_the_fix(adaptor):
    """0.13-0.16: the name is unbound without TE and the fix makes the router run. 0.17+: megatron
    binds it to None, its own router runs, and the fix declares no patch for the release."""
    moe_utils = importlib.import_module(MOE_UTILS)
    if FIXED_UPSTREAM:
        assert moe_utils.te_general_gemm is None  # no TransformerEngine here
        assert declared_patches(router_gating_without_te.FEATURE.name) == []
        assert _moe_loss().isfinite()
        return
    assert not hasattr(moe_utils, "te_general_gemm")  # no TransformerEngine here
    assert _moe_loss().isfinite()
    runtime.ENGINE.remove(router_gating_without_te.FEATURE.name)  # megatron's own path
    with pytest.raises(NameError, match="te_general_gemm"):
        _moe_loss()


def test_where_te_binds_the_name_megatron_calls_it(adaptor, monkeypatch):
    """With TE installed the module has ``te_general_gemm``: the fix steps aside and megatron's TE
    branch runs (a stand-in for TE's GEMM records the calls)."""
    moe_utils = importlib.import_module(MOE_UTILS)
    calls = []

    def te_gemm(a, b, dtype, layout="TN", bias=None, grad=False):  # TE's general_gemm(A, B): B @ op(A)
        calls.append(layout)
        a, b = a.to(dtype), b.to(dtype)
        return ({"TN": lambda: b @ a.t(), "NN": lambda: b @ a, "NT": lambda: b.t() @ a}[layout](),)

    monkeypatch.setattr(moe_utils, "te_general_gemm", te_gemm, raising=False)
    assert _moe_loss().isfinite()
    assert calls[:1] == ["TN"] and "NN" in calls and "NT" in calls, calls
