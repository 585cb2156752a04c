"""Run megatron's own functions on a CPU host: their CUDA calls see a host view of torch.

Megatron-core spells "the accelerator" in three ways inside function bodies:

1. ``torch.cuda.<fn>()`` (``current_device()`` as a device argument, ``Stream()``,
   ``current_stream()``, ``get_rng_state()``, ``manual_seed()``, ``synchronize()``, ...);
2. the string constant ``'cuda'`` (``device='cuda'``, ``torch.device('cuda')``), and the f-string
   ``f"cuda:{torch.cuda.current_device()}"`` (megatron-FSDP's device);
3. type strings compared with ``tensor.type()`` (``'torch.cuda.FloatTensor'`` ...);
4. the method ``.cuda()`` (``weight.data.cuda()``, ``send_tensor.cuda()``) to move a tensor there.

None of them works on a CPU-only torch, and changing torch itself (``torch.cuda.current_device``
or ``torch.cuda.is_available`` for the whole process) breaks other users of torch, e.g.
``torch.compile``/inductor. :func:`host_function` instead makes a twin of one megatron function
that executes the *same bytecode* (no copied source: every megatron version brings its own)
with

* ``torch`` resolved to :data:`HOST_TORCH`, a read-through view of torch whose ``cuda``
  namespace is :data:`HOST_CUDA` (host device, host RNG, no-op streams and events);
* the constants of (2) and (3) rewritten to their host spelling (``'cpu'``, ``'torch.FloatTensor'``;
  an f-string's literal ``'cuda:'`` to nothing, so ``f"cuda:{torch.cuda.current_device()}"`` reads
  ``"cpu"``);
* the method calls of (4) read as ``.to(...)`` with the same arguments (only method-call loads of
  the name ``cuda`` are rewritten: ``torch.cuda.<fn>`` is an attribute load and keeps going to the
  host view). ``.to()`` takes every argument ``.cuda()`` takes on tensors and modules (``device``,
  ``non_blocking``); the device megatron passes is the host view's ``current_device()``, the CPU,
  so ``x.cuda(torch.cuda.current_device())`` leaves ``x`` where it is. A literal CUDA index
  (``x.cuda(0)``) reaches ``.to(0)``, a CUDA device, and raises: loud, not wrong.

Every other global name is read live from the function's own module (a dict overlay whose
``__missing__`` reads the module's namespace), so later patches and module state stay visible.
:func:`run_on_host` is the wrapt wrapper that calls the twin in place of the original; the
patches that use it name each megatron function they adapt, so the report lists them.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import wrapt

_HOST_CONSTANTS = {
    "cuda": "cpu",
    # the literal part of f"cuda:{torch.cuda.current_device()}": the host view's current_device()
    # formats as "cpu", so the f-string reads "cpu" (an int index would read "0": torch.device
    # refuses it, loud rather than wrong)
    "cuda:": "",
    "torch.cuda.FloatTensor": "torch.FloatTensor",
    "torch.cuda.HalfTensor": "torch.HalfTensor",
    "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor",
}


class NullEvent:
    """A CUDA event on a host where every operation is already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: NullEvent) -> float:
        return 0.0


class _NullStream:
    """The one host "stream": work runs in program order, so waits are no-ops."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> NullEvent:
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = _NullStream()
_HOST_DEVICE = torch.device("cpu")


class _HostNvtx:
    @staticmethod
    def range_push(msg: str) -> None:
        pass

    @staticmethod
    def range_pop() -> None:
        pass


class HostCuda(types.SimpleNamespace):
    """``torch.cuda`` as megatron code sees it on a CPU host.

    The device is the CPU, the "device" random generator is torch's CPU generator (so
    ``torch.cuda.manual_seed`` seeds what CPU dropout draws from), streams and events are
    no-ops. Anything not listed falls through to the real ``torch.cuda`` (e.g. ``FloatTensor``).
    """

    nvtx = _HostNvtx()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @property
    def random(self) -> HostCuda:  # torch.cuda.random.get_rng_state(...)
        return self

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> torch.device:
        return _HOST_DEVICE

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _NullStream:  # noqa: N802 - torch's spelling
        return _HOST_STREAM

    Event = NullEvent

    @staticmethod
    def stream(stream: Any = None) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _HOST_STREAM

    @staticmethod
    def default_stream(device: Any = None) -> _NullStream:
        return _HOST_STREAM

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


class OneDeviceHostCuda(HostCuda):
    """``HostCuda`` with one device, the host, that ``set_device`` selects (nothing to do): for code
    that picks its device as ``rank % torch.cuda.device_count()`` (megatron.training, megatron's
    persistent checkpoint worker), where ``HostCuda``'s 0 devices divide by zero."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        pass


HOST_CUDA = HostCuda()


