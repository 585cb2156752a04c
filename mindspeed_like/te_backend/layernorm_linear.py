"""``TELayerNormColumnParallelLinear``: the norm fused into the next column-parallel linear.

TE's ``LayerNormLinear`` (megatron's wrapper: ``linear_qkv`` and ``linear_fc1`` of TE specs) owns
the input norm: its parameters are ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm)
beside ``weight``/``bias``, which is why TE-spec checkpoints name the input norm
``...linear_qkv.layer_norm_weight``. Here it is a :class:`TEColumnParallelLinear` (so TP, SP,
tp-overlap and DDP act on it as on megatron's linear) whose forward first runs the norm TENorm
would build (megatron's torch norm through ``WrappedTorchNorm``, so ``--use-fused-rmsnorm`` is the
fused kernel here too) on the local shard, then the linear (which all-gathers the normed shard
under SP, as TE does). The norm module is held unregistered; its parameters are this module's
``layer_norm_*`` (the same Parameter objects), so state dicts carry TE's names only.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_like.te_backend.linear import TEColumnParallelLinear
from mindspeed_like.te_backend.norm import build_norm
from mindspeed_like.te_shim import modules as te_pytorch


class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
    """megatron's ``TELayerNormColumnParallelLinear`` contract on megatron's ColumnParallelLinear."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        stride: int = 1,
        **newer: Any,
    ) -> None:
        if is_expert:
            raise ValueError("Transformer Engine linear layers do not yet support MoE")  # megatron's wrapper
        norm = build_norm(config, input_size, eps=config.layernorm_epsilon)
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            gather_output=gather_output,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=False,
            skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
            stride=stride,
            **newer,
        )
        object.__setattr__(self, "_norm", norm)  # unregistered: its parameters are registered below
        self.layer_norm_weight = norm.weight
        if getattr(norm, "bias", None) is not None:
            self.layer_norm_bias = norm.bias
        self.eps = config.layernorm_epsilon
        # TE's LayerNormLinear switches (megatron builds it with both False; clients set them on the
        # built module: mcore-bridge's LoRA sets return_layernorm_output to feed its adapter the
        # normed input the linear saw)
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        norm = self._norm
        # the registered Parameters are the truth (load_state_dict(assign=True) may replace them)
        if norm._parameters["weight"] is not self.layer_norm_weight:
            norm._parameters["weight"] = self.layer_norm_weight
        if "layer_norm_bias" in self._parameters and norm._parameters.get("bias") is not self.layer_norm_bias:
            norm._parameters["bias"] = self.layer_norm_bias
        return norm(x)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        """megatron's ``(output, bias)``; with ``return_layernorm_output`` TE's ``((output, normed), bias)``,
        ``normed`` being this rank's normed input, or under sequence parallelism with
        ``return_layernorm_output_gathered`` the all-gathered one the linear multiplied (TE's
        contract: its gradient is reduce-scattered back, as the linear's own input gradient is)."""
        normed = self._normed(x)
        output, bias = super().forward(normed, *args, **kwargs)
        if not self.return_layernorm_output:
            return output, bias
        if self.return_layernorm_output_gathered and self.sequence_parallel and self.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            normed = gather_from_sequence_parallel_region(normed, tensor_parallel_output_grad=True, group=self.tp_group)
        return (output, normed), bias

    @property
    def normalization(self) -> str:
        return "RMSNorm" if isinstance(self._norm, torch.nn.RMSNorm) else "LayerNorm"


te_pytorch.LayerNormLinear.register(TELayerNormColumnParallelLinear)  # TE's base of megatron's wrapper
