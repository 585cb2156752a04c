"""CPU adapter, the persistent async-save worker (``--async-save --use-persistent-ckpt-worker``).

megatron-core's ``PersistentAsyncCaller`` (``dist_checkpointing.strategies.async_utils``) starts
one checkpoint writer per rank with multiprocessing ``spawn`` (target
``PersistentAsyncCaller.async_loop``) and hands it each save through queues. On a CPU host this
failed four ways, each leaving the trainer waiting forever on a queue (the run never ended):

1. the worker's first act is ``torch.cuda.set_device(rank % torch.cuda.device_count())``: a
   ``ZeroDivisionError`` (device count 0) on a CPU-only torch, and the worker is gone;
2. a spawned worker is a new interpreter: the import line has not run there, so megatron's
   ``FileSystemWriterAsync.preload_tensors`` (``torch.cuda.synchronize()``) raises in it;
3. the request cannot even reach the worker: its ``preload_fn`` is a ``partial`` of the
   cpu-adapter's wrapped ``preload_tensors`` (a wrapt proxy), which does not pickle; the queue's
   feeder thread prints the error and drops the request;
4. a CPU tensor put on a multiprocessing queue is moved to shared memory and SHARED with the
   worker, and megatron's preload (on a GPU the device-to-host copy the trainer waits for) is no
   copy on a host (``.to("cpu")`` of a host tensor is the tensor): the worker would write the
   parameters the trainer has gone on updating.

The patches (the targets exist from megatron-core 0.13 on; megatron's own bodies run each time):

* ``PersistentAsyncCaller.async_loop``: megatron's loop runs as a twin whose ``torch.cuda`` has
  one device, the host (``device_count()`` 1, ``set_device`` selects nothing). Not a plain host
  twin: the host view's ``device_count()`` is 0 (what a host has), which the loop divides by.
* ``PersistentAsyncCaller.schedule_async_call`` (the trainer): megatron's body runs as a twin
  that starts :func:`worker_main` (a module-level function: a spawned process finds it by name)
  instead of ``async_loop``; the request is first made sendable: each wrapped (patched) callable
  in it becomes a reference by name (:class:`ByName`), resolved in the worker, where the same
  patches are in place, and every tensor it carries is copied (the copy is what the queue moves
  to shared memory; the trainer's own tensors stay its own). The request is test-pickled without
  its tensors, so one that cannot be sent fails here with the reason instead of being dropped.
  While megatron waits for the worker to stage the tensors, a watcher thread checks that the
  worker lives: one that died releases the wait and the call raises :class:`WorkerDied`.
* ``PersistentAsyncCaller.is_current_async_call_done``: megatron polls the completion queue
  forever when blocking; a worker that died before answering raises :class:`WorkerDied`.
* ``PersistentAsyncCaller.close``: megatron puts ``'DONE'`` and joins the queue, which a dead
  worker never drains (the process would hang at exit); a dead worker is only reaped.

:func:`worker_main` brings the worker up as a process of the run: it imports the run's entry
(``mindspeed_like.megatron_adaptor``, the import line; the flags come from the inherited
``MINDSPEED_LIKE_ARGS`` and the command line, which ``spawn`` hands to the child), so the
patches the trainer has (the cpu-adapter's ``preload_tensors`` twin, the loop above) apply to
what the worker runs, then calls ``PersistentAsyncCaller.async_loop``. Flags given only through
``mindspeed_like.configure()`` in the trainer are not seen by the worker; on a host the
cpu-adapter is on in both.

Not covered: :class:`WorkerDied` is raised on the rank whose worker died; the other ranks wait in
megatron's next collective until the launcher ends them (torchrun does at the first failed rank) or
the process group times out.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import threading
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch
import wrapt

from mindspeed_like.adapters.cpu.host_view import HostTorch, OneDeviceHostCuda, host_function
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.targets import CORE

CALLER = "dist_checkpointing.strategies.async_utils.PersistentAsyncCaller"

RUN_ENTRY = "mindspeed_like.megatron_adaptor"
"""What makes a new interpreter a process of the run: the import line. Imported by name, and only
in the worker's own new process (:func:`worker_main`), never in the process that applies these
patches: the adapter does not reach up to the runtime, the worker starts the way every rank of
the run started."""

TRAINER_GONE_EXIT_CODE = 3
"""The exit code of a worker that ended because its trainer's process ended."""

