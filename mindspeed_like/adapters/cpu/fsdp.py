"""CPU adapter, fully sharded data parallelism: megatron's two FSDP paths on a host.

torch's FSDP2 (``fully_shard``) itself runs on a CPU mesh over gloo: torch 2.13 all-gathers with
``all_gather_single`` and reduce-scatters with ``reduce_scatter_single(AVG)``, both served by gloo.
What stops megatron's wrappers on a host is megatron's own spelling of the device:

* ``distributed.torch_fully_sharded_data_parallel.TorchFullyShardedDataParallel.__init__``
  (``--use-torch-fsdp2``) builds its mesh with ``DeviceMesh.from_group(group, "cuda")``; as a host
  twin the mesh is on "cpu" and ``fully_shard`` shards on the host, nothing else changes.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host

FSDP2 = "distributed.torch_fully_sharded_data_parallel.TorchFullyShardedDataParallel"

PATCHES = [
    on_host(f"{FSDP2}.__init__", "DeviceMesh.from_group(..., 'cuda')"),
]
