"""Megatron-LM's ``report_theoretical_memory`` on the same run, for the accuracy table.

Its own code (``megatron/training/theoretical_memory_usage.py``) is run, not a copy: the file is
read from Megatron-LM's checkout (``MEGATRON_LM_PATH``, or wherever ``megatron.training`` is
importable) and executed with its relative import from ``megatron.training.utils`` stood in for, so
neither megatron.core nor torch is imported. ``None`` where no Megatron-LM is at hand.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mindspeed_like.plan.spec import Run

RELATIVE = Path("megatron/training/theoretical_memory_usage.py")


def source_path() -> Path | None:
    root = os.environ.get("MEGATRON_LM_PATH")
    if root and (Path(root) / RELATIVE).exists():
        return Path(root) / RELATIVE
    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return None
    if spec and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / RELATIVE.name
        return path if path.exists() else None
    return None


# what the file takes from megatron.training.utils (its one relative import), stood in for: printing
# nothing, and no hybrid (Mamba) model (plan models GPT; 0.19's file asks which it is)
_UTILS_STANDINS = {"print_rank_0": lambda *args, **kwargs: None, "is_hybrid_model": lambda *args, **kwargs: False}
_RELATIVE_IMPORT = re.compile(r"^from \.utils import ([\w, ]+)$", re.M)


def _module(path: Path) -> SimpleNamespace:
    text = path.read_text()
    names = [n.strip() for m in _RELATIVE_IMPORT.finditer(text) for n in m.group(1).split(",")]
    unknown = sorted(set(names) - set(_UTILS_STANDINS))
    if unknown:
        raise ImportError(f"{path} takes {unknown} from megatron.training.utils: plan has no stand-in for them")
    scope: dict[str, Any] = {"__name__": "megatron_lm_theoretical_memory_usage", **_UTILS_STANDINS}
    exec(compile(_RELATIVE_IMPORT.sub("", text), str(path), "exec"), scope)  # Megatron-LM's own file
    return SimpleNamespace(**scope)


class _Arguments(argparse.Namespace):
    """Megatron-LM's argument namespace for the file: an option it reads that the plan does not set
    is None, Megatron-LM's default for its optional features (0.19's file reads ``moe_latent_size``)."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def megatron_args(run: Run) -> argparse.Namespace:
    """The Megatron-LM argument namespace ``report_theoretical_memory`` reads, for ``run``."""
    m, lay = run.model, run.layout
    return _Arguments(
        kv_channels=m.kv_channels,
        num_attention_heads=m.num_attention_heads,
        hidden_size=m.hidden_size,
        group_query_attention=m.num_query_groups != m.num_attention_heads and not m.multi_latent_attention,
        num_query_groups=m.num_query_groups,
        num_experts=m.num_experts or None,
        swiglu=m.gated_linear_unit,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size or None,
        moe_layer_freq=list(m.moe_layer_pattern) if m.is_moe else 1,
        num_layers=m.num_layers,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        mtp_num_layers=m.mtp_num_layers or None,
        normalization=m.normalization,
        multi_latent_attention=m.multi_latent_attention,
        q_lora_rank=m.q_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        kv_lora_rank=m.kv_lora_rank,
        v_head_dim=m.v_head_dim,
        ffn_hidden_size=m.ffn_hidden_size,
        padded_vocab_size=m.vocab_size,
        untie_embeddings_and_output_weights=not m.tied_embeddings,
        pipeline_model_parallel_size=lay.pp,
        tensor_model_parallel_size=lay.tp,
        use_distributed_optimizer=lay.distributed_optimizer,
        data_parallel_size=lay.dp,
        seq_length=m.seq_length,
        micro_batch_size=lay.micro_batch_size,
        virtual_pipeline_model_parallel_size=lay.vpp,
        sequence_parallel=lay.sequence_parallel,
        recompute_granularity=run.recompute.granularity,
        is_hybrid_model=False,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.expert_tp,
        world_size=lay.world_size,
        add_bias_linear=m.add_bias_linear,
        moe_router_topk=m.moe_router_topk,
    )


def report(run: Run) -> dict[str, float] | None:
    """``{"model_state_bytes", "activations_bytes", "total_bytes"}`` as Megatron-LM's
    ``report_theoretical_memory`` computes them (it prints MB = 2**20 bytes), or None."""
    path = source_path()
    if path is None:
        return None
    module = _module(path)
    args = megatron_args(run)
    mib = 2**20
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its figures
        weights_and_optimizer, activations, total = module.report_theoretical_memory(args, run.layout.num_microbatches)
    return {
        "model_state_bytes": weights_and_optimizer * mib,
        "activations_bytes": activations * mib,
        "total_bytes": total * mib,
    }
