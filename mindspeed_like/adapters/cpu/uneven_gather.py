"""CPU adapter: megatron's all-gather of uneven first-dimension pieces on gloo.

``tensor_parallel.mappings._gather_along_first_dim(input_, group, output_split_sizes=...)`` gathers
pieces of different lengths with ``torch.distributed.all_gather(list_of_uneven_tensors, input_)``. NCCL
takes that list; gloo refuses it ("ProcessGroupGloo::allgather: invalid tensor size at index 0
(expected (64, 64), got (60, 64))"). megatron passes split sizes where each rank holds its own number
of rows: the alltoall token dispatcher with expert tensor parallelism > 1 (``dispatch_postprocess``
gathers each expert-TP rank's routed tokens; expert TP defaults to TP, so MoE with TP 2 and EP 2 on 4
ranks stopped at the first forward on a host, with or without FSDP). Its backward (a reduce-scatter
with ``input_split_sizes``) is served by gloo as it is.

On gloo with uneven sizes, each rank's piece is padded to the longest, gathered with
``all_gather_into_tensor`` (equal pieces, which gloo serves) and the padding dropped: the same rows in
the same order as NCCL's gather (copies only, no arithmetic). Everything else, and every other backend,
runs megatron's function as its host twin (``devices.on_host``, what this patch stacked over before).
"""

from __future__ import annotations

import torch

from mindspeed_like.adapters.cpu.host_view import run_on_host
from mindspeed_like.toolkit.binding import Call


def _uneven_on_gloo(group, sizes) -> bool:
    if sizes is None or group is None or group.size() == 1 or len(set(int(s) for s in sizes)) == 1:
        return False
    return torch.distributed.get_backend(group) == "gloo"


def gather_uneven_pieces(input_: torch.Tensor, group, sizes) -> torch.Tensor:
    """The rows of every rank's ``input_`` (rank ``i`` holds ``sizes[i]``) in rank order, over gloo."""
    sizes = [int(s) for s in sizes]
    rank = group.rank()
    if input_.shape[0] != sizes[rank]:
        raise ValueError(
            f"cpu-adapter: this rank holds {input_.shape[0]} rows, output_split_sizes says {sizes[rank]} ({sizes})"
        )
    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: sizes[rank]] = input_
    gathered = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
    return torch.cat([gathered[i * longest : i * longest + size] for i, size in enumerate(sizes)])


def gather_along_first_dim(wrapped, instance, args, kwargs):
    """``_gather_along_first_dim`` on a host: uneven pieces over gloo gathered padded, else its host twin."""
    call = Call(wrapped, args, kwargs)
    group, sizes = call.get("group"), call.get("output_split_sizes")
    if not _uneven_on_gloo(group, sizes):
        return run_on_host(wrapped, instance, args, kwargs)
    return gather_uneven_pieces(call["input_"], group, sizes)


gather_along_first_dim.runs_host_twin = True  # the CUDA-site inventory: the rest runs megatron's host twin
