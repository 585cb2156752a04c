"""``TENorm``: megatron's TE norm factory, built from megatron's own torch norm.

megatron's ``TENorm(config, hidden_size, eps=1e-5[, has_residual])`` returns TransformerEngine's
``LayerNorm`` or ``RMSNorm`` (by ``config.normalization``) with parameters ``weight`` (and
``bias``), TE's ``_extra_state``, ``sequence_parallel`` (the config's) marked on the parameters, and
zero-centered gamma (``layernorm_zero_centered_gamma``: the stored weight is gamma - 1).

Here the module is the one megatron's local spec would build, through
``megatron.core.transformer.torch_norm.WrappedTorchNorm`` looked up at call time: so the
fused-rmsnorm feature (which wraps that factory) and device adapters act on TE-spec norms as on
local-spec ones. Its class is then a subclass with TE's ``_extra_state`` mixed in (same
parameters, ``isinstance`` of the torch norm still true). What the torch norm refuses and TE
supports is done here: sequence parallel (the parameters are marked instead of asserting) and
zero-centered gamma (our RMSNorm kernel / ``layer_norm`` with ``weight + 1``).
"""

from __future__ import annotations

import functools

import torch

from mindspeed_like.kernels.rmsnorm import rms_norm
from mindspeed_like.te_backend.extra_state import TEExtraState
from mindspeed_like.te_backend.refusals import refuse
from mindspeed_like.toolkit.overrides import with_fields


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose stored weight is gamma - 1 (initialised to zeros), as TE's zero_centered_gamma."""

    def reset_parameters(self) -> None:
        if getattr(self, "weight", None) is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, zero_centered_gamma=True)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose stored weight is gamma - 1 (initialised to zeros), as TE's zero_centered_gamma."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "weight", None) is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


@functools.cache
def with_te_extra_state(cls: type, normalization: str) -> type:
    """``cls`` with TE's ``_extra_state`` (one subclass per norm class, made once), registered under
    TE's class for ``normalization`` (``transformer_engine.pytorch.LayerNorm`` / ``RMSNorm``, the
    te-client-module's): megatron's ``TENorm`` returns an instance of TE's, and clients check it."""
    from mindspeed_like.te_shim import modules as te_pytorch

    te_class = type(f"TE{cls.__name__}", (TEExtraState, cls), {"__module__": __name__})
    getattr(te_pytorch, normalization).register(te_class)
    return te_class


def build_norm(config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False) -> torch.nn.Module:
    """The norm TE's ``LayerNorm``/``RMSNorm`` would be, as megatron's own module."""
    normalization = config.normalization
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"TENorm: only LayerNorm and RMSNorm are supported (TE's), got {normalization!r}")
    if has_residual and getattr(config, "fused_residual_rmsnorm", False):
        refuse("fused_residual_rmsnorm (TEFusedResidualRMSNorm)", "leave --fused-residual-rmsnorm off")
    dtype = config.params_dtype
    if config.layernorm_zero_centered_gamma:
        norm_cls = ZeroCenteredRMSNorm if normalization == "RMSNorm" else ZeroCenteredLayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=dtype)
    else:
        from megatron.core.transformer import torch_norm

        # megatron's torch norm asserts against what TE allows; those are handled here instead
        plain = with_fields(config, sequence_parallel=False, persist_layer_norm=False)
        if hasattr(config, "memory_efficient_layer_norm"):
            plain = with_fields(plain, memory_efficient_layer_norm=False)
        norm = torch_norm.WrappedTorchNorm(config=plain, hidden_size=hidden_size, eps=eps)
        norm.to(dtype=dtype)
    # TE's LayerNorm / RMSNorm (and LayerNormLinear's layer_norm_*) mark their parameters in
    # reset_parameters, whatever perform_initialization says: under SP each rank's gradient is its
    # sequence shard's part, summed over TP by megatron's finalize_model_grads
    for param in norm.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    norm.__class__ = with_te_extra_state(type(norm), normalization)
    return norm


class TENorm:
    """megatron's ``TENorm`` contract: ``TENorm(config, hidden_size, eps)`` returns the norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        return build_norm(config, hidden_size, eps, has_residual)
