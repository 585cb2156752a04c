"""A placement check on a CPU-only torch: megatron-core code runs as on a one-GPU host, with real numbers.

    from mindspeed_like.testing.fake_cuda import fake_cuda, DeviceMismatchError

    with fake_cuda():
        model = build()                                   # megatron's CUDA calls answered as one GPU
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
        loss = model(tokens.cuda(), ...).mean()           # a host tensor mixed in raises
        loss.backward(); optimizer.step(); loss.item()    # everything runs, on the host's CPU

What it proves: every tensor an operation reads is where a one-GPU run would have it. Inside the
block "the GPU" is a label on storages: a tensor created with ``device="cuda"`` (or ``"cuda:0"``,
``0``, ``torch.cuda.current_device()``), moved with ``.to("cuda")`` / ``.cuda()``, or computed from
such tensors, lives in labelled host memory and reports ``device == cuda:0``, ``is_cuda``,
``get_device() == 0`` and ``type() == 'torch.cuda.FloatTensor'`` to Python code (megatron's, ours,
torch's). Every aten operation, backward included, is checked with CUDA's placement rule (the one
torch's ``FakeTensorMode`` applies): all tensor operands on one device, except CPU 0-dim tensors
(scalars), the source of a copy (``copy_``, ``.to``) and the indices of ``index`` / ``index_put_``.
A mix raises :class:`DeviceMismatchError` with CUDA's message (``Expected all tensors to be on the
same device, but found at least two devices, cuda:0 and cpu!``), naming the operation and the
host operand. ``.numpy()`` of a GPU tensor raises as on CUDA. The data is real, so ``.item()``,
``.tolist()``, data-dependent shapes (MoE routing) and megatron's optimizer step all run, and a
model trains to the same numbers as on the CPU.

A tensor an operation creates without tensor operands goes where CUDA would put it: on the GPU
when it names the GPU, or when torch's C++ makes it inside a Python-level torch call that computes
on the GPU (``at::zeros(sizes, grad.options())`` in a backward formula names the host's device
here, the GPU's there); ``torch.zeros(n)`` called from Python is on the host. The autograd engine
runs under the check (hooks and Python ``backward`` functions see the GPU too).

The few ``torch.cuda`` entry points megatron calls on a one-GPU host are answered as that host
would: ``is_available`` (True), ``device_count`` (1), ``current_device`` (0), ``set_device(0)``,
``device(0)``, ``get_device_name`` / ``get_device_properties`` / ``get_device_capability`` (an
H100's 9.0), RNG state (``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` /
``default_generators``: a generator of its own standing for the GPU's), streams and events (one
stream in program order; ``record_stream`` accepted), ``synchronize``, ``empty_cache``, memory
statistics (zero) and nvtx ranges (no-ops); ``torch.device(0)`` is ``cuda:0`` (a CPU-only torch
refuses a bare index). All of it is patched only inside the block and restored on exit (not
reentrant, one thread), and torch.compile is forced eager inside it
(``torch.compiler.set_stance("force_eager")``: dynamo would trace the labels away). One thing
survives the block: torch's C++ marks CUDA initialized the first time a GPU tensor is made inside
it (a one-way flag with no Python reset), so afterwards ``.cuda()`` of a host tensor outside a block
fails with ``RuntimeError: PyTorch is not linked with support for cuda devices`` instead of
torch.cuda's ``AssertionError: Torch not compiled with CUDA enabled``; it still fails.

What it does not prove:
- speed, memory, or that a CUDA kernel exists for an operation: every operation runs on the CPU (a
  path that calls Triton or a CUDA library is not exercised: it fails here, and a feature's guarded
  fallback runs instead);
- the streams' ordering (one host stream) or anything about NCCL: collectives go through the
  process group the test made (gloo), so a host tensor handed alone to a collective is not caught
  (NCCL would refuse it), only a mix is;
- placement inside the body of a Python-implemented torch function (torch runs it with the check's
  view popped: there ``.device`` is the host's and new tensors follow the call's operands), and
  tensors copied below the dispatcher (``copy.deepcopy`` of a storage, ``torch.load``: host memory
  here);
- more than one GPU (an index other than 0 is refused, as on a one-GPU host).
torch's ``FakeTensorMode`` was the first candidate: on torch 2.13+cpu it cannot index a ``cuda``
tensor (``x[:, :-1]``: "PyTorch is not linked with support for cuda devices") nor copy host to
device, and stops at the first ``.item()`` or data-dependent shape (MoE routing), so megatron's
step does not get past its first layer under it; this runs the whole step.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from mindspeed_like.adapters.cpu.host_view import NullEvent
from mindspeed_like.testing import host_round_trips
from mindspeed_like.toolkit.overrides import attributes_set

_REAL_DEVICE = torch.device  # the block replaces torch.device (see _OneGpuDevice)
CUDA0 = _REAL_DEVICE("cuda", 0)
_HOST = _REAL_DEVICE("cpu")
_MARK = "_mindspeed_like_fake_cuda"  # set on a storage's Python object (torch keeps it while the storage lives)
aten = torch.ops.aten
# .call: the arguments of the Python-level torch call in progress; .to_host: Python moves a tensor from the
# GPU to the host
_state = threading.local()


class DeviceMismatchError(RuntimeError):
    """A host tensor met a tensor on the (fake) GPU in one operation: CUDA would refuse it."""


def on_fake_cuda(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s memory is "on the GPU" of :func:`fake_cuda`."""
    try:
        with torch._C.DisableTorchFunction():
            storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        return False
    return getattr(storage, _MARK, False)


