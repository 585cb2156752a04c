"""``transformer_engine.pytorch.attention`` as served to clients: where TE 2.1 (the version the client
module answers) keeps its attention module's names, a module rather than TE >= 2.2's package.

Who asks: mcore-bridge (ms-swift) patches TE at import (``mcore_bridge/patcher.py``
``_patch_transformer_engine``): ``from transformer_engine.pytorch.attention import
apply_rotary_pos_emb`` (else ``...attention.rope.apply_rotary_pos_emb``, TE >= 2.3) and ``from
transformer_engine.pytorch.attention import _SplitAlongDim`` (else ``...pytorch.utils.SplitAlongDim``,
TE >= 2.2); each miss logs "Failed to patch ...". megatron's extension module reads the same two
names (TE 2.1 paths: its ``fused_apply_rotary_pos_emb`` and ``SplitAlongDim = _SplitAlongDim.apply``);
megatron itself decides before this module is served, and gets the fused RoPE from the te-backend.

  name                   here
  apply_rotary_pos_emb   TE 2.1's RoPE contract on our RoPE kernel (``te_backend/rope.py``)
  _SplitAlongDim         TE's autograd split into views (below)
  DotProductAttention,   the same classes as ``transformer_engine.pytorch``'s (TE re-exports
  MultiheadAttention     them from here)

Anything else is not here (``AttributeError``; ``from ... import`` raises ``ImportError``), and
``transformer_engine.pytorch.attention.rope`` is not found (TE 2.1 has no such module), so clients'
version fallbacks run as on TE 2.1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindspeed_like.te_backend.rope import apply_rotary_pos_emb
from mindspeed_like.te_shim.pytorch import DotProductAttention, MultiheadAttention
from mindspeed_like.te_shim.refusals import refused_module_getattr


class _SplitAlongDim(torch.autograd.Function):
    """TE's ``_SplitAlongDim``: ``apply(mixed_x_layer, split_dim, split_size_or_sections,
    squeeze=False)`` returns ``torch.split``'s views (each squeezed along ``split_dim`` with
    ``squeeze``), so q, k and v of a fused QKV projection share its storage without copies.

    Backward, as TE's: when the incoming gradients are themselves adjacent slices of one buffer
    along ``split_dim`` (same strides, consecutive offsets: e.g. the output of an op that wrote
    dq, dk, dv into one tensor), the gradient is that buffer viewed whole, no copy; otherwise
    they are concatenated along ``split_dim``. Two departures, both where TE's own backward is
    wrong and autograd would reject its result: the sizes come from the forward's pieces (an int
    split size with a shorter last piece), and squeezed gradients get ``split_dim`` back before
    they are joined (TE uses ``squeeze=True`` only outside autograd). fp8 tensors (TE's
    ``Float8Tensor`` branches) do not exist here: fp8 is refused.
    """

    @staticmethod
    def forward(
        ctx,
        mixed_x_layer: torch.Tensor,
        split_dim: int,
        split_size_or_sections: int | Sequence[int],
        squeeze: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        if (
            not isinstance(split_size_or_sections, int)
            and sum(split_size_or_sections) != mixed_x_layer.shape[split_dim]
        ):
            raise ValueError(
                f"_SplitAlongDim: sections {list(split_size_or_sections)} do not add up to the size "
                f"{mixed_x_layer.shape[split_dim]} of dim {split_dim}"
            )
        pieces = torch.split(mixed_x_layer, split_size_or_sections, dim=split_dim)
        ctx.split_dim = split_dim % mixed_x_layer.dim()
        ctx.sizes = [piece.shape[split_dim] for piece in pieces]
        ctx.squeezed = [squeeze and size == 1 for size in ctx.sizes]  # torch's squeeze(dim) keeps a size > 1
        if squeeze:
            return tuple(piece.squeeze(split_dim) for piece in pieces)
        return pieces

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        if len(grad_outputs) != len(ctx.sizes):
            raise RuntimeError(f"_SplitAlongDim: {len(grad_outputs)} gradients for {len(ctx.sizes)} pieces")
        dim = ctx.split_dim
        grads = [g.unsqueeze(dim) if squeezed else g for g, squeezed in zip(grad_outputs, ctx.squeezed)]
        whole = _adjacent_view(grads, dim)
        if whole is not None:
            return whole, None, None, None
        return torch.cat(grads, dim=dim), None, None, None


def _adjacent_view(grads: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    """The one tensor the ``grads`` are consecutive slices of along ``dim``, as a view; else None."""
    first = grads[0]
    strides = first.stride()
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for grad in grads:
        if (
            grad.stride() != strides
            or grad.dtype != first.dtype
            or grad.shape[:dim] != first.shape[:dim]
            or grad.shape[dim + 1 :] != first.shape[dim + 1 :]
            or grad.untyped_storage().data_ptr() != storage
            or grad.storage_offset() != offset
        ):
            return None
        offset += grad.shape[dim] * strides[dim]
    shape = list(first.shape)
    shape[dim] = sum(grad.shape[dim] for grad in grads)
    return first.as_strided(shape, strides, first.storage_offset())


__getattr__ = refused_module_getattr("transformer_engine.pytorch.attention", {})

__all__ = ["DotProductAttention", "MultiheadAttention", "_SplitAlongDim", "apply_rotary_pos_emb"]