class HostTorch(types.ModuleType):
    """A read-through view of the ``torch`` module whose ``cuda`` is :data:`HOST_CUDA`."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__("torch", "torch as megatron code sees it on a CPU host (mindspeed_like)")
        self.cuda = HOST_CUDA
        for name, value in overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


HOST_TORCH = HostTorch()


class _Overlay(dict):
    """Globals of a host twin: a few overrides, everything else read live from the module."""

    __slots__ = ("_base", "_fallbacks")

    # Read by the interpreter's C code with plain dict lookups that never reach ``__missing__``:
    # a relative import inside the function (``from .x import y``, e.g. megatron-core 0.18's
    # DistributedDataParallel.__init__) resolves its package from these (KeyError '__name__'
    # otherwise). They never change after the module executed, so copies are exact.
    _MODULE_FACTS = ("__name__", "__package__", "__spec__", "__file__", "__path__", "__loader__")

    def __init__(self, base: dict, overrides: dict, fallbacks: dict) -> None:
        super().__init__(overrides)
        self["__builtins__"] = base.get("__builtins__", __builtins__)
        for key in self._MODULE_FACTS:
            if key in base:
                self[key] = base[key]
        self._base = base
        self._fallbacks = fallbacks

    def __missing__(self, key: str) -> Any:
        try:
            return self._base[key]
        except KeyError:
            if key in self._fallbacks:
                return self._fallbacks[key]
            raise


def _host_constant(value: Any) -> Any:
    if isinstance(value, str):
        return _HOST_CONSTANTS.get(value, value)
    if isinstance(value, tuple):
        return tuple(_host_constant(v) for v in value)
    if isinstance(value, frozenset):
        return frozenset(_host_constant(v) for v in value)
    if isinstance(value, types.CodeType):
        return _host_code(value)
    return value


def _is_method_load(instruction: dis.Instruction) -> bool:
    if instruction.opname == "LOAD_METHOD":  # Python 3.10, 3.11
        return True
    return instruction.opname == "LOAD_ATTR" and sys.version_info >= (3, 12) and bool(instruction.arg & 1)


HOST_METHOD = "to"
"""What a twin calls where megatron calls ``.cuda(...)``: ``.to(...)``, same arguments. It was
``.cpu()`` until ``DynamicGradScaler.load_state_dict``'s ``.cuda(torch.cuda.current_device())``
(an ``--fp16`` resume) met ``cpu()``'s empty signature."""


def _host_method_calls(code: types.CodeType) -> types.CodeType:
    """``x.cuda(...)`` read as ``x.to(...)``: the name operand of each method-call load of ``cuda``
    points at ``to`` instead (same instruction length, so no jump moves)."""
    if "cuda" not in code.co_names:
        return code
    sites = [i for i in dis.get_instructions(code) if i.argval == "cuda" and _is_method_load(i)]
    if not sites:
        return code
    names = list(code.co_names)
    if HOST_METHOD not in names:
        names.append(HOST_METHOD)
    index = names.index(HOST_METHOD)
    raw = bytearray(code.co_code)
    for site in sites:
        arg = index if site.opname == "LOAD_METHOD" else (index << 1) | 1
        if arg > 0xFFFF or (arg > 0xFF) != (site.arg > 0xFF):
            raise TypeError(
                f"{code.co_name}: cannot rewrite .cuda() to .{HOST_METHOD}() in place (operand width); "
                "adapt it with a dedicated patch."
            )
        raw[site.offset + 1] = arg & 0xFF
        if arg > 0xFF:
            raw[site.offset - 1] = arg >> 8  # the operand byte of the preceding EXTENDED_ARG
    return code.replace(co_code=bytes(raw), co_names=tuple(names))


def _host_code(code: types.CodeType) -> types.CodeType:
    code = _host_method_calls(code)
    return code.replace(co_consts=tuple(_host_constant(c) for c in code.co_consts))


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _decorated_function(func: Callable) -> Callable | None:
    """The function a decorator's wrapper calls, if ``func`` is such a wrapper."""
    inner = getattr(func, "__wrapped__", None)
    if inner is None or not getattr(func, "__closure__", None):
        return None
    if any(_cell_contents(c) is inner for c in func.__closure__):
        return inner
    return None


def _redecorate(wrapper: Callable, inner: Callable, twin_inner: Callable) -> Callable:
    """``wrapper`` rebuilt around ``twin_inner`` instead of ``inner`` (same code, same globals)."""
    closure = tuple(types.CellType(twin_inner) if _cell_contents(c) is inner else c for c in wrapper.__closure__)
    twin = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, closure)
    twin.__kwdefaults__ = wrapper.__kwdefaults__
    twin.__dict__.update(wrapper.__dict__)
    twin.__qualname__ = wrapper.__qualname__
    twin.__module__ = wrapper.__module__
    twin.__doc__ = wrapper.__doc__
    twin.__wrapped__ = twin_inner
    return twin


