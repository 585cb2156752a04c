"""megatron's ``make_sharded_tensors_for_checkpoint`` with the groups the installed release takes.

0.14+ take the TP group and the DP x CP group of the module (from ``metadata``); 0.13 reads
megatron's global groups itself. Keys, axes and replica ids are megatron's, so a checkpoint of a
TE-compatible module is the one megatron's TE wrapper writes."""

from __future__ import annotations

from typing import Any

from mindspeed_like.toolkit.binding import accepted


def dp_cp_group(metadata: dict | None) -> Any:
    if metadata is not None and metadata.get("dp_cp_group") is not None:
        return metadata["dp_cp_group"]
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def sharded_tensors(
    state_dict: dict, prefix: str, axis_map: dict[str, int] | None, sharded_offsets, tp_group, metadata: dict | None
) -> dict:
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    groups = accepted(make_sharded_tensors_for_checkpoint, tp_group=tp_group, dp_cp_group=None)
    if "dp_cp_group" in groups:
        groups["dp_cp_group"] = dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, axis_map, sharded_offsets, **groups)
