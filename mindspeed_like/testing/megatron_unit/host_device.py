"""What the harness changes so Megatron-LM's unit tests, written for CUDA GPUs, run on a CPU host.

Harness only: none of this is in the library. The import line (``--device cpu --transfer-to-host``)
adapts megatron-core's own CUDA call sites; the tests themselves also call CUDA directly
(``device='cuda'``, ``torch.cuda.device_count()``, NCCL process groups, streams), and 219 of them
are behind ``skipif(not torch.cuda.is_available())``. Each change below is one reason a test could
not run on a host, reversible with :func:`uninstall`:

* ``torch.cuda.is_available()`` answers True (``--megatron-host-cuda``, on by default). The tests
  behind that skipif mostly create tensors on ``'cuda'`` and compare numbers: with the changes
  below those run on the host and say something real. The library never claims CUDA (torch.compile
  would believe it and crash in inductor), so dynamo is disabled in the harness
  (``TORCHDYNAMO_DISABLE=1``: megatron's ``jit_fuser`` runs eagerly, as it does in ``make test``).
* NCCL becomes gloo (``init_process_group`` / ``new_group``), with a finite timeout so one rank's
  failure cannot leave the others waiting for the default 30 minutes.
* ``torch.cuda.device_count()`` is the world size: megatron's ``Utils`` picks ``rank % device_count()``.
* A ``TorchFunctionMode`` turns ``device='cuda'`` / ``'cuda:N'`` / an index, and ``Tensor.to``'s
  positional device, into the host; ``pin_memory`` is off (no pinned memory without CUDA).
* ``torch.cuda`` streams, events, memory statistics and device queries answer as one host device
  (the null stream/event of the cpu adapter).
* ``megatron.core.utils._fa_version`` is set when flash_attn is missing: some tests read it at
  collection and would error before they can skip.
* megatron's batch-invariant mode is switched off after each test: a test that fails inside it
  leaves ``aten::mm`` overridden by a Triton kernel and every later test failing with it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mindspeed_like.adapters.cpu.host_view import NullEvent, _NullStream

HOST = torch.device("cpu")
PG_TIMEOUT_S = float(os.environ.get("MEGATRON_UNIT_PG_TIMEOUT_S", "120"))
_NULL_STREAM = _NullStream()
_saved: list[tuple[Any, str, Any]] = []
_mode: TorchFunctionMode | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class HostDeviceMode(TorchFunctionMode):
    """Every torch call's ``device=`` naming CUDA goes to the host; pinned memory is declined."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": HOST}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func in (torch.Tensor.to, torch.Tensor.type) and len(args) > 1 and _is_cuda(args[1]):
            if func is torch.Tensor.type:
                return args[0].type(str(args[1]).replace("torch.cuda.", "torch."), *args[2:], **kwargs)
            args = (args[0], HOST, *args[2:])
        return func(*args, **kwargs)


def _set(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name, None))))
    setattr(owner, name, value)


def _gloo(original: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args and original.__name__ == "init_process_group" else None)
        if isinstance(backend, str) and "nccl" in backend:
            backend = "gloo"
        if original.__name__ == "init_process_group":
            if args:
                args = (backend, *args[1:])
            else:
                kwargs["backend"] = backend
            kwargs.setdefault("timeout", datetime.timedelta(seconds=PG_TIMEOUT_S))
        else:
            if "backend" in kwargs or backend is not None:
                kwargs["backend"] = "gloo" if backend is not None else None
            kwargs.pop("pg_options", None)  # NCCL's options; gloo takes none
            kwargs.setdefault("timeout", datetime.timedelta(seconds=PG_TIMEOUT_S))
        return original(*args, **kwargs)

    call.__wrapped__ = original  # type: ignore[attr-defined]
    call.__name__ = original.__name__
    return call


class _Props:
    """``torch.cuda.get_device_properties``: a host with the process's memory, named as the harness."""

    name = "cpu (mindspeed_like megatron-unit harness)"
    major, minor = 8, 0
    total_memory = 64 << 30
    multi_processor_count = os.cpu_count() or 1


def install(host_cuda: bool = True) -> None:
    """Apply every change in the module docstring (idempotent)."""
    global _mode
    if _mode is not None:
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for owner in (dist, c10d):
        for name in ("init_process_group", "new_group"):
            _set(owner, name, _gloo(getattr(owner, name)))
    cuda = torch.cuda
    world = int(os.environ.get("WORLD_SIZE", "1"))
    answers: dict[str, Any] = {
        "device_count": lambda: world,
        "Stream": lambda *a, **k: _NULL_STREAM,
        "Event": NullEvent,
        "current_stream": lambda device=None: _NULL_STREAM,
        "default_stream": lambda device=None: _NULL_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "empty_cache": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "get_device_name": lambda device=None: _Props.name,
        "get_device_capability": lambda device=None: (_Props.major, _Props.minor),
        "get_device_properties": lambda device=None: _Props(),
        "is_bf16_supported": lambda including_emulation=True: True,
        # the "device" generator is the host's (as the cpu adapter's view of torch.cuda has it)
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
    }
    if host_cuda:
        answers["is_available"] = lambda: True
    for name, value in answers.items():
        _set(cuda, name, value)
    _set_fa_version()
    _mode = HostDeviceMode()
    _mode.__enter__()


