"""Which pipeline-stage layer an MLP belongs to, for ``--recompute-activation-function-num-layers``.

``TransformerLayer.__init__``'s ``layer_number`` is the layer's 1-based number within its model
chunk (the block passes ``i + 1``; the global number adds the pipeline offset). It is recorded on
the layer's MLPs/GroupedMLPs, so only the first N layers of each stage recompute.
"""

from __future__ import annotations

import torch

from mindspeed_like.toolkit.binding import Call

STAGE_LAYER_ATTR = "_mindspeed_like_stage_layer"  # 1-based layer number within the model chunk


def layer_init(wrapped, instance, args, kwargs):
    """Wrapper of ``TransformerLayer.__init__``: records the layer number on its MLPs."""
    wrapped(*args, **kwargs)
    from megatron.core.transformer import mlp as mlp_module
    from megatron.core.transformer.moe import experts

    # GroupedMLP: megatron-core < 0.17 only (deleted in 0.17); TEGroupedMLP: TE specs
    grouped = (getattr(experts, "GroupedMLP", None), getattr(experts, "TEGroupedMLP", None))
    kinds = tuple(k for k in (mlp_module.MLP, *grouped) if k is not None)
    number = Call(wrapped, args, kwargs)["layer_number"]
    mlp = getattr(instance, "mlp", None)
    if isinstance(mlp, torch.nn.Module):
        for module in mlp.modules():
            if isinstance(module, kinds):
                setattr(module, STAGE_LAYER_ATTR, number)
