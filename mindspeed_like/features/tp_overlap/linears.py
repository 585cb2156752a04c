"""tp-overlap's mechanism: tiled tensor-parallel communication/computation overlap
(``--use-tiled-tp-overlap``, MindSpeed's ``--use-ascend-coc``) and the fused communication+matmul
kernels (``--use-fused-tp-comm-matmul``, MindSpeed's ``--use-ascend-mc2``).

Megatron's ColumnParallelLinear / RowParallelLinear communicate serially with their matmul
(all-gather then matmul, matmul then reduce-scatter or all-reduce). Tiled: the token rows are
cut into ``--tiled-tp-overlap-chunks`` tiles (MindSpeed's ``--coc-parallel-num``) and each
tile's collective runs under another tile's matmul (``mindspeed_like.kernels.tp_overlap``).
MC2: on an NPU the whole all-gather+matmul / matmul+reduce-scatter is one torch_npu kernel.

Targets, and why each is the right symbol:

- ``megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce``
  (WRAP): the function every ColumnParallelLinear (and RowParallelLinear) calls through
  ``_forward_impl`` (0.14-0.16 look it up as a module global at call time; 0.13 assigns it to
  ``self._forward_impl`` inside ``forward``, also a global lookup), re-exported by name from
  ``megatron.core.tensor_parallel`` (the engine re-points that alias). Its arguments say
  whether the call communicates (``sequence_parallel``: forward all-gather + backward
  reduce-scatter; ``allreduce_dgrad``: backward all-reduce); only those calls are taken.
  The Function itself (``LinearWithGradAccumulationAndAsyncCommunication``) is not touched:
  the row-parallel calls and every fallback still run it unchanged.
- ``megatron.core.tensor_parallel.layers.RowParallelLinear.forward`` (WRAP): the row
  layer's reduction (``reduce_scatter_to_sequence_parallel_region`` /
  ``reduce_from_tensor_model_parallel_region``) happens *after* the Function, in ``forward``
  itself, so overlapping it with the matmul needs the whole forward. The wrapper computes
  the reduced output with the tiled (or MC2) Function and then applies the bias exactly as
  megatron does (``skip_bias_add``); everything it does not handle calls megatron's forward.
  The mapping functions are not patched: they are used by many other modules
  (gpt_model, MoE dispatchers, MLA) where no matmul is there to overlap with.

Handed back to megatron's path, logged once per reason (an error under ``strict``): a tile
count of 1, fewer local token rows than tiles, frozen weights (megatron uses
``linear_with_frozen_weight``), expert layers with explicit expert communication, CPU
activation offloading, input not already split (``input_is_parallel=False``), a sequence
length that does not divide by the TP size, a GTP-sharded weight (megatron-core 0.19's
``gtp_remat_size > 1``: megatron all-gathers it inside its own Function). Calls that do not
communicate (TP size 1, expert layers, row-parallel's inner call) pass through silently: there is nothing to overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback

FEATURE_NAME = "tp-overlap"


class TpOverlapUnsupported(FeatureUnsupported):
    """``strict`` is on and a call cannot use the requested overlap."""


@dataclass(frozen=True)
class Overlap:
    """What the flags ask for: tiles (``None``: no tiling) and/or MC2, and the fallback."""

    tiles: int | None
    mc2: bool
    fall_back: Fallback

    def tiles_for(self, local_rows: int) -> int | None:
        """The tile count for a call with ``local_rows`` token rows per rank, or None (logged)."""
        if self.tiles is None:
            return None
        if self.tiles == 1:  # the user's choice: logged, never an error
            self.fall_back.once("tiles=1", f"{FEATURE_NAME}: tiled_tp_overlap_chunks=1, using megatron's path")
            return None
        if local_rows < self.tiles:
            self.fall_back(f"{local_rows} token rows per rank < {self.tiles} tiles")
            return None
        return self.tiles

    def mc2_takes(self, input, weight, group, column: bool) -> bool:
        """True when the MC2 kernels take this (sequence-parallel) call; else logged once."""
        if not self.mc2:
            return False
        from mindspeed_like.kernels.tp_overlap.mc2 import mc2_unsupported

        reason = mc2_unsupported(input, weight, group, column=column)
        if reason is None:
            return True
        self.fall_back(f"fused comm+matmul (MC2): {reason}")
        return False


def _rows(tensor) -> int:
    return math.prod(tensor.shape[:-1])


# ---------------------------------------------------------------- column-parallel


@dataclass(frozen=True)
class ColumnParallelLinear:
    """Wrapper of ``linear_with_grad_accumulation_and_async_allreduce``."""

    overlap: Overlap

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        sequence_parallel, allreduce_dgrad = bool(call["sequence_parallel"]), bool(call["allreduce_dgrad"])
        if not (sequence_parallel or allreduce_dgrad) or call["input"].dim() < 2:
            return wrapped(*args, **kwargs)  # no communication in this call: nothing to overlap
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        group = get_tensor_model_parallel_group_if_none(call.get("tp_group"))
        if group is None or group.size() == 1:
            return wrapped(*args, **kwargs)
        if call.get("gtp_remat_size", 1) > 1:  # megatron-core 0.19+
            self.overlap.fall_back(GTP_REMAT)
            return wrapped(*args, **kwargs)
        input, weight = call["input"], call["weight"]
        common = (
            call["gradient_accumulation_fusion"],
            allreduce_dgrad,
            sequence_parallel,
            call.get("grad_output_buffer"),
            call.get("wgrad_deferral_limit", 0),
            group,
        )
        if sequence_parallel and self.overlap.mc2_takes(input, weight, group, column=True):
            from mindspeed_like.kernels.tp_overlap.mc2 import column_parallel_mc2

            return column_parallel_mc2(input, weight, call["bias"], *common)
        tiles = self.overlap.tiles_for(_rows(input))
        if tiles is None:
            return wrapped(*args, **kwargs)
        from mindspeed_like.kernels.tp_overlap.column import column_parallel_tiled

        return column_parallel_tiled(input, weight, call["bias"], *common, tiles)


# ---------------------------------------------------------------- row-parallel


# megatron-core 0.19's GTP rematerialization: the linear's weight is sharded once more over the
# gtp_remat group and all-gathered inside megatron's Function before each use; the tiled and MC2
# kernels take the local weight as the full matrix, so such calls are handed back.
GTP_REMAT = "GTP-sharded weight (gtp_remat_size > 1: megatron all-gathers it inside its own Function)"


def _row_unsupported(layer, input) -> str | None:
    if getattr(layer, "gtp_remat_size", 1) > 1:  # megatron-core 0.19+
        return GTP_REMAT
    if not layer.weight.requires_grad:
        return "frozen weight (megatron's linear_with_frozen_weight)"
    if not layer.input_is_parallel:
        return "input_is_parallel=False (megatron scatters the input first)"
    offloading = getattr(layer.config, "_cpu_offloading_context", None)
    if offloading is not None and getattr(offloading, "inside_context", False):
        return "CPU activation offloading"
    if input.dim() < 2:
        return f"input of shape {tuple(input.shape)} (needs [tokens..., hidden])"
    if layer.sequence_parallel and input.shape[0] % layer.tp_group.size() != 0:
        return f"sequence length {input.shape[0]} not divisible by the tensor-parallel size {layer.tp_group.size()}"
    return None


@dataclass(frozen=True)
class RowParallelForward:
    """Wrapper of ``RowParallelLinear.forward``."""

    overlap: Overlap

    def __call__(self, wrapped, instance, args, kwargs):
        group = getattr(instance, "tp_group", None)
        if instance.explicit_expert_comm or group is None or group.size() == 1:
            return wrapped(*args, **kwargs)  # megatron reduces nothing here (experts) or TP is 1
        input = Call(wrapped, args, kwargs)["input_"]
        reason = _row_unsupported(instance, input)
        if reason is not None:
            self.overlap.fall_back(reason)
            return wrapped(*args, **kwargs)
        sequence_parallel = bool(instance.sequence_parallel)
        fusion = instance.gradient_accumulation_fusion
        if sequence_parallel and self.overlap.mc2_takes(input, instance.weight, group, column=False):
            from mindspeed_like.kernels.tp_overlap.mc2 import row_parallel_mc2

            output_ = row_parallel_mc2(input, instance.weight, fusion, group)
        else:
            local_rows = _rows(input) // (group.size() if sequence_parallel else 1)
            tiles = self.overlap.tiles_for(local_rows)
            if tiles is None:
                return wrapped(*args, **kwargs)
            from mindspeed_like.kernels.tp_overlap.row import row_parallel_tiled

            output_ = row_parallel_tiled(input, instance.weight, fusion, sequence_parallel, group, tiles)
        if not instance.skip_bias_add:  # megatron's own tail of RowParallelLinear.forward
            output = (output_ + instance.bias) if instance.bias is not None else output_
            return output, None
        return output_, instance.bias
