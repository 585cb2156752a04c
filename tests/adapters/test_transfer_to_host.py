"""--transfer-to-host: a client's own .cuda() on a CPU host (issue 37 item 9a), opt-in and reversible."""

from __future__ import annotations

import importlib
import logging
import sys

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
    methods = (torch.Tensor.cuda, torch.nn.Module.cuda, torch.Tensor.to, torch.nn.Module.to)
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
    process_wide = {"torch.Tensor.cuda", "torch.nn.Module.cuda", "torch.Tensor.to", "torch.nn.Module.to"}
    process_wide |= {f"torch.cuda.{n}" for n in ORIGINALS}
    # the rest: client modules' own torch (none here unless ms-swift / mcore-bridge are installed)
    assert process_wide <= reported and all(t.endswith(".torch") for t in reported - process_wide)
    assert all(r.global_change for r in mindspeed_like.report() if r.feature == "transfer-to-host")
    # switched off: every torch function is the original again, by identity
    mindspeed_like.configure(transfer_to_host=False)
    assert {name: getattr(torch.cuda, name) for name in ORIGINALS} == originals
    assert (torch.Tensor.cuda, torch.nn.Module.cuda, torch.Tensor.to, torch.nn.Module.to) == methods
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


# --- issue 55 item 3: the rest of a client's CUDA spellings (ms-swift, mcore-bridge) ---------------

CLIENT_SOURCE = '''
import torch


def seed_if_devices(seed):
    """mcore-bridge 1.6.5 utils/megatron_utils.py: megatron's seeding behind a device-count gate."""
    if torch.cuda.device_count() > 0:
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return True
    return False


def wrap_with_streams(module):
    """ms-swift 4.6.0 megatron_lm_utils.py wrap_model: DDP built on a side stream."""
    module.cuda(torch.cuda.current_device())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = module
    torch.cuda.current_stream().wait_stream(side)
    return out


def flags(is_lora):
    """mcore-bridge gpt_bridge.py: flags exchanged between ranks, made on 'cuda'."""
    return torch.tensor([is_lora], dtype=torch.bool, device="cuda"), torch.empty(3, device=torch.device("cuda:1"))


def rng_and_memory():
    state = {"cuda_rng_state": torch.cuda.get_rng_state()}
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    peak = torch.cuda.max_memory_reserved() / 1024**3
    return peak, torch.cuda.is_available(), isinstance(torch.device("cpu"), torch.device)
'''


@pytest.fixture
def client_package(tmp_path, monkeypatch):
    """A package shaped like a client's (one module spelling CUDA, one not), listed as a client."""
    package = tmp_path / "fake_swift_client"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cuda_user.py").write_text(CLIENT_SOURCE)
    (package / "plain.py").write_text("import torch\n\ndef f():\n    return torch.ones(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(transfer_to_host, "CLIENT_PACKAGES", ("fake_swift_client",))
    yield "fake_swift_client"
    for name in [m for m in sys.modules if m.startswith("fake_swift_client")]:
        del sys.modules[name]


def test_client_modules_are_found_on_disk_without_importing(client_package):
    assert transfer_to_host.client_modules((client_package,)) == (f"{client_package}.cuda_user",)
    assert client_package not in sys.modules
    assert transfer_to_host.client_modules(("no_such_client_package",)) == ()


def test_off_a_clients_cuda_spellings_fail(cpu_config, client_package):
    cpu_config()
    client = importlib.import_module(f"{client_package}.cuda_user")
    assert client.torch is torch
    with pytest.raises((AssertionError, RuntimeError)):
        client.flags(True)
    with pytest.raises((AssertionError, RuntimeError)):
        client.wrap_with_streams(torch.nn.Linear(2, 2))
    assert client.seed_if_devices(1) is False  # the gate skips megatron's seeding: TP=2 then fails


@pytest.mark.parametrize("import_first", [False, True], ids=["imported-after", "imported-before"])
def test_on_a_client_module_runs_on_the_host(cpu_config, client_package, import_first):
    if import_first:
        importlib.import_module(f"{client_package}.cuda_user")
    cpu_config(transfer_to_host=True)
    client = importlib.import_module(f"{client_package}.cuda_user")
    plain = importlib.import_module(f"{client_package}.plain")
    assert client.torch is transfer_to_host.CLIENT_HOST_TORCH and plain.torch is torch
    linear = torch.nn.Linear(2, 2)
    assert client.wrap_with_streams(linear) is linear
    flag, buffer = client.flags(True)
    assert flag.device.type == "cpu" and flag.item() is True and buffer.device.type == "cpu"
    init_parallel()
    assert client.seed_if_devices(1234) is True  # megatron's seeding reached (device_count() == 1)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    assert "model-parallel-rng" in get_cuda_rng_tracker().get_states()
    peak_gib, available, is_device = client.rng_and_memory()
    assert peak_gib > 0.01 and available is False and is_device is True  # the host's figure, not 0.0
    assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0  # torch itself unchanged
    targets = {r.target for r in mindspeed_like.report() if r.feature == "transfer-to-host"}
    assert f"{client_package}.cuda_user.torch" in targets and f"{client_package}.plain.torch" not in targets
    mindspeed_like.configure(transfer_to_host=False)
    assert client.torch is torch


def test_to_cuda_reads_as_the_host_and_other_to_calls_are_torchs(cpu_config):
    to = torch.Tensor.to
    x = torch.ones(2, dtype=torch.float64)
    cpu_config(transfer_to_host=True)
    for moved in (x.to("cuda"), x.to("cuda:1"), x.to(device="cuda"), x.to(torch.device("cuda", 0)), x.to(0),
                  torch.Tensor.to(x, "cuda"), x.to("cuda", torch.float32)):  # fmt: skip
        assert moved.device.type == "cpu"
    assert x.to("cuda", torch.float32).dtype == torch.float32
    assert x.to(torch.float16).dtype == torch.float16 and x.to(x) is x and x.to("cpu") is x
    module = torch.nn.Linear(2, 2)
    assert module.to("cuda") is module and module.to(device="cuda:0", dtype=torch.float64).weight.dtype == torch.float64
    mindspeed_like.configure(transfer_to_host=False)
    assert torch.Tensor.to is to
    with pytest.raises((AssertionError, RuntimeError)):
        x.to("cuda")


@pytest.mark.compile
def test_torch_compile_is_unaffected(cpu_config):
    """dynamo dispatches tensor methods by name: the process-wide wraps of Tensor.to/.cuda do not
    break a full graph, and torch.cuda.is_available() stays False for inductor."""
    cpu_config(transfer_to_host=True)

    @torch.compile(fullgraph=True)
    def fused(x):
        return torch.nn.functional.silu(x.to(torch.float32)) * 2

    x = torch.randn(16, dtype=torch.bfloat16)
    torch.testing.assert_close(fused(x), torch.nn.functional.silu(x.float()) * 2)