def _set_fa_version() -> None:
    import importlib.util

    import megatron.core.utils as utils
    from packaging.version import Version

    if importlib.util.find_spec("flash_attn") is None and getattr(utils, "_fa_version", None) is None:
        _set(utils, "_fa_version", Version("0.0"))


def uninstall() -> None:
    """Undo :func:`install` (the function mode and every attribute, in reverse)."""
    global _mode
    if _mode is not None:
        _mode.__exit__(None, None, None)
        _mode = None
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)


def _referenced_groups(value: Any, found: set[int], depth: int = 0) -> None:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        found.add(id(value))
    elif depth < 3 and isinstance(value, (list, tuple, set)):
        for inner in value:
            _referenced_groups(inner, found, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for inner in value.values():
            _referenced_groups(inner, found, depth + 1)


def destroy_leftover_groups() -> int:
    """Destroy the process groups no one holds any more; returns how many.

    megatron's ``destroy_model_parallel`` forgets its groups without destroying them, so every test
    that initializes model parallelism leaves a dozen gloo groups, each with its own threads: a
    run of the transformer folder reached 9,704 threads and starved the host. The groups megatron's
    parallel state still holds (a class that initialized once for all its tests), those a live
    ``DeviceMesh`` holds, and the default group are kept: a mesh outlives its test where a module
    caches it (Megatron-FSDP's tests clear torch's mesh caches only when they reach their end), and
    a destroyed group under a cached mesh fails a later test with "Could not resolve the process group
    registered under the name N", which megatron's CI, destroying no group between tests, never sees.
    """
    import gc
    import sys

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_available() or not dist.is_initialized():
        return 0
    keep = {id(c10d._get_default_group())}
    for name in ("megatron.core.parallel_state",):
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            _referenced_groups(value, keep)
    gc.collect()  # the test's own meshes, unreachable now, go first
    for mesh in _live_device_meshes():
        _referenced_groups(getattr(mesh, "_pg_registry", None) or {}, keep)
    destroyed = 0
    for group in list(c10d._world.pg_map.keys()):
        if id(group) not in keep:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
                destroyed += 1
    # a destroyed gloo group's threads end only when the object is freed: models and tracebacks of the
    # test may still hold it in reference cycles (measured: 812 groups alive after the transformer folder)
    gc.collect()
    return destroyed


def _live_device_meshes() -> list[Any]:
    """Every ``DeviceMesh`` still reachable (found by the collector: torch keeps them in module caches,
    Megatron-FSDP in its parameters' DTensor specs)."""
    import gc
    import sys

    module = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(module, "DeviceMesh", None)
    if not isinstance(mesh_type, type):
        return []
    return [obj for obj in gc.get_objects() if isinstance(obj, mesh_type)]


def before_test() -> None:
    """In a rank, before each test: the default process group, as megatron's CI has it there.

    megatron's CI runs a whole directory in one ``torchrun --nproc-per-node 8`` launch, so by the time a
    test runs, an earlier one has made the default group (``Utils.initialize_distributed``, which
    ``Utils.initialize_model_parallel`` calls). The harness launches only the tests a size needs, so a
    launch can start with a test that builds its groups itself and never makes the default one
    (models/test_gpt_model.py's ``TestGPTModelWithCustomPG``: "Default process group has not been
    initialized" at 8 ranks). Made the way megatron's utility makes it (its store, its backend, which
    the harness serves with gloo)."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        from tests.unit_tests.test_utilities import Utils

        Utils.initialize_distributed()


def after_test(module_ends: bool = False) -> None:
    """Between tests: leftover process groups destroyed, megatron's batch-invariant mode off (it
    overrides aten::mm process-wide); where a test module ends, its num-microbatches calculator unset."""
    destroy_leftover_groups()
    if module_ends:
        unset_module_globals()
    try:
        from megatron.core.transformer.custom_layers import batch_invariant_kernels as bik
    except Exception:  # noqa: BLE001 - no triton: the mode cannot have been switched on
        return
    if bik.is_batch_invariant_mode_enabled():
        with contextlib.suppress(Exception):
            bik.disable_batch_invariant_mode()


def unset_module_globals() -> None:
    """megatron's process-global num-microbatches calculator, unset where a test module ends.

    Some tests set it through megatron.training's ``set_global_variables`` and never unset it; a later
    module whose fixture calls ``init_num_microbatches_calculator`` then fails "num microbatches
    calculator is already initialized" (distributed/test_torch_fully_sharded_parallel.py's two tests and
    dist_checkpointing/test_pipeline_parallel_layout.py's, in a whole-directory launch). A module that
    sets it in a module- or class-scoped fixture keeps it for all its tests: only the boundary clears it."""
    try:
        from megatron.core import num_microbatches_calculator as calculator
    except ImportError:  # megatron-core not imported by these tests at all
        return
    if calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        calculator.unset_num_microbatches_calculator()
