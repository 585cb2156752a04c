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

* the mask type decides, as in TE: ``attention_mask`` is not read for causal and no-mask layers
  (``MASK_NOT_READ``; megatron's local math would apply whatever mask it is given);

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

from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.te_backend.attention_backend import _backend_name, _flash_forward, flash_attention_on
from mindspeed_like.te_backend.extra_state import TEExtraState
from mindspeed_like.te_backend.sharding import sharded_tensors
from mindspeed_like.te_shim import modules as te_pytorch
from mindspeed_like.toolkit.binding import accepted

MASK_NOT_READ = ("causal", "causal_bottom_right", "no_mask")
"""Mask types for which TE's attention never reads ``attention_mask`` (it is None for them in TE's
documentation; megatron hands its dataloader's mask over regardless)."""


def _core_attention_extra_state_not_missing(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """TE's ``remove_extra_states_check``: ``core_attention._extra_state`` is never a missing key."""
    for key in list(incompatible_keys.missing_keys):
        if "core_attention._extra_state" in key:
            incompatible_keys.missing_keys.remove(key)


def _global_memory_buffer_made() -> None:
    """megatron's math path takes its score buffer from ``parallel_state``'s global memory buffer, which
    only ``initialize_model_parallel`` makes; TE's attention needs nothing of megatron's state, so a model
    built with its own process groups (``pg_collection``, no ``initialize_model_parallel``: megatron's
    ``TestGPTModelWithCustomPG``) stopped with "global memory buffer is not initialized". Made here when
    absent, as megatron makes it."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


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
        window_size = _te_window(config, layer_number, attn_mask_type)
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
        # TE's sliding window, as megatron's wrapper hands it to TE and reads it back; megatron's math and
        # the flash kernel read the softmax's window (None: no window, where megatron's own mask would take
        # TE's -1 "unbounded" literally)
        self.window_size = window_size
        self.scale_mask_softmax.window_size = window_size if te_pytorch.is_window(window_size) else None
        # TE's DotProductAttention registers this hook: megatron's TEDotProductAttention.sharded_state_dict
        # saves no _extra_state, so a strict load_state_dict of a distributed checkpoint would miss it
        self.register_load_state_dict_post_hook(_core_attention_extra_state_not_missing)

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
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type.name in MASK_NOT_READ:
            # TE's contract: the mask type decides, attention_mask is read only for padding / arbitrary
            # types (megatron passes the dataloader's causal mask anyway); megatron's math would apply it
            # (issue 48 item 5: megatron's test gives an all-True mask to a causal layer)
            attention_mask = None
        self._check_window_with_mask(attention_mask, mask_type)
        _global_memory_buffer_made()
        if _is_thd(packed_seq_params) and not self._thd_in_one_call(packed_seq_params, attention_bias):
            return self._per_sequence(query, key, value, mask_type, attention_bias, packed_seq_params)
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

    def _check_window_with_mask(self, attention_mask, mask_type) -> None:
        """TE applies a padding mask and a sliding window together; megatron's math and the flash
        kernel apply the window in place of the mask (megatron's local semantics). A causal layer's
        mask is inside its window; any other mask with a window is refused, not dropped."""
        if attention_mask is None or not te_pytorch.is_window(self.window_size) or "causal" in mask_type.name:
            return
        raise ValueError(
            f"TEDotProductAttention (mindspeed_like te-backend): a sliding window (config.window_size="
            f"{self.window_size}) together with an attention_mask of type {mask_type.name} is not supported: the "
            "window would replace the mask; use a causal mask type, or no window"
        )

    def _thd_in_one_call(self, packed, attention_bias) -> bool:
        """Whether packed (thd) sequences go to the kernels in one call: context-parallel's at CP > 1,
        the flash kernel when it runs here and the sequences lie back to back (no padding between them)
        with TE's vanilla softmax. Otherwise :meth:`_per_sequence`."""
        if getattr(self.config, "context_parallel_size", 1) > 1:
            return True
        if attention_bias is not None:
            raise ValueError(
                "TEDotProductAttention (mindspeed_like te-backend): attention_bias with packed sequences (thd) is not "
                "supported; run the batch unpacked (sbhd)"
            )
        flash = flash_attention_on() or self._flash_without_feature()
        vanilla = getattr(self.config, "softmax_type", "vanilla") == "vanilla"
        return flash and vanilla and not _padded(packed)

    def _per_sequence(self, query, key, value, mask_type, attention_bias, packed) -> torch.Tensor:
        """Packed sequences (thd, ``[t, heads, dim]``) one sequence at a time through this module's
        attention for one unpacked sequence (``[s_i, 1, heads, dim]``: megatron's math, or the flash
        kernel where flash-attention is on), so each sequence attends only to itself, causally per
        sequence for causal masks, at ``cu_seqlens_*_padded`` offsets when TE's padded layout is given.
        Rows between and after the sequences (padding) come out zero. Returns ``[t, heads * v_dim]``."""
        from megatron.core.transformer.enums import AttnMaskType

        starts_q, lens_q = _segments(packed.cu_seqlens_q, getattr(packed, "cu_seqlens_q_padded", None))
        starts_kv, lens_kv = _segments(packed.cu_seqlens_kv, getattr(packed, "cu_seqlens_kv_padded", None))
        if len(lens_q) != len(lens_kv):
            raise ValueError(
                f"TEDotProductAttention: cu_seqlens_q has {len(lens_q)} sequences, cu_seqlens_kv {len(lens_kv)}"
            )
        causal = "causal" in mask_type.name
        bottom_right = "bottom_right" in mask_type.name
        forward = DotProductAttention.forward.__get__(self, type(self))  # through the features' wrappers
        pieces: list[torch.Tensor] = []
        end = 0
        for start_q, len_q, start_kv, len_kv in zip(starts_q, lens_q, starts_kv, lens_kv, strict=True):
            if len_q == 0:
                continue
            q = query[start_q : start_q + len_q].unsqueeze(1)
            k = key[start_kv : start_kv + len_kv].unsqueeze(1)
            v = value[start_kv : start_kv + len_kv].unsqueeze(1)
            mask = None
            if causal:
                offset = len_kv - len_q if bottom_right else 0
                mask = torch.ones(len_q, len_kv, dtype=torch.bool, device=q.device).triu(1 + offset)[None, None]
            out = forward(q, k, v, mask, attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.no_mask)
            out = out.reshape(len_q, -1)
            if start_q > end:
                pieces.append(out.new_zeros(start_q - end, out.shape[-1]))
            pieces.append(out)
            end = start_q + len_q
        if not pieces:
            raise ValueError("TEDotProductAttention: packed sequences (thd) with no tokens")
        if query.shape[0] > end:
            pieces.append(pieces[-1].new_zeros(query.shape[0] - end, pieces[-1].shape[-1]))
        return torch.cat(pieces, dim=0)

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


def _te_window(config, layer_number: int, attn_mask_type) -> tuple[int, int]:
    """TE's window for this layer: ``config.window_size`` where megatron's wrapper hands it to TE
    (``is_layer_window_attention``: ``window_attn_skip_freq`` leaves some layers full), checked as TE
    checks it (an int or a malformed pair: a ``ValueError`` naming ``config.window_size``)."""
    window = getattr(config, "window_size", None)
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # megatron-core < 0.15: its local attention (our base) has no sliding window
        if window is not None:
            raise ValueError(
                f"TEDotProductAttention (mindspeed_like te-backend): config.window_size={window!r}: sliding window "
                f"attention needs megatron-core >= 0.15 here (installed: {megatron_core_version()}), whose local "
                "attention applies the window; upgrade megatron-core, or set window_size=None"
            ) from None
        on_this_layer = False
    else:
        if window is not None and not isinstance(window, (tuple, list)):
            on_this_layer = True  # refused just below, with its name
        else:
            on_this_layer = is_layer_window_attention(
                window, getattr(config, "window_attn_skip_freq", None), layer_number
            )
    try:
        return te_pytorch.check_set_window_size(attn_mask_type.name, window if on_this_layer else None)
    except ValueError as error:
        raise ValueError(f"TEDotProductAttention: config.window_size={window!r}: {error}") from None


def _is_thd(packed) -> bool:
    return packed is not None and getattr(packed, "qkv_format", None) == "thd"


def _padded(packed) -> bool:
    """Whether TE's padded thd layout puts padding between (or after) the sequences."""
    for real, padded in (
        (packed.cu_seqlens_q, getattr(packed, "cu_seqlens_q_padded", None)),
        (packed.cu_seqlens_kv, getattr(packed, "cu_seqlens_kv_padded", None)),
    ):
        if padded is not None and not torch.equal(padded.to(real.device, real.dtype), real):
            return True
    return False


def _segments(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(start, length) of each packed sequence: lengths from the real ``cu_seqlens``, starts from the
    padded ones where given (TE's layout: sequence i at ``cu_seqlens_padded[i]``)."""
    real = [int(x) for x in cu_seqlens.tolist()]
    offsets = real if cu_seqlens_padded is None else [int(x) for x in cu_seqlens_padded.tolist()]
    if len(offsets) != len(real):
        raise ValueError("TEDotProductAttention: cu_seqlens and cu_seqlens_padded differ in length")
    lengths = [b - a for a, b in zip(real[:-1], real[1:])]
    return offsets[:-1], lengths


te_pytorch.DotProductAttention.register(TEDotProductAttention)  # TE's base of megatron's wrapper
