"""The public helpers in mindspeed_like.testing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mindspeed_like.testing import SavedBytesMeter, param_bytes, run_distributed
from mindspeed_like.testing.distributed import DistributedError


def test_importing_testing_does_not_import_megatron():
    code = "import sys, mindspeed_like.testing; print(any(m.startswith('megatron') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_param_bytes_dedups_storages():
    a = torch.zeros(10)
    view = a[2:5]
    b = torch.zeros(3, dtype=torch.bfloat16)
    assert param_bytes([a, view, a, b]) == 40 + 6


def test_saved_bytes_meter_counts_and_dedups():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with SavedBytesMeter() as meter:
        y = x @ w  # saves x and w
        z = (y * y).sum()  # saves y (twice: dedup)
    assert meter.count == 3
    assert meter.bytes == (32 + 64 + 32) * 4
    y.untyped_storage().resize_(0)  # a feature freeing a saved activation
    assert meter.current_bytes() == (32 + 64) * 4
    del z


def test_run_distributed_returns_per_rank_values():
    from dist_workers import echo_rank

    assert run_distributed(echo_rank, 2, "x") == [(0, 2, "x"), (1, 2, "x")]


def test_run_distributed_surfaces_child_traceback():
    from dist_workers import fail_on_rank_one

    with pytest.raises(DistributedError, match="rank one fails on purpose") as info:
        run_distributed(fail_on_rank_one, 2, timeout=60)
    assert "rank 1" in str(info.value) and "Traceback" in str(info.value)


@pytest.mark.slow
def test_run_distributed_kills_stragglers_on_timeout():
    from dist_workers import sleep_forever

    with pytest.raises(DistributedError, match="timed out"):
        run_distributed(sleep_forever, 2, timeout=3)


def test_tiny_gpt_defaults_and_train_steps_deterministic():
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    try:
        init_parallel(seed=3)
        model = tiny_gpt()
        cfg = model.config
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 4)
        assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
        assert model.vocab_size == 256 and model.max_sequence_length == 32
        first = train_steps(model, 3, seed=9, optimizer="sgd", lr=0.1)
        init_parallel(seed=3)
        again = train_steps(tiny_gpt(), 3, seed=9, optimizer="sgd", lr=0.1)
        assert first == again  # bitwise: same seed, same data, same ops
        init_parallel(seed=3)
        other = train_steps(tiny_gpt(), 3, seed=10, optimizer="sgd", lr=0.1)
        assert other != first
    finally:
        destroy_parallel()
        mindspeed_like.reset()