POLL_S = 0.1
"""How often the trainer looks at its worker while it waits on it (megatron polls its completion
queue at the same period)."""


WORKER_TORCH = HostTorch(cuda=OneDeviceHostCuda())
"""``torch`` as the worker's loop sees it: one device, the host."""


class WorkerDied(RuntimeError):
    """The persistent checkpoint worker of this rank exited while the trainer waited on it."""


def _died(caller: Any, waiting_for: str) -> WorkerDied:
    process = caller.process
    return WorkerDied(
        f"rank {torch.distributed.get_rank()}: megatron's persistent checkpoint worker (pid {process.pid}) "
        f"exited with code {process.exitcode} {waiting_for}; its error is printed above, in this rank's "
        "stderr (--use-persistent-ckpt-worker)"
    )


# ---------------------------------------------------------------- the worker process


def _end_with_the_trainer() -> None:
    """A worker whose trainer is gone (killed, crashed) waits on its queue for good: megatron's
    loop has no other way out. A daemon thread ends it when the trainer's process ends (nothing it
    could still write would be finalized: the trainer writes the checkpoint's metadata)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(TRAINER_GONE_EXIT_CODE)

    threading.Thread(target=watch, name="ckpt-worker-trainer-watch", daemon=True).start()


def worker_main(*args: Any, **kwargs: Any) -> None:
    """The worker process's target: the run's entry, then megatron's loop (patched by it)."""
    _end_with_the_trainer()
    importlib.import_module(RUN_ENTRY)
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    PersistentAsyncCaller.async_loop(*args, **kwargs)


@functools.cache
def _loop_twin(loop: Callable) -> Callable:
    return host_function(loop, WORKER_TORCH)


