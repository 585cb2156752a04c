"""Fix: multi-latent attention cannot be built on megatron's local spec.

``get_gpt_layer_local_spec(multi_latent_attention=True)`` (and the decoder-block spec built from
it, which Megatron-LM's ``pretrain_gpt.py`` uses with ``--transformer-impl local``) puts
megatron's own ``DotProductAttention`` under ``MLASelfAttention``. ``MultiLatentAttention.__init__``
builds its core attention with ``k_channels=q_head_dim`` (``qk_head_dim + qk_pos_emb_head_dim``)
and ``v_channels=v_head_dim``, arguments only TransformerEngine's attention takes: the local one
has no such parameters in any release (0.13.1, 0.16.1 and 0.19.2 checked, and upstream main), so
the model dies with ``TypeError: ... unexpected keyword argument 'k_channels' when instantiating
DotProductAttention``.

Target: ``megatron.core.transformer.dot_product_attention.DotProductAttention.__init__`` (WRAP).
The constructor is where the head dims are fixed; the unfused ``forward`` already computes from
the tensors' own shapes (``q k^T`` over the query/key head dim, ``probs v`` over the value head
dim) except two numbers the constructor derives from ``config.kv_channels``:
``hidden_size_per_partition`` (the width of the output view, heads x V head dim) and
``hidden_size_per_attention_head`` (the default softmax scale ``1/sqrt(d_qk)``). The wrapper
builds the module without the two arguments and then sets those from them, exactly as
TransformerEngine's ``DotProductAttention(k_channels, v_channels)`` interprets them; the
arguments are kept on the module (``k_channels``, ``v_channels``). Nothing else changes: when the
arguments are not given (every non-MLA layer) the call is megatron's, untouched, and a megatron
release whose constructor takes them itself gets them unchanged.

Stacking: above the cpu-adapter's host twin and context-parallel's constructor wrapper (the
latter binds the call to megatron's signature, where ``k_channels`` would be a TypeError).
"""

from __future__ import annotations

import math

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import signature_of
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DOT_PRODUCT_ATTENTION

HEAD_DIMS = ("k_channels", "v_channels")


def _takes_head_dims(wrapped) -> bool:
    return all(name in signature_of(wrapped).parameters for name in HEAD_DIMS)


def construct_with_head_dims(wrapped, instance, args, kwargs):
    """``DotProductAttention.__init__`` accepting TransformerEngine's ``k_channels``/``v_channels``."""
    if not any(name in kwargs for name in HEAD_DIMS) or _takes_head_dims(wrapped):
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    k_channels, v_channels = kwargs.pop("k_channels", None), kwargs.pop("v_channels", None)
    result = wrapped(*args, **kwargs)
    heads = instance.num_attention_heads_per_partition
    if k_channels is not None:
        instance.hidden_size_per_attention_head = k_channels
        if kwargs.get("softmax_scale") is None:  # megatron's default scale, on the real q/k head dim
            instance.softmax_scale = 1.0 / math.sqrt(k_channels)
            if instance.config.apply_query_key_layer_scaling:
                instance.softmax_scale /= instance.layer_number
    if v_channels is not None:
        instance.hidden_size_per_partition = v_channels * heads
    instance.k_channels, instance.v_channels = k_channels, v_channels
    return result


PATCHES = [
    Patch(
        f"{DOT_PRODUCT_ATTENTION}.DotProductAttention.__init__",
        Kind.WRAP,
        construct_with_head_dims,
        why="MLA passes k_channels/v_channels (TransformerEngine's arguments) to the local core attention",
        after=("cpu-adapter", "context-parallel"),
    )
]

FEATURE = Feature(
    name="fix-local-attention-head-dims",
    summary="multi-latent attention on megatron's local spec: its core attention takes k_channels/v_channels",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
