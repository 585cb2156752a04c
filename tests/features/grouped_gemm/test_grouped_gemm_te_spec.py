"""grouped-gemm on the TE spec: TEGroupedMLP's grouped linears are the te-backend's (this
feature's gmm kernel); the feature records that and changes nothing in the computation."""

from __future__ import annotations

import logging

from mindspeed_like.testing import init_parallel, tiny_gpt, train_steps
from mindspeed_like.testing.parity import SEED
from mindspeed_like.toolkit.fallback import forget_logged, served

MODEL = dict(transformer_impl="transformer_engine", num_moe_experts=4, moe_grouped_gemm=True)


def _losses(cpu_config, **flags) -> list[float]:
    cpu_config(**flags)
    init_parallel(seed=SEED)
    return train_steps(tiny_gpt(**MODEL), 2, seed=SEED)


def test_te_spec_experts_are_served_by_the_te_backend(cpu_config, caplog):
    forget_logged()
    off = _losses(cpu_config, grouped_gemm="off")
    assert "grouped-gemm" not in served()
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        on = _losses(cpu_config, grouped_gemm="on")
    assert served().get("grouped-gemm") == "te-backend"
    assert caplog.text.count("grouped-gemm: the TE spec's grouped experts") == 1  # said once
    assert on == off  # a pass-through: the same grouped GEMMs either way


def test_te_spec_served_line_is_said_by_rank_zero_only(cpu_config, caplog, monkeypatch):
    """A Megatron-LM run at EP=2 printed the line once per process; ranks other than 0 record
    "served by te-backend" for the report and say nothing."""
    import torch

    forget_logged()
    cpu_config(grouped_gemm="on")
    init_parallel(seed=SEED)
    model = tiny_gpt(**MODEL)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 1)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        train_steps(model, 1, seed=SEED)
    assert served().get("grouped-gemm") == "te-backend"
    assert "grouped-gemm: the TE spec's grouped experts" not in caplog.text
