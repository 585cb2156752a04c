"""megatron's FSDP paths with model parallelism (issue 54 items 1 and 2): TP, CP, EP and HSDP.

Megatron-LM allows, with ``--use-torch-fsdp2``, tensor and context parallelism (the FSDP2 mesh is the
data x context group; a parameter stays a TP shard inside its DTensor) and refuses pipeline and expert
parallelism; with ``--use-megatron-fsdp`` TP, CP, EP and hybrid sharding
(``--num-distributed-optimizer-instances``), refusing only hybrid context parallelism. Each layout
trains as the same layout without FSDP: DDP for FSDP2, the distributed optimizer for Megatron-FSDP
(its optimizer). docs/features/fsdp.md has the Megatron-LM runs and their losses.

The first stop was ours: for TP/CP the cpu-training-loop set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (what
Megatron-LM asserts for TP/CP without FSDP), and Megatron-LM asserts the opposite under both FSDP
paths ("FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one").
"""

from __future__ import annotations

import os
import types

import pytest

from mindspeed_like.adapters.cpu_training.arguments import host_defaults


def _args(**overrides) -> types.SimpleNamespace:
    values = dict(transformer_impl="local", distributed_backend="gloo", tensor_model_parallel_size=2, rank=1)
    return types.SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("flag", ["use_torch_fsdp2", "use_megatron_fsdp", "overlap_moe_expert_parallel_comm", None])
def test_max_connections_set_only_where_megatron_lm_asserts_it(monkeypatch, flag):
    """Megatron-LM's validate_args (core_v0.16.1, arguments.py 927-953): TP/CP assert
    ``CUDA_DEVICE_MAX_CONNECTIONS == "1"`` unless an FSDP path or the MoE EP overlap is on, where
    they only warn; the FSDP paths themselves assert it is not "1"."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")  # recorded, so what host_defaults sets is undone
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    args = _args(**({flag: True} if flag else {}))
    changes = host_defaults(args)
    if flag is None:
        assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
        assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in line for line in changes)
    else:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
        assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in line for line in changes)
