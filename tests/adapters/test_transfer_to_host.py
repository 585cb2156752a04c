"""--transfer-to-host: a client's own .cuda() on a CPU host (issue 37 item 9a), opt-in and reversible."""

from __future__ import annotations

import logging

import pytest
import torch

import mindspeed_like
from mindspeed_like.adapters import transfer_to_host
from mindspeed_like.testing import init_parallel
from mindspeed_like.toolkit.errors import ConfigError

ORIGINALS = ("current_device", "set_device", "synchronize")


def _mbridge_get_model_tail(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """What mbridge 0.15.1's own copy of megatron's get_model does after building (core/util.py)."""
    for model_module in model:
        model_module.cuda(torch.cuda.current_device())
    return model


def _cuda_call_failure() -> str:
    """How ``.cuda()`` of a host tensor fails in this process. A fresh one: torch.cuda's lazy init,
    ``AssertionError: Torch not compiled with CUDA enabled``. Once a ``testing.fake_cuda`` block has
    run (tests/features, tests/integration: ``make test-versions`` runs them first), torch's C++
    keeps CUDA marked initialized for the process (a one-way flag with no Python reset), and the
    same call fails in the dispatcher: ``RuntimeError: PyTorch is not linked with support for cuda
    devices``."""
    with pytest.raises(
        (AssertionError, RuntimeError),
        match="Torch not compiled with CUDA enabled|PyTorch is not linked with support for cuda devices",
    ) as failure:
        torch.ones(1).cuda()
    return f"{failure.type.__name__}: {failure.value}"


def test_off_by_default_a_clients_cuda_call_fails_as_before(cpu_config):
    cpu_config()
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        _mbridge_get_model_tail([torch.nn.Linear(2, 2)])


def test_on_a_megatron_model_moved_by_the_client_stays_on_the_host_and_trains(cpu_config, caplog):
    originals = {name: getattr(torch.cuda, name) for name in ORIGINALS}
    methods = (torch.Tensor.cuda, torch.nn.Module.cuda)
    failure = _cuda_call_failure()
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        cpu_config(transfer_to_host=True)
    from mindspeed_like.testing.models import tiny_gpt

    init_parallel()
    model = tiny_gpt(wrap_float16=False)
    [moved] = _mbridge_get_model_tail([model])
    assert moved is model and all(p.device.type == "cpu" for p in model.parameters())
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    weight = next(model.parameters())
    assert weight.cuda() is weight and weight.cuda(non_blocking=True) is weight
    assert weight.to(torch.cuda.current_device()).device.type == "cpu"
    assert torch.cuda.is_available() is False  # never lies: torch.compile relies on it
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    reported = {r.target for r in mindspeed_like.report() if r.feature == "transfer-to-host"}
    assert reported == {"torch.Tensor.cuda", "torch.nn.Module.cuda", *(f"torch.cuda.{n}" for n in ORIGINALS)}
    assert all(r.global_change for r in mindspeed_like.report() if r.feature == "transfer-to-host")
    # switched off: every torch function is the original again, by identity
    mindspeed_like.configure(transfer_to_host=False)
    assert {name: getattr(torch.cuda, name) for name in ORIGINALS} == originals
    assert (torch.Tensor.cuda, torch.nn.Module.cuda) == methods
    assert _cuda_call_failure() == failure  # .cuda() fails again, as it did before the feature was on


def test_said_once_when_on(cpu_config, caplog, monkeypatch):
    monkeypatch.setattr(transfer_to_host, "_said", False)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        cpu_config(transfer_to_host=True)
        mindspeed_like.configure(transfer_to_host=True, use_fused_rmsnorm=True)
    assert sum(transfer_to_host.SAID in r.getMessage() for r in caplog.records) == 1


def test_refused_where_the_device_is_not_the_host():
    from mindspeed_like import runtime

    ctx = runtime.context_for(runtime.resolve_config(code={"transfer_to_host": True}, argv=[]))
    object.__setattr__(ctx, "device", "cuda")
    with pytest.raises(ConfigError, match="for a CPU host"):
        transfer_to_host.FEATURE.validate(ctx)


def test_an_expanded_view_is_materialized_as_the_copy_to_a_gpu_would(cpu_config):
    """``arange(n).expand(5, n).cuda()`` then one write per row (Megatron-LM's LLaVA test): on a GPU
    the copy is dense, so each write stays in its row; a tensor that owns its memory stays itself."""
    cpu_config(transfer_to_host=True)
    ids = torch.arange(8).expand(3, 8).cuda()
    ids[0, 0] = -1
    assert ids[:, 0].tolist() == [-1, 0, 0] and ids.is_contiguous()
    dense = torch.zeros(3, 8)
    assert dense.cuda() is dense