def _label(tensor: torch.Tensor) -> None:
    with contextlib.suppress(RuntimeError, NotImplementedError), torch._C.DisableTorchFunction():
        setattr(tensor.untyped_storage(), _MARK, True)


def _cuda_device(device: Any) -> torch.device | None:
    """``device`` as the one GPU when it names CUDA (``"cuda"``, ``"cuda:0"``, ``0``), else None."""
    if isinstance(device, bool) or device is None:
        return None
    if isinstance(device, int):
        index = device
    else:
        try:
            device = _REAL_DEVICE(device)
        except (TypeError, RuntimeError):
            return None
        if device.type != "cuda":
            return None
        index = 0 if device.index is None else device.index
    if index != 0:
        raise RuntimeError(f"CUDA error: invalid device ordinal (fake_cuda is a one-GPU host; asked for cuda:{index})")
    return CUDA0


def _view_device(tensor: torch.Tensor) -> torch.device:
    return CUDA0 if on_fake_cuda(tensor) else torch.Tensor.device.__get__(tensor)


# ---------------------------------------------------------------------------------------------
# The operations: CUDA's placement rule, the device arguments read as the host, outputs labelled


# the source of a copy may be anywhere (host<->device copies), as on CUDA
_CROSS_DEVICE = {
    aten.copy_.default,
    aten._to_copy.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten._foreach_copy_.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
}
# index tensors may be host tensors (CUDA moves them); self and the values may not
_HOST_INDICES = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _operand_tensors(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if func in _HOST_INDICES:
        args = (args[0], *args[2:])  # drop the indices
    return [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]


def _check_placement(func, tensors: list[torch.Tensor]) -> bool:
    """Whether the operation computes on the GPU; raise on a host operand next to a GPU one."""
    on_gpu = [on_fake_cuda(t) for t in tensors]
    if not any(on_gpu) or func in _CROSS_DEVICE:
        return any(on_gpu)
    for tensor, gpu in zip(tensors, on_gpu):
        if not gpu and tensor.dim() > 0:  # a CPU 0-dim tensor is a scalar CUDA kernels accept
            raise DeviceMismatchError(
                "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                f"(fake_cuda: {func} got a host tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
                "beside tensors on the GPU)"
            )
    return True


def _python_call_on_gpu() -> bool:
    """Whether the Python-level torch call in progress has a GPU tensor among its arguments."""
    call = getattr(_state, "call", None)
    return call is not None and any(
        isinstance(leaf, torch.Tensor) and on_fake_cuda(leaf) for leaf in tree_flatten(call)[0]
    )


class _Placement(TorchDispatchMode):
    """Every aten operation: CUDA's placement rule; ``device=cuda`` run on the host; outputs labelled.

    A new tensor (an operation without tensor operands) is on the GPU when it names the GPU, or
    when the Python call in progress computes on the GPU: torch's C++ makes such tensors with an
    operand's options (``at::zeros(sizes, grad.options())`` in a backward formula, a composite
    op's workspace), which name the host here and the GPU there. ``torch.zeros(n)`` called from
    Python without a tensor is on the host, as on CUDA."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            target = kwargs.get("device")
            to_gpu = _cuda_device(target) is not None if target is not None else False
            if to_gpu:
                kwargs = {**kwargs, "device": _HOST}
            flat, spec = tree_flatten((args, kwargs))
            if any(isinstance(a, _REAL_DEVICE) and a.type == "cuda" for a in flat):  # a positional device
                flat = [_HOST if isinstance(a, _REAL_DEVICE) and a.type == "cuda" else a for a in flat]
                to_gpu = True
                args, kwargs = tree_unflatten(flat, spec)
            operands = _operand_tensors(func, args, kwargs)
            computes_on_gpu = _check_placement(func, operands)
            to_host = target is not None and getattr(_state, "to_host", False)
            host_round_trips.observe(func, args, kwargs, on_fake_cuda, to_host)
            if to_gpu:
                label = True
            elif func is aten._to_copy.default:
                # to the host only when Python moved it there (``.cpu()``, ``.to("cpu")``); a copy torch's
                # C++ makes with its operand's options (``type_as``: the host's options here) stays put
                label = on_fake_cuda(args[0]) and not to_host
            elif func in _CROSS_DEVICE:  # a copy keeps its destination's place
                label = False
            elif operands:
                label = computes_on_gpu
            else:
                label = _python_call_on_gpu()
        out = func(*args, **kwargs)
        if label:
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    _label(leaf)
        return out


# ---------------------------------------------------------------------------------------------
# What Python code sees: devices of labelled tensors, and moves between host and GPU


def _to(tensor: torch.Tensor, device: torch.device | None, **options: Any) -> torch.Tensor:
    """``tensor.to(device, ...)`` between the host and the labelled GPU (torch's own ``to`` on the
    host would return the tensor itself for a move to the CPU: it is already there)."""
    here = _view_device(tensor)
    to = torch.Tensor.to
    options = {k: v for k, v in options.items() if v is not None}
    if device is None or device == here:
        return to(tensor, **options)
    if device.type == "cuda":
        return to(tensor, device=CUDA0, **options)  # host -> GPU: the dispatcher sees device=cuda and labels
    options["copy"] = True  # GPU -> host: a new host tensor, as on CUDA
    _state.to_host = True
    try:
        return to(tensor, device=device, **options)
    finally:
        _state.to_host = False


def _tensor_to(func, args: tuple, kwargs: dict) -> torch.Tensor:
    tensor, rest = args[0], args[1:]
    kwargs = dict(kwargs)
    copy = kwargs.pop("copy", False)
    if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
        other = rest[0]
        device, dtype, non_blocking = _view_device(other), other.dtype, kwargs.pop("non_blocking", False)
        memory_format = kwargs.pop("memory_format", None)
        if len(rest) > 1:
            non_blocking = rest[1]
    else:
        if "device" in kwargs:
            kwargs["device"] = _normalized_device(kwargs["device"])
        rest = tuple(_normalized_device(a) if _names_a_device(a) else a for a in rest)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
    return _to(
        tensor,
        device,
        dtype=dtype,
        non_blocking=non_blocking,
        copy=copy or None,
        memory_format=memory_format,
    )


def _names_a_device(value: Any) -> bool:
    return (
        isinstance(value, (_REAL_DEVICE, int))
        and not isinstance(value, bool)
        or (isinstance(value, str) and (value.startswith("cuda") or value == "cpu"))
    )


def _normalized_device(device: Any) -> Any:
    return _cuda_device(device) or device


def _tensor_cuda(func, args: tuple, kwargs: dict) -> torch.Tensor:
    device = args[1] if len(args) > 1 else kwargs.get("device")
    _cuda_device(0 if device is None else device)  # refuses another index
    return _to(args[0], CUDA0, non_blocking=kwargs.get("non_blocking", False))


def _tensor_cpu(func, args: tuple, kwargs: dict) -> torch.Tensor:
    return _to(args[0], _HOST)


_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _tensor_type(func, args: tuple, kwargs: dict) -> Any:
    if len(args) == 1 and not kwargs and on_fake_cuda(args[0]):
        return _CUDA_TYPES.get(args[0].dtype, func(*args))
    return func(*args, **kwargs)


def _tensor_numpy(func, args: tuple, kwargs: dict) -> Any:
    if on_fake_cuda(args[0]):
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
            "first. (fake_cuda)"
        )
    return func(*args, **kwargs)


def _pin_memory(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """A CPU-only torch cannot pin; on a GPU host the result is a host copy (pinned), here unpinned."""
    if on_fake_cuda(args[0]):
        raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned (fake_cuda)")
    return args[0].clone()


def _record_stream(func, args: tuple, kwargs: dict) -> None:
    """``tensor.record_stream(stream)``: one stream in program order has nothing to record."""
    if not on_fake_cuda(args[0]):
        raise RuntimeError("record_stream: the tensor is on the host, not on the GPU (fake_cuda)")


def _tensor_tolist(func, args: tuple, kwargs: dict) -> Any:
    """``.tolist()`` reads the storage below the dispatcher: counted here as the device-to-host copy CUDA makes."""
    if on_fake_cuda(args[0]):
        host_round_trips.count("to-host")
    return func(*args, **kwargs)


_HANDLERS = {
    torch.Tensor.tolist: _tensor_tolist,
    torch.Tensor.record_stream: _record_stream,
    torch.Tensor.device.__get__: lambda func, args, kwargs: _view_device(args[0]),
    torch.Tensor.is_cuda.__get__: lambda func, args, kwargs: on_fake_cuda(args[0]),
    torch.Tensor.is_cpu.__get__: lambda func, args, kwargs: not on_fake_cuda(args[0]) and func(*args),
    torch.Tensor.get_device: lambda func, args, kwargs: 0 if on_fake_cuda(args[0]) else func(*args, **kwargs),
    torch.Tensor.to: _tensor_to,
    torch.Tensor.cuda: _tensor_cuda,
    torch.Tensor.cpu: _tensor_cpu,
    torch.Tensor.type: _tensor_type,
    torch.Tensor.numpy: _tensor_numpy,
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.is_pinned: lambda func, args, kwargs: False,
}


def _engine_under_the_view(run_backward: Any) -> Any:
    """torch's autograd engine entry (``_engine_run_backward``, called by ``Tensor.backward``,
    ``torch.autograd.backward`` and ``torch.autograd.grad``) with this view active while it runs:
    torch runs a torch function's body with the mode popped, and the hooks and Python backward
    functions the engine calls must see the GPU too."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(mode, _DeviceView) for mode in torch.overrides._get_current_function_mode_stack()):
            return run_backward(*args, **kwargs)
        with _DeviceView():
            return run_backward(*args, **kwargs)

    return run


class _DeviceView(TorchFunctionMode):
    """Python's view: labelled tensors are on ``cuda:0``; ``device=`` arguments naming CUDA become
    ``cuda:0`` (a CPU-only torch cannot resolve ``"cuda"`` or an index without a GPU). The call's
    arguments are kept while it runs: where the tensors torch's C++ makes inside it go (``_Placement``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None and "device" in kwargs:
            kwargs = {**kwargs, "device": _normalized_device(kwargs["device"])}
        previous = getattr(_state, "call", None)
        _state.call = (args, kwargs)
        try:
            return func(*args, **kwargs) if handler is None else handler(func, args, kwargs)
        finally:
            _state.call = previous


# ---------------------------------------------------------------------------------------------
# torch.cuda as a one-GPU host answers


class _DeviceType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_DEVICE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _REAL_DEVICE)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
            return _cuda_device(args[0])
        return _REAL_DEVICE(*args, **kwargs)


class _OneGpuDevice(metaclass=_DeviceType):
    """``torch.device`` inside the block: ``torch.device(0)`` is the GPU, as on a GPU host (a CPU-only
    torch refuses a bare index: "Cannot access accelerator device"). It makes real ``torch.device``
    objects, and ``isinstance(x, torch.device)`` holds for them; ``type(x) is torch.device`` does not."""


_Event = NullEvent  # an event on one in-order stream: every operation is already complete


class _Stream(torch.Stream):
    """One stream in program order: waits are no-ops, work is complete when it returns. A
    ``torch.Stream`` (of the host) so that torch's argument parser takes it (``record_stream``)."""

    device = property(lambda self: CUDA0)

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stream:
        return super().__new__(cls, device="cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _DeviceContext:
    """``torch.cuda.device(i)``: a context manager on the one GPU."""

    def __init__(self, device: Any) -> None:
        _cuda_device(0 if device is None or device == -1 else device)

    def __enter__(self) -> _DeviceContext:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_PROPERTIES = types.SimpleNamespace(
    name="fake_cuda (one GPU, host memory)",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    multi_processor_count=132,
    is_integrated=False,
    gcnArchName="",
    uuid="fake-cuda-0",
)


def _one_gpu(generator: torch.Generator, stream: _Stream) -> dict[str, Any]:
    """The ``torch.cuda`` attributes a one-GPU host answers, for the block."""

    def set_device(device: Any) -> None:
        _cuda_device(device)

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return generator.get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        generator.set_state(new_state)

    def manual_seed(seed: int) -> None:
        generator.manual_seed(seed)

    def zero(*args: Any, **kwargs: Any) -> int:
        return 0

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    return dict(
        is_available=lambda: True,
        is_initialized=lambda: True,
        _lazy_init=nothing,
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=set_device,
        device=_DeviceContext,
        get_device_name=lambda device=None: _PROPERTIES.name,
        get_device_properties=lambda device=None: _PROPERTIES,
        get_device_capability=lambda device=None: (_PROPERTIES.major, _PROPERTIES.minor),
        is_bf16_supported=lambda including_emulation=True: True,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        get_rng_state_all=lambda: [generator.get_state()],
        set_rng_state_all=lambda states: generator.set_state(states[0]),
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        seed=lambda: generator.seed(),
        seed_all=lambda: generator.seed(),
        initial_seed=lambda: generator.initial_seed(),
        default_generators=(generator,),
        Stream=_Stream,
        Event=_Event,
        stream=lambda s=None: contextlib.nullcontext(s),
        current_stream=lambda device=None: stream,
        default_stream=lambda device=None: stream,
        set_stream=nothing,
        synchronize=nothing,
        empty_cache=nothing,
        memory_allocated=zero,
        max_memory_allocated=zero,
        memory_reserved=zero,
        max_memory_reserved=zero,
        reset_peak_memory_stats=nothing,
        reset_max_memory_allocated=nothing,
        memory_stats=lambda device=None: {},
    )


_RANDOM = ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "manual_seed")
_RANDOM += ("manual_seed_all", "seed", "seed_all", "initial_seed")
_MISSING = object()
_active = threading.Lock()


@contextlib.contextmanager
def _tensors_made_on_the_host() -> Iterator[None]:
    """``torch.tensor(data, device="cuda")``: made on the host, then moved by a dispatched copy (torch
    would otherwise ask the CUDA allocator directly, which a CPU-only build lacks)."""
    previous = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        yield
    finally:
        torch._C._set_only_lift_cpu_tensors(previous)


@contextlib.contextmanager
def fake_cuda(seed: int = 0) -> Iterator[None]:
    """Run the block as on a one-GPU host with the host's memory labelled as the GPU's (module doc).

    ``seed`` seeds the generator that stands for the GPU's. Not reentrant, one thread at a time.
    """
    if not _active.acquire(blocking=False):
        raise RuntimeError("fake_cuda() is already active (it is not reentrant)")
    try:
        generator = torch.Generator().manual_seed(seed)
        cuda = _one_gpu(generator, _Stream())
        random = {name: cuda[name] for name in _RANDOM}
        nvtx = dict(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)
        with contextlib.ExitStack() as stack:
            stack.enter_context(attributes_set(torch.cuda, **cuda))
            stack.enter_context(attributes_set(torch.cuda.random, **random))
            stack.enter_context(attributes_set(torch.cuda.nvtx, **nvtx))
            stack.enter_context(attributes_set(torch, device=_OneGpuDevice))
            engine = _engine_under_the_view(torch.autograd.graph._engine_run_backward)
            stack.enter_context(attributes_set(torch.autograd.graph, _engine_run_backward=engine))
            stack.enter_context(attributes_set(torch.autograd, _engine_run_backward=engine))
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(_tensors_made_on_the_host())
            stack.enter_context(_Placement())
            stack.enter_context(_DeviceView())
            yield
    finally:
        _active.release()
