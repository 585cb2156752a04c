"""The state dicts Megatron-LM saves and loads with ``--ckpt-format fsdp_dtensor`` under Megatron-FSDP.

Megatron-LM's ``checkpointing.py`` builds them inline (model and optimizer sharded state dicts, then
``preprocess_fsdp_dtensor_state_dict``: fp8 extra state, SwiGLU, the experts' global indices and
uneven-DTensor preprocessing); tests that save and resume through ``torch.distributed.checkpoint``
outside Megatron-LM need the same two dicts.
"""

from __future__ import annotations

from typing import Any


def fsdp_dtensor_state(model: Any, optimizer: Any, loading: bool) -> tuple[dict, dict]:
    """(raw, prepared): the state dicts Megatron-LM builds, before and after its fsdp_dtensor
    preprocessing; ``model`` is megatron's ``FullyShardedDataParallel`` wrapper (``model[0]``)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer import fsdp_dtensor_checkpoint as fdc
    from megatron.core.utils import get_attr_wrapped_model

    state = {"model": model.state_dict_for_save_checkpoint()}
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=loading, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"}
    )
    raw = {"model": dict(state["model"]), "optimizer": dict(state["optimizer"])}
    fdc.handle_fp8_extra_state_case(state["model"])
    megatron_fsdp = model.module  # what Megatron-LM hands it: model[0] unwrapped once
    state["model"], state["optimizer"] = fdc.handle_swiglu_in_state_dict(
        megatron_fsdp, state["model"], state["optimizer"]
    )
    num_experts = get_attr_wrapped_model(model, "config").num_moe_experts
    if num_experts:
        # Megatron-LM's ``if args.num_experts``: the model's expert keys are local (``local_experts.0`` on
        # every EP rank), so each EP rank's experts are renamed to their global index, as the optimizer's
        # keys already are. Without it the EP ranks' experts share names: the save keeps one rank's
        # copy of each and a resume loads it into every EP rank (MoE at EP 2: resumed loss 5.643348
        # against the straight run's 5.637125, megatron-core 0.16.1 and 0.19.2 alike).
        state["model"] = fdc.handle_experts_in_state_dict(state["model"], num_experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return raw, state
