"""fused-rmsnorm's mechanism: megatron's torch RMSNorm becomes a :class:`FusedRMSNorm`.

Target: ``megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__`` (WRAP). It is the
factory behind every norm of the local spec: ``gpt_layer_specs.LNImpl`` /
``models.backends.LNImpl`` (input_layernorm, pre_mlp_layernorm, q/k layernorm) and
``transformer_block.LayerNormImpl`` (the final norm) are all the same class object, so wrapping
its ``__new__`` on the class reaches every alias; replacing module-level names could miss one.
It is a WRAP (not REPLACE) stacked above the cpu-adapter's wrap of the same target (sequence
parallel; declared ``after=("cpu-adapter",)``): our wrapper calls the wrapped chain first, so
megatron's own assertions and the SP marking of the weight (``weight.sequence_parallel``) still
happen, and then moves that very Parameter into a :class:`FusedRMSNorm`. Only
``config.normalization == "RMSNorm"`` is touched; LayerNorm and L2Norm configs get megatron's
module unchanged.

:class:`FusedRMSNorm` subclasses ``torch.nn.RMSNorm`` (same ``weight`` parameter, same
``state_dict`` keys, ``isinstance`` still true), so checkpoints move freely between runs with
and without the flag. It also supports ``layernorm_zero_centered_gamma`` (weight stored as
gamma - 1, initialised to zeros), which megatron's torch norm rejects; such checkpoints are
interchangeable with other zero-centered implementations (TE), not with a plain torch RMSNorm.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.rmsnorm import rms_norm
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.overrides import with_fields


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`mindspeed_like.kernels.rmsnorm.rms_norm`."""

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float | None = None,
        zero_centered_gamma: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        self.zero_centered_gamma = zero_centered_gamma  # read by reset_parameters from __init__
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        if getattr(self, "weight", None) is not None:
            with torch.no_grad():
                self.weight.fill_(0.0 if getattr(self, "zero_centered_gamma", False) else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", zero_centered_gamma=True" if self.zero_centered_gamma else "")

    @classmethod
    def from_torch(cls, norm: torch.nn.RMSNorm, zero_centered_gamma: bool = False) -> FusedRMSNorm:
        """Take over ``norm``'s Parameter (and its attributes, e.g. ``sequence_parallel``)."""
        fused = cls(norm.normalized_shape, eps=norm.eps, zero_centered_gamma=zero_centered_gamma, device="meta")
        fused.weight = norm.weight
        if zero_centered_gamma:
            with torch.no_grad():
                fused.weight.zero_()
        return fused


def new_fused_rmsnorm(wrapped, instance, args, kwargs):
    """Wrapper of ``WrappedTorchNorm.__new__``: an RMSNorm config gets a :class:`FusedRMSNorm`."""
    call = Call(wrapped, args, kwargs)
    config = call["config"]
    if getattr(config, "normalization", None) != "RMSNorm":
        return wrapped(*args, **kwargs)
    zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
    if zero_centered:  # megatron's torch norm asserts against it; our module supports it
        norm = call(config=with_fields(config, layernorm_zero_centered_gamma=False))
    else:
        norm = wrapped(*args, **kwargs)
    if type(norm) is not torch.nn.RMSNorm:  # something else built a different norm: leave it alone
        return norm
    return FusedRMSNorm.from_torch(norm, zero_centered_gamma=zero_centered)