def _loop_on_host(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    return _loop_twin(getattr(wrapped, "__func__", wrapped))(*args, **kwargs)


# ---------------------------------------------------------------- the request, sendable


class ByName:
    """A callable that pickles as its place (module, qualified name, and the object it is bound
    to if any) and is looked up there when called: in the worker, that is the function as the
    worker's patches left it. For the engine's wrapped functions (wrapt proxies), which do not
    pickle."""

    def __init__(self, module: str, qualname: str, bound_to: Any = None) -> None:
        if "<locals>" in qualname:
            raise TypeError(f"{module}.{qualname} is a local function: a spawned worker cannot look it up")
        self.module, self.qualname, self.bound_to = module, qualname, bound_to

    @classmethod
    def of(cls, proxy: wrapt.FunctionWrapper | wrapt.BoundFunctionWrapper) -> ByName:
        target = proxy.__wrapped__
        function = getattr(target, "__func__", target)
        bound_to = getattr(target, "__self__", None)
        return cls(function.__module__, function.__qualname__, bound_to)

    def resolve(self) -> Callable:
        if self.bound_to is not None:
            return getattr(self.bound_to, self.qualname.rpartition(".")[2])
        found: Any = importlib.import_module(self.module)
        for name in self.qualname.split("."):
            found = getattr(found, name)
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ByName({self.module}.{self.qualname})"


_WRAPPED = (wrapt.FunctionWrapper, wrapt.BoundFunctionWrapper)  # what the engine's WRAP patches install


def _sendable_callable(function: Any, copies: dict[int, torch.Tensor]) -> Any:
    if isinstance(function, functools.partial):
        return functools.partial(
            _sendable_callable(function.func, copies),
            *_copied(function.args, copies),
            **_copied(function.keywords, copies),
        )
    if isinstance(function, _WRAPPED):
        return ByName.of(function)
    return function


def _copied(value: Any, copies: dict[int, torch.Tensor]) -> Any:
    """``value`` with every tensor in its lists, tuples and dicts replaced by a copy (one copy per
    tensor object: a tensor met twice is copied once)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.detach().clone()
        return copies[id(value)]
    if isinstance(value, list):
        return [_copied(v, copies) for v in value]
    if isinstance(value, tuple):
        items = [_copied(v, copies) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _copied(v, copies) for k, v in value.items()}
    return value


class _WithoutTensors(multiprocessing.reduction.ForkingPickler):
    def persistent_id(self, obj: Any) -> Any:
        return id(obj) if isinstance(obj, torch.Tensor) else None


def sendable(request: Any) -> Any:
    """The ``AsyncRequest`` as the worker can take it (see the module doc); raises TypeError
    naming the reason if it still cannot be pickled."""
    copies: dict[int, torch.Tensor] = {}
    request = request._replace(
        async_fn=_sendable_callable(request.async_fn, copies),
        async_fn_args=tuple(_copied(list(request.async_fn_args), copies)),
        async_fn_kwargs=_copied(dict(request.async_fn_kwargs), copies),
        preload_fn=_sendable_callable(request.preload_fn, copies) if request.preload_fn else request.preload_fn,
    )
    try:
        _WithoutTensors(io.BytesIO()).dump(request)
    except Exception as error:
        raise TypeError(
            f"this async checkpoint request cannot be sent to the persistent checkpoint worker "
            f"(--use-persistent-ckpt-worker): {type(error).__name__}: {error}"
        ) from error
    return request


# ---------------------------------------------------------------- the trainer side


def _starts_worker_main(caller_class: type) -> Any:
    """``PersistentAsyncCaller`` as ``schedule_async_call``'s twin reads it: a subclass whose
    ``async_loop`` (the spawned target) is :func:`worker_main`, all else megatron's."""
    return type(caller_class.__name__, (caller_class,), {"async_loop": staticmethod(worker_main)})


@functools.cache
def _schedule_twin(schedule: Callable, caller_class: type) -> Callable:
    return host_function(schedule, overrides={caller_class.__name__: _starts_worker_main(caller_class)})


def _watch(caller: Any, finished: threading.Event, died: list[int]) -> None:
    """Until ``finished``: once the worker has exited, release megatron's wait for it to stage the
    tensors (``preload_q.join()``), each time something is left to release."""
    while not finished.wait(POLL_S):
        process = caller.process
        if process is None or process.exitcode is None:  # not started yet (is_alive() is False then), or alive
            continue
        if not died:
            died.append(process.exitcode)
        with contextlib.suppress(ValueError):  # nothing waited on yet (or any more)
            caller.preload_q.task_done()


def _schedule_on_host(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    call = Call(wrapped, args, kwargs)
    arguments = call.arguments
    name, request = next(iter(arguments.items()))  # the request: megatron's one parameter
    if request.async_fn is None:
        return wrapped(*args, **kwargs)
    arguments[name] = sendable(request)
    twin = _schedule_twin(wrapped.__func__, type(instance))
    finished, died = threading.Event(), []
    watcher = threading.Thread(target=_watch, args=(instance, finished, died), daemon=True)
    watcher.start()
    try:
        result = twin(instance, **arguments)
    finally:
        finished.set()
        watcher.join()
    if died:
        raise _died(instance, "before it had staged the checkpoint request")
    return result


def _done_or_died(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """megatron's check, after this rank's answer is in (or known not to come)."""
    blocking = Call(wrapped, args, kwargs).get("blocking", False)
    process = instance.process
    if process is not None and instance.cur_item is None:
        while True:
            try:
                instance.cur_item = instance.comp_q.get(timeout=POLL_S) if blocking else instance.comp_q.get_nowait()
                break
            except Empty:
                if process.exitcode is not None and instance.comp_q.empty():
                    raise _died(instance, "before it finished writing the checkpoint") from None
                if not blocking:
                    break
    return wrapped(*args, **kwargs)


def _close_dead(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    process = instance.process
    if process is not None and process.exitcode is not None:
        process.join()
        instance.process = None  # megatron's close then has nothing to stop
    return wrapped(*args, **kwargs)


ADAPTED_VERSIONS = "<0.17"
"""Run on 0.13.1 and 0.16.1 (0.14/0.15 read): one process per caller instance. megatron-core 0.19 keeps
one worker per class (``PersistentAsyncCaller._get_process``), which these patches do not reach (its
spawn pickled the wrapped loop and failed); 0.17/0.18 not read. There it stays refused
(``not_adapted``)."""


def _caller(name: str, new: Callable, why: str) -> Patch:
    return Patch(f"{CORE}.{CALLER}.{name}", Kind.WRAP, new, why=why, versions=ADAPTED_VERSIONS)


PATCHES = [
    _caller(
        "async_loop",
        _loop_on_host,
        "torch.cuda.set_device(rank % torch.cuda.device_count()): the worker's one device is the host",
    ),
    _caller(
        "schedule_async_call",
        _schedule_on_host,
        "spawns worker_main (the run's entry, then the loop); the request sendable; a dead worker raises",
    ),
    _caller("is_current_async_call_done", _done_or_died, "a dead worker raises instead of a wait without end"),
    _caller("close", _close_dead, "a dead worker is reaped, not waited on"),
]
