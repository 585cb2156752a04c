"""The device adapters as patches: reversible by identity, reported, device-selected."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import types

import pytest
import torch

import mindspeed_like
from mindspeed_like.adapters import detect as device_mod
from mindspeed_like.adapters import npu as npu_adapter
from mindspeed_like.engine import split_target
from mindspeed_like.testing.declarations import declared_patches


def _resolve(target: str):
    module_name, attrs = split_target(target)
    owner = importlib.import_module(module_name)
    for name in attrs[:-1]:
        owner = getattr(owner, name)
    return owner, attrs[-1]


def _raw(owner, attr):
    return vars(owner)[attr] if attr in vars(owner) else inspect.getattr_static(owner, attr)


def _present(patch) -> bool:
    try:
        owner, attr = _resolve(patch.target)
        _raw(owner, attr)
    except (AttributeError, ImportError):
        return False
    return True


# Target existence per installed megatron-core version: tests/test_megatron_versions.py.
# Targets of other releases declare theirs (``versions``: get_sliding_window_causal_mask from 0.15)
# and are not declared here; optional targets absent from the installed version are skipped by the
# engine; the tests below check the ones that exist.
ADAPTER_PATCHES = declared_patches("cpu-adapter")  # what configure(device="cpu") applies


def _present_patches() -> list:
    return [p for p in ADAPTER_PATCHES if _present(p)]


def test_reset_restores_every_original_by_identity():
    mindspeed_like.reset()
    targets = [_resolve(p.target) for p in _present_patches()]
    originals = [_raw(o, a) for o, a in targets]
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    alias_before = dispatcher.maybe_move_tensor_to_cpu
    assert alias_before is moe_utils.maybe_move_tensor_to_cpu

    mindspeed_like.configure(device="cpu")
    try:
        changed = [_raw(o, a) is not orig for (o, a), orig in zip(targets, originals)]
        assert all(changed)
        assert dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu  # alias followed
        assert dispatcher.maybe_move_tensor_to_cpu is not alias_before
        mindspeed_like.configure(device="cpu")  # idempotent
    finally:
        mindspeed_like.reset()
    assert all(_raw(o, a) is orig for (o, a), orig in zip(targets, originals))
    assert dispatcher.maybe_move_tensor_to_cpu is alias_before


def test_cpu_adapter_report_has_no_global_changes():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    try:
        records = [r for r in mindspeed_like.report() if r.feature == "cpu-adapter"]
        assert len(records) == len(ADAPTER_PATCHES)
        present = _present_patches()
        status = {r.target: r.status for r in records}
        assert status == {p.target: "applied" if p in present else "skipped" for p in ADAPTER_PATCHES}
        assert all(p.optional for p in ADAPTER_PATCHES if p not in present)
        assert not [r for r in records if r.global_change]
        assert not any(m == "torch" or m.startswith("torch.") for r in records for m in [r.target])
    finally:
        mindspeed_like.reset()


def test_torch_itself_is_untouched():
    """The adapter never lies to torch: torch.cuda stays unavailable and raising."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    try:
        assert torch.cuda.is_available() is False
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()
    finally:
        mindspeed_like.reset()


def test_detect_device():
    device_mod.npu_available.cache_clear()
    assert device_mod.detect_device("auto") == "cpu"  # this host: no torch_npu, no CUDA
    assert device_mod.detect_device("cpu") == "cpu"
    assert device_mod.detect_device("npu") == "npu"
    with pytest.raises(ValueError):
        device_mod.detect_device("tpu")


class _FakeTransferFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates torch_npu.contrib.transfer_to_npu on import and records that it happened."""

    imported = 0

    def find_spec(self, name, path=None, target=None):
        if name == npu_adapter.TRANSFER_MODULE:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        type(self).imported += 1


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """A FAKE torch_npu (no real torch_npu exists on this host and must not be installed):
    just enough surface for detection and the adapter, injected into sys.modules."""
    pkg = types.ModuleType("torch_npu")
    pkg.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, is_package=True)
    pkg.__path__ = []
    npu = types.ModuleType("torch_npu.npu")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None)
    npu.is_available = lambda: True
    pkg.npu = npu
    contrib = types.ModuleType("torch_npu.contrib")
    contrib.__spec__ = importlib.machinery.ModuleSpec("torch_npu.contrib", None, is_package=True)
    contrib.__path__ = []
    pkg.contrib = contrib
    for name, module in {"torch_npu": pkg, "torch_npu.npu": npu, "torch_npu.contrib": contrib}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    finder = _FakeTransferFinder()
    _FakeTransferFinder.imported = 0
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    device_mod.npu_available.cache_clear()
    yield npu
    sys.modules.pop(npu_adapter.TRANSFER_MODULE, None)
    device_mod.npu_available.cache_clear()
    mindspeed_like.reset()


def test_npu_adapter_imports_transfer_to_npu_and_reports_it(fake_torch_npu):
    mindspeed_like.reset()
    original = fake_torch_npu.is_available
    config = mindspeed_like.configure()  # device=auto finds the (fake) NPU
    assert device_mod.detect_device(config["device"]) == "npu"
    assert _FakeTransferFinder.imported == 1 and npu_adapter.adapted()
    records = {r.feature: r for r in mindspeed_like.report()}
    assert "cpu-adapter" not in records
    npu_record = records["npu-adapter"]
    assert npu_record.global_change and npu_adapter.TRANSFER_MODULE in npu_record.why
    mindspeed_like.configure()  # re-applying does not import again
    assert _FakeTransferFinder.imported == 1
    mindspeed_like.reset()
    assert fake_torch_npu.is_available is original
