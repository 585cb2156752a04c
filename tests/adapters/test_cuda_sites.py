"""Every CUDA call site of the installed megatron is adapted on a host or declared as not (issue 37).

Findings 1 (``--fp16`` resume), 5 (``--check-weight-hash-across-dp-replicas-interval``) and 9a (a
client's ``.cuda()``) were one class: megatron code behind a flag calling CUDA outside what the
adapters covered. ``cuda_sites`` lists every function of the installed megatron.core (and of
Megatron-LM's megatron.training where MEGATRON_LM_PATH points at a checkout) that spells CUDA; this
test derives what the cpu-adapter and cpu-training-loop patches cover, site by site:

* a host twin (a ``run_on_host`` patch on the function): every spelling, except a ``torch.cuda``
  function the host view does not define (it falls through to the real ``torch.cuda``) and a
  ``'cuda:N'`` string other than ``f"cuda:{torch.cuda.current_device()}"`` (which a twin reads
  "cpu"), which no twin rewrites;
* any other adapter patch on the function (our own implementation): the function as a whole;
* a module-wide host view of torch (megatron.training's modules): ``torch.cuda`` functions the
  training view defines and ``device='cuda'`` of tensor factories, nothing else;
* a host region (``run_in_host_region``): the function's own ``.cuda()`` calls.

What is left must be in ``adapters/cpu/not_adapted.py`` with its reason. So a new CUDA call site
upstream, or an adapter patch removed, fails here by name; so does a stale entry of that table.
Reachability is not decided statically (nothing here knows which flag reaches what): the table
says it for each entry, and Megatron-LM runs behind the flags check the ones that matter
(``tests/reliability/test_megatron_lm_host_flags.py``).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from mindspeed_like.adapters.cpu import cuda_sites as cs
from mindspeed_like.adapters.cpu import not_adapted
from mindspeed_like.adapters.cpu.host_view import HostCuda, host_function
from mindspeed_like.adapters.cpu_training.host_training import TRAINING_HOST_TORCH, TrainingHostCuda, run_in_host_region
from mindspeed_like.testing import megatron_lm
from mindspeed_like.testing.declarations import declared_patches


def _inventory() -> dict[str, tuple[cs.Site, ...]]:
    found = dict(cs.cuda_sites("megatron.core"))
    if megatron_lm.available():
        found.update(
            cs.cuda_sites("megatron.training", [os.path.join(megatron_lm.MEGATRON_LM, "megatron", "training")])
        )
    return found


def _key(target: str, modules: set[str]) -> str | None:
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in modules:
            return f"{module}:{'.'.join(parts[i:])}"
    return None


class Coverage:
    def __init__(self, found: dict[str, tuple[cs.Site, ...]]) -> None:
        modules = {key.split(":")[0] for key in found}
        modules |= {module for module, _ in cs.package_modules("megatron.core")}
        self.twins: set[str] = set()
        self.own: dict[str, str] = {}
        self.regions: set[str] = set()
        self.views: set[str] = set()
        for patch in declared_patches("cpu-adapter") + declared_patches("cpu-training-loop"):
            if patch.new is TRAINING_HOST_TORCH and patch.target.endswith(".torch"):
                self.views.add(patch.target[: -len(".torch")])
                continue
            key = _key(patch.target, modules)
            if key is None:
                continue
            if getattr(patch.new, "runs_host_twin", False):
                self.twins.add(key)
            elif patch.new is run_in_host_region:
                self.regions.add(key)
            else:
                self.own[key] = patch.why

    def uncovered(self, key: str, sites: tuple[cs.Site, ...]) -> list[cs.Site]:
        if key in self.own:
            return []
        module = key.split(":")[0]
        return [site for site in sites if not self._covers(key, module, site)]

    def _covers(self, key: str, module: str, site: cs.Site) -> bool:
        fn = site.detail.split(".")[0]
        if key in self.twins:
            return site.kind != cs.CUDA_INDEXED and (site.kind != cs.TORCH_CUDA or _defines(HostCuda, fn))
        if module in self.views:
            if site.kind == cs.FACTORY_DEVICE or (site.kind == cs.TORCH_CUDA and _defines(TrainingHostCuda, fn)):
                return True
        return key in self.regions and site.kind == cs.CUDA_METHOD


def _defines(view: type, name: str) -> bool:
    """The host view itself answers ``torch.cuda.<name>`` (not its fall-through to torch.cuda)."""
    return any(name in vars(klass) for klass in view.__mro__ if klass is not object)


FOUND = _inventory()
COVERAGE = Coverage(FOUND)
UNADAPTED = {key: left for key, sites in FOUND.items() if (left := COVERAGE.uncovered(key, sites))}


def test_the_scan_finds_the_known_sites():
    """The scanner sees what issue 37 found by hand (so an empty result cannot pass as "covered")."""
    grad_scaler = FOUND["megatron.core.optimizer.grad_scaler:DynamicGradScaler.load_state_dict"]
    assert {site.kind for site in grad_scaler} == {cs.CUDA_METHOD, cs.TORCH_CUDA}
    hashes = FOUND["megatron.core.utils:check_param_hashes_across_dp_replicas"]
    assert [site.kind for site in hashes] == [cs.CUDA_METHOD]
    assert len(FOUND) > 100


def test_every_unadapted_cuda_site_is_declared():
    undeclared = {key: left for key, left in UNADAPTED.items() if not_adapted.entry_for(key) is None}
    assert not undeclared, (
        "megatron functions that call CUDA on a host, neither adapted (cpu-adapter / cpu-training-loop) nor "
        "declared in mindspeed_like/adapters/cpu/not_adapted.py:\n"
        + "\n".join(f"  {key}: {'; '.join(map(str, left))}" for key, left in sorted(undeclared.items()))
    )


def test_no_declared_entry_is_stale():
    """An entry that matches nothing unadapted (the site went away upstream, or a patch now adapts
    it) goes, or its ``versions`` end before the installed release; an entry whose ``versions``
    exclude the installed release is not asked here. megatron.training's entries count only where
    its source was scanned."""
    used = {entry.where for key in UNADAPTED if (entry := not_adapted.entry_for(key)) is not None}
    scanned_training = megatron_lm.available()
    stale = [
        entry.where
        for entry in not_adapted.installed_entries()
        if entry.where not in used and (scanned_training or not entry.where.startswith(not_adapted.TRAINING))
    ]
    assert not stale, f"entries of not_adapted.py that match no unadapted CUDA site: {stale}"


def test_issue_37_sites_are_adapted():
    for key in (
        "megatron.core.optimizer.grad_scaler:DynamicGradScaler.load_state_dict",  # item 1
        "megatron.core.utils:check_param_hashes_across_dp_replicas",  # item 5
    ):
        assert key in COVERAGE.twins and key not in UNADAPTED


@pytest.mark.parametrize("key", sorted(k for k in COVERAGE.twins if k.startswith("megatron.core.")))
def test_every_twinned_core_function_can_be_twinned(key):
    """A twin is built at the first call; one that cannot be (a function assigning a module global)
    would fail then, mid-run. Build each now."""
    import importlib

    import wrapt

    module, qualname = key.split(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    func = inspect.getattr_static(owner, name)
    while isinstance(func, (wrapt.ObjectProxy, staticmethod, classmethod)):
        func = func.__wrapped__ if isinstance(func, wrapt.ObjectProxy) else func.__func__
    assert callable(host_function(func))


def test_refused_flags_are_megatron_arguments():
    """Every flag the cpu-training-loop refuses is a Megatron-LM argument (a ``dest`` of its parser,
    read in a fresh process with the checkout on the path), so a typo cannot leave a crashing flag
    unrefused."""
    if not megatron_lm.available():
        pytest.skip(megatron_lm.SKIP_REASON)
    code = (
        "import argparse; from megatron.training.arguments import add_megatron_arguments; "
        "print(' '.join(a.dest for a in add_megatron_arguments(argparse.ArgumentParser())._actions))"
    )
    env = {**os.environ, "PYTHONPATH": megatron_lm.MEGATRON_LM}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    dests = set(result.stdout.split())
    assert not set(not_adapted.refused_flags()) - dests


def test_profile_is_refused_only_on_cudas_profiler():
    """``--profile`` starts CUDA's profiler at --profile-step-start (the flag sweep saw it crash
    mid-run, ``AssertionError: Torch not compiled with CUDA enabled``); with ``--use-pytorch-profiler``
    torch's profiler runs on the host, so the flag is accepted."""
    import argparse

    from mindspeed_like.adapters.cpu_training.arguments import refuse_host_unsupported
    from mindspeed_like.toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="--profile: --profile without --use-pytorch-profiler starts CUDA's profiler"):
        refuse_host_unsupported(argparse.Namespace(profile=True, use_pytorch_profiler=False))
    refuse_host_unsupported(argparse.Namespace(profile=True, use_pytorch_profiler=True))


