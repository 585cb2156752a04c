"""CPU adapter, distributed checkpointing: ``megatron.core.dist_checkpointing`` save and load.

``dist_checkpointing.save``/``load`` (the model's and the optimizers' ``sharded_state_dict``)
go through a few functions that sync "the device" or put a one-element flag tensor on it before
a collective. On a CPU host each raises ("Torch not compiled with CUDA enabled"). Each target
below is the function holding the call (0.13-0.16); each runs as its host twin
(``mindspeed_like.adapters.cpu.host_view``: ``torch.cuda.synchronize`` is a no-op, the flag lives on
the CPU, where gloo reduces it):

* ``strategies.filesystem_async.FileSystemWriterAsync.preload_tensors`` (a staticmethod):
  ``torch.cuda.synchronize()`` after the device-to-host copies; every save runs it (the
  synchronous save executes the async request in place);
* ``strategies.state_dict_saver.save_state_dict_async_finalize``: the failure flag broadcast
  from the coordinator, on ``torch.cuda.current_device()``; every save runs it;
* ``strategies.state_dict_saver.verify_global_md_reuse``: ``device='cuda'`` flag, when a save
  reuses the cached global metadata (``dist_checkpointing.save(..., validate_access_integrity``
  / cached plans);
* ``strategies.async_utils.AsyncCaller.sync_all_async_calls``,
  ``TemporalAsyncCaller.schedule_async_call``, ``AsyncCallsQueue.maybe_finalize_async_calls``:
  the same device sync / device flag, for ``async_save`` users;
* ``strategies.fully_parallel.FullyParallelLoadStrategyWrapper.load``: device syncs after the
  exchange of loaded shards (``FullyParallelLoadStrategyWrapper`` users);
* ``exchange_utils._get_empty_tensor_for_exchange``, ``exchange_loaded_tensors_gather_rounds``
  and ``exchange_loaded_tensors_broadcast``: buffers for that exchange on ``device="cuda"``, and
  loaded shards moved with ``.cuda()`` (read ``.cpu()`` in a twin) before the collective.

The DistributedOptimizer's parameter state (the optimizer's half of a checkpoint), in
``optimizer.distrib_optimizer.DistributedOptimizer`` (0.13-0.16):

* ``get_parameter_state_dp_zero``: gathers each bucket's state to DP rank 0 in buffers on
  ``torch.cuda.current_device()`` after ``send_tensor.cuda()`` (unless gloo is asked for);
  used by ``save_parameter_state`` and the ``fully_reshardable``/``dp_zero_gather_scatter``
  sharded formats;
* ``load_state_dict``: a fresh optimizer (no step taken yet) gets dummy state tensors on
  ``torch.cuda.current_device()`` before the loaded values are copied in.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host

CKPT = "dist_checkpointing"

PATCHES = [
    on_host(f"{CKPT}.strategies.filesystem_async.FileSystemWriterAsync.preload_tensors", "torch.cuda.synchronize()"),
    on_host(
        f"{CKPT}.strategies.state_dict_saver.save_state_dict_async_finalize", "flag on torch.cuda.current_device()"
    ),
    on_host(f"{CKPT}.strategies.state_dict_saver.verify_global_md_reuse", "flag on device='cuda'"),
    on_host(f"{CKPT}.strategies.async_utils.AsyncCaller.sync_all_async_calls", "flag on torch.cuda.current_device()"),
    on_host(f"{CKPT}.strategies.async_utils.TemporalAsyncCaller.schedule_async_call", "torch.cuda.synchronize()"),
    on_host(
        f"{CKPT}.strategies.async_utils.AsyncCallsQueue.maybe_finalize_async_calls",
        "flag on torch.cuda.current_device()",
    ),
    on_host(f"{CKPT}.strategies.fully_parallel.FullyParallelLoadStrategyWrapper.load", "torch.cuda.synchronize()"),
    on_host(f"{CKPT}.exchange_utils._get_empty_tensor_for_exchange", "exchange buffers on device='cuda'"),
    on_host(f"{CKPT}.exchange_utils.exchange_loaded_tensors_gather_rounds", "device='cuda' buffers, .cuda()"),
    on_host(f"{CKPT}.exchange_utils.exchange_loaded_tensors_broadcast", ".cuda() before the broadcast"),
    on_host(
        "optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero",
        "gather buffers on torch.cuda.current_device(), .cuda()",
    ),
    on_host(
        "optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
        "dummy state on torch.cuda.current_device()",
    ),
]
