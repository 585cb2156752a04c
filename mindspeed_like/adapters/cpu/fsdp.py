"""CPU adapter, fully sharded data parallelism: megatron's two FSDP paths on a host.

torch's FSDP2 (``fully_shard``) and DTensors run on a CPU mesh over gloo: torch 2.13 all-gathers with
``all_gather_single`` and reduce-scatters with ``reduce_scatter_single``, both served by gloo. What
stops megatron's wrappers on a host is megatron's own spelling of the device; each target below runs
as its host twin (``host_view``: meshes on "cpu", ``f"cuda:{torch.cuda.current_device()}"`` reads
"cpu", streams and events are the host's program order, ``.cuda()`` stays on the host).

torch FSDP2 (``--use-torch-fsdp2``):

* ``distributed.torch_fully_sharded_data_parallel.TorchFullyShardedDataParallel.__init__``:
  ``DeviceMesh.from_group(group, "cuda")``.

Megatron-FSDP (``--use-megatron-fsdp``; megatron-core 0.14+ vendors it under
``distributed.fsdp.src.megatron_fsdp``, 0.13 had ``distributed.custom_fsdp``, not adapted):

* ``mcore_fsdp_adapter.FullyShardedDataParallel.__init__`` / ``_init_dist_index``: the device
  (``cuda:N``) and the DP x TP (and HSDP, expert) meshes on "cuda";
* ``megatron_fsdp.MegatronFSDP.__init__`` / ``_init_fsdp_param_and_grad_buffer``: the device and the
  all-gather / reduce-scatter streams;
* ``param_and_grad_buffer``: ``GradReducePipeline`` and ``AllGatherPipeline`` (their streams, the
  stream switches around each bucket's collective), ``FixedPoolAllocator.allocate``
  (``--fsdp-double-buffer``: a device sync before a new pool buffer);
* ``utils.GlobalMemoryBuffer.get_tensor``: megatron-FSDP's own scratch buffers (the double buffer);
* ``uneven_dtensor.validate_uneven_dtensor``: a boundary check moved with ``.cuda()`` before its
  all-reduce (checkpoints);
* ``mcore_fsdp_adapter._get_rng_state_dict`` / ``_load_rng_state_dict`` (0.16+): the RNG state of an
  ``fsdp_dtensor`` checkpoint (the "cuda" generator is the host's);
* ``transformer.fsdp_dtensor_checkpoint.validate_loaded_state_dict``: its mesh on "cuda";
* ``fully_shard.fully_shard_model``: megatron-FSDP's own ``fully_shard`` API (its mesh on "cuda");
* ``param_and_grad_buffer.gradient_reduce_preprocessing``: the default ``gradient_reduce_div_fusion``
  reduce-scatters with NCCL's ``PREMUL_SUM``, which gloo refuses; without NCCL megatron's own
  scale-then-SUM branch runs instead (``scale_then_sum``).

What is left is listed in ``not_adapted.py`` with its reason (megatron_fsdp's standalone RNG tracker,
which megatron-core replaces by its own; NCCL user buffers; FP8; meta-device initialization).
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.targets import CORE

FSDP2 = "distributed.torch_fully_sharded_data_parallel.TorchFullyShardedDataParallel"
ADAPTER = "distributed.fsdp.mcore_fsdp_adapter"
MFSDP = "distributed.fsdp.src.megatron_fsdp"
BUFFER = f"{MFSDP}.param_and_grad_buffer"

_MEGATRON_FSDP = ">=0.14"

PATCHES = [
    on_host(f"{FSDP2}.__init__", "DeviceMesh.from_group(..., 'cuda')"),
    *[
        on_host(target, why, versions=_MEGATRON_FSDP)
        for target, why in (
            (f"{ADAPTER}.FullyShardedDataParallel.__init__", "device cuda:{torch.cuda.current_device()}"),
            (f"{ADAPTER}.FullyShardedDataParallel._init_dist_index", "DeviceMesh.from_group(..., 'cuda')"),
            (f"{MFSDP}.megatron_fsdp.MegatronFSDP.__init__", "device cuda:{torch.cuda.current_device()}"),
            (f"{MFSDP}.megatron_fsdp.MegatronFSDP._init_fsdp_param_and_grad_buffer", "torch.cuda.Stream()"),
            (f"{BUFFER}.GradReducePipeline.__init__", "torch.cuda.Stream()"),
            (f"{BUFFER}.GradReducePipeline._bucket_group_gradient_reduce", "torch.cuda stream switches"),
            (f"{BUFFER}.GradReducePipeline.wait_for_previous_grad_reduce", "torch.cuda.current_stream()"),
            (f"{BUFFER}.AllGatherPipeline.__init__", "torch.cuda.Stream()"),
            (f"{BUFFER}.AllGatherPipeline.all_gather_params", "torch.cuda stream switches"),
            (f"{BUFFER}.FixedPoolAllocator.allocate", "torch.cuda.synchronize() (--fsdp-double-buffer)"),
            (f"{MFSDP}.utils.GlobalMemoryBuffer.get_tensor", "scratch buffer on torch.cuda.current_device()"),
            (f"{MFSDP}.uneven_dtensor.validate_uneven_dtensor", "boundary check moved with .cuda()"),
            (f"{MFSDP}.fully_shard.fully_shard_model", "init_device_mesh('cuda', ...)"),
        )
    ],
    # megatron-core 0.16+: the RNG state an fsdp_dtensor checkpoint carries (0.14 and 0.15 have neither
    # function: the CPU adapter failed to apply there with a PatchTargetError)
    *[
        on_host(f"{ADAPTER}.{name}", why, versions=">=0.16")
        for name, why in (
            ("_get_rng_state_dict", "torch.cuda.get_rng_state() in fsdp_dtensor checkpoints"),
            ("_load_rng_state_dict", "torch.cuda.set_rng_state() in fsdp_dtensor checkpoints"),
        )
    ],
    # the double buffer's limit (its torch.cuda.stream from megatron-core 0.18.0; 0.17.1's has none) and
    # 0.19's max-pool allocator
    on_host(f"{BUFFER}.GradReducePipeline._enforce_double_buffer_limit", "torch.cuda.stream", versions=">=0.18"),
    on_host(f"{BUFFER}.MaxPoolAllocator.allocate", "torch.cuda.synchronize()", versions=">=0.19"),
    on_host(
        "transformer.fsdp_dtensor_checkpoint.validate_loaded_state_dict",
        "DeviceMesh.from_group(..., 'cuda')",
        versions=">=0.16",
    ),
]


def _premul_sum_available() -> bool:
    """NCCL alone implements ``ReduceOp.PREMUL_SUM``; gloo refuses it ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). A host's process groups are gloo."""
    import torch.distributed as dist

    return dist.is_nccl_available() and dist.is_initialized() and dist.get_backend() == "nccl"


def scale_then_sum(wrapped, instance, args, kwargs):
    """megatron-FSDP's default ``gradient_reduce_div_fusion`` reduce-scatters with NCCL's
    ``PREMUL_SUM(1/DP)``. Without NCCL the same reduction is megatron's own unfused branch of
    ``gradient_reduce_preprocessing``: the gradient scaled in place, then SUM (what
    ``--no-gradient-reduce-div-fusion`` runs, bit for bit)."""
    from mindspeed_like.toolkit.binding import Call
    from mindspeed_like.toolkit.overrides import with_fields

    call = Call(wrapped, args, kwargs)
    ddp_config = call["ddp_config"]
    if not getattr(ddp_config, "gradient_reduce_div_fusion", False) or _premul_sum_available():
        return wrapped(*args, **kwargs)
    return call(ddp_config=with_fields(ddp_config, gradient_reduce_div_fusion=False))


PATCHES.append(
    Patch(
        f"{CORE}.{BUFFER}.gradient_reduce_preprocessing",
        Kind.WRAP,
        scale_then_sum,
        versions=_MEGATRON_FSDP,
        why="gradient_reduce_div_fusion's PREMUL_SUM is NCCL-only: gloo gets megatron's scale-then-SUM branch",
    )
)