def test_the_persistent_checkpoint_worker_is_adapted_not_refused():
    """``--async-save --use-persistent-ckpt-worker`` never ended on a host (the flag sweep: no exit in
    150 s; the worker set a CUDA device in its new process) and was refused at start-up; the cpu
    adapter's ckpt_worker runs it now (tests/adapters/test_persistent_ckpt_worker.py), so it is
    accepted and its loop counts as adapted."""
    import argparse

    from packaging.version import Version

    from mindspeed_like.adapters.cpu_training.arguments import refuse_host_unsupported
    from mindspeed_like.megatron_version import megatron_core_version

    key = "megatron.core.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller.async_loop"
    args = argparse.Namespace(use_persistent_ckpt_worker=True, async_save=True)
    if megatron_core_version() >= Version("0.17"):  # one worker per class there: not adapted, refused
        from mindspeed_like.toolkit.errors import ConfigError

        with pytest.raises(ConfigError, match="use-persistent-ckpt-worker"):
            refuse_host_unsupported(args)
        return
    refuse_host_unsupported(args)
    assert key in COVERAGE.own and key not in UNADAPTED


def test_partial_optimizer_offload_is_refused_and_a_whole_one_runs():
    """--optimizer-cpu-offload runs on a host (the cpu adapter's HybridDeviceOptimizer on one
    device); below fraction 1.0 Megatron-LM's run trained visibly slower, so it is refused, naming
    the fraction that works."""
    import argparse

    from mindspeed_like.adapters.cpu_training.arguments import refuse_host_unsupported
    from mindspeed_like.toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="--optimizer-offload-fraction: below 1.0"):
        refuse_host_unsupported(argparse.Namespace(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5))
    refuse_host_unsupported(argparse.Namespace(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0))
    refuse_host_unsupported(argparse.Namespace(optimizer_cpu_offload=False, optimizer_offload_fraction=0.5))
