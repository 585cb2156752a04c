"""MoE helpers (compare's arms, tests): move expert weights between megatron's SequentialMLP and GroupedMLP layouts.

SequentialMLP holds one ``MLP`` per local expert: ``linear_fc1.weight`` ``[fc1_out, hidden]``
(``fc1_out = 2 * ffn`` with a gated unit, rows ``[gate; up]``) and ``linear_fc2.weight``
``[hidden, ffn]`` (``[out, in]``, as every megatron linear). GroupedMLP holds two flat
parameters that its forward views as ``weight1.view(E, hidden, fc1_out)`` and
``weight2.view(E, ffn, hidden)`` (a reinterpretation of the flat memory: ``[in, out]`` per
expert, one expert after the other), and its GLU
chunks the fc1 output in the same ``[gate, up]`` order. So expert ``e`` maps as
``w1[e] = fc1_e.weight.T`` and ``w2[e] = fc2_e.weight.T``. Valid at expert-TP 1 (each rank's
local experts; with expert TP the shard layouts differ).
"""

from __future__ import annotations

import re

import torch

_SEQ = re.compile(r"^(?P<prefix>.*\.experts\.)local_experts\.(?P<e>\d+)\.linear_fc(?P<fc>[12])\.weight$")


def sequential_to_grouped_state(state: dict[str, torch.Tensor], num_local_experts: int) -> dict[str, torch.Tensor]:
    """A SequentialMLP model's ``state_dict`` (parameters) in the GroupedMLP model's names and
    layout; every other entry is passed through unchanged."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _SEQ.match(name)
        if match is None:
            out[name] = tensor
            continue
        experts.setdefault((match["prefix"], match["fc"]), {})[int(match["e"])] = tensor
    for (prefix, fc), per_expert in experts.items():
        if sorted(per_expert) != list(range(num_local_experts)):
            raise ValueError(f"{prefix}: expected experts 0..{num_local_experts - 1}, found {sorted(per_expert)}")
        stacked = torch.stack([per_expert[e].t() for e in range(num_local_experts)]).contiguous()  # [E, in, out]
        # megatron VIEWS the flat parameters as [E, in, out] (weight1.view(E, hidden, -1),
        # weight2.view(E, -1, hidden)): the flat tensor is the stacked one's memory, reshaped.
        if fc == "1":
            out[f"{prefix}weight1"] = stacked.reshape(stacked.shape[1], -1)  # [hidden, E * fc1_out]
        else:
            out[f"{prefix}weight2"] = stacked.reshape(-1, stacked.shape[2])  # [E * ffn, hidden]
    return out


def grouped_expert_weights(weight1: torch.Tensor, weight2: torch.Tensor, num_local_experts: int):
    """GroupedMLP's parameters as megatron's forward sees them: ``[E, hidden, fc1_out]`` and
    ``[E, ffn, hidden]`` views (the layout ``gg.ops.gmm`` receives)."""
    hidden = weight1.shape[0]
    return weight1.view(num_local_experts, hidden, -1), weight2.view(num_local_experts, -1, hidden)


def copy_sequential_into_grouped(sequential: torch.nn.Module, grouped: torch.nn.Module, num_local_experts: int) -> None:
    """Give ``grouped`` (a model with GroupedMLP experts) exactly ``sequential``'s weights."""
    mapped = sequential_to_grouped_state(dict(sequential.named_parameters()), num_local_experts)
    params = dict(grouped.named_parameters())
    missing = set(params) - set(mapped)
    extra = set(mapped) - set(params)
    if missing or extra:
        raise ValueError(f"models do not correspond: missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != mapped[name].shape:
                raise ValueError(f"{name}: shape {tuple(param.shape)} vs mapped {tuple(mapped[name].shape)}")
            param.copy_(mapped[name])
