"""``TEDotProductAttention``: megatron's TE core attention as megatron's own ``DotProductAttention``.

The TE wrapper's contract: constructor ``(config, layer_number, attn_mask_type, attention_type,
attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None[, num_splits],
cp_comm_type="p2p", pg_collection / model_comm_pgs)``, forward ``(query, key, value,
attention_mask, attn_mask_type, attention_bias=None, packed_seq_params=None[, num_splits])``
returning ``[sq, b, heads * v_channels]``, no parameters (vanilla softmax), an ``_extra_state``
in the state dict that megatron leaves out of the distributed checkpoint.

Here it is a subclass of megatron's local ``DotProductAttention``: its forward is looked up on
that class at call time, so everything that acts on the local core attention acts here
(flash-attention's kernel, context-parallel's ring / Ulysses / hybrid / all-gather-KV at CP > 1,
megatron's own unfused math when neither is on). What TE adds over the local module:

* the softmax never routes to megatron's compiled ``scaled_masked_softmax_cuda`` extension, whatever
  the client's ``masked_softmax_fusion`` (mbridge's and verl's configs set it True): TE's attention
  has its own kernels and never uses that extension; megatron's softmax in torch runs instead;
* ``k_channels`` / ``v_channels`` (MLA: the query/key head dim differs from the value's), which
  megatron's local attention takes through ``fixes/local_attention_head_dims.py`` (an always-on
  fix: MLA on the local spec needs the same); megatron's unfused math and the flash kernel both
  take a different V head dim, V is never padded;
* context parallelism constructed (``cp_comm_type`` is megatron's argument; the algorithm is
  ``--context-parallel-algo``'s, see docs/features/te-backend.md);
* ``config.attention_backend`` (Megatron-LM's ``--attention-backend``, which picks TE's kernel),
  mapped onto ours (``ATTENTION_BACKENDS``): ``flash`` is our flash kernel (flash-attention's, with
  its knobs when ``--use-flash-attn`` is on, with the default causal shape when it is off),
  ``unfused`` is megatron's own math, ``fused`` and ``auto`` are whatever our features chose for
  megatron's ``DotProductAttention`` (the flash kernel under ``--use-flash-attn`` or
  ``--optimization-level`` >= 1, megatron's math otherwise; context-parallel's at CP > 1).
  What cannot be honoured is refused at argument validation (``check_attention_backend``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from mindspeed_like.te_backend.attention_backend import _backend_name, _flash_forward, flash_attention_on
from mindspeed_like.te_backend.extra_state import TEExtraState
from mindspeed_like.te_backend.sharding import sharded_tensors
from mindspeed_like.te_shim import pytorch as te_pytorch
from mindspeed_like.toolkit.binding import accepted


class TEDotProductAttention(TEExtraState, DotProductAttention):
    """megatron's ``TEDotProductAttention`` contract on megatron's ``DotProductAttention``."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_splits: int | None = None,
        cp_comm_type: str | None = "p2p",
        pg_collection=None,
        model_comm_pgs=None,
        **newer: Any,
    ) -> None:
        if newer:
            raise TypeError(f"TEDotProductAttention() got unexpected keyword arguments {sorted(newer)}")
        if num_splits is not None:
            raise ValueError("TEDotProductAttention: num_splits (TE's flash-attention split count) is not supported")
        if (k_channels is None) != (v_channels is None):
            raise ValueError("TEDotProductAttention: give both k_channels and v_channels, or neither")
        head_dims = {} if k_channels is None else {"k_channels": k_channels, "v_channels": v_channels}
        groups = accepted(DotProductAttention.__init__, pg_collection=pg_collection, model_comm_pgs=model_comm_pgs)
        DotProductAttention.__init__(  # head dims: fixes/local_attention_head_dims.py (megatron's takes none)
            self,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            **{name: value for name, value in groups.items() if value is not None},
            **head_dims,
        )
        self.qkv_format = "sbhd"
        # TE's attention computes its softmax with its own kernels: megatron's compiled extension
        # (scaled_masked_softmax_cuda, which masked_softmax_fusion=True asks for in fp16/bf16) is not one
        # of them, and is absent on a host and on GPUs without megatron's compiled kernels (issue 37 9b)
        self.scale_mask_softmax.scaled_masked_softmax_fusion = False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        if num_splits is not None:
            raise ValueError("TEDotProductAttention: num_splits (TE's flash-attention split count) is not supported")
        if self._flash_without_feature():
            return _flash_forward()(
                DotProductAttention.forward.__get__(self, type(self)),
                self,
                (query, key, value, attention_mask),
                dict(attn_mask_type=attn_mask_type, attention_bias=attention_bias, packed_seq_params=packed_seq_params),
            )
        return DotProductAttention.forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )

    def _flash_without_feature(self) -> bool:
        """``--attention-backend flash`` while flash-attention is off (at CP > 1 context-parallel's
        kernels run either way)."""
        return (
            _backend_name(getattr(self.config, "attention_backend", None)) == "flash"
            and getattr(self.config, "context_parallel_size", 1) == 1
            and not flash_attention_on()
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """As megatron's TE wrapper: only a learnable softmax offset goes into the checkpoint."""
        learnable = getattr(self.config, "softmax_type", "vanilla") == "learnable"
        state_dict = self.state_dict(prefix="", keep_vars=True) if learnable else {}
        return sharded_tensors(
            state_dict, prefix, {"softmax_offset": 0}, sharded_offsets, getattr(self, "tp_group", None), metadata
        )


te_pytorch.DotProductAttention.register(TEDotProductAttention)  # TE's base of megatron's wrapper
