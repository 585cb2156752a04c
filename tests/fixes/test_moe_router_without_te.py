"""megatron's MoE router without TransformerEngine: ``te_general_gemm`` is unbound (NameError); the
fix runs the router's non-TE branch on every device (this CPU here; a GPU in
tests/integration/test_cuda_placement.py), and leaves megatron's TE branch alone where TE binds it."""

from __future__ import annotations

import importlib

import pytest
import torch

from mindspeed_like import runtime
from mindspeed_like.fixes import router_gating_without_te
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


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
    assert not hasattr(importlib.import_module(MOE_UTILS), "te_general_gemm")  # no TransformerEngine here
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