def _refuse_global_writes(func: Callable) -> None:
    """A twin's globals are an overlay: a ``global x; x = ...`` in it would write to the overlay,
    not to the module (CPython stores into a dict subclass directly), and the module would never
    see the change. No function adapted today does that; a future megatron version that does
    must fail here, loudly, instead of silently losing the write."""
    stack = [func.__code__]
    while stack:
        code = stack.pop()
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for instruction in dis.get_instructions(code):
            if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                raise TypeError(
                    f"{func.__module__}.{func.__qualname__} assigns the module global {instruction.argval!r}; "
                    "it cannot run as a host twin (the write would be lost). Adapt it with a dedicated patch."
                )


_twins: weakref.WeakKeyDictionary[Callable, Callable] = weakref.WeakKeyDictionary()


def host_function(
    func: Callable,
    torch_view: HostTorch = HOST_TORCH,
    missing_globals: dict | None = None,
    overrides: dict | None = None,
) -> Callable:
    """A twin of ``func`` running its own bytecode with the host view of torch (see module doc).

    A decorator's wrapper (``@contextlib.contextmanager``, ``@torch.amp.custom_bwd``, any
    ``functools.wraps`` wrapper holding the function in its closure) is kept: the twin is the
    same wrapper around the twin of the decorated function. A ``functools.lru_cache`` wrapper
    (C code, no closure; e.g. ``RotaryEmbedding.forward`` in megatron-core 0.13-0.15) becomes a
    new cache of the same ``maxsize``/``typed`` around the twin, so caching behaves as megatron's.
    ``missing_globals`` supplies names the module does not define, e.g. one that megatron
    binds only when an optional package imports (used only while the module lacks them).
    ``overrides`` are further module globals the twin reads as the objects given, whatever the
    module holds (e.g. a class seen with one attribute changed), beside ``torch``.
    """
    if isinstance(func, functools._lru_cache_wrapper):
        cached = host_function(func.__wrapped__, torch_view, missing_globals, overrides)
        return functools.lru_cache(**func.cache_parameters())(cached)
    decorated = _decorated_function(func)
    if decorated is not None:
        return _redecorate(func, decorated, host_function(decorated, torch_view, missing_globals, overrides))
    _refuse_global_writes(func)
    overlay = _Overlay(func.__globals__, {"torch": torch_view, **(overrides or {})}, dict(missing_globals or {}))
    twin = types.FunctionType(
        _host_code(func.__code__),
        overlay,
        func.__name__,
        tuple(_host_constant(d) for d in func.__defaults__) if func.__defaults__ else None,
        func.__closure__,
    )
    twin.__kwdefaults__ = (
        {k: _host_constant(v) for k, v in func.__kwdefaults__.items()} if func.__kwdefaults__ else None
    )
    twin.__qualname__ = func.__qualname__
    twin.__module__ = func.__module__
    twin.__doc__ = func.__doc__
    twin.__wrapped__ = func
    return twin


def _twin(func: Callable, key: Any, factory: Callable[[Callable], Callable]) -> Callable:
    cache = _twins.setdefault(func, {})  # type: ignore[arg-type]
    twin = cache.get(key)
    if twin is None:
        twin = cache[key] = factory(func)
    return twin


def host_wrapper(torch_view: HostTorch = HOST_TORCH, missing_globals: dict | None = None) -> Callable:
    """A wrapt wrapper that calls the host twin of the wrapped function (built once, cached).

    Works for module functions, methods, static and class methods: the twin is made from the
    underlying function and called with the instance the wrapped callable was bound to.
    """
    key = (id(torch_view), tuple(sorted((k, id(v)) for k, v in (missing_globals or {}).items())))

    def wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        if isinstance(wrapped, wrapt.PartialCallableObjectProxy):
            # a method called through its class (``Base.__init__(self, ...)``, as subclasses do):
            # wrapt took the instance out of args and holds it in this partial
            twin = _twin(wrapped.__wrapped__, key, lambda f: host_function(f, torch_view, missing_globals))
            return twin(instance, *args, **kwargs)
        func = getattr(wrapped, "__func__", wrapped)
        twin = _twin(func, key, lambda f: host_function(f, torch_view, missing_globals))
        bound_to = getattr(wrapped, "__self__", None)
        if bound_to is not None and not isinstance(wrapped, types.BuiltinFunctionType):
            return twin(bound_to, *args, **kwargs)
        return twin(*args, **kwargs)

    wrapper.__name__ = "run_on_host"
    wrapper.runs_host_twin = True  # read by the CUDA-site inventory test: this wrapper twins its target
    return wrapper


run_on_host = host_wrapper()
